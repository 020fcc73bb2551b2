//! Connection rules and topic rules, driven by raw MQTT clients.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::raw::{
    LEGACY_REQUEST_TOPIC, NOTIFY_NAMESPACE, REQUEST_TOPIC, Raw, Raw4, Recv, disconnect_reason,
    now_hlc, user_property, v5,
};
use common::{eventually, start_broker, start_broker_with};
use rumqttc::v5::mqttbytes::QoS;
use statestore::resp3::encode_request;
use v5::{DisconnectReasonCode, Packet, PubAckReason, SubscribeReasonCode};

fn notify_topic(client_id: &str, key: &[u8]) -> String {
    format!(
        "{NOTIFY_NAMESPACE}/{}/command/notify/{}",
        hex::encode_upper(client_id),
        hex::encode_upper(key)
    )
}

// ------------------------------------------------------------ responses

#[tokio::test]
async fn responses_carry_status_timestamp_correlation_and_content_type() {
    let broker = start_broker().await;
    let mut c = Raw::connect(broker.local_addr(), "resp").await;
    let response = c.request(&[b"SET", b"k", b"v"]).await;
    assert_eq!(&response.payload[..], b"+OK\r\n");
    assert_eq!(response.topic, c.response_topic.as_bytes());
    assert_eq!(response.qos, QoS::AtLeastOnce);
    let props = response.properties.as_ref().unwrap();
    assert_eq!(
        props.content_type.as_deref(),
        Some("application/octet-stream")
    );
    assert_eq!(user_property(&response, "__stat"), Some("200"));
    assert_eq!(user_property(&response, "__protVer"), Some("1.0"));
    assert!(
        user_property(&response, "__ts")
            .unwrap()
            .ends_with(":statebroker")
    );

    // -ERR answers carry __stat = 200 too (the Rust client requires it).
    let response = c.request(&[b"NOPE"]).await;
    assert_eq!(&response.payload[..], b"-ERR unknown command\r\n");
    assert_eq!(user_property(&response, "__stat"), Some("200"));
}

#[tokio::test]
async fn malformed_resp_gets_syntax_error_and_the_broker_keeps_serving() {
    let broker = start_broker().await;
    let mut c = Raw::connect(broker.local_addr(), "malformed").await;
    let ts = now_hlc("malformed");
    for payload in [
        &b"garbage"[..],
        b"*2\r\n$3\r\nGET\r\n$99999999999999999999999\r\nk\r\n",
        b"*2\r\n$3\r\nGET\r\n$10\r\nk\r\n",
        b"*1\r\n$3\r\nGET",
        b"*2\r\n$3\r\nGET\r\n:1\r\n",
        b"*1\r\n$3\r\nGET\r\nextra",
        b"",
    ] {
        let response = c
            .request_raw(REQUEST_TOPIC, payload, &[("__ts", &ts)])
            .await;
        assert_eq!(
            &response.payload[..],
            b"-ERR syntax error\r\n",
            "{payload:?}"
        );
    }
    let response = c.request(&[b"SET", b"k", b"still here"]).await;
    assert_eq!(&response.payload[..], b"+OK\r\n");
}

// ------------------------------------------------------------ request rules

#[tokio::test]
async fn reserved_response_topics_get_the_client_disconnected() {
    let broker = start_broker().await;
    let reserved = [
        REQUEST_TOPIC.to_owned(),
        LEGACY_REQUEST_TOPIC.to_owned(),
        format!(
            "{NOTIFY_NAMESPACE}/{}/command/notify/6B",
            hex::encode_upper("victim")
        ),
        NOTIFY_NAMESPACE.to_owned(),
        // The broker's own: an answer there would pass for its word.
        "$SYS/broker/version".to_owned(),
    ];
    for (i, topic) in reserved.iter().enumerate() {
        let mut c = Raw::connect(broker.local_addr(), &format!("rogue-{i}")).await;
        let mut props = c.request_properties(b"1", &[("__ts", &now_hlc("rogue"))]);
        props.response_topic = Some(topic.clone());
        let mut publish = v5::Publish::new(
            REQUEST_TOPIC,
            QoS::AtLeastOnce,
            encode_request(&["SET", "k", "v"]),
            Some(props),
        );
        publish.pkid = 1;
        c.send(Packet::Publish(publish)).await;
        let d = c.expect_disconnect().await;
        assert_eq!(
            disconnect_reason(&d),
            Some(DisconnectReasonCode::NotAuthorized),
            "{topic}"
        );
    }
    // Nothing was executed, and the broker serves others.
    let mut other = Raw::connect(broker.local_addr(), "bystander").await;
    assert_eq!(
        &other.request(&[b"GET", b"k"]).await.payload[..],
        b"$-1\r\n"
    );
}

