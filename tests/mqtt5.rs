//! MQTT 5 publish/subscribe semantics, asserted packet by packet with raw
//! clients: what the broker delivers, at which QoS, with which flags.
//! Each test names the rule (and the section of the MQTT 5 specification).

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::mqtt::{
    ack, filter, goodbye, next_raw_publish, publish_complete, publish_until_pubrec, pubrel_with,
    session, subscribe_with, subscribe_with_id,
};
use common::raw::{Raw, Recv, v5};
use common::start_broker;
use rumqttc::v5::mqttbytes::QoS;
use v5::{Packet, Publish, SubscribeReasonCode};

/// MQTT 5 3.8.4: a message is delivered at the smaller of its own QoS and
/// the subscription's, never upgraded.
#[tokio::test]
async fn delivered_qos_is_the_minimum_of_publish_and_subscription() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut sub2 = Raw::connect(addr, "qos-sub2").await;
    let mut sub1 = Raw::connect(addr, "qos-sub1").await;
    let mut sub0 = Raw::connect(addr, "qos-sub0").await;
    for (c, qos) in [
        (&mut sub2, QoS::ExactlyOnce),
        (&mut sub1, QoS::AtLeastOnce),
        (&mut sub0, QoS::AtMostOnce),
    ] {
        assert_eq!(
            c.subscribe("qos/t", qos).await,
            vec![SubscribeReasonCode::Success(qos)]
        );
    }
    let mut publisher = Raw::connect(addr, "qos-pub").await;
    let levels = [QoS::AtMostOnce, QoS::AtLeastOnce, QoS::ExactlyOnce];
    for (n, qos) in levels.into_iter().enumerate() {
        let payload: &'static [u8] = [&b"0"[..], b"1", b"2"][n];
        publish_complete(&mut publisher, "qos/t", payload, qos, false).await;
        for (c, sub_qos) in [
            (&mut sub2, QoS::ExactlyOnce),
            (&mut sub1, QoS::AtLeastOnce),
            (&mut sub0, QoS::AtMostOnce),
        ] {
            let p = next_raw_publish(c).await;
            let expected = std::cmp::min(qos as u8, sub_qos as u8);
            assert_eq!(&p.payload[..], payload);
            assert_eq!(
                p.qos as u8, expected,
                "publish QoS {qos:?} to a QoS {sub_qos:?} subscription"
            );
            assert_eq!(p.pkid == 0, expected == 0, "a packet id only at QoS 1/2");
            ack(c, &p).await;
        }
    }
    for c in [&mut sub2, &mut sub1, &mut sub0] {
        c.no_publish_within(Duration::from_millis(100)).await;
    }
}

/// MQTT 5 3.8.3.1 No Local: a subscriber with No Local does not get its
/// own publishes back; others' it does, and without No Local its own too.
#[tokio::test]
async fn no_local() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut local = Raw::connect(addr, "nl-self").await;
    let codes = subscribe_with(
        &mut local,
        filter("nl/t", QoS::AtLeastOnce, |f| f.nolocal = true),
    )
    .await;
    assert_eq!(codes, vec![SubscribeReasonCode::Success(QoS::AtLeastOnce)]);
    let mut plain = Raw::connect(addr, "nl-plain").await;
    subscribe_with(&mut plain, filter("nl/t", QoS::AtLeastOnce, |_| {})).await;

    publish_complete(&mut local, "nl/t", b"mine", QoS::AtLeastOnce, false).await;
    let p = next_raw_publish(&mut plain).await;
    assert_eq!(&p.payload[..], b"mine");
    ack(&mut plain, &p).await;
    local.no_publish_within(Duration::from_millis(200)).await;

    publish_complete(&mut plain, "nl/t", b"theirs", QoS::AtLeastOnce, false).await;
    let p = next_raw_publish(&mut local).await;
    assert_eq!(&p.payload[..], b"theirs");
    ack(&mut local, &p).await;
    let p = next_raw_publish(&mut plain).await;
    assert_eq!(&p.payload[..], b"theirs", "no No Local: its own comes back");
    ack(&mut plain, &p).await;
}

/// MQTT 5 3.3.1.3 and 3.8.3.1 Retain As Published: a retained publish
/// reaches existing subscribers with RETAIN 0, unless they asked to keep
/// the flag; a new subscription gets the retained message with RETAIN 1.
#[tokio::test]
async fn retain_as_published() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut keeps = Raw::connect(addr, "rap-keeps").await;
    subscribe_with(
        &mut keeps,
        filter("rap/t", QoS::AtLeastOnce, |f| f.preserve_retain = true),
    )
    .await;
    let mut clears = Raw::connect(addr, "rap-clears").await;
    subscribe_with(&mut clears, filter("rap/t", QoS::AtLeastOnce, |_| {})).await;
    let mut publisher = Raw::connect(addr, "rap-pub").await;
    publish_complete(&mut publisher, "rap/t", b"r1", QoS::AtLeastOnce, true).await;
    publish_complete(&mut publisher, "rap/t", b"plain", QoS::AtLeastOnce, false).await;
    for (c, retained_flag) in [(&mut keeps, true), (&mut clears, false)] {
        let p = next_raw_publish(c).await;
        assert_eq!((&p.payload[..], p.retain), (&b"r1"[..], retained_flag));
        ack(c, &p).await;
        let p = next_raw_publish(c).await;
        assert_eq!((&p.payload[..], p.retain), (&b"plain"[..], false));
        ack(c, &p).await;
    }
    let mut late = Raw::connect(addr, "rap-late").await;
    subscribe_with(&mut late, filter("rap/t", QoS::AtLeastOnce, |_| {})).await;
    let p = next_raw_publish(&mut late).await;
    assert_eq!((&p.payload[..], p.retain), (&b"r1"[..], true));
}

/// MQTT 5 3.8.3.1 Retain Handling: 0 sends the retained messages on every
/// SUBSCRIBE, 1 only when the subscription is new, 2 never.
#[tokio::test]
async fn retain_handling() {
    use v5::RetainForwardRule as Rule;
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut publisher = Raw::connect(addr, "rh-pub").await;
    publish_complete(&mut publisher, "rh/t", b"kept", QoS::AtLeastOnce, true).await;
    let rule = |r: Rule| filter("rh/t", QoS::AtLeastOnce, move |f| f.retain_forward_rule = r);

    let mut every = Raw::connect(addr, "rh-every").await;
    for round in 0..2 {
        subscribe_with(&mut every, rule(Rule::OnEverySubscribe)).await;
        let p = next_raw_publish(&mut every).await;
        assert_eq!(
            (&p.payload[..], p.retain),
            (&b"kept"[..], true),
            "round {round}"
        );
        ack(&mut every, &p).await;
    }
    every.no_publish_within(Duration::from_millis(100)).await;

    let mut new_only = Raw::connect(addr, "rh-new").await;
    subscribe_with(&mut new_only, rule(Rule::OnNewSubscribe)).await;
    let p = next_raw_publish(&mut new_only).await;
    assert_eq!(&p.payload[..], b"kept");
    ack(&mut new_only, &p).await;
    subscribe_with(&mut new_only, rule(Rule::OnNewSubscribe)).await;
    new_only.no_publish_within(Duration::from_millis(200)).await;

    let mut never = Raw::connect(addr, "rh-never").await;
    subscribe_with(&mut never, rule(Rule::Never)).await;
    never.no_publish_within(Duration::from_millis(200)).await;
    // The subscription itself works.
    publish_complete(&mut publisher, "rh/t", b"live", QoS::AtLeastOnce, false).await;
    let p = next_raw_publish(&mut never).await;
    assert_eq!((&p.payload[..], p.retain), (&b"live"[..], false));
}

