//! The machine on its own: packets in, bytes and router packets out.

use super::*;
use bytes::Bytes;
use router::protocol::{
    Filter, PingReq, PubAck, PubAckReason, QoS, RetainForwardRule, SubAck, Subscribe,
    SubscribeReasonCode, UnsubAckReason, Unsubscribe,
};
use router::{Ack, Forward, Notification, Receipt};

use crate::config::Settings;
use crate::persistence::Batch;
use crate::sessions::{Direct, QueueBound};

/// The broker's shared parts, in memory, without listeners; `tweak`
/// adjusts the settings.
async fn shared(tweak: impl FnOnce(&mut Settings)) -> Arc<Shared> {
    let mut settings = Settings::listening_on("127.0.0.1:0".parse().unwrap());
    tweak(&mut settings);
    let (_stop, shutdown) = watch::channel(false);
    Shared::build(settings, None, Vec::new(), shutdown)
        .await
        .unwrap()
}

/// A machine for client `c1` (MQTT 5), joined to the router or not,
/// with the disk's position in the test's hands.
async fn machine(joined: bool) -> (Machine, watch::Sender<Position>) {
    machine_with(joined, |_| {}).await
}

/// [`machine`], with `tweak` adjusting the broker's settings.
async fn machine_with(
    joined: bool,
    tweak: impl FnOnce(&mut Settings),
) -> (Machine, watch::Sender<Position>) {
    let shared = shared(tweak).await;
    let (disk, position) = watch::channel(Position::default());
    let acknowledged = shared.sessions.connected(
        "c1",
        1,
        false,
        crate::sessions::Mailbox::new(
            tokio::sync::mpsc::unbounded_channel().0,
            QueueBound::new(100, 1 << 20),
        ),
        Arc::new(crate::sessions::Peer {
            protocol: "MQTT 5",
            address: "127.0.0.1:1".parse().unwrap(),
            listener: "test".into(),
            in_flight: Default::default(),
            epoch: 0,
        }),
    );
    let start = Start {
        id: 1,
        client_id: "c1".into(),
        protocol: Protocol::V5,
        session_expiry: 0,
        receive_maximum: 10,
        max_packet_size: 1 << 20,
        broker_receive_maximum: 10,
        topic_alias_max: 10,
        client_topic_alias_max: 0,
        acknowledged: (acknowledged, 10),
        joined,
        bound: QueueBound::new(100, 1 << 20),
        principal: Arc::new(Principal {
            client_id: "c1".into(),
            ..Principal::default()
        }),
        owner: "addr:127.0.0.1".into(),
        disk: position,
        from_link: false,
        ids: crate::sessions::PacketIdBlock::default(),
    };
    (Machine::new(start, shared), disk)
}

/// `packet` as the codec hands it over, from the client.
fn incoming(packet: Packet) -> Incoming {
    let mut bytes = BytesMut::new();
    Protocol::V5.write(packet, &mut bytes).unwrap();
    Protocol::V5.read(&mut bytes, 1 << 20).unwrap().unwrap()
}

fn publish(topic: &str, qos: u8, pkid: u16) -> Packet {
    Packet::Publish(
        crate::codec::publish(topic.as_bytes(), b"x", qos, pkid, false),
        None,
    )
}

/// What the machine wrote for the client, decoded as a client would.
fn written(m: &mut Machine) -> Vec<Packet> {
    use router::protocol::Protocol as _;
    let mut packets = Vec::new();
    while !m.wbuf.is_empty() {
        packets.push(
            router::protocol::v5::V5
                .read_mut(&mut m.wbuf, 1 << 20)
                .unwrap(),
        );
    }
    packets
}

fn puback(pkid: u16) -> Ack {
    Ack::PubAck(PubAck {
        pkid,
        reason: PubAckReason::Success,
    })
}

fn at(n: u64) -> Position {
    Position::after(Batch::new(n))
}

#[tokio::test]
async fn pings_are_answered_and_publishes_go_to_the_router() {
    let (mut m, _disk) = machine(false).await;
    m.on_packet(incoming(Packet::PingReq(PingReq))).unwrap();
    assert!(matches!(written(&mut m)[..], [Packet::PingResp(_)]));
    m.on_packet(incoming(publish("t/1", 1, 7))).unwrap();
    assert!(written(&mut m).is_empty(), "the router acknowledges it");
    assert!(matches!(m.to_router[..], [Packet::Publish(..)]));
    m.on_router(Notification::DeviceAck(puback(7))).unwrap();
    assert!(matches!(
        written(&mut m)[..],
        [Packet::PubAck(PubAck { pkid: 7, .. }, _)]
    ));
}