#[tokio::test]
async fn qos0_requests_are_not_executed() {
    let broker = start_broker().await;
    let mut c = Raw::connect(broker.local_addr(), "qos0").await;
    c.request(&[b"GET", b"warm-up"]).await; // subscribes to the response topic
    let props = c.request_properties(b"q0", &[("__ts", &now_hlc("qos0"))]);
    let payload = Bytes::from(encode_request(&["SET", "k", "v"]));
    c.publish(REQUEST_TOPIC, payload, QoS::AtMostOnce, Some(props))
        .await;
    let answer = c.next_publish().await;
    assert_eq!(
        &answer.payload[..],
        b"-ERR requests must be published with QoS 1\r\n"
    );
    assert_eq!(
        answer
            .properties
            .as_ref()
            .unwrap()
            .correlation_data
            .as_deref(),
        Some(&b"q0"[..])
    );
    assert_eq!(
        &c.request(&[b"GET", b"k"]).await.payload[..],
        b"$-1\r\n",
        "the SET did not run"
    );
}

#[tokio::test]
async fn requests_without_response_topic_or_correlation_are_not_executed() {
    let broker = start_broker().await;
    let mut c = Raw::connect(broker.local_addr(), "partial").await;
    c.request(&[b"GET", b"warm-up"]).await;
    let payload = Bytes::from(encode_request(&["SET", "a", "v"]));
    // No response topic: acknowledged, not executed, nothing comes back.
    let mut props = c.request_properties(b"x", &[("__ts", &now_hlc("partial"))]);
    props.response_topic = None;
    assert_eq!(
        c.publish(
            REQUEST_TOPIC,
            payload.clone(),
            QoS::AtLeastOnce,
            Some(props)
        )
        .await,
        Some(PubAckReason::Success)
    );
    // No correlation data: an -ERR on the response topic.
    let mut props = c.request_properties(b"x", &[("__ts", &now_hlc("partial"))]);
    props.correlation_data = None;
    c.publish(REQUEST_TOPIC, payload, QoS::AtLeastOnce, Some(props))
        .await;
    let answer = c.next_publish().await;
    assert_eq!(
        &answer.payload[..],
        b"-ERR requests must carry correlation data\r\n"
    );
    assert_eq!(&c.request(&[b"GET", b"a"]).await.payload[..], b"$-1\r\n");
}

#[tokio::test]
async fn the_caller_is_the_connection_not_the_payload() {
    let broker = start_broker().await;
    let mut victim = Raw::connect(broker.local_addr(), "victim").await;
    let mut mallory = Raw::connect(broker.local_addr(), "mallory").await;
    victim
        .subscribe(
            &format!(
                "{NOTIFY_NAMESPACE}/{}/command/notify/+",
                hex::encode_upper("victim")
            ),
            QoS::AtLeastOnce,
        )
        .await;
    // mallory claims to be the victim in __srcId; the registration is mallory's.
    let ts = now_hlc("victim");
    let payload = encode_request(&["KEYNOTIFY", "k"]);
    let r = mallory
        .request_raw(
            REQUEST_TOPIC,
            &payload,
            &[("__ts", &ts), ("__srcId", "victim")],
        )
        .await;
    assert_eq!(&r.payload[..], b"+OK\r\n");
    mallory.request(&[b"SET", b"k", b"v"]).await;
    victim.no_publish_within(Duration::from_millis(300)).await;
    let watchers = broker.store().with_store(|s| s.watch_count());
    assert_eq!(watchers, 1);
}