/// MQTT 5 3.8.4: a SUBSCRIBE for a filter the client already has replaces
/// the subscription's options (here its QoS), without a second copy.
#[tokio::test]
async fn subscribing_again_replaces_the_options() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut sub = Raw::connect(addr, "resub").await;
    subscribe_with(&mut sub, filter("resub/t", QoS::AtMostOnce, |_| {})).await;
    let mut publisher = Raw::connect(addr, "resub-pub").await;
    publish_complete(&mut publisher, "resub/t", b"a", QoS::AtLeastOnce, false).await;
    let p = next_raw_publish(&mut sub).await;
    assert_eq!((&p.payload[..], p.qos), (&b"a"[..], QoS::AtMostOnce));
    let codes = subscribe_with(&mut sub, filter("resub/t", QoS::AtLeastOnce, |_| {})).await;
    assert_eq!(codes, vec![SubscribeReasonCode::Success(QoS::AtLeastOnce)]);
    publish_complete(&mut publisher, "resub/t", b"b", QoS::AtLeastOnce, false).await;
    let p = next_raw_publish(&mut sub).await;
    assert_eq!((&p.payload[..], p.qos), (&b"b"[..], QoS::AtLeastOnce));
    ack(&mut sub, &p).await;
    sub.no_publish_within(Duration::from_millis(200)).await;
}

/// MQTT 5 3.3.1.3: every matching retained message reaches a new
/// subscription, however many there are, at QoS 0 as at QoS 1 (the
/// router used to send 100 at QoS 1/2 and 200 at QoS 0).
#[tokio::test]
async fn every_retained_message_reaches_a_new_subscription() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut publisher = Raw::connect(addr, "many-ret-pub").await;
    let count = 500;
    for n in 0..count {
        let topic = format!("many/{n}");
        let mut publish = Publish::new(topic, QoS::AtLeastOnce, format!("{n}"), None);
        publish.retain = true;
        publish.pkid = publisher.pkid();
        publisher.send(Packet::Publish(publish)).await;
    }
    for _ in 0..count {
        assert!(matches!(
            publisher.recv().await,
            Recv::Packet(Packet::PubAck(_))
        ));
    }
    for qos in [QoS::AtLeastOnce, QoS::AtMostOnce] {
        let mut sub = Raw::connect(addr, &format!("many-ret-sub-{}", qos as u8)).await;
        subscribe_with(&mut sub, filter("many/#", qos, |_| {})).await;
        let mut seen = std::collections::HashSet::new();
        while seen.len() < count {
            let p = next_raw_publish(&mut sub).await;
            assert!(p.retain);
            assert_eq!(p.qos, qos);
            ack(&mut sub, &p).await;
            assert!(seen.insert(p.payload.clone()), "twice: {:?}", p.payload);
        }
        sub.no_publish_within(Duration::from_millis(200)).await;
    }
}

/// MQTT 5 3.3.1.3: a retained publish with an empty payload removes the
/// topic's retained message (and is delivered to current subscribers as
/// usual); an empty publish without RETAIN leaves it in place.
#[tokio::test]
async fn only_a_retained_empty_publish_clears_the_retained_message() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut publisher = Raw::connect(addr, "clear-pub").await;
    let mut watcher = Raw::connect(addr, "clear-watch").await;
    subscribe_with(&mut watcher, filter("clear/t", QoS::AtLeastOnce, |_| {})).await;
    publish_complete(&mut publisher, "clear/t", b"x", QoS::AtLeastOnce, true).await;
    publish_complete(&mut publisher, "clear/t", b"", QoS::AtLeastOnce, false).await;
    for expected in [&b"x"[..], b""] {
        let p = next_raw_publish(&mut watcher).await;
        assert_eq!(&p.payload[..], expected);
        ack(&mut watcher, &p).await;
    }
    let mut late = Raw::connect(addr, "clear-late").await;
    subscribe_with(&mut late, filter("clear/t", QoS::AtLeastOnce, |_| {})).await;
    let p = next_raw_publish(&mut late).await;
    assert_eq!(
        (&p.payload[..], p.retain),
        (&b"x"[..], true),
        "still retained"
    );
    ack(&mut late, &p).await;

    publish_complete(&mut publisher, "clear/t", b"", QoS::AtLeastOnce, true).await;
    let p = next_raw_publish(&mut watcher).await;
    assert_eq!((&p.payload[..], p.retain), (&b""[..], false));
    ack(&mut watcher, &p).await;
    let mut later = Raw::connect(addr, "clear-later").await;
    subscribe_with(&mut later, filter("clear/t", QoS::AtLeastOnce, |_| {})).await;
    later.no_publish_within(Duration::from_millis(200)).await;
}

fn expiring(secs: u32) -> Option<v5::PublishProperties> {
    Some(v5::PublishProperties {
        message_expiry_interval: Some(secs),
        ..Default::default()
    })
}

fn expiry_of(p: &Publish) -> Option<u32> {
    p.properties.as_ref()?.message_expiry_interval
}

/// MQTT 5 3.3.2.3.3: a retained message expires on time, and each new
/// subscriber gets the interval less the time it waited (reading it must
/// not shorten it for the next reader).
#[tokio::test]
async fn retained_messages_expire_on_time() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut publisher = Raw::connect(addr, "exp-ret-pub").await;
    let mut publish = Publish::new("exp/ret", QoS::AtLeastOnce, "soon gone", expiring(2));
    publish.retain = true;
    publish.pkid = publisher.pkid();
    publisher.send(Packet::Publish(publish)).await;
    assert!(matches!(
        publisher.recv().await,
        Recv::Packet(Packet::PubAck(_))
    ));
    let subscribe_and_get = |name: &'static str| async move {
        let mut c = Raw::connect(addr, name).await;
        subscribe_with(&mut c, filter("exp/ret", QoS::AtLeastOnce, |_| {})).await;
        c
    };
    let mut first = subscribe_and_get("exp-ret-a").await;
    assert_eq!(expiry_of(&next_raw_publish(&mut first).await), Some(2));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    for name in ["exp-ret-b", "exp-ret-c"] {
        let mut c = subscribe_and_get(name).await;
        let p = next_raw_publish(&mut c).await;
        assert_eq!(expiry_of(&p), Some(1), "{name}: one second waited");
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let mut late = subscribe_and_get("exp-ret-d").await;
    late.no_publish_within(Duration::from_millis(200)).await;
}

/// MQTT 5 3.3.2.3.3: a message queued for an offline persistent session is
/// not delivered once expired; one still valid arrives with the time it
/// waited taken off its interval.
#[tokio::test]
async fn queued_messages_expire_while_the_subscriber_is_away() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let persistent = |c: &mut (v5::Connect, Option<v5::LastWill>, Option<v5::Login>)| {
        c.0.clean_start = false;
        c.0.properties = Some(v5::ConnectProperties {
            session_expiry_interval: Some(600),
            ..v5::ConnectProperties::new()
        });
    };
    let (mut sub, _) = Raw::connect_with(addr, "exp-away", persistent).await;
    subscribe_with(&mut sub, filter("exp/away", QoS::AtLeastOnce, |_| {})).await;
    sub.send(Packet::Disconnect(v5::Disconnect::new(
        v5::DisconnectReasonCode::NormalDisconnection,
    )))
    .await;
    drop(sub);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut publisher = Raw::connect(addr, "exp-away-pub").await;
    for (payload, secs) in [("short", 1), ("long", 100)] {
        let mut publish = Publish::new("exp/away", QoS::AtLeastOnce, payload, expiring(secs));
        publish.pkid = publisher.pkid();
        publisher.send(Packet::Publish(publish)).await;
        assert!(matches!(
            publisher.recv().await,
            Recv::Packet(Packet::PubAck(_))
        ));
    }
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let (mut sub, connack) = Raw::connect_with(addr, "exp-away", persistent).await;
    assert!(connack.session_present);
    let p = next_raw_publish(&mut sub).await;
    assert_eq!(&p.payload[..], b"long");
    let left = expiry_of(&p).unwrap();
    assert!((97..=98).contains(&left), "interval left: {left}");
    ack(&mut sub, &p).await;
    sub.no_publish_within(Duration::from_millis(200)).await;
}

