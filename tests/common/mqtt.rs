//! MQTT 5 exchanges completed packet by packet with the raw client: publish
//! at any QoS, subscribe with full options, sessions.

use bytes::Bytes;
use rumqttc::v5::mqttbytes::QoS;

use super::raw::{Raw, Recv, v5};
use v5::{Filter, Packet, Publish, Subscribe, SubscribeReasonCode};

/// Publishes at `qos` and completes the exchange (PUBACK, or
/// PUBREC/PUBREL/PUBCOMP).
pub async fn publish_complete(
    c: &mut Raw,
    topic: &str,
    payload: &'static [u8],
    qos: QoS,
    retain: bool,
) {
    publish_complete_with(c, topic, payload, qos, retain, None).await;
}

/// [`publish_complete`] with MQTT 5 publish properties.
pub async fn publish_complete_with(
    c: &mut Raw,
    topic: &str,
    payload: &'static [u8],
    qos: QoS,
    retain: bool,
    properties: Option<v5::PublishProperties>,
) {
    let mut publish = Publish::new(topic, qos, Bytes::from_static(payload), properties);
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
            pubrec_of(c, pkid).await;
            pubrel_with(c, pkid, None).await;
        }
    }
}

/// Sends QoS 2 `publish` (its packet id set) and waits for its PUBREC.
pub async fn publish_until_pubrec(c: &mut Raw, publish: Publish) {
    let pkid = publish.pkid;
    c.send(Packet::Publish(publish)).await;
    pubrec_of(c, pkid).await;
}

/// The next packet is the PUBREC of `pkid`.
async fn pubrec_of(c: &mut Raw, pkid: u16) {
    match c.recv().await {
        Recv::Packet(Packet::PubRec(rec)) => assert_eq!(rec.pkid, pkid),
        other => panic!("expected PUBREC {pkid}, got {other:?}"),
    }
}

/// Sends the PUBREL of `pkid` with `properties`; its PUBCOMP.
pub async fn pubrel_with(
    c: &mut Raw,
    pkid: u16,
    properties: Option<v5::PubRelProperties>,
) -> v5::PubComp {
    c.send(Packet::PubRel(v5::PubRel::new(pkid, properties)))
        .await;
    match c.recv().await {
        Recv::Packet(Packet::PubComp(comp)) => {
            assert_eq!(comp.pkid, pkid);
            comp
        }
        other => panic!("expected PUBCOMP {pkid}, got {other:?}"),
    }
}

/// Subscribes with full subscription options.
pub async fn subscribe_with(c: &mut Raw, filter: Filter) -> Vec<SubscribeReasonCode> {
    subscribe_with_id(c, filter, None).await
}

/// Subscribes with full subscription options and a Subscription Identifier.
pub async fn subscribe_with_id(
    c: &mut Raw,
    filter: Filter,
    id: Option<usize>,
) -> Vec<SubscribeReasonCode> {
    let pkid = c.pkid();
    let properties = id.map(|id| v5::SubscribeProperties {
        id: Some(id),
        user_properties: Vec::new(),
    });
    let mut subscribe = Subscribe::new(filter, properties);
    subscribe.pkid = pkid;
    c.send(Packet::Subscribe(subscribe)).await;
    match c.recv().await {
        Recv::Packet(Packet::SubAck(ack)) => {
            assert_eq!(ack.pkid, pkid);
            ack.return_codes
        }
        other => panic!("expected SUBACK, got {other:?}"),
    }
}

/// The next PUBLISH exactly as it arrived (not acknowledged).
pub async fn next_raw_publish(c: &mut Raw) -> Publish {
    match c.recv().await {
        Recv::Packet(Packet::Publish(p)) => p,
        other => panic!("expected PUBLISH, got {other:?}"),
    }
}

pub async fn ack(c: &mut Raw, p: &Publish) {
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

pub fn filter(path: &str, qos: QoS, tweak: impl FnOnce(&mut Filter)) -> Filter {
    let mut f = Filter::new(path, qos);
    tweak(&mut f);
    f
}

pub fn session(
    clean_start: bool,
    expiry: Option<u32>,
) -> impl FnOnce(&mut (v5::Connect, Option<v5::LastWill>, Option<v5::Login>)) {
    move |c| {
        c.0.clean_start = clean_start;
        c.0.properties = Some(v5::ConnectProperties {
            session_expiry_interval: expiry,
            ..v5::ConnectProperties::new()
        });
    }
}

pub async fn goodbye(mut c: Raw, expiry: Option<u32>) {
    let properties = expiry.map(|secs| v5::DisconnectProperties {
        session_expiry_interval: Some(secs),
        reason_string: None,
        user_properties: Vec::new(),
        server_reference: None,
    });
    let mut disconnect = v5::Disconnect::new(v5::DisconnectReasonCode::NormalDisconnection);
    disconnect.properties = properties;
    c.send(Packet::Disconnect(disconnect)).await;
    assert!(matches!(c.recv().await, Recv::Closed));
}

/// After sending request `pkid` again: completes its acknowledgement
/// (PUBACK, or PUBREC, PUBREL, PUBCOMP) and acknowledges every answer
/// until half a second passes without a packet. Returns whether it was
/// acknowledged, and the answers' payloads in order.
pub async fn acknowledgement_and_answers(c: &mut Raw, pkid: u16) -> (bool, Vec<Bytes>) {
    let mut answers = Vec::new();
    let mut acknowledged = false;
    loop {
        match c.recv_within(std::time::Duration::from_millis(500)).await {
            Recv::Packet(Packet::PubAck(ack)) if ack.pkid == pkid => acknowledged = true,
            Recv::Packet(Packet::PubRec(rec)) if rec.pkid == pkid => {
                c.send(Packet::PubRel(v5::PubRel::new(pkid, None))).await;
            }
            Recv::Packet(Packet::PubComp(comp)) if comp.pkid == pkid => acknowledged = true,
            Recv::Packet(Packet::Publish(answer)) => {
                c.send(Packet::PubAck(v5::PubAck::new(answer.pkid, None)))
                    .await;
                answers.push(answer.payload);
            }
            Recv::Packet(_) => {}
            Recv::Timeout | Recv::Closed => return (acknowledged, answers),
        }
    }
}

/// The packet ids of the next `n` QoS 2 publishes `c` receives, each
/// PUBREC'd and its PUBREL left unanswered: the client keeps those ids
/// (MQTT 5 4.3.3, method B). QoS 1 ones (a cluster node hands a moved
/// session's queued messages over at QoS 1) are acknowledged and passed
/// over.
pub async fn kept_qos2_ids(c: &mut Raw, n: usize) -> Vec<u16> {
    let mut ids = Vec::new();
    while ids.len() < n {
        match c.recv().await {
            Recv::Packet(Packet::Publish(p)) if p.qos == QoS::AtLeastOnce => {
                c.send(Packet::PubAck(v5::PubAck::new(p.pkid, None))).await;
            }
            Recv::Packet(Packet::Publish(p)) => {
                assert_eq!(p.qos, QoS::ExactlyOnce, "{p:?}");
                c.send(Packet::PubRec(v5::PubRec::new(p.pkid, None))).await;
                ids.push(p.pkid);
            }
            Recv::Packet(_) => {}
            other => panic!("expected PUBLISH, got {other:?}"),
        }
    }
    ids
}