#[tokio::test]
async fn qos2_requests_execute_once() {
    let broker = start_broker().await;
    let mut c = Raw::connect(broker.local_addr(), "q2").await;
    c.request(&[b"GET", b"warm-up"]).await;
    let props = c.request_properties(b"q2", &[("__ts", &now_hlc("q2"))]);
    let mut publish = v5::Publish::new(
        REQUEST_TOPIC,
        QoS::ExactlyOnce,
        encode_request(&["SET", "q2", "v"]),
        Some(props),
    );
    publish.pkid = 77;
    c.send(Packet::Publish(publish.clone())).await;
    publish.dup = true;
    c.send(Packet::Publish(publish)).await; // a retransmission before PUBREL
    let mut pubrecs = 0;
    let mut responses = 0;
    while pubrecs < 2 || responses < 1 {
        match c.recv().await {
            Recv::Packet(Packet::PubRec(r)) => {
                assert_eq!(r.pkid, 77);
                pubrecs += 1;
            }
            Recv::Packet(Packet::Publish(p)) => {
                assert_eq!(&p.payload[..], b"+OK\r\n");
                c.send(Packet::PubAck(v5::PubAck::new(p.pkid, None))).await;
                responses += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    c.send(Packet::PubRel(v5::PubRel::new(77, None))).await;
    match c.recv().await {
        Recv::Packet(Packet::PubComp(comp)) => assert_eq!(comp.pkid, 77),
        Recv::Packet(Packet::Publish(p)) => panic!("executed twice: {p:?}"),
        other => panic!("{other:?}"),
    }
    let version_count = broker.store().with_store(|s| s.last_version().counter);
    assert!(version_count <= 1, "one SET only");
}

// ------------------------------------------------------------ notification namespace

#[tokio::test]
async fn publishing_into_the_notification_namespace_is_refused() {
    let broker = start_broker().await;
    let mut victim = Raw::connect(broker.local_addr(), "victim").await;
    let own = format!(
        "{NOTIFY_NAMESPACE}/{}/command/notify/+",
        hex::encode_upper("victim")
    );
    assert_eq!(
        victim.subscribe(&own, QoS::AtLeastOnce).await,
        vec![SubscribeReasonCode::Success(QoS::AtLeastOnce)]
    );

    let mut forger = Raw::connect(broker.local_addr(), "forger").await;
    let forged = notify_topic("victim", b"k");
    let payload = Bytes::from_static(b"*2\r\n$6\r\nNOTIFY\r\n$6\r\nDELETE\r\n");
    assert_eq!(
        forger
            .publish(&forged, payload.clone(), QoS::AtLeastOnce, None)
            .await,
        Some(PubAckReason::NotAuthorized)
    );
    forger
        .publish(&forged, payload, QoS::AtMostOnce, None)
        .await;
    victim.no_publish_within(Duration::from_millis(300)).await;

    // MQTT 3.1.1 has no negative PUBACK: acknowledged and dropped.
    let mut old = Raw4::connect(broker.local_addr(), "forger4").await;
    use rumqttc::mqttbytes::v4;
    let mut publish = v4::Publish::new(
        forged.as_str(),
        rumqttc::mqttbytes::QoS::AtLeastOnce,
        b"x".to_vec(),
    );
    publish.pkid = old.pkid();
    old.send(v4::Packet::Publish(publish)).await;
    assert!(matches!(old.recv().await, Some(v4::Packet::PubAck(_))));
    victim.no_publish_within(Duration::from_millis(300)).await;
}

#[tokio::test]
async fn subscribing_to_another_clients_notifications_is_refused() {
    let broker = start_broker().await;
    let mut c = Raw::connect(broker.local_addr(), "nosy").await;
    let other = format!(
        "{NOTIFY_NAMESPACE}/{}/command/notify/+",
        hex::encode_upper("victim")
    );
    let own = format!(
        "{NOTIFY_NAMESPACE}/{}/command/notify/+",
        hex::encode_upper("nosy")
    );
    assert_eq!(
        c.subscribe(&other, QoS::AtLeastOnce).await,
        vec![SubscribeReasonCode::NotAuthorized]
    );
    assert_eq!(
        c.subscribe(&format!("$share/g/{other}"), QoS::AtLeastOnce)
            .await,
        vec![SubscribeReasonCode::NotAuthorized]
    );
    // Mixed: per-filter answers in order.
    let codes = c
        .subscribe_many(
            &["a/b", &other, &own, "$other/#", "bad/#/filter"],
            QoS::AtLeastOnce,
        )
        .await;
    assert_eq!(
        codes,
        vec![
            SubscribeReasonCode::Success(QoS::AtLeastOnce),
            SubscribeReasonCode::NotAuthorized,
            SubscribeReasonCode::Success(QoS::AtLeastOnce),
            SubscribeReasonCode::NotAuthorized,
            SubscribeReasonCode::TopicFilterInvalid,
        ]
    );
    // Still connected and working.
    assert_eq!(&c.request(&[b"GET", b"k"]).await.payload[..], b"$-1\r\n");
}

#[tokio::test]
async fn wildcards_deliver_only_the_clients_own_notifications() {
    let broker = start_broker().await;
    let mut nosy = Raw::connect(broker.local_addr(), "nosy").await;
    assert_eq!(
        nosy.subscribe("#", QoS::AtLeastOnce).await,
        vec![SubscribeReasonCode::Success(QoS::AtLeastOnce)]
    );
    let mut victim = Raw::connect(broker.local_addr(), "victim").await;
    victim
        .subscribe(
            &format!("{NOTIFY_NAMESPACE}/{}/#", hex::encode_upper("victim")),
            QoS::AtLeastOnce,
        )
        .await;
    assert_eq!(
        &victim.request(&[b"KEYNOTIFY", b"secret"]).await.payload[..],
        b"+OK\r\n"
    );
    assert_eq!(
        &nosy.request(&[b"KEYNOTIFY", b"mine"]).await.payload[..],
        b"+OK\r\n"
    );

    victim.request(&[b"SET", b"secret", b"s3cr3t"]).await;
    let n = victim.next_publish().await;
    assert_eq!(
        &n.payload[..],
        b"*4\r\n$6\r\nNOTIFY\r\n$3\r\nSET\r\n$5\r\nVALUE\r\n$6\r\ns3cr3t\r\n"
    );
    assert_eq!(n.topic, notify_topic("victim", b"secret").as_bytes());
    assert!(user_property(&n, "__ts").is_some());

    victim.request(&[b"SET", b"mine", b"x"]).await;
    // nosy, subscribed to "#", sees its own notification but never the victim's.
    loop {
        let p = nosy.next_publish().await;
        let topic = String::from_utf8(p.topic.to_vec()).unwrap();
        assert_ne!(
            topic,
            notify_topic("victim", b"secret"),
            "leaked another client's notification"
        );
        if topic == notify_topic("nosy", b"mine") {
            break;
        }
    }
}

// ------------------------------------------------------------ KEYNOTIFY lifetime

/// A SUBSCRIBE to the response topic and a request sent with it in one
/// write (a pipelining client, or Nagle): the answer comes. It was
/// answered, through the router, before the router had the subscription,
/// and lost; so was a notification after SUBSCRIBE, KEYNOTIFY and SET in
/// one write.
#[tokio::test]
async fn a_subscribe_and_a_request_in_one_write_get_the_answer() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let encode = |packets: Vec<Packet>| {
        let mut buf = bytes::BytesMut::new();
        for p in packets {
            p.write(&mut buf, None).expect("encode");
        }
        buf
    };
    let request = |c: &Raw, pkid: u16, args: &[&str]| {
        let ts = now_hlc("pipeline");
        let props = c.request_properties(&pkid.to_be_bytes(), &[("__ts", &ts)]);
        let mut publish = v5::Publish::new(
            REQUEST_TOPIC,
            QoS::AtLeastOnce,
            encode_request(args),
            Some(props),
        );
        publish.pkid = pkid;
        Packet::Publish(publish)
    };
    let subscribe = |pkid: u16, filter: &str| {
        let mut s = v5::Subscribe::new(v5::Filter::new(filter, QoS::AtLeastOnce), None);
        s.pkid = pkid;
        Packet::Subscribe(s)
    };
    for round in 0..5 {
        let mut c = Raw::connect(addr, &format!("pipeline-{round}")).await;
        let inbox = c.request_properties(b"", &[]).response_topic.unwrap();
        let own = format!(
            "{NOTIFY_NAMESPACE}/{}/#",
            hex::encode_upper(format!("pipeline-{round}"))
        );
        let key = format!("k{round}");
        let bytes = encode(vec![
            subscribe(1, &inbox),
            request(&c, 2, &["GET", &key]),
            subscribe(3, &own),
            request(&c, 4, &["KEYNOTIFY", &key]),
            request(&c, 5, &["SET", &key, "v"]),
        ]);
        c.send_bytes(&bytes).await;
        let mut answers = Vec::new();
        let mut notified = false;
        while answers.len() < 3 || !notified {
            let p = c.next_publish().await;
            if p.topic == inbox.as_bytes() {
                answers.push(p.payload.to_vec());
            } else {
                assert_eq!(
                    p.topic,
                    notify_topic(&format!("pipeline-{round}"), key.as_bytes()).as_bytes()
                );
                notified = true;
            }
        }
        assert_eq!(
            answers,
            [
                b"$-1\r\n".to_vec(),
                b"+OK\r\n".to_vec(),
                b"+OK\r\n".to_vec()
            ],
            "round {round}"
        );
    }
}

#[tokio::test]
async fn registrations_vanish_when_the_client_disconnects() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let own = format!("{NOTIFY_NAMESPACE}/{}/#", hex::encode_upper("watcher"));
    {
        let mut w = Raw::connect(addr, "watcher").await;
        w.subscribe(&own, QoS::AtLeastOnce).await;
        assert_eq!(
            &w.request(&[b"KEYNOTIFY", b"k"]).await.payload[..],
            b"+OK\r\n"
        );
        assert_eq!(broker.store().with_store(|s| s.watch_count()), 1);
        // Dropped without DISCONNECT.
    }
    eventually("registration removed", || {
        broker.store().with_store(|s| s.watch_count()) == 0
    })
    .await;
    let mut w = Raw::connect(addr, "watcher").await;
    w.subscribe(&own, QoS::AtLeastOnce).await;
    let mut writer = Raw::connect(addr, "writer").await;
    writer.request(&[b"SET", b"k", b"v"]).await;
    w.no_publish_within(Duration::from_millis(300)).await;
    // After registering again, notifications flow.
    w.request(&[b"KEYNOTIFY", b"k"]).await;
    writer.request(&[b"SET", b"k", b"v2"]).await;
    assert_eq!(
        w.next_publish().await.topic,
        notify_topic("watcher", b"k").as_bytes()
    );
}

#[tokio::test]
async fn a_taken_over_client_id_keeps_the_new_connections_registrations() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let own = format!("{NOTIFY_NAMESPACE}/{}/#", hex::encode_upper("twin"));
    let mut first = Raw::connect(addr, "twin").await;
    first.request(&[b"KEYNOTIFY", b"old"]).await;
    let mut second = Raw::connect(addr, "twin").await;
    second.subscribe(&own, QoS::AtLeastOnce).await;
    second.request(&[b"KEYNOTIFY", b"new"]).await;
    let d = first.expect_disconnect().await;
    assert_eq!(
        disconnect_reason(&d),
        Some(DisconnectReasonCode::SessionTakenOver)
    );
    eventually("old registration removed", || {
        broker.store().with_store(|s| s.watch_count()) == 1
    })
    .await;
    let mut writer = Raw::connect(addr, "writer").await;
    writer.request(&[b"SET", b"new", b"v"]).await;
    assert_eq!(
        second.next_publish().await.topic,
        notify_topic("twin", b"new").as_bytes()
    );
}