/// Sends a QoS 2 PUBLISH with packet id `pkid` and expects its PUBREC.
async fn publish_qos2_until_pubrec(
    c: &mut Raw,
    topic: &str,
    payload: &'static [u8],
    pkid: u16,
    dup: bool,
) {
    let mut publish = Publish::new(topic, QoS::ExactlyOnce, Bytes::from_static(payload), None);
    publish.pkid = pkid;
    publish.dup = dup;
    publish_until_pubrec(c, publish).await;
}

async fn pubrel(c: &mut Raw, pkid: u16) -> v5::PubComp {
    pubrel_with(c, pkid, None).await
}

/// MQTT 5 3.3.4: the broker announces its Receive Maximum in CONNACK and
/// ends the connection of a client that has more QoS 1/2 publishes
/// unacknowledged (QoS 2: until PUBCOMP) with 0x93; within it, all flows.
#[tokio::test]
async fn the_brokers_receive_maximum_is_enforced() {
    let broker = common::start_broker_with(|s| s.listeners[0].receive_maximum = 3).await;
    let addr = broker.local_addr();
    let (mut c, connack) = Raw::connect_with(addr, "rm-pub", |_| {}).await;
    let announced = connack.properties.and_then(|p| p.receive_max);
    assert_eq!(announced, Some(3));
    for pkid in 1..=3 {
        publish_qos2_until_pubrec(&mut c, "rm/t", b"x", pkid, false).await;
    }
    // One completes: room for one more.
    assert_eq!(pubrel(&mut c, 1).await.reason, v5::PubCompReason::Success);
    publish_qos2_until_pubrec(&mut c, "rm/t", b"x", 4, false).await;
    // A retransmission of one still waiting for PUBREL is not another.
    publish_qos2_until_pubrec(&mut c, "rm/t", b"x", 4, true).await;
    // QoS 0 never counts.
    c.publish("rm/t", "zero", QoS::AtMostOnce, None).await;
    // The fourth unacknowledged one is one too many.
    let mut publish = Publish::new("rm/t", QoS::AtLeastOnce, Bytes::from_static(b"x"), None);
    publish.pkid = 5;
    c.send(Packet::Publish(publish)).await;
    let d = c.expect_disconnect().await;
    assert_eq!(
        common::raw::disconnect_reason(&d),
        Some(v5::DisconnectReasonCode::ReceiveMaximumExceeded)
    );
    // QoS 1 publishes acknowledged one by one never come near it.
    let mut ok = Raw::connect(addr, "rm-ok").await;
    for _ in 0..20 {
        let reason = ok.publish("rm/t", "y", QoS::AtLeastOnce, None).await;
        assert_eq!(reason, Some(v5::PubAckReason::Success));
    }
}

/// MQTT 5 4.3.3: a QoS 2 message is delivered exactly once: a
/// retransmitted PUBLISH before PUBREL is acknowledged, not delivered
/// again; PUBREL releases the message with its packet id, in whatever
/// order; a PUBREL for an unknown packet id gets PUBCOMP 0x92.
#[tokio::test]
async fn qos2_exactly_once_by_packet_id() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut sub = Raw::connect(addr, "eo-sub").await;
    subscribe_with(&mut sub, filter("eo/t", QoS::ExactlyOnce, |_| {})).await;
    let mut publisher = Raw::connect(addr, "eo-pub").await;
    publish_qos2_until_pubrec(&mut publisher, "eo/t", b"seven", 7, false).await;
    publish_qos2_until_pubrec(&mut publisher, "eo/t", b"seven", 7, true).await;
    publish_qos2_until_pubrec(&mut publisher, "eo/t", b"eight", 8, false).await;
    sub.no_publish_within(Duration::from_millis(100)).await;
    // Released out of order: 8 first.
    assert_eq!(
        pubrel(&mut publisher, 8).await.reason,
        v5::PubCompReason::Success
    );
    let p = next_raw_publish(&mut sub).await;
    assert_eq!(&p.payload[..], b"eight");
    ack(&mut sub, &p).await;
    assert_eq!(
        pubrel(&mut publisher, 7).await.reason,
        v5::PubCompReason::Success
    );
    let p = next_raw_publish(&mut sub).await;
    assert_eq!(&p.payload[..], b"seven");
    ack(&mut sub, &p).await;
    sub.no_publish_within(Duration::from_millis(200)).await;
    // Released already, and never sent: "packet identifier not found",
    // and the connection stays up.
    for pkid in [7, 99] {
        assert_eq!(
            pubrel(&mut publisher, pkid).await.reason,
            v5::PubCompReason::PacketIdentifierNotFound
        );
    }
    publish_complete(&mut publisher, "eo/t", b"after", QoS::ExactlyOnce, false).await;
    let p = next_raw_publish(&mut sub).await;
    assert_eq!(&p.payload[..], b"after");
}

/// The PUBREL mark by which the broker discards a QoS 2 copy it had
/// (`statebroker:discard`, router patch 35) is the broker's own: a
/// client's PUBREL that carries it releases the message all the same.
#[tokio::test]
async fn a_clients_discard_mark_on_pubrel_is_not_honoured() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut sub = Raw::connect(addr, "dm-sub").await;
    subscribe_with(&mut sub, filter("dm/t", QoS::ExactlyOnce, |_| {})).await;
    let mut publisher = Raw::connect(addr, "dm-pub").await;
    publish_qos2_until_pubrec(&mut publisher, "dm/t", b"kept", 4, false).await;
    let marked = v5::PubRelProperties {
        reason_string: None,
        user_properties: vec![("statebroker:discard".into(), String::new())],
    };
    pubrel_with(&mut publisher, 4, Some(marked)).await;
    let p = next_raw_publish(&mut sub).await;
    assert_eq!(&p.payload[..], b"kept");
}

/// MQTT 5 4.4: the QoS 2 state of a persistent session survives a
/// reconnect: a PUBREL sent on the new connection releases the message
/// received on the old one, once.
#[tokio::test]
async fn qos2_state_survives_a_reconnect() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut sub = Raw::connect(addr, "eo-re-sub").await;
    subscribe_with(&mut sub, filter("eo/re", QoS::ExactlyOnce, |_| {})).await;
    let persistent = |c: &mut (v5::Connect, Option<v5::LastWill>, Option<v5::Login>)| {
        c.0.clean_start = false;
        c.0.properties = Some(v5::ConnectProperties {
            session_expiry_interval: Some(600),
            ..v5::ConnectProperties::new()
        });
    };
    let (mut publisher, _) = Raw::connect_with(addr, "eo-re-pub", persistent).await;
    publish_qos2_until_pubrec(&mut publisher, "eo/re", b"across", 3, false).await;
    drop(publisher); // the connection breaks before PUBREL
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (mut publisher, connack) = Raw::connect_with(addr, "eo-re-pub", persistent).await;
    assert!(connack.session_present);
    assert_eq!(
        pubrel(&mut publisher, 3).await.reason,
        v5::PubCompReason::Success
    );
    let p = next_raw_publish(&mut sub).await;
    assert_eq!(&p.payload[..], b"across");
    ack(&mut sub, &p).await;
    sub.no_publish_within(Duration::from_millis(200)).await;
}

