//! How responses and notifications reach clients: directly to the only
//! recipient, through the router when others listen too, within the
//! client's Receive Maximum, and kept for a persistent session.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::raw::{REQUEST_TOPIC, Raw, Recv, now_hlc, v5};
use common::start_broker;
use rumqttc::v5::mqttbytes::QoS;
use statestore::resp3::encode_request;

fn request(c: &mut Raw, correlation: u64, args: &[&str]) -> v5::Packet {
    let props = c.request_properties(
        &correlation.to_be_bytes(),
        &[("__ts", &now_hlc(&c.client_id))],
    );
    let mut publish = v5::Publish::new(
        REQUEST_TOPIC,
        QoS::AtLeastOnce,
        encode_request(args),
        Some(props),
    );
    publish.pkid = c.pkid();
    v5::Packet::Publish(publish)
}

/// Publishes received within `wait`, not acknowledged.
async fn collect_publishes(c: &mut Raw, wait: Duration) -> Vec<v5::Publish> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match c.recv_within(left).await {
            Recv::Packet(v5::Packet::Publish(p)) => got.push(p),
            Recv::Packet(_) => {}
            Recv::Timeout | Recv::Closed => return got,
        }
    }
}

#[tokio::test]
async fn the_only_subscriber_gets_its_response_directly() {
    let broker = start_broker().await;
    let mut c = Raw::connect(broker.local_addr(), "direct").await;
    c.subscribe(&c.response_topic.clone(), QoS::AtLeastOnce)
        .await;
    let packet = request(&mut c, 1, &["SET", "k", "v"]);
    c.send(packet).await;
    let response = loop {
        match c.recv().await {
            Recv::Packet(v5::Packet::Publish(p)) => break p,
            Recv::Packet(_) => continue,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(&response.payload[..], b"+OK\r\n");
    assert!(
        response.pkid > 100,
        "not numbered by the router: {}",
        response.pkid
    );
    c.send(v5::Packet::PubAck(v5::PubAck::new(response.pkid, None)))
        .await;
    // The connection is healthy afterwards: the ack did not confuse the router.
    assert_eq!(
        &c.request(&[b"GET", b"k"]).await.payload[..],
        b"$1\r\nv\r\n"
    );
}

#[tokio::test]
async fn a_wildcard_listener_still_sees_responses() {
    let broker = start_broker().await;
    let mut spy = Raw::connect(broker.local_addr(), "spy").await;
    spy.subscribe("clients/#", QoS::AtLeastOnce).await;
    let mut c = Raw::connect(broker.local_addr(), "requester").await;
    let response = c.request(&[b"SET", b"k", b"v"]).await;
    assert_eq!(&response.payload[..], b"+OK\r\n");
    let seen = spy.next_publish().await;
    assert_eq!(seen.topic, c.response_topic.as_bytes());
    assert_eq!(&seen.payload[..], b"+OK\r\n");
}

#[tokio::test]
async fn direct_deliveries_respect_receive_maximum() {
    let broker = start_broker().await;
    // The client's whole window is shared by the router's deliveries and
    // direct ones (none from the router here).
    let (mut c, _) = Raw::connect_with(broker.local_addr(), "slow", |c| {
        c.0.properties.as_mut().unwrap().receive_maximum = Some(20);
    })
    .await;
    c.subscribe(&c.response_topic.clone(), QoS::AtLeastOnce)
        .await;
    for i in 0..50 {
        let packet = request(&mut c, i, &["GET", "k"]);
        c.send(packet).await;
    }
    let first = collect_publishes(&mut c, Duration::from_millis(500)).await;
    assert_eq!(
        first.len(),
        20,
        "no more than the window before acknowledgements"
    );
    for p in &first {
        c.send(v5::Packet::PubAck(v5::PubAck::new(p.pkid, None)))
            .await;
    }
    let mut total = first.len();
    while total < 50 {
        let more = collect_publishes(&mut c, Duration::from_millis(500)).await;
        assert!(!more.is_empty() && more.len() <= 20, "{}", more.len());
        for p in &more {
            c.send(v5::Packet::PubAck(v5::PubAck::new(p.pkid, None)))
                .await;
        }
        total += more.len();
    }
    assert_eq!(total, 50, "every response, once");
}

#[tokio::test]
async fn a_persistent_session_gets_a_response_its_connection_missed() {
    let broker = start_broker().await;
    let persistent = |c: &mut (v5::Connect, Option<v5::LastWill>, Option<v5::Login>)| {
        c.0.clean_start = false;
        c.0.properties.as_mut().unwrap().session_expiry_interval = Some(3600);
    };
    {
        let (mut c, _) = Raw::connect_with(broker.local_addr(), "flaky", persistent).await;
        c.subscribe(&c.response_topic.clone(), QoS::AtLeastOnce)
            .await;
        let packet = request(&mut c, 77, &["SET", "k", "v"]);
        c.send(packet).await;
        // Gone without reading or acknowledging anything.
    }
    common::eventually("disconnected", || broker.connection_count() == 0).await;
    let (mut c, connack) = Raw::connect_with(broker.local_addr(), "flaky", persistent).await;
    assert!(connack.session_present);
    let response = c.next_publish().await;
    assert_eq!(&response.payload[..], b"+OK\r\n");
    let correlation = response.properties.unwrap().correlation_data.unwrap();
    assert_eq!(correlation, Bytes::copy_from_slice(&77u64.to_be_bytes()));
}

#[tokio::test]
async fn notifications_reach_only_their_owner_directly() {
    let broker = start_broker().await;
    let mut w = Raw::connect(broker.local_addr(), "owner").await;
    let own = format!(
        "{}/{}/command/notify/+",
        common::raw::NOTIFY_NAMESPACE,
        hex::encode_upper("owner")
    );
    w.subscribe(&own, QoS::AtMostOnce).await;
    w.request(&[b"KEYNOTIFY", b"k"]).await;
    let mut other = Raw::connect(broker.local_addr(), "other").await;
    other.request(&[b"SET", b"k", b"v"]).await;
    let n = w.next_publish().await;
    assert_eq!(n.qos, QoS::AtMostOnce, "at the subscription's QoS");
    assert_eq!(
        &n.payload[..],
        b"*4\r\n$6\r\nNOTIFY\r\n$3\r\nSET\r\n$5\r\nVALUE\r\n$1\r\nv\r\n"
    );
}

#[tokio::test]
async fn a_clean_connection_takes_over_a_persistent_one_and_joins_the_router_when_it_subscribes() {
    let broker = start_broker().await;
    let (mut old, _) = Raw::connect_with(broker.local_addr(), "twin", |c| {
        c.0.clean_start = false;
        c.0.properties.as_mut().unwrap().session_expiry_interval = Some(3600);
    })
    .await;
    old.subscribe("news", QoS::AtLeastOnce).await;
    let mut new = Raw::connect(broker.local_addr(), "twin").await;
    let d = old.expect_disconnect().await;
    assert_eq!(
        d.map(|d| d.reason_code),
        Some(v5::DisconnectReasonCode::SessionTakenOver)
    );
    // The new, clean session has nothing of the old one...
    let mut publisher = Raw::connect(broker.local_addr(), "publisher").await;
    publisher
        .publish("news", Bytes::from_static(b"one"), QoS::AtLeastOnce, None)
        .await;
    new.no_publish_within(Duration::from_millis(300)).await;
    // ...and gets messages once it subscribes (joining the router then).
    new.subscribe("news", QoS::AtLeastOnce).await;
    publisher
        .publish("news", Bytes::from_static(b"two"), QoS::AtLeastOnce, None)
        .await;
    assert_eq!(&new.next_publish().await.payload[..], b"two");
    // Its store requests work throughout.
    assert_eq!(
        &new.request(&[b"SET", b"k", b"v"]).await.payload[..],
        b"+OK\r\n"
    );
}

/// MQTT 4.3 and 4.4 for state store requests: a request the client sends
/// again after reconnecting to its session (DUP 1, the same packet id and
/// correlation data), because the acknowledgement did not reach it, is
/// acknowledged again and not run again. The client gets one answer, the
/// one its session kept; a second run of this `SET NX` would answer `:-1`.
/// At QoS 2 this is what exactly once means; at QoS 1 it keeps a retried
/// lock acquisition from moving the key's version (its fencing token).
#[tokio::test]
async fn a_request_resent_after_a_reconnect_runs_once() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    for (qos, id) in [
        (QoS::AtLeastOnce, "resend-1"),
        (QoS::ExactlyOnce, "resend-2"),
    ] {
        let (mut c, _) = Raw::connect_with(addr, id, common::mqtt::session(false, Some(600))).await;
        c.ensure_response_subscription().await;
        let props = c.request_properties(b"once", &[("__ts", &now_hlc(id))]);
        let payload = encode_request(&["SET", id, "v", "NX"]);
        let mut publish = v5::Publish::new(REQUEST_TOPIC, qos, payload, Some(props));
        publish.pkid = 77;
        c.send(v5::Packet::Publish(publish.clone())).await;
        // Acknowledged, so it ran; the client acts as if it never came.
        loop {
            match c.recv().await {
                Recv::Packet(v5::Packet::PubAck(ack)) if ack.pkid == 77 => break,
                Recv::Packet(v5::Packet::PubRec(rec)) if rec.pkid == 77 => break,
                Recv::Packet(_) => {}
                other => panic!("{id}: expected the acknowledgement, got {other:?}"),
            }
        }
        drop(c);

        let (mut c, connack) =
            Raw::connect_with(addr, id, common::mqtt::session(false, Some(600))).await;
        assert!(connack.session_present, "{id}");
        publish.dup = true;
        c.send(v5::Packet::Publish(publish)).await;
        let (acknowledged, answers) = common::mqtt::acknowledgement_and_answers(&mut c, 77).await;
        assert!(acknowledged, "{id}: the resent request is acknowledged");
        assert_eq!(answers, [Bytes::from_static(b"+OK\r\n")], "{id}");
    }
}
