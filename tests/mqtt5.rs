//! MQTT 5 publish/subscribe semantics, asserted packet by packet with raw
//! clients: what the broker delivers, at which QoS, with which flags.
//! Each test names the rule (and the section of the MQTT 5 specification).

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::raw::{Raw, Recv, v5};
use common::start_broker;
use rumqttc::v5::mqttbytes::QoS;
use v5::{Filter, Packet, Publish, Subscribe, SubscribeReasonCode};

/// Publishes at `qos` and completes the exchange (PUBACK, or
/// PUBREC/PUBREL/PUBCOMP).
async fn publish_complete(
    c: &mut Raw,
    topic: &str,
    payload: &'static [u8],
    qos: QoS,
    retain: bool,
) {
    let mut publish = Publish::new(topic, qos, Bytes::from_static(payload), None);
    publish.retain = retain;
    if qos != QoS::AtMostOnce {
        publish.pkid = c.pkid();
    }
    let pkid = publish.pkid;
    c.send(Packet::Publish(publish)).await;
    match qos {
        QoS::AtMostOnce => {}
        QoS::AtLeastOnce => match c.recv().await {
            Recv::Packet(Packet::PubAck(ack)) => assert_eq!(ack.pkid, pkid),
            other => panic!("expected PUBACK, got {other:?}"),
        },
        QoS::ExactlyOnce => {
            match c.recv().await {
                Recv::Packet(Packet::PubRec(rec)) => assert_eq!(rec.pkid, pkid),
                other => panic!("expected PUBREC, got {other:?}"),
            }
            c.send(Packet::PubRel(v5::PubRel::new(pkid, None))).await;
            match c.recv().await {
                Recv::Packet(Packet::PubComp(comp)) => assert_eq!(comp.pkid, pkid),
                other => panic!("expected PUBCOMP, got {other:?}"),
            }
        }
    }
}

/// Subscribes with full subscription options.
async fn subscribe_with(c: &mut Raw, filter: Filter) -> Vec<SubscribeReasonCode> {
    let pkid = c.pkid();
    let mut subscribe = Subscribe::new(filter, None);
    subscribe.pkid = pkid;
    c.send(Packet::Subscribe(subscribe)).await;
    loop {
        match c.recv().await {
            Recv::Packet(Packet::SubAck(ack)) => {
                assert_eq!(ack.pkid, pkid);
                return ack.return_codes;
            }
            other => panic!("expected SUBACK, got {other:?}"),
        }
    }
}

/// The next PUBLISH exactly as it arrived (not acknowledged).
async fn next_raw_publish(c: &mut Raw) -> Publish {
    match c.recv().await {
        Recv::Packet(Packet::Publish(p)) => p,
        other => panic!("expected PUBLISH, got {other:?}"),
    }
}

async fn ack(c: &mut Raw, p: &Publish) {
    match p.qos {
        QoS::AtMostOnce => {}
        QoS::AtLeastOnce => c.send(Packet::PubAck(v5::PubAck::new(p.pkid, None))).await,
        QoS::ExactlyOnce => {
            c.send(Packet::PubRec(v5::PubRec::new(p.pkid, None))).await;
            match c.recv().await {
                Recv::Packet(Packet::PubRel(rel)) => assert_eq!(rel.pkid, p.pkid),
                other => panic!("expected PUBREL, got {other:?}"),
            }
            c.send(Packet::PubComp(v5::PubComp::new(p.pkid, None)))
                .await;
        }
    }
}

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