/// MQTT 5 4.4 and 4.3.3, outgoing: a subscriber of a persistent session
/// that drops its connection in the middle of QoS 2 exchanges gets, after
/// reconnecting, the unacknowledged PUBLISH again (DUP 1, same packet id)
/// and the PUBREL of the one it had PUBREC'd, then what was published
/// while it was away: each message exactly once, and a QoS 0 message it
/// had received not again.
#[tokio::test]
async fn outgoing_qos2_survives_a_subscriber_reconnect() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let (mut sub, _) = Raw::connect_with(addr, "eo-out-sub", session(true, Some(600))).await;
    subscribe_with(&mut sub, filter("eo/out", QoS::ExactlyOnce, |_| {})).await;
    let mut publisher = Raw::connect(addr, "eo-out-pub").await;
    publish_complete(&mut publisher, "eo/out", b"one", QoS::ExactlyOnce, false).await;
    publish_complete(&mut publisher, "eo/out", b"two", QoS::ExactlyOnce, false).await;
    publish_complete(&mut publisher, "eo/out", b"zero", QoS::AtMostOnce, false).await;
    let one = next_raw_publish(&mut sub).await;
    let two = next_raw_publish(&mut sub).await;
    let zero = next_raw_publish(&mut sub).await;
    assert_eq!(
        (&one.payload[..], &two.payload[..], &zero.payload[..]),
        (&b"one"[..], &b"two"[..], &b"zero"[..])
    );
    // PUBREC for "one" only, then the connection breaks before PUBREL is
    // answered; "two" was never acknowledged.
    sub.send(Packet::PubRec(v5::PubRec::new(one.pkid, None)))
        .await;
    match sub.recv().await {
        Recv::Packet(Packet::PubRel(rel)) => assert_eq!(rel.pkid, one.pkid),
        other => panic!("expected PUBREL, got {other:?}"),
    }
    drop(sub);
    tokio::time::sleep(Duration::from_millis(100)).await;
    publish_complete(&mut publisher, "eo/out", b"three", QoS::ExactlyOnce, false).await;

    let (mut sub, connack) = Raw::connect_with(addr, "eo-out-sub", session(false, Some(600))).await;
    assert!(connack.session_present);
    let mut released = false;
    let mut recorded = std::collections::HashSet::new();
    let mut payloads = Vec::new();
    loop {
        match sub.recv_within(Duration::from_millis(500)).await {
            Recv::Packet(Packet::PubRel(rel)) => {
                if rel.pkid == one.pkid && !released {
                    released = true; // "one", again
                } else {
                    assert!(
                        recorded.remove(&rel.pkid),
                        "PUBREL {} for nothing received",
                        rel.pkid
                    );
                }
                sub.send(Packet::PubComp(v5::PubComp::new(rel.pkid, None)))
                    .await;
            }
            Recv::Packet(Packet::Publish(p)) => {
                assert_ne!(&p.payload[..], b"one", "\"one\" was received: never again");
                if &p.payload[..] == b"two" {
                    assert!(p.dup, "a retransmission carries DUP");
                    assert_eq!(p.pkid, two.pkid, "with its packet id");
                }
                sub.send(Packet::PubRec(v5::PubRec::new(p.pkid, None)))
                    .await;
                assert!(recorded.insert(p.pkid), "packet id {} in use", p.pkid);
                payloads.push(p.payload.clone());
            }
            Recv::Packet(_) => {}
            Recv::Timeout => break,
            Recv::Closed => panic!("closed"),
        }
    }
    assert!(released, "the PUBREL of \"one\" came again");
    assert!(recorded.is_empty(), "every PUBREC answered by PUBREL");
    assert_eq!(
        payloads,
        [&b"two"[..], b"three"],
        "each once, in order; the QoS 0 \"zero\" not again"
    );
}

/// MQTT 5 3.14.2.2.1: a DISCONNECT of Remaining Length 1 (reason code
/// only) is valid: 0x00 ends the connection without its Will, 0x04
/// "disconnect with will message" publishes it.
#[tokio::test]
async fn disconnect_with_reason_code_only() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut listener = Raw::connect(addr, "dc1-listener").await;
    subscribe_with(&mut listener, filter("dc1/#", QoS::AtLeastOnce, |_| {})).await;
    for (client, code) in [("dc1-normal", 0x00u8), ("dc1-with-will", 0x04)] {
        let topic = format!("dc1/{client}");
        let (mut c, _) = Raw::connect_with(addr, client, |c| {
            c.1 = Some(v5::LastWill::new(
                topic.as_str(),
                "gone",
                QoS::AtLeastOnce,
                false,
                None,
            ));
        })
        .await;
        c.send_bytes(&[0xE0, 0x01, code]).await;
        // The broker closes the socket without a DISCONNECT of its own.
        assert!(matches!(c.recv().await, Recv::Closed), "{client}");
    }
    let p = next_raw_publish(&mut listener).await;
    assert_eq!(&p.topic[..], b"dc1/dc1-with-will");
    ack(&mut listener, &p).await;
    listener.no_publish_within(Duration::from_millis(300)).await;
}

/// MQTT 5 3.1.2.11.4: the broker never sends a client a packet larger than
/// the client's Maximum Packet Size; such a message is discarded for that
/// client (a publish, or a state store answer), and the rest flows on.
#[tokio::test]
async fn maximum_packet_size_of_the_client() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let (mut small, _) = Raw::connect_with(addr, "mps-small", |c| {
        c.0.properties = Some(v5::ConnectProperties {
            max_packet_size: Some(300),
            ..v5::ConnectProperties::new()
        });
    })
    .await;
    subscribe_with(&mut small, filter("mps/t", QoS::AtLeastOnce, |_| {})).await;
    let mut publisher = Raw::connect(addr, "mps-pub").await;
    let big: &'static [u8] = Box::leak(vec![b'x'; 500].into_boxed_slice());
    publish_complete(&mut publisher, "mps/t", big, QoS::AtLeastOnce, false).await;
    publish_complete(&mut publisher, "mps/t", b"small", QoS::AtLeastOnce, false).await;
    let p = next_raw_publish(&mut small).await;
    assert_eq!(&p.payload[..], b"small");
    ack(&mut small, &p).await;
    // A state store answer too large for it is discarded too.
    let value = "v".repeat(400);
    let set = publisher
        .request(&[b"SET", b"mps-key", value.as_bytes()])
        .await;
    assert_eq!(&set.payload[..], b"+OK\r\n");
    small.ensure_response_subscription().await;
    let correlation = 1u64.to_be_bytes();
    let ts = common::raw::now_hlc("mps-small");
    let properties = small.request_properties(&correlation, &[("__ts", &ts)]);
    for key in [&b"mps-key"[..], b"missing"] {
        let payload = statestore::resp3::encode_request(&[&b"GET"[..], key]);
        let mut publish = Publish::new(
            common::raw::REQUEST_TOPIC,
            QoS::AtLeastOnce,
            payload,
            Some(properties.clone()),
        );
        publish.pkid = small.pkid();
        small.send(Packet::Publish(publish)).await;
    }
    loop {
        match small.recv().await {
            Recv::Packet(Packet::PubAck(_)) => continue,
            Recv::Packet(Packet::Publish(p)) => {
                assert_eq!(&p.payload[..], b"$-1\r\n", "only the small answer");
                break;
            }
            other => panic!("{other:?}"),
        }
    }
}

/// A client that keeps pinging but stops reading cannot hold a connection
/// whose writes are blocked: it is disconnected once a write has stalled
/// for 1.5 times its keep-alive, and the broker serves the others.
#[tokio::test]
async fn a_client_that_stops_reading_is_disconnected() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let (mut stuck, _) = Raw::connect_with(addr, "stall-sub", |c| c.0.keep_alive = 1).await;
    subscribe_with(&mut stuck, filter("stall/t", QoS::AtMostOnce, |_| {})).await;
    // Pings, never reads.
    let pinger = tokio::spawn(async move {
        for _ in 0..30 {
            stuck.send(Packet::PingReq(v5::PingReq)).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        stuck
    });
    let mut publisher = Raw::connect(addr, "stall-pub").await;
    let payload = Bytes::from(vec![b'x'; 100_000]);
    for _ in 0..300 {
        publisher
            .publish("stall/t", payload.clone(), QoS::AtMostOnce, None)
            .await;
    }
    common::eventually("the stalled client is disconnected", || {
        broker.connection_count() == 1
    })
    .await;
    // The broker still serves the publisher.
    let r = publisher.request(&[b"GET", b"k"]).await;
    assert_eq!(&r.payload[..], b"$-1\r\n");
    pinger.abort();
}