/// A connection that takes a client id over hears nothing of what the
/// earlier connection registered: those registrations end when it is
/// accepted, not with the earlier connection's clean-up, which comes
/// only after that one said goodbye to its client (0x8E, then a linger).
#[tokio::test]
async fn a_taken_over_connections_registrations_end_before_the_new_one_starts() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let own = format!("{NOTIFY_NAMESPACE}/{}/#", hex::encode_upper("twin2"));
    let mut first = Raw::connect(addr, "twin2").await;
    first.request(&[b"KEYNOTIFY", b"old"]).await;
    let mut second = Raw::connect(addr, "twin2").await;
    second.subscribe(&own, QoS::AtLeastOnce).await;
    let mut writer = Raw::connect(addr, "writer2").await;
    writer.request(&[b"SET", b"old", b"v"]).await;
    second.request(&[b"KEYNOTIFY", b"new"]).await;
    writer.request(&[b"SET", b"new", b"v"]).await;
    // The first notification it gets is of its own registration.
    assert_eq!(
        second.next_publish().await.topic,
        notify_topic("twin2", b"new").as_bytes()
    );
    drop(first);
}

// ------------------------------------------------------------ MQTT 3.1.1 and 5 on one port

#[tokio::test]
async fn mqtt311_and_mqtt5_clients_exchange_messages_on_one_port() {
    use rumqttc::mqttbytes::v4;
    let broker = start_broker().await;
    let mut five = Raw::connect(broker.local_addr(), "five").await;
    let mut four = Raw4::connect(broker.local_addr(), "four").await;

    // A SUBSCRIBE with packet id 0 is malformed ([MQTT-2.2.1-3]).
    let mut subscribe = v4::Subscribe::new("to/four", rumqttc::mqttbytes::QoS::AtLeastOnce);
    subscribe.pkid = four.pkid();
    four.send(v4::Packet::Subscribe(subscribe)).await;
    assert!(matches!(four.recv().await, Some(v4::Packet::SubAck(_))));
    five.subscribe("to/five", QoS::AtLeastOnce).await;

    // 5 -> 3.1.1, with properties that 3.1.1 cannot carry.
    let props = v5::PublishProperties {
        user_properties: vec![("k".into(), "v".into())],
        content_type: Some("text/plain".into()),
        ..Default::default()
    };
    five.publish(
        "to/four",
        Bytes::from_static(b"hello four"),
        QoS::AtLeastOnce,
        Some(props),
    )
    .await;
    match four.recv().await {
        Some(v4::Packet::Publish(p)) => {
            assert_eq!(&p.payload[..], b"hello four");
            four.send(v4::Packet::PubAck(v4::PubAck::new(p.pkid))).await;
        }
        other => panic!("{other:?}"),
    }
    // 3.1.1 -> 5
    let mut publish = v4::Publish::new(
        "to/five",
        rumqttc::mqttbytes::QoS::AtLeastOnce,
        b"hello five".to_vec(),
    );
    publish.pkid = four.pkid();
    four.send(v4::Packet::Publish(publish)).await;
    assert!(matches!(four.recv().await, Some(v4::Packet::PubAck(_))));
    assert_eq!(&five.next_publish().await.payload[..], b"hello five");
}