#[tokio::test]
async fn an_acknowledgement_waiting_for_the_disk_holds_those_after_it() {
    let (mut m, disk) = machine(true).await;
    m.on_packet(incoming(publish("retained/1", 1, 1))).unwrap();
    // Refused here ($SYS is the broker's), acknowledged after 1's.
    m.on_packet(incoming(publish("$SYS/x", 1, 2))).unwrap();
    assert!(written(&mut m).is_empty());
    m.on_router(Notification::DurableAck(
        Receipt::new(5).unwrap(),
        puback(1),
    ))
    .unwrap();
    assert!(written(&mut m).is_empty(), "batch 5 is not on disk");
    assert_eq!(m.waiting_for(), Batch::new(5));
    disk.send_replace(at(4));
    m.on_disk().unwrap();
    assert!(written(&mut m).is_empty(), "4 is not enough");
    disk.send_replace(at(5));
    m.on_disk().unwrap();
    let acks = written(&mut m);
    let pkids: Vec<(u16, PubAckReason)> = acks
        .iter()
        .map(|p| match p {
            Packet::PubAck(a, _) => (a.pkid, a.reason),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        pkids,
        [(1, PubAckReason::Success), (2, PubAckReason::NotAuthorized)],
        "in the order the publishes came"
    );
    assert_eq!(m.waiting_for(), None);
}

#[tokio::test]
async fn what_a_subscription_brings_waits_behind_its_suback() {
    let (mut m, disk) = machine(true).await;
    let filter = Filter {
        path: "r/#".into(),
        qos: QoS::AtLeastOnce,
        nolocal: false,
        preserve_retain: false,
        retain_forward_rule: RetainForwardRule::OnEverySubscribe,
    };
    let subscribe = Subscribe {
        pkid: 3,
        filters: vec![filter],
    };
    m.on_packet(incoming(Packet::Subscribe(subscribe, None)))
        .unwrap();
    assert!(matches!(m.to_router[..], [Packet::Subscribe(..)]));
    let suback = Ack::SubAck(SubAck {
        pkid: 3,
        return_codes: vec![SubscribeReasonCode::Success(QoS::AtLeastOnce)],
    });
    m.on_router(Notification::DurableAck(Receipt::new(2).unwrap(), suback))
        .unwrap();
    let mut retained = crate::codec::publish(b"r/1", b"kept", 1, 1, true);
    retained.retain = true;
    m.on_router(Notification::Forward(Forward {
        cursor: None,
        size: 0,
        publish: retained,
        properties: None,
        queued: None,
    }))
    .unwrap();
    assert!(written(&mut m).is_empty(), "both wait for the disk");
    disk.send_replace(at(2));
    m.on_disk().unwrap();
    assert!(matches!(
        written(&mut m)[..],
        [Packet::SubAck(..), Packet::Publish(..)]
    ));
}

#[tokio::test]
async fn unsubscribe_before_joining_the_router_finds_no_subscription() {
    let (mut m, _disk) = machine(false).await;
    let mut unsubscribe = Unsubscribe {
        pkid: 4,
        filters: vec!["a".into(), "b/#".into()],
    };
    unsubscribe.pkid = 4;
    m.on_packet(incoming(Packet::Unsubscribe(unsubscribe, None)))
        .unwrap();
    let Packet::UnsubAck(unsuback, _) = &written(&mut m)[0] else {
        panic!("no UNSUBACK")
    };
    assert_eq!(unsuback.reasons, [UnsubAckReason::NoSubscriptionExisted; 2]);
    assert!(m.to_router.is_empty(), "the router is not bothered");
}

#[tokio::test]
async fn a_state_store_request_is_served_here_and_answers_come_straight() {
    let (mut m, _disk) = machine(false).await;
    let payload = statestore::resp3::encode_request(&["SET", "k", "v"]);
    let properties = PublishProperties {
        response_topic: Some("clients/c1/response".into()),
        correlation_data: Some(Bytes::from_static(b"1")),
        user_properties: vec![(
            "__ts".into(),
            format!("{}:0:c1", crate::clock::now_ms()).into(),
        )],
        ..PublishProperties::default()
    };
    let request = crate::codec::publish(topics::REQUEST_TOPIC.as_bytes(), &payload, 1, 9, false);
    m.on_packet(incoming(Packet::Publish(request, Some(properties))))
        .unwrap();
    assert!(matches!(
        written(&mut m)[..],
        [Packet::PubAck(PubAck { pkid: 9, .. }, _)]
    ));
    assert!(m.to_router.is_empty(), "a request never reaches the router");
    assert_eq!(
        m.shared.store.with_store(|s| s.len()),
        1,
        "the store ran it"
    );
    // The broker's answer comes straight, numbered above the router's ids.
    m.on_broker(answer(Bytes::from_static(b"+OK\r\n"))).unwrap();
    let Packet::Publish(answer, _) = &written(&mut m)[0] else {
        panic!("no answer")
    };
    assert_eq!(answer.pkid, outbound::FIRST_DIRECT_PKID);
}

#[tokio::test]
async fn protocol_errors_end_the_connection() {
    let (mut m, _disk) = machine(false).await;
    let disconnect = Packet::Disconnect(
        Disconnect {
            reason_code: DisconnectReasonCode::NormalDisconnection,
        },
        Some(DisconnectProperties {
            session_expiry_interval: Some(60),
            reason_string: None,
            user_properties: Vec::new(),
            server_reference: None,
        }),
    );
    let end = m.on_packet(incoming(disconnect)).unwrap_err();
    assert_eq!(
        end.reason().0,
        Some(DisconnectReasonCode::ProtocolError),
        "a session without expiry cannot get one at DISCONNECT"
    );
    let too_many: Vec<_> = (1..=11)
        .map(|pkid| m.on_packet(incoming(publish("t", 1, pkid))))
        .collect();
    assert!(too_many[..10].iter().all(Result::is_ok));
    assert_eq!(
        too_many[10].as_ref().unwrap_err().reason().0,
        Some(DisconnectReasonCode::ReceiveMaximumExceeded),
        "one more than the Receive Maximum announced"
    );
}

/// The router's DISCONNECT ends the connection with its reason code, and
/// a Reason String that says something even when the router gave none.
#[tokio::test]
async fn a_disconnect_from_the_router_is_passed_on_with_its_reason() {
    let (mut m, _disk) = machine(true).await;
    let without = Notification::Disconnect(
        Disconnect {
            reason_code: DisconnectReasonCode::ProtocolError,
        },
        None,
    );
    let end = m.on_router(without).unwrap_err();
    assert_eq!(
        end.reason(),
        (
            Some(DisconnectReasonCode::ProtocolError),
            "router: ProtocolError".to_owned()
        )
    );
}

#[tokio::test]
async fn the_end_tells_the_client_why_and_the_router_how_long_to_keep_the_session() {
    let (mut m, _disk) = machine(true).await;
    m.session_expiry = 30;
    m.end(&End::KeepAlive);
    let Packet::Disconnect(to_client, _) = &written(&mut m)[0] else {
        panic!("no DISCONNECT")
    };
    assert_eq!(
        to_client.reason_code,
        DisconnectReasonCode::KeepAliveTimeout
    );
    let Packet::Disconnect(_, Some(to_router)) = &m.to_router[0] else {
        panic!("the router is not told")
    };
    assert_eq!(to_router.session_expiry_interval, Some(30));
}

/// A state store request (RESP3 `args`) with a response topic and
/// correlation data, at QoS 1.
fn request(pkid: u16, args: &[&[u8]]) -> Packet {
    let payload = statestore::resp3::encode_request(args);
    let publish = crate::codec::publish(
        crate::topics::REQUEST_TOPIC.as_bytes(),
        &payload,
        1,
        pkid,
        false,
    );
    let properties = PublishProperties {
        response_topic: Some("c1/answers".into()),
        correlation_data: Some(Bytes::from(pkid.to_be_bytes().to_vec())),
        ..PublishProperties::default()
    };
    Packet::Publish(publish, Some(properties))
}

#[tokio::test]
async fn a_cluster_nodes_acknowledgements_wait_for_their_requests_outcome_in_order() {
    // A fault delays every SET: its outcome is not out until it runs.
    let (mut m, _disk) = machine_with(false, |settings| {
        settings.faults.enabled = true;
        settings.faults.rules = vec![crate::faults::RuleSpec {
            commands: vec!["SET".into()],
            delay_ms: Some(crate::faults::DelaySpec::Fixed(600_000)),
            ..Default::default()
        }];
    })
    .await;
    // As on a cluster node (see `store::tickets`).
    m.outcomes = Some(crate::store::tickets::Tickets::new());
    m.on_packet(incoming(request(5, &[b"SET", b"k", b"v"])))
        .unwrap();
    m.on_packet(incoming(request(6, &[b"PING"]))).unwrap();
    assert!(
        written(&mut m).is_empty(),
        "the SET's PUBACK waits for its outcome, and the PING's behind it"
    );
    assert_eq!(m.waits().outcome, Some(2));
    m.on_disk().unwrap();
    assert!(written(&mut m).is_empty(), "still waiting");
    // The delayed SET is dropped (its connection would have ended): its
    // outcome is out, and both acknowledgements go, in order.
    m.later.clear();
    m.on_disk().unwrap();
    let pkids: Vec<u16> = written(&mut m)
        .iter()
        .map(|p| match p {
            Packet::PubAck(ack, _) => ack.pkid,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(pkids, [5, 6]);
    assert_eq!(m.waits().outcome, None);
}

#[test]
fn a_puback_written_at_once_is_the_codecs() {
    for protocol in [Protocol::V4, Protocol::V5] {
        for pkid in [1u16, 0x1234, u16::MAX] {
            let mut by_codec = BytesMut::new();
            let ack = PubAck {
                pkid,
                reason: PubAckReason::Success,
            };
            protocol
                .write(Packet::PubAck(ack, None), &mut by_codec)
                .unwrap();
            assert_eq!(
                &by_codec[..],
                &puback_bytes(pkid)[..],
                "{protocol:?} {pkid}"
            );
        }
    }
}

/// A session in block 2 (it moved twice): the client sees the router's
/// ids 200 higher, the router gets its own back, and an acknowledgement
/// of an id outside the block (one a node the session left had used)
/// reaches neither.
#[tokio::test]
async fn the_router_ids_are_the_sessions_block_to_the_client() {
    use router::protocol::{PubComp, PubCompReason, PubRec, PubRecReason, PubRel, PubRelReason};
    let (mut m, _disk) = machine(true).await;
    m.out = Outbound::new(
        "c1",
        10,
        1 << 20,
        QueueBound::new(100, 1 << 20),
        0,
        crate::sessions::PacketIdBlock::new(2),
    );
    m.on_router(Notification::Forward(Forward {
        cursor: None,
        size: 0,
        publish: crate::codec::publish(b"q/1", b"x", 2, 5, false),
        properties: None,
        queued: None,
    }))
    .unwrap();
    let [Packet::Publish(p, _)] = &written(&mut m)[..] else {
        panic!("no publish")
    };
    assert_eq!(p.pkid, 205);
    let rec = |pkid| PubRec {
        pkid,
        reason: PubRecReason::Success,
    };
    // Block 0's id 5 and block 3's id 305: not this session's here.
    m.on_packet(incoming(Packet::PubRec(rec(5), None))).unwrap();
    m.on_packet(incoming(Packet::PubRec(rec(305), None)))
        .unwrap();
    assert!(m.to_router.is_empty() && written(&mut m).is_empty());
    m.on_packet(incoming(Packet::PubRec(rec(205), None)))
        .unwrap();
    assert!(matches!(
        m.to_router[..],
        [Packet::PubRec(PubRec { pkid: 5, .. }, _)]
    ));
    m.to_router.clear();
    m.on_router(Notification::DeviceAck(Ack::PubRel(PubRel {
        pkid: 5,
        reason: PubRelReason::Success,
    })))
    .unwrap();
    assert!(matches!(
        written(&mut m)[..],
        [Packet::PubRel(PubRel { pkid: 205, .. }, _)]
    ));
    let comp = PubComp {
        pkid: 205,
        reason: PubCompReason::Success,
    };
    m.on_packet(incoming(Packet::PubComp(comp, None))).unwrap();
    assert!(matches!(
        m.to_router[..],
        [Packet::PubComp(PubComp { pkid: 5, .. }, _)]
    ));
    assert_eq!(m.out.in_flight(), 0);
}

/// A delivery that writes nothing (too large for the client, or waiting
/// for its Receive Maximum) may be the answer that held acknowledgements
/// wait for, and the store will not say it went elsewhere: they go (see
/// `hold.rs`).
#[tokio::test]
async fn a_delivery_that_writes_nothing_ends_the_acknowledgements_hold() {
    let (mut m, _disk) = machine(true).await;
    // A persisted request's PUBACK, held to leave with its answer.
    m.ack(1, 9, true);
    let len = m.wbuf.len();
    m.ack_hold.acknowledged(0, len, Batch::new(5), false);
    assert!(m.may_hold_output(), "held for its answer");
    // The answer, larger than the client's Maximum Packet Size (1 MiB).
    m.on_broker(answer(Bytes::from(vec![b'x'; 2 << 20])))
        .unwrap();
    assert!(!m.may_hold_output(), "the answer was discarded: all goes");
    assert!(matches!(
        written(&mut m)[..],
        [Packet::PubAck(PubAck { pkid: 9, .. }, _)]
    ));
}

/// An answer to `c1`, as the store delivers it straight.
fn answer(payload: Bytes) -> ToConnection {
    ToConnection::Deliver(Box::new(Direct::qos1(b"clients/c1/response", payload)))
}