/// After an UNSUBSCRIBE frees a filter's log, subscribing again to the
/// same filter (or another that takes its place) delivers each message
/// once, from the right log.
#[tokio::test]
async fn subscribe_after_unsubscribe() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut sub = Raw::connect(addr, "unsub-sub").await;
    let mut publisher = Raw::connect(addr, "unsub-pub").await;
    for (round, topic) in ["unsub/a", "unsub/b", "unsub/a"].into_iter().enumerate() {
        subscribe_with(&mut sub, filter(topic, QoS::AtLeastOnce, |_| {})).await;
        let payload: &'static [u8] = [&b"0"[..], b"1", b"2"][round];
        publish_complete(&mut publisher, topic, payload, QoS::AtLeastOnce, false).await;
        let p = next_raw_publish(&mut sub).await;
        assert_eq!((&p.topic[..], &p.payload[..]), (topic.as_bytes(), payload));
        ack(&mut sub, &p).await;
        let pkid = sub.pkid();
        let mut unsubscribe = v5::Unsubscribe::new(topic, None);
        unsubscribe.pkid = pkid;
        sub.send(Packet::Unsubscribe(unsubscribe)).await;
        match sub.recv().await {
            Recv::Packet(Packet::UnsubAck(ack)) => assert_eq!(ack.pkid, pkid),
            other => panic!("expected UNSUBACK, got {other:?}"),
        }
        publish_complete(&mut publisher, topic, b"unheard", QoS::AtLeastOnce, false).await;
        sub.no_publish_within(Duration::from_millis(100)).await;
    }
}

/// MQTT 5 3.8.2.1.2 and 3.3.2.3.8: a message delivered through a
/// subscription that carried a Subscription Identifier carries it.
#[tokio::test]
async fn subscription_identifiers_are_delivered() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let (mut sub, _) = Raw::connect_with(addr, "subid-sub", session(true, Some(600))).await;
    let codes = subscribe_with_id(
        &mut sub,
        filter("subid/+", QoS::AtLeastOnce, |_| {}),
        Some(42),
    )
    .await;
    assert_eq!(codes, [SubscribeReasonCode::Success(QoS::AtLeastOnce)]);
    let mut publisher = Raw::connect(addr, "subid-pub").await;
    publish_complete(&mut publisher, "subid/x", b"m", QoS::AtLeastOnce, false).await;
    let p = next_raw_publish(&mut sub).await;
    ack(&mut sub, &p).await;
    let ids = p.properties.map(|p| p.subscription_identifiers);
    assert_eq!(ids, Some(vec![42]));
    // The session keeps them: after a reconnect, while away and after.
    goodbye(sub, None).await;
    publish_complete(&mut publisher, "subid/y", b"away", QoS::AtLeastOnce, false).await;
    let (mut sub, connack) = Raw::connect_with(addr, "subid-sub", session(false, Some(600))).await;
    assert!(connack.session_present);
    publish_complete(&mut publisher, "subid/z", b"back", QoS::AtLeastOnce, false).await;
    for topic in [&b"subid/y"[..], b"subid/z"] {
        let p = next_raw_publish(&mut sub).await;
        ack(&mut sub, &p).await;
        assert_eq!(&p.topic[..], topic);
        let ids = p.properties.map(|p| p.subscription_identifiers);
        assert_eq!(ids, Some(vec![42]), "{topic:?} after the reconnect");
    }
}

/// MQTT 5 3.3.2.3.4: a client's topic alias stands for its topic on later
/// publishes; an alias above the broker's Topic Alias Maximum disconnects
/// it with 0x94.
#[tokio::test]
async fn topic_aliases_from_the_client() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut sub = Raw::connect(addr, "alias-sub").await;
    subscribe_with(&mut sub, filter("alias/t", QoS::AtLeastOnce, |_| {})).await;
    let mut publisher = Raw::connect(addr, "alias-pub").await;
    let aliased = |topic: &str, alias: u16, payload: &'static [u8]| {
        Publish::new(
            topic,
            QoS::AtMostOnce,
            Bytes::from_static(payload),
            Some(v5::PublishProperties {
                topic_alias: Some(alias),
                ..Default::default()
            }),
        )
    };
    publisher
        .send(Packet::Publish(aliased("alias/t", 3, b"first")))
        .await;
    publisher
        .send(Packet::Publish(aliased("", 3, b"second")))
        .await;
    for expected in [&b"first"[..], b"second"] {
        let p = next_raw_publish(&mut sub).await;
        assert_eq!((&p.topic[..], &p.payload[..]), (&b"alias/t"[..], expected));
        ack(&mut sub, &p).await;
    }
    publisher
        .send(Packet::Publish(aliased("alias/t", 60000, b"x")))
        .await;
    let d = publisher.expect_disconnect().await;
    assert_eq!(
        common::raw::disconnect_reason(&d),
        Some(v5::DisconnectReasonCode::TopicAliasInvalid)
    );
}

/// MQTT 5 3.1.2.4 and 3.1.2.11.2: Clean Start and Session Expiry Interval
/// are separate. Clean Start 1 with an expiry starts a new session that
/// outlives the connection; Clean Start 0 with expiry 0 resumes nothing
/// afterwards; Session Present says exactly whether a session was resumed.
#[tokio::test]
async fn clean_start_and_session_expiry_are_separate() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut publisher = Raw::connect(addr, "se-pub").await;

    // Clean Start 1, expiry 300: kept after the connection ends.
    let (mut c, connack) = Raw::connect_with(addr, "se-a", session(true, Some(300))).await;
    assert!(!connack.session_present);
    subscribe_with(&mut c, filter("se/a", QoS::AtLeastOnce, |_| {})).await;
    goodbye(c, None).await;
    publish_complete(&mut publisher, "se/a", b"kept", QoS::AtLeastOnce, false).await;
    let (mut c, connack) = Raw::connect_with(addr, "se-a", session(false, Some(300))).await;
    assert!(connack.session_present);
    let p = next_raw_publish(&mut c).await;
    assert_eq!(&p.payload[..], b"kept");
    ack(&mut c, &p).await;
    goodbye(c, Some(0)).await; // ends it at DISCONNECT

    // The DISCONNECT above set the expiry to 0: nothing to resume.
    let (c, connack) = Raw::connect_with(addr, "se-a", session(false, Some(300))).await;
    assert!(!connack.session_present, "ended by DISCONNECT expiry 0");
    goodbye(c, None).await;

    // Clean Start 0, expiry 0: the session ends with the connection.
    let (mut c, _) = Raw::connect_with(addr, "se-b", session(false, None)).await;
    subscribe_with(&mut c, filter("se/b", QoS::AtLeastOnce, |_| {})).await;
    goodbye(c, None).await;
    let (mut c, connack) = Raw::connect_with(addr, "se-b", session(false, Some(60))).await;
    assert!(!connack.session_present, "expiry 0 ended it");
    publish_complete(
        &mut publisher,
        "se/b",
        b"to nobody",
        QoS::AtLeastOnce,
        false,
    )
    .await;
    c.no_publish_within(Duration::from_millis(200)).await;
}