#[tokio::test]
async fn unsubscribe_is_always_acknowledged() {
    let broker = start_broker().await;
    let mut c = Raw::connect(broker.local_addr(), "unsub").await;
    c.subscribe("a", QoS::AtLeastOnce).await;
    let mut unsubscribe = v5::Unsubscribe::new("a", None);
    unsubscribe.filters.push("never-subscribed".into());
    unsubscribe.pkid = 9;
    c.send(Packet::Unsubscribe(unsubscribe)).await;
    match c.recv().await {
        Recv::Packet(Packet::UnsubAck(ack)) => {
            assert_eq!(ack.pkid, 9);
            assert_eq!(ack.reasons.len(), 2);
        }
        other => panic!("{other:?}"),
    }
    assert!(
        matches!(
            c.recv_within(Duration::from_millis(200)).await,
            Recv::Timeout
        ),
        "exactly one UNSUBACK"
    );
    let mut other = Raw::connect(broker.local_addr(), "pub").await;
    other
        .publish("a", Bytes::from_static(b"x"), QoS::AtLeastOnce, None)
        .await;
    c.no_publish_within(Duration::from_millis(300)).await;
}

// ------------------------------------------------------------ protocol enforcement

#[tokio::test]
async fn keep_alive_is_enforced() {
    let broker = start_broker().await;
    let (mut c, _) = Raw::connect_with(broker.local_addr(), "sleepy", |c| c.0.keep_alive = 1).await;
    let started = std::time::Instant::now();
    let d = c.expect_disconnect().await;
    assert_eq!(
        disconnect_reason(&d),
        Some(DisconnectReasonCode::KeepAliveTimeout)
    );
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(1400) && waited < Duration::from_secs(4),
        "{waited:?}"
    );
}