/// MQTT 5 3.1.2.4: Clean Start 1 discards the session the server holds,
/// one without subscriptions too, and also when the new connection never
/// needs the router (it idles, or only talks to the state store, and so
/// joins the router lazily, see `connection/link.rs`).
#[tokio::test]
async fn a_clean_start_discards_a_session_without_subscriptions() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let (c, connack) = Raw::connect_with(addr, "se-empty", session(false, Some(300))).await;
    assert!(!connack.session_present);
    goodbye(c, None).await;
    let (c, connack) = Raw::connect_with(addr, "se-empty", session(false, Some(300))).await;
    assert!(
        connack.session_present,
        "kept, though it has no subscription"
    );
    goodbye(c, None).await;
    let (c, connack) = Raw::connect_with(addr, "se-empty", session(true, None)).await;
    assert!(!connack.session_present);
    goodbye(c, None).await;
    let (c, connack) = Raw::connect_with(addr, "se-empty", session(false, Some(300))).await;
    assert!(!connack.session_present, "the clean start discarded it");

    // Taken over while connected, by a clean start that only idles.
    let (taker, connack) = Raw::connect_with(addr, "se-empty", session(true, None)).await;
    assert!(!connack.session_present);
    let mut old = c;
    assert!(matches!(
        old.recv().await,
        Recv::Packet(Packet::Disconnect(..))
    ));
    goodbye(taker, None).await;
    // The old connection is gone too (it told the router its expiry).
    common::eventually("both ended", || broker.connection_count() == 0).await;
    let (c, connack) = Raw::connect_with(addr, "se-empty", session(false, Some(300))).await;
    assert!(
        !connack.session_present,
        "the takeover's clean start discarded it"
    );
    goodbye(c, Some(0)).await;
}

/// MQTT 5 3.1.2.6 and 3.3.1.2: a will keeps its QoS. A QoS 2 will reaches
/// a QoS 2 subscriber at QoS 2 (once, through the whole exchange) and a
/// QoS 1 subscriber at QoS 1.
#[tokio::test]
async fn a_qos2_will_is_delivered_at_qos2() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut two = Raw::connect(addr, "will-q2-sub2").await;
    subscribe_with(&mut two, filter("will/q2", QoS::ExactlyOnce, |_| {})).await;
    let mut one = Raw::connect(addr, "will-q2-sub1").await;
    subscribe_with(&mut one, filter("will/q2", QoS::AtLeastOnce, |_| {})).await;
    {
        let will = v5::LastWill::new("will/q2", "gone", QoS::ExactlyOnce, false, None);
        let (_c, _) = Raw::connect_with(addr, "will-q2", |c| c.1 = Some(will)).await;
        // dropped without DISCONNECT: the will goes out
    }
    let p = next_raw_publish(&mut two).await;
    assert_eq!((&p.payload[..], p.qos), (&b"gone"[..], QoS::ExactlyOnce));
    ack(&mut two, &p).await;
    let p = next_raw_publish(&mut one).await;
    assert_eq!((&p.payload[..], p.qos), (&b"gone"[..], QoS::AtLeastOnce));
    ack(&mut one, &p).await;
    two.no_publish_within(Duration::from_millis(200)).await;
    one.no_publish_within(Duration::from_millis(1)).await;
}

/// MQTT 5 3.1.2.11.2: a session that expires is removed with what it
/// holds; connecting after the expiry finds none.
#[tokio::test]
async fn sessions_expire() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let (mut c, _) = Raw::connect_with(addr, "se-short", session(false, Some(1))).await;
    subscribe_with(&mut c, filter("se/short", QoS::AtLeastOnce, |_| {})).await;
    goodbye(c, None).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (mut c, connack) = Raw::connect_with(addr, "se-short", session(false, Some(60))).await;
    assert!(!connack.session_present, "expired after 1 s");
    let mut publisher = Raw::connect(addr, "se-short-pub").await;
    publish_complete(&mut publisher, "se/short", b"late", QoS::AtLeastOnce, false).await;
    c.no_publish_within(Duration::from_millis(200)).await;
}

/// MQTT 5 3.14.2.2.2: a DISCONNECT may not give an expiry to a session
/// that had none (protocol error 0x82).
#[tokio::test]
async fn disconnect_cannot_revive_an_expiring_session() {
    let broker = start_broker().await;
    let (mut c, _) = Raw::connect_with(broker.local_addr(), "se-revive", session(true, None)).await;
    let mut disconnect = v5::Disconnect::new(v5::DisconnectReasonCode::NormalDisconnection);
    disconnect.properties = Some(v5::DisconnectProperties {
        session_expiry_interval: Some(30),
        reason_string: None,
        user_properties: Vec::new(),
        server_reference: None,
    });
    c.send(Packet::Disconnect(disconnect)).await;
    let d = c.expect_disconnect().await;
    assert_eq!(
        common::raw::disconnect_reason(&d),
        Some(v5::DisconnectReasonCode::ProtocolError)
    );
}

/// MQTT 5 3.3.4: the broker never has more unacknowledged QoS 1/2
/// publishes out to a client than its Receive Maximum, whichever source
/// they come from; the rest wait and follow as acknowledgements arrive.
#[tokio::test]
async fn receive_maximum_of_the_client() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let (mut sub, _) = Raw::connect_with(addr, "rm-sub", |c| {
        c.0.properties = Some(v5::ConnectProperties {
            receive_maximum: Some(2),
            ..v5::ConnectProperties::new()
        });
    })
    .await;
    subscribe_with(&mut sub, filter("rm/t", QoS::AtLeastOnce, |_| {})).await;
    let mut publisher = Raw::connect(addr, "rm-pub").await;
    for n in 0..5u8 {
        let payload: &'static [u8] = [&b"0"[..], b"1", b"2", b"3", b"4"][usize::from(n)];
        publish_complete(&mut publisher, "rm/t", payload, QoS::AtLeastOnce, false).await;
    }
    let first = next_raw_publish(&mut sub).await;
    let second = next_raw_publish(&mut sub).await;
    sub.no_publish_within(Duration::from_millis(200)).await;
    let mut got = vec![first.payload.clone(), second.payload.clone()];
    ack(&mut sub, &first).await;
    let third = next_raw_publish(&mut sub).await;
    sub.no_publish_within(Duration::from_millis(100)).await;
    got.push(third.payload.clone());
    for p in [second, third] {
        ack(&mut sub, &p).await;
    }
    for _ in 0..2 {
        let p = next_raw_publish(&mut sub).await;
        got.push(p.payload.clone());
        ack(&mut sub, &p).await;
    }
    let got: Vec<&[u8]> = got.iter().map(|b| &b[..]).collect();
    assert_eq!(got, [&b"0"[..], b"1", b"2", b"3", b"4"], "all, in order");
}

/// Once SUBACK is sent, a matching publish from any client reaches the
/// subscriber, even from a client that joins the router just then.
#[tokio::test]
async fn a_publish_right_after_suback_is_delivered() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    // A publisher that joined the router already, one that joins with its
    // publish, and a wildcard listener that caches the topic's filters.
    let mut linked = Raw::connect(addr, "race-linked").await;
    publish_complete(&mut linked, "race/warm", b"w", QoS::AtLeastOnce, false).await;
    let mut spy = Raw::connect(addr, "race-spy").await;
    subscribe_with(&mut spy, filter("race/#", QoS::AtMostOnce, |_| {})).await;
    for round in 0..100 {
        let topic = format!("race/{round}");
        // The topic is published (and its filters cached) before anyone
        // subscribes to it by name.
        publish_complete(&mut linked, &topic, b"before", QoS::AtLeastOnce, false).await;
        let mut sub = Raw::connect(addr, &format!("race-sub-{round}")).await;
        subscribe_with(&mut sub, filter(&topic, QoS::AtLeastOnce, |_| {})).await;
        publish_complete(&mut linked, &topic, b"now", QoS::AtLeastOnce, false).await;
        match sub.recv_within(Duration::from_secs(2)).await {
            Recv::Packet(Packet::Publish(p)) => {
                assert_eq!(&p.payload[..], b"now");
                ack(&mut sub, &p).await;
            }
            other => panic!("round {round}, linked publisher: {other:?}"),
        }
        let mut publisher = Raw::connect(addr, &format!("race-pub-{round}")).await;
        let mut publish = Publish::new(topic.as_str(), QoS::AtMostOnce, "now", None);
        publish.pkid = 0;
        publisher.send(Packet::Publish(publish)).await;
        match sub.recv_within(Duration::from_secs(2)).await {
            Recv::Packet(Packet::Publish(p)) => assert_eq!(&p.payload[..], b"now"),
            other => panic!("round {round}: {other:?}"),
        }
    }
}