/// A client that keeps talking stays connected well past its keep-alive:
/// the timer moves on with what was last heard.
#[tokio::test]
async fn keep_alive_moves_on_while_the_client_talks() {
    let broker = start_broker().await;
    let (mut c, _) = Raw::connect_with(broker.local_addr(), "chatty", |c| c.0.keep_alive = 1).await;
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        c.send(Packet::PingReq(v5::PingReq)).await;
        match c.recv_within(Duration::from_secs(1)).await {
            Recv::Packet(Packet::PingResp(_)) => {}
            other => panic!("expected PINGRESP, got {other:?}"),
        }
    }
    // 3.2 s in, more than twice the 1.5 s limit; then silence ends it.
    let d = c.expect_disconnect().await;
    assert_eq!(
        disconnect_reason(&d),
        Some(DisconnectReasonCode::KeepAliveTimeout)
    );
}

#[tokio::test]
async fn max_keep_alive_is_announced_and_enforced() {
    let broker = start_broker_with(|s| s.broker.max_keep_alive_secs = 1).await;
    let (mut c, connack) =
        Raw::connect_with(broker.local_addr(), "greedy", |c| c.0.keep_alive = 600).await;
    assert_eq!(connack.properties.unwrap().server_keep_alive, Some(1));
    let d = c.expect_disconnect().await;
    assert_eq!(
        disconnect_reason(&d),
        Some(DisconnectReasonCode::KeepAliveTimeout)
    );
}

#[tokio::test]
async fn connect_must_come_in_time() {
    let broker = start_broker_with(|s| s.listeners[0].connect_timeout_ms = 200).await;
    let mut stream = tokio::net::TcpStream::connect(broker.local_addr())
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let mut buf = [0u8; 16];
    use tokio::io::AsyncReadExt;
    let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
        .await
        .unwrap()
        .unwrap_or(0);
    assert_eq!(n, 0, "closed without a word");
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn packets_over_the_size_limit_disconnect() {
    let broker = start_broker_with(|s| s.listeners[0].max_packet_size = 1024).await;
    let (mut c, connack) = Raw::connect_with(broker.local_addr(), "big", |_| {}).await;
    assert_eq!(connack.properties.unwrap().max_packet_size, Some(1024));
    c.publish("t", Bytes::from(vec![b'x'; 2000]), QoS::AtMostOnce, None)
        .await;
    let d = c.expect_disconnect().await;
    assert_eq!(
        disconnect_reason(&d),
        Some(DisconnectReasonCode::PacketTooLarge)
    );
}

#[tokio::test]
async fn connection_limit_answers_server_busy() {
    let broker = start_broker_with(|s| s.router.max_connections = 2).await;
    let _a = Raw::connect(broker.local_addr(), "a").await;
    let _b = Raw::connect(broker.local_addr(), "b").await;
    let (_c, connack) = Raw::connect_with(broker.local_addr(), "c", |_| {}).await;
    assert_eq!(connack.code, v5::ConnectReturnCode::ServerBusy);
    drop(_a);
    eventually("a slot frees up", || broker.connection_count() < 2).await;
    let (_d, connack) = Raw::connect_with(broker.local_addr(), "d", |_| {}).await;
    assert_eq!(connack.code, v5::ConnectReturnCode::Success);
}

#[tokio::test]
async fn bad_packets_disconnect_the_sender_only() {
    let broker = start_broker().await;
    let mut good = Raw::connect(broker.local_addr(), "good").await;
    for (i, bytes) in [
        &[0x20u8, 0x02, 0x00, 0x00][..],             // CONNACK from a client
        &[0xB0, 0x02, 0x00, 0x01],                   // UNSUBACK from a client
        &[0x90, 0x03, 0x00, 0x01, 0x00],             // SUBACK from a client
        &[0x00, 0x00],                               // reserved packet type
        &[0x36, 0x05, 0x00, 0x01, b't', 0x00, 0x01], // QoS 3
        &[0x30, 0xFF, 0xFF, 0xFF, 0xFF, 0x01],       // remaining length too long
        &[0x82, 0x04, 0x00, 0x01, 0x00, 0x00],       // SUBSCRIBE without filters (malformed)
    ]
    .iter()
    .enumerate()
    {
        let mut bad = Raw::connect(broker.local_addr(), &format!("bad-{i}")).await;
        bad.send_bytes(bytes).await;
        let d = bad.expect_disconnect().await;
        let reason = disconnect_reason(&d);
        assert!(
            matches!(
                reason,
                Some(
                    DisconnectReasonCode::ProtocolError
                        | DisconnectReasonCode::MalformedPacket
                        | DisconnectReasonCode::PacketTooLarge
                )
            ),
            "{bytes:?}: {reason:?}"
        );
    }
    assert_eq!(
        &good.request(&[b"SET", b"still", b"fine"]).await.payload[..],
        b"+OK\r\n"
    );
}

#[tokio::test]
async fn invalid_client_ids_and_reserved_will_topics_are_refused() {
    let broker = start_broker().await;
    for id in ["a/b", "a+b", "statebroker:store", "$x"] {
        let (_c, connack) = Raw::connect_with(broker.local_addr(), id, |_| {}).await;
        assert_eq!(
            connack.code,
            v5::ConnectReturnCode::ClientIdentifierNotValid,
            "{id}"
        );
    }
    let (_c, connack) =
        Raw::connect_with(broker.local_addr(), "", |c| c.0.clean_start = false).await;
    assert_eq!(
        connack.code,
        v5::ConnectReturnCode::ClientIdentifierNotValid
    );
    let (_c, connack) = Raw::connect_with(broker.local_addr(), "", |_| {}).await;
    assert_eq!(connack.code, v5::ConnectReturnCode::Success);
    assert!(
        connack
            .properties
            .unwrap()
            .assigned_client_identifier
            .is_some()
    );
    for topic in [notify_topic("x", b"k"), REQUEST_TOPIC.to_owned()] {
        let (_c, connack) = Raw::connect_with(broker.local_addr(), "willful", |c| {
            c.1 = Some(v5::LastWill::new(
                topic.as_str(),
                "bye",
                QoS::AtMostOnce,
                false,
                None,
            ));
        })
        .await;
        assert_eq!(
            connack.code,
            v5::ConnectReturnCode::TopicNameInvalid,
            "{topic}"
        );
    }
}

// ------------------------------------------------------------ wills and sessions

#[tokio::test]
async fn wills_fire_on_abnormal_close_only() {
    let broker = start_broker().await;
    let mut listener = Raw::connect(broker.local_addr(), "listener").await;
    listener.subscribe("wills/#", QoS::AtLeastOnce).await;
    let will = |topic: &str| {
        Some(v5::LastWill::new(
            topic,
            "gone",
            QoS::AtLeastOnce,
            false,
            None,
        ))
    };
    {
        let (mut polite, _) = Raw::connect_with(broker.local_addr(), "polite", |c| {
            c.1 = will("wills/polite")
        })
        .await;
        polite
            .send(Packet::Disconnect(v5::Disconnect::new(
                DisconnectReasonCode::NormalDisconnection,
            )))
            .await;
    }
    {
        let (_rude, _) =
            Raw::connect_with(broker.local_addr(), "rude", |c| c.1 = will("wills/rude")).await;
        // dropped: the socket closes without DISCONNECT
    }
    let p = listener.next_publish().await;
    assert_eq!(&p.topic[..], b"wills/rude");
    assert_eq!(&p.payload[..], b"gone");
    listener.no_publish_within(Duration::from_millis(300)).await;
}

#[tokio::test]
async fn persistent_sessions_keep_subscriptions() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let persistent = |c: &mut (v5::Connect, Option<v5::LastWill>, Option<v5::Login>)| {
        c.0.clean_start = false;
        c.0.properties.as_mut().unwrap().session_expiry_interval = Some(3600);
    };
    {
        let (mut c, connack) = Raw::connect_with(addr, "durable", persistent).await;
        assert!(!connack.session_present);
        c.subscribe("news", QoS::AtLeastOnce).await;
        c.send(Packet::Disconnect(v5::Disconnect::new(
            DisconnectReasonCode::NormalDisconnection,
        )))
        .await;
    }
    eventually("disconnected", || broker.connection_count() == 0).await;
    let mut publisher = Raw::connect(addr, "publisher").await;
    publisher
        .publish(
            "news",
            Bytes::from_static(b"while you were away"),
            QoS::AtLeastOnce,
            None,
        )
        .await;
    let (mut c, connack) = Raw::connect_with(addr, "durable", persistent).await;
    assert!(connack.session_present);
    assert_eq!(&c.next_publish().await.payload[..], b"while you were away");
}