/// MQTT 3.1.1 4.6 (and MQTT 5 4.6): PUBACKs go out in the order the
/// PUBLISHes arrived, ordinary publishes (acknowledged by the router) and
/// those the broker acknowledges itself (state store requests, refused
/// publishes) mixed.
#[tokio::test]
async fn acknowledgements_in_arrival_order_for_3_1_1() {
    use rumqttc::mqttbytes::v4;
    let broker = start_broker().await;
    let mut c = common::raw::Raw4::connect(broker.local_addr(), "order-v4").await;
    for round in 0..20 {
        let topics = [
            "order/t",
            common::raw::REQUEST_TOPIC,
            "order/u",
            common::raw::NOTIFY_NAMESPACE,
        ];
        let mut packets = Vec::new();
        let mut pkids = Vec::new();
        for topic in topics {
            let mut publish = v4::Publish::new(topic, rumqttc::mqttbytes::QoS::AtLeastOnce, "x");
            publish.pkid = c.pkid();
            pkids.push(publish.pkid);
            packets.push(v4::Packet::Publish(publish));
        }
        c.send_all(packets).await;
        let mut acked = Vec::new();
        while acked.len() < pkids.len() {
            match c.recv().await {
                Some(v4::Packet::PubAck(ack)) => acked.push(ack.pkid),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(acked, pkids, "round {round}");
    }
}

/// Reads publishes until none comes for `quiet`, acknowledging each;
/// returns their payloads in arrival order.
async fn drain(c: &mut Raw, quiet: Duration) -> Vec<String> {
    let mut got = Vec::new();
    loop {
        match c.recv_within(quiet).await {
            Recv::Packet(Packet::Publish(p)) => {
                got.push(String::from_utf8_lossy(&p.payload).into_owned());
                ack(c, &p).await;
            }
            Recv::Timeout => return got,
            other => panic!("expected PUBLISH, got {other:?}"),
        }
    }
}

/// Two members of a group got `expected` between them, each once, and
/// each member some of it.
fn each_once_between(got_a: &[String], got_b: &[String], expected: &[&str]) {
    let mut all: Vec<&str> = got_a.iter().chain(got_b).map(String::as_str).collect();
    all.sort();
    assert_eq!(all, expected, "a: {got_a:?}, b: {got_b:?}");
    assert!(
        !got_a.is_empty() && !got_b.is_empty(),
        "a: {got_a:?}, b: {got_b:?}"
    );
}

/// MQTT 5 4.8.2: a group shares each message: every message to one of
/// its members, once, and round robin (the router's default strategy)
/// gives each member its turn.
#[tokio::test]
async fn a_shared_subscription_delivers_each_message_to_one_member() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut a = Raw::connect(addr, "share-a").await;
    let mut b = Raw::connect(addr, "share-b").await;
    for c in [&mut a, &mut b] {
        c.subscribe("$share/g/share/t", QoS::AtLeastOnce).await;
    }
    let mut publisher = Raw::connect(addr, "share-pub").await;
    const PAYLOADS: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
    for payload in PAYLOADS {
        publish_complete(
            &mut publisher,
            "share/t",
            payload.as_bytes(),
            QoS::AtLeastOnce,
            false,
        )
        .await;
    }
    let quiet = Duration::from_millis(300);
    let (got_a, got_b) = (drain(&mut a, quiet).await, drain(&mut b, quiet).await);
    each_once_between(&got_a, &got_b, &PAYLOADS);
}

/// MQTT 5 4.8.2: a shared subscription is its Share Name *and* its Topic
/// Filter: the same group name on two filters is two groups, each with
/// the messages of its own filter.
#[tokio::test]
async fn one_group_name_on_two_filters_is_two_shared_subscriptions() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut x = Raw::connect(addr, "share2-x").await;
    let mut y = Raw::connect(addr, "share2-y").await;
    x.subscribe("$share/g/share2/x", QoS::AtLeastOnce).await;
    y.subscribe("$share/g/share2/y", QoS::AtLeastOnce).await;
    let mut publisher = Raw::connect(addr, "share2-pub").await;
    for n in 0..4 {
        publish_complete(
            &mut publisher,
            "share2/x",
            ["x0", "x1", "x2", "x3"][n].as_bytes(),
            QoS::AtLeastOnce,
            false,
        )
        .await;
        publish_complete(
            &mut publisher,
            "share2/y",
            ["y0", "y1", "y2", "y3"][n].as_bytes(),
            QoS::AtLeastOnce,
            false,
        )
        .await;
    }
    let quiet = Duration::from_millis(300);
    assert_eq!(drain(&mut x, quiet).await, ["x0", "x1", "x2", "x3"]);
    assert_eq!(drain(&mut y, quiet).await, ["y0", "y1", "y2", "y3"]);
}

/// MQTT 5 3.3.4: one client with a filter and shared subscriptions on
/// it in two groups has three subscriptions, and gets a copy for each.
/// The router kept one read of a filter's log per connection in mind: a
/// debug build's assertion ended the router thread (every connection) at
/// such a SUBSCRIBE (router patch 43).
#[tokio::test]
async fn a_filter_and_two_groups_on_it_are_three_subscriptions() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut c = Raw::connect(addr, "share4-c").await;
    c.subscribe_many(
        &["$share/g/share4/t", "$share/h/share4/t", "share4/t"],
        QoS::AtLeastOnce,
    )
    .await;
    let mut publisher = Raw::connect(addr, "share4-pub").await;
    publish_complete(&mut publisher, "share4/t", b"m", QoS::AtLeastOnce, false).await;
    let quiet = Duration::from_millis(300);
    assert_eq!(drain(&mut c, quiet).await, ["m", "m", "m"]);
    // The broker still serves.
    let mut other = Raw::connect(addr, "share4-other").await;
    other.subscribe("share4/u", QoS::AtLeastOnce).await;
}

/// A persistent session, the last member of its group, leaving with a
/// shared message it had not acknowledged: the router panicked ("group
/// must exists") and every client after got DISCONNECT 0x89 on its first
/// SUBSCRIBE or PUBLISH, the health checks still saying ready (router
/// patch 44). Now the broker goes on, and the session gets the message
/// again when it comes back (4.4).
#[tokio::test]
async fn a_shared_members_session_leaving_mid_delivery_keeps_the_router() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    for (round, abrupt) in [(0, false), (1, true)] {
        let worker = format!("share5-w{round}");
        let (mut w, _) = Raw::connect_with(addr, &worker, session(true, Some(60))).await;
        w.subscribe(&format!("$share/g5/share5/{round}"), QoS::AtLeastOnce)
            .await;
        let mut publisher = Raw::connect(addr, &format!("share5-p{round}")).await;
        publish_complete(
            &mut publisher,
            &format!("share5/{round}"),
            b"job",
            QoS::AtLeastOnce,
            false,
        )
        .await;
        let first = next_raw_publish(&mut w).await;
        assert_eq!(&first.payload[..], b"job");
        // Left without a PUBACK.
        if abrupt {
            drop(w);
        } else {
            goodbye(w, None).await;
        }
        // Others are served.
        let mut other = Raw::connect(addr, &format!("share5-o{round}")).await;
        other.subscribe("share5/other", QoS::AtLeastOnce).await;
        publish_complete(&mut other, "share5/other", b"x", QoS::AtLeastOnce, false).await;
        assert_eq!(&other.next_publish().await.payload[..], b"x");
        // The session comes back to the message.
        let (mut w, ack) = Raw::connect_with(addr, &worker, session(false, Some(60))).await;
        assert!(ack.session_present, "round {round}");
        let again = next_raw_publish(&mut w).await;
        assert_eq!(&again.payload[..], b"job", "round {round}");
    }
}