#[tokio::test]
async fn legacy_2023_topic_is_served_and_can_be_switched_off() {
    let broker = start_broker().await;
    let mut c = Raw::connect(broker.local_addr(), "old-client").await;
    let ts = now_hlc("old-client");
    let r = c
        .request_raw(
            LEGACY_REQUEST_TOPIC,
            &encode_request(&["set", "k", "v"]),
            &[("__ts", &ts)],
        )
        .await;
    assert_eq!(&r.payload[..], b"+OK\r\n");
    let r = c
        .request_raw(
            LEGACY_REQUEST_TOPIC,
            &encode_request(&["GET", "k"]),
            &[("__ts", &ts)],
        )
        .await;
    assert_eq!(&r.payload[..], b"-ERR unknown command\r\n");

    let broker = start_broker_with(|s| s.broker.legacy_2023_topic = false).await;
    let mut c = Raw::connect(broker.local_addr(), "old-client").await;
    c.request(&[b"GET", b"warm-up"]).await;
    let props = c.request_properties(b"1", &[("__ts", &ts)]);
    c.publish(
        LEGACY_REQUEST_TOPIC,
        Bytes::from(encode_request(&["get", "k"])),
        QoS::AtLeastOnce,
        Some(props),
    )
    .await;
    c.no_publish_within(Duration::from_millis(300)).await;
}