/// A publisher's DUP is its own ([MQTT-3.3.1-3]): a PUBLISH sent with DUP
/// 1 (a client resending after a reconnect) reaches subscribers, and its
/// retained copy later ones, with DUP 0; a QoS 0 delivery of it is not
/// QoS 0 with DUP 1 (malformed, [MQTT-3.3.1-2]). It was passed on before.
#[tokio::test]
async fn a_publishers_dup_is_not_passed_on() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut q1 = Raw::connect(addr, "dup-q1").await;
    q1.subscribe("dup/t", QoS::AtLeastOnce).await;
    let mut q0 = Raw::connect(addr, "dup-q0").await;
    q0.subscribe("dup/t", QoS::AtMostOnce).await;
    let mut publisher = Raw::connect(addr, "dup-pub").await;
    let mut publish = Publish::new("dup/t", QoS::AtLeastOnce, "again", None);
    publish.pkid = 7;
    publish.dup = true;
    publish.retain = true;
    publisher.send(Packet::Publish(publish)).await;
    match publisher.recv().await {
        Recv::Packet(Packet::PubAck(ack)) => assert_eq!(ack.pkid, 7),
        other => panic!("no PUBACK: {other:?}"),
    }
    for c in [&mut q1, &mut q0] {
        let p = next_raw_publish(c).await;
        assert!(!p.dup, "{p:?}");
        ack(c, &p).await;
    }
    let mut later = Raw::connect(addr, "dup-later").await;
    later.subscribe("dup/t", QoS::AtLeastOnce).await;
    let retained = next_raw_publish(&mut later).await;
    assert!(retained.retain && !retained.dup, "{retained:?}");
}

/// Message Expiry while a message waits for the client's Receive Maximum
/// ([MQTT-3.3.2-5], [MQTT-3.3.2-6]): one that expires meanwhile is not
/// sent, the others go with the interval reduced by the time they waited.
/// Both went out as they were taken from the router before.
#[tokio::test]
async fn a_message_held_for_receive_maximum_expires() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let (mut sub, _) = Raw::connect_with(addr, "held-exp", |c| {
        c.0.properties = Some(v5::ConnectProperties {
            receive_maximum: Some(1),
            ..v5::ConnectProperties::new()
        });
    })
    .await;
    sub.subscribe("held/t", QoS::AtLeastOnce).await;
    let mut publisher = Raw::connect(addr, "held-pub").await;
    for (payload, expiry) in [("first", None), ("short", Some(1)), ("long", Some(60))] {
        let properties = expiry.map(|secs| v5::PublishProperties {
            message_expiry_interval: Some(secs),
            ..Default::default()
        });
        let ack = publisher
            .publish("held/t", Bytes::from(payload), QoS::AtLeastOnce, properties)
            .await;
        assert_eq!(ack, Some(v5::PubAckReason::Success));
    }
    let first = next_raw_publish(&mut sub).await;
    assert_eq!(&first.payload[..], b"first");
    // "short" expires while "first" takes the only place.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    ack(&mut sub, &first).await;
    let next = next_raw_publish(&mut sub).await;
    assert_eq!(&next.payload[..], b"long");
    let left = next
        .properties
        .as_ref()
        .and_then(|p| p.message_expiry_interval);
    assert!(left.is_some_and(|s| s <= 58), "interval {left:?}");
    ack(&mut sub, &next).await;
    assert!(matches!(
        sub.recv_within(Duration::from_millis(300)).await,
        Recv::Timeout
    ));
    // The router is done with the expired one: more come.
    publish_complete(&mut publisher, "held/t", b"after", QoS::AtLeastOnce, false).await;
    assert_eq!(&next_raw_publish(&mut sub).await.payload[..], b"after");
}

/// MQTT 5 3.10.4: UNSUBSCRIBE ends the subscription it names, not the
/// client's other shared subscriptions.
#[tokio::test]
async fn unsubscribing_one_shared_subscription_keeps_the_others() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut c = Raw::connect(addr, "share3-c").await;
    let mut d = Raw::connect(addr, "share3-d").await;
    c.subscribe("$share/g/share3/x", QoS::AtLeastOnce).await;
    c.subscribe("$share/h/share3/y", QoS::AtLeastOnce).await;
    d.subscribe("$share/h/share3/y", QoS::AtLeastOnce).await;
    c.unsubscribe_many(&["$share/g/share3/x"]).await;
    let mut publisher = Raw::connect(addr, "share3-pub").await;
    publish_complete(&mut publisher, "share3/x", b"x", QoS::AtLeastOnce, false).await;
    for payload in ["y0", "y1", "y2", "y3"] {
        publish_complete(
            &mut publisher,
            "share3/y",
            payload.as_bytes(),
            QoS::AtLeastOnce,
            false,
        )
        .await;
    }
    let quiet = Duration::from_millis(300);
    let (got_c, got_d) = (drain(&mut c, quiet).await, drain(&mut d, quiet).await);
    // Still a member of h: its turns, and nothing of x.
    assert_eq!(got_c.len(), 2, "c: {got_c:?}, d: {got_d:?}");
    assert_eq!(got_d.len(), 2, "c: {got_c:?}, d: {got_d:?}");
    assert!(got_c.iter().all(|p| p.starts_with('y')), "{got_c:?}");
}

/// A session resumed with Session Present 1 is a member of its shared
/// subscriptions again: it gets its turns, not nothing.
#[tokio::test]
async fn a_resumed_session_takes_its_turns_in_its_groups() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let (mut a, _) = Raw::connect_with(addr, "share4-a", session(true, Some(60))).await;
    a.subscribe("$share/g/share4/t", QoS::AtLeastOnce).await;
    goodbye(a, None).await;
    let mut b = Raw::connect(addr, "share4-b").await;
    b.subscribe("$share/g/share4/t", QoS::AtLeastOnce).await;
    let (mut a, connack) = Raw::connect_with(addr, "share4-a", session(false, Some(60))).await;
    assert!(connack.session_present, "{connack:?}");
    let mut publisher = Raw::connect(addr, "share4-pub").await;
    for payload in ["0", "1", "2", "3", "4", "5"] {
        publish_complete(
            &mut publisher,
            "share4/t",
            payload.as_bytes(),
            QoS::AtLeastOnce,
            false,
        )
        .await;
    }
    let quiet = Duration::from_millis(300);
    let (got_a, got_b) = (drain(&mut a, quiet).await, drain(&mut b, quiet).await);
    each_once_between(&got_a, &got_b, &["0", "1", "2", "3", "4", "5"]);
}

/// The mark a cluster node puts on a publish to keep it from a shared
/// subscription another node serves is the broker's: a client's publish
/// carrying it reaches the group all the same, without it.
#[tokio::test]
async fn a_client_cannot_keep_its_publish_from_a_group() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut member = Raw::connect(addr, "share5-m").await;
    member
        .subscribe("$share/g/share5/t", QoS::AtLeastOnce)
        .await;
    let mut publisher = Raw::connect(addr, "share5-pub").await;
    let properties = v5::PublishProperties {
        user_properties: vec![
            (
                "statebroker:not-for-group".into(),
                "$share/g/share5/t".into(),
            ),
            ("mine".into(), "kept".into()),
        ],
        ..Default::default()
    };
    common::mqtt::publish_complete_with(
        &mut publisher,
        "share5/t",
        b"m",
        QoS::AtLeastOnce,
        false,
        Some(properties),
    )
    .await;
    let p = next_raw_publish(&mut member).await;
    assert_eq!(&p.payload[..], b"m");
    let user = p.properties.map(|p| p.user_properties).unwrap_or_default();
    assert_eq!(user, [("mine".to_owned(), "kept".to_owned())]);
}
