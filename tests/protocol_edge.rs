//! Issue #31: MQTT edge cases, byte by byte over a real broker: packets a
//! conforming client never sends, and the exact answer to each.
//!
//! The rules, by section of MQTT 5 (and 3.1.1 where it differs): a
//! malformed CONNECT is answered CONNACK 0x81 and closed in MQTT 5 (3.1.4,
//! 4.13), closed without CONNACK in 3.1.1 (3.1.4); a malformed packet after
//! CONNECT ends the connection with DISCONNECT 0x81 in MQTT 5, by closing it
//! in 3.1.1 (4.13, 3.1.1 4.8).

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::BytesMut;
use common::mqtt::{ack, filter, next_raw_publish, publish_complete, session, subscribe_with_id};
use common::raw::{Raw, Recv, disconnect_reason, v5};
use common::{eventually, start_broker};
use rumqttc::v5::mqttbytes::QoS;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use v5::{ConnectReturnCode, DisconnectReasonCode, Packet, UnsubAckReason};

// ------------------------------------------------------------ raw bytes

/// A length-prefixed string or binary field.
fn s(bytes: &[u8]) -> Vec<u8> {
    let mut out = (bytes.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(bytes);
    out
}

/// A variable byte integer.
fn varint(mut n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let mut byte = (n % 128) as u8;
        n /= 128;
        if n > 0 {
            byte |= 0x80;
        }
        out.push(byte);
        if n == 0 {
            return out;
        }
    }
}

/// A packet: first byte, then the remaining length, then `body`.
fn packet(byte0: u8, body: &[u8]) -> Vec<u8> {
    let mut out = vec![byte0];
    out.extend(varint(body.len()));
    out.extend_from_slice(body);
    out
}

/// A CONNECT of protocol `level` with `flags`, keep-alive 30, MQTT 5
/// `properties` (ignored for 3.1.1), and `payload` as it goes on the wire.
fn connect(level: u8, flags: u8, properties: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut body = s(b"MQTT");
    body.extend([level, flags, 0, 30]);
    if level == 5 {
        body.extend(varint(properties.len()));
        body.extend_from_slice(properties);
    }
    body.extend_from_slice(payload);
    packet(0x10, &body)
}

/// Payload fields, each length-prefixed, concatenated.
fn fields(parts: &[&[u8]]) -> Vec<u8> {
    parts.iter().flat_map(|p| s(p)).collect()
}

/// Sends `bytes` on a new connection and returns every byte the broker
/// sent back until it closed the connection (panics if it stays open).
async fn answer(addr: SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(bytes).await.unwrap();
    read_until_closed(&mut stream).await
}

async fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await {
            Err(_) => panic!("the broker kept the connection open; sent {got:02x?}"),
            Ok(Ok(0)) | Ok(Err(_)) => return got,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// CONNACK refusing with `code`, MQTT 5, no properties.
fn refusal(code: u8) -> Vec<u8> {
    vec![0x20, 0x03, 0x00, code, 0x00]
}

/// A clean 3.1.1 connection, connected.
async fn connected_v4(addr: SocketAddr, client_id: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let bytes = connect(4, 0x02, &[], &fields(&[client_id.as_bytes()]));
    stream.write_all(&bytes).await.unwrap();
    let mut connack = [0u8; 4];
    stream.read_exact(&mut connack).await.unwrap();
    assert_eq!(connack, [0x20, 0x02, 0x00, 0x00]);
    stream
}

/// After a 3.1.1 CONNECT, `bytes` make the broker close the connection
/// without a word.
async fn v4_closes_on(addr: SocketAddr, bytes: &[u8], what: &str) {
    let mut stream = connected_v4(addr, "edge-v4").await;
    stream.write_all(bytes).await.unwrap();
    assert_eq!(read_until_closed(&mut stream).await, b"", "{what}");
}

/// After an MQTT 5 CONNECT, `bytes` end the connection with DISCONNECT 0x81.
async fn v5_malformed_on(addr: SocketAddr, bytes: &[u8], what: &str) {
    let mut c = Raw::connect(addr, "edge-v5").await;
    c.send_bytes(bytes).await;
    let d = c.expect_disconnect().await;
    assert_eq!(
        disconnect_reason(&d),
        Some(DisconnectReasonCode::MalformedPacket),
        "{what}"
    );
}

/// A malformed CONNECT: CONNACK 0x81 and close in MQTT 5 (3.1.4, 4.13),
/// close without CONNACK in 3.1.1 (3.1.4).
async fn refused_as_malformed(addr: SocketAddr, level: u8, bytes: &[u8], what: &str) {
    let expected = match level {
        5 => refusal(0x81),
        _ => Vec::new(),
    };
    assert_eq!(
        answer(addr, bytes).await,
        expected,
        "{what} (level {level})"
    );
}

// ------------------------------------------------------------ group 2: AUTH

/// [MQTT-4.12.0-1]: an Authentication Method the server does not support
/// is refused (0x8C Bad authentication method) and the connection closed.
/// statebroker supports none (no AUTH exchange).
#[tokio::test]
async fn an_authentication_method_is_refused() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut method = vec![0x15];
    method.extend(s(b"SCRAM-SHA-1"));
    let bytes = connect(5, 0x02, &method, &fields(&[b"auth"]));
    assert_eq!(answer(addr, &bytes).await, refusal(0x8C));
    // With data too.
    let mut both = method.clone();
    both.push(0x16);
    both.extend(s(b"client-first"));
    let bytes = connect(5, 0x02, &both, &fields(&[b"auth"]));
    assert_eq!(answer(addr, &bytes).await, refusal(0x8C));
    // 3.1.2.11.10: Authentication Data without a method is a Protocol Error.
    let mut data = vec![0x16];
    data.extend(s(b"client-first"));
    let bytes = connect(5, 0x02, &data, &fields(&[b"auth"]));
    assert_eq!(answer(addr, &bytes).await, refusal(0x82));
    // Without either, the same CONNECT is accepted.
    let bytes = connect(5, 0x02, &[], &fields(&[b"auth"]));
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(&bytes).await.unwrap();
    let mut head = [0u8; 4];
    stream.read_exact(&mut head).await.unwrap();
    assert_eq!((head[0], head[3]), (0x20, 0x00));
}

// ------------------------------------------------------------ group 7: malformed

/// [MQTT-3.1.2-3]: the reserved bit of the Connect Flags must be 0.
#[tokio::test]
async fn connect_with_the_reserved_flag_set() {
    let broker = start_broker().await;
    for level in [5, 4] {
        let bytes = connect(level, 0x03, &[], &fields(&[b"reserved"]));
        refused_as_malformed(broker.local_addr(), level, &bytes, "reserved flag").await;
    }
}

/// MQTT 5 [MQTT-3.1.2-16], [MQTT-3.1.2-18] (3.1.1: [MQTT-3.1.2-18],
/// [MQTT-3.1.2-20]): a User Name or Password whose flag is 0 must not be
/// present. 3.1.1 also wants no Password without a User Name
/// ([MQTT-3.1.2-22]).
#[tokio::test]
async fn username_or_password_without_its_flag() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    for level in [5, 4] {
        let user = fields(&[b"flags", b"alice"]);
        refused_as_malformed(
            addr,
            level,
            &connect(level, 0x02, &[], &user),
            "user name, flag 0",
        )
        .await;
        let both = fields(&[b"flags", b"alice", b"secret"]);
        refused_as_malformed(
            addr,
            level,
            &connect(level, 0x82, &[], &both),
            "password, flag 0",
        )
        .await;
        refused_as_malformed(
            addr,
            level,
            &connect(level, 0x02, &[], &both),
            "both, flags 0",
        )
        .await;
    }
    let password = fields(&[b"flags", b"secret"]);
    refused_as_malformed(addr, 4, &connect(4, 0x42, &[], &password), "password alone").await;
}

/// [MQTT-1.5.4-2] (3.1.1: [MQTT-1.5.3-2]): a UTF-8 string must not hold
/// U+0000, in a client id, a user name, a will topic.
#[tokio::test]
async fn null_character_in_connect() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    for level in [5, 4] {
        let id = fields(&[b"nul\0id"]);
        refused_as_malformed(addr, level, &connect(level, 0x02, &[], &id), "client id").await;
        let user = fields(&[b"nul-user", b"ali\0ce", b"pw"]);
        refused_as_malformed(addr, level, &connect(level, 0xC2, &[], &user), "user name").await;
        // Will flag, QoS 0.
        let mut will = s(b"nul-will");
        if level == 5 {
            will.push(0); // will properties
        }
        will.extend(fields(&[b"will/\0topic", b"bye"]));
        refused_as_malformed(addr, level, &connect(level, 0x06, &[], &will), "will topic").await;
    }
}

/// 3.1.1 [MQTT-4.7.3-1]: a topic name is at least one character long; an
/// empty will topic makes a malformed CONNECT, closed without CONNACK
/// (3.1.4). MQTT 5 answers CONNACK 0x90 Topic Name invalid, as before (a
/// reason code of 0x80 or more before closing, 3.1.4, 4.13).
#[tokio::test]
async fn empty_will_topic() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let will = fields(&[b"empty-will", b"", b"bye"]);
    assert_eq!(answer(addr, &connect(4, 0x06, &[], &will)).await, b"");
    let mut will = s(b"empty-will");
    will.push(0);
    will.extend(fields(&[b"", b"bye"]));
    assert_eq!(
        answer(addr, &connect(5, 0x06, &[], &will)).await,
        refusal(0x90)
    );
}

/// After CONNECT: U+0000 in a topic or a filter ([MQTT-1.5.4-2]).
#[tokio::test]
async fn null_character_in_topics_and_filters() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    // PUBLISH QoS 0 "a\0b" "x": MQTT 5 has a property length.
    let mut publish5 = s(b"a\0b");
    publish5.extend([0, b'x']);
    let mut publish4 = s(b"a\0b");
    publish4.push(b'x');
    // SUBSCRIBE id 1 "a\0b" QoS 0.
    let mut subscribe5 = vec![0, 1, 0];
    subscribe5.extend(s(b"a\0b"));
    subscribe5.push(0);
    let mut subscribe4 = vec![0, 1];
    subscribe4.extend(s(b"a\0b"));
    subscribe4.push(0);
    let mut unsubscribe5 = vec![0, 1, 0];
    unsubscribe5.extend(s(b"a\0b"));
    let mut unsubscribe4 = vec![0, 1];
    unsubscribe4.extend(s(b"a\0b"));
    for (byte0, five, four, what) in [
        (0x30, publish5, publish4, "PUBLISH topic"),
        (0x82, subscribe5, subscribe4, "SUBSCRIBE filter"),
        (0xA2, unsubscribe5, unsubscribe4, "UNSUBSCRIBE filter"),
    ] {
        v5_malformed_on(addr, &packet(byte0, &five), what).await;
        v4_closes_on(addr, &packet(byte0, &four), what).await;
    }
}

/// [MQTT-3.10.3-2]: an UNSUBSCRIBE holds at least one filter.
#[tokio::test]
async fn unsubscribe_without_a_filter() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    v5_malformed_on(addr, &packet(0xA2, &[0, 1, 0]), "MQTT 5").await;
    v4_closes_on(addr, &packet(0xA2, &[0, 1]), "3.1.1").await;
}

/// [MQTT-2.2.1-3]: SUBSCRIBE and UNSUBSCRIBE carry a non-zero packet id.
#[tokio::test]
async fn subscribe_and_unsubscribe_with_packet_id_0() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut subscribe5 = vec![0, 0, 0];
    subscribe5.extend(s(b"a"));
    subscribe5.push(0);
    let mut subscribe4 = vec![0, 0];
    subscribe4.extend(s(b"a"));
    subscribe4.push(0);
    let mut unsubscribe5 = vec![0, 0, 0];
    unsubscribe5.extend(s(b"a"));
    let mut unsubscribe4 = vec![0, 0];
    unsubscribe4.extend(s(b"a"));
    v5_malformed_on(addr, &packet(0x82, &subscribe5), "SUBSCRIBE").await;
    v4_closes_on(addr, &packet(0x82, &subscribe4), "SUBSCRIBE").await;
    v5_malformed_on(addr, &packet(0xA2, &unsubscribe5), "UNSUBSCRIBE").await;
    v4_closes_on(addr, &packet(0xA2, &unsubscribe4), "UNSUBSCRIBE").await;
}

/// [MQTT-3.8.1-1], [MQTT-3.10.1-1]: the fixed-header flags of SUBSCRIBE
/// and UNSUBSCRIBE are 0010; anything else is malformed.
#[tokio::test]
async fn subscribe_and_unsubscribe_with_other_header_flags() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut subscribe5 = vec![0, 1, 0];
    subscribe5.extend(s(b"a"));
    subscribe5.push(0);
    let mut subscribe4 = vec![0, 1];
    subscribe4.extend(s(b"a"));
    subscribe4.push(0);
    let mut unsubscribe5 = vec![0, 1, 0];
    unsubscribe5.extend(s(b"a"));
    let mut unsubscribe4 = vec![0, 1];
    unsubscribe4.extend(s(b"a"));
    for flags in [0x0, 0x3, 0xA] {
        v5_malformed_on(addr, &packet(0x80 | flags, &subscribe5), "SUBSCRIBE").await;
        v4_closes_on(addr, &packet(0x80 | flags, &subscribe4), "SUBSCRIBE").await;
        v5_malformed_on(addr, &packet(0xA0 | flags, &unsubscribe5), "UNSUBSCRIBE").await;
        v4_closes_on(addr, &packet(0xA0 | flags, &unsubscribe4), "UNSUBSCRIBE").await;
    }
}

/// MQTT 5 [MQTT-3.8.3-5]: bits 6 and 7 of the Subscription Options are
/// reserved, 0 (3.1.1 [MQTT-3-8.3-4]: bits 2 to 7).
#[tokio::test]
async fn subscription_options_with_reserved_bits() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    for bit in [0x40u8, 0x80] {
        let mut subscribe = vec![0, 1, 0];
        subscribe.extend(s(b"a"));
        subscribe.push(bit | 1);
        v5_malformed_on(addr, &packet(0x82, &subscribe), "MQTT 5").await;
    }
    for bit in [0x04u8, 0x10, 0x80] {
        let mut subscribe = vec![0, 1];
        subscribe.extend(s(b"a"));
        subscribe.push(bit | 1);
        v4_closes_on(addr, &packet(0x82, &subscribe), "3.1.1").await;
    }
}

/// The checks above refuse nothing a conforming client sends: the same
/// packets, well formed, are answered.
#[tokio::test]
async fn well_formed_edge_packets_are_answered() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    // User name and password with their flags, in both versions.
    for level in [5, 4] {
        let both = fields(&[b"flags-ok", b"alice", b"secret"]);
        let got = answer_first(addr, &connect(level, 0xC2, &[], &both)).await;
        assert_eq!((got[0], got[3]), (0x20, 0x00), "level {level}");
    }
    let mut c = Raw::connect(addr, "options-ok").await;
    // No Local, Retain As Published, Retain Handling 2: all allowed bits.
    let mut subscribe = vec![0, 7, 0];
    subscribe.extend(s(b"a"));
    subscribe.push(0x2D);
    c.send_bytes(&packet(0x82, &subscribe)).await;
    match c.recv().await {
        Recv::Packet(Packet::SubAck(ack)) => assert_eq!(ack.pkid, 7),
        other => panic!("{other:?}"),
    }
}

/// Sends `bytes` and returns the first packet's first bytes.
async fn answer_first(addr: SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(bytes).await.unwrap();
    let mut buf = BytesMut::new();
    while buf.len() < 4 {
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read_buf(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "closed after {buf:02x?}");
    }
    buf.to_vec()
}

// ------------------------------------------------------------ group 8: CONNACK size

/// The CONNACK as it arrives, with the client's Maximum Packet Size.
async fn connack_for(addr: SocketAddr, client_id: &str, max: u32) -> Vec<u8> {
    let mut props = vec![0x27];
    props.extend(max.to_be_bytes());
    let bytes = connect(5, 0x02, &props, &fields(&[client_id.as_bytes()]));
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(&bytes).await.unwrap();
    let mut head = [0u8; 2];
    stream.read_exact(&mut head).await.unwrap();
    let mut rest = vec![0u8; usize::from(head[1])];
    stream.read_exact(&mut rest).await.unwrap();
    let mut all = head.to_vec();
    all.extend(rest);
    all
}

fn connack_properties(bytes: &[u8]) -> (v5::ConnAck, v5::ConnAckProperties) {
    let mut buf = BytesMut::from(bytes);
    match Packet::read(&mut buf, None).unwrap() {
        Packet::ConnAck(ack) => {
            let props = ack.properties.clone().expect("CONNACK properties");
            (ack, props)
        }
        other => panic!("{other:?}"),
    }
}

/// [MQTT-3.1.2-24]: no packet, CONNACK included, larger than the client's
/// Maximum Packet Size. What the broker leaves out first, as far as
/// needed, are the four "available" properties, whose absence means what
/// they say (3.2.2.3.5, 3.2.2.3.11-13), then the Topic Alias Maximum (absent: 0, the client
/// uses no aliases); Receive Maximum, Maximum Packet Size, Server Keep
/// Alive and an Assigned Client Identifier stay, and a CONNACK that cannot
/// carry them refuses the connection (0x83 Implementation specific error).
#[tokio::test]
async fn connack_fits_the_clients_maximum_packet_size() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let full = connack_for(addr, "big", 1 << 20).await;
    let (ack, props) = connack_properties(&full);
    assert_eq!(ack.code, ConnectReturnCode::Success);
    assert_eq!(full.len(), 24, "{full:02x?}");
    assert_eq!(props.retain_available, Some(1));

    let small = connack_for(addr, "small", 20).await;
    assert!(small.len() <= 20, "{} bytes: {small:02x?}", small.len());
    let (ack, props) = connack_properties(&small);
    assert_eq!(ack.code, ConnectReturnCode::Success);
    assert_eq!(props.receive_max, Some(1000));
    assert!(props.max_packet_size.is_some());
    assert!(props.topic_alias_max.is_some());
    assert_eq!(props.retain_available, Some(1), "left out only as needed");
    assert_eq!(props.shared_subscription_available, None);
    assert_eq!(props.wildcard_subscription_available, None);

    let smaller = connack_for(addr, "smaller", 15).await;
    assert!(smaller.len() <= 15, "{smaller:02x?}");
    let (ack, props) = connack_properties(&smaller);
    assert_eq!(ack.code, ConnectReturnCode::Success);
    assert_eq!(props.receive_max, Some(1000));
    assert!(props.max_packet_size.is_some());
    assert_eq!(props.topic_alias_max, None);

    // An assigned client id does not fit in 20 bytes.
    let assigned = connack_for(addr, "", 20).await;
    assert_eq!(assigned, refusal(0x83));
}

// ------------------------------------------------------------ group 9: UNSUBACK

/// 3.11.2.2: UNSUBACK 0x11 "No subscription existed" for a filter never
/// subscribed, 0x00 for one that was, with or without a router link.
#[tokio::test]
async fn unsuback_tells_which_subscriptions_existed() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let unsubscribe = |filters: &[&str], pkid| {
        let mut u = v5::Unsubscribe::new(filters[0], None);
        u.filters = filters.iter().map(|f| f.to_string()).collect();
        u.pkid = pkid;
        Packet::Unsubscribe(u)
    };
    // Never joined the router: answered by the connection.
    let mut fresh = Raw::connect(addr, "unsub-fresh").await;
    fresh.send(unsubscribe(&["never"], 3)).await;
    match fresh.recv().await {
        Recv::Packet(Packet::UnsubAck(ack)) => {
            assert_eq!(ack.pkid, 3);
            assert_eq!(ack.reasons, vec![UnsubAckReason::NoSubscriptionExisted]);
        }
        other => panic!("{other:?}"),
    }
    // Subscribed to something else: answered by the router.
    let mut c = Raw::connect(addr, "unsub-joined").await;
    c.subscribe("a/+", QoS::AtLeastOnce).await;
    c.send(unsubscribe(&["never", "a/+"], 4)).await;
    match c.recv().await {
        Recv::Packet(Packet::UnsubAck(ack)) => {
            assert_eq!(ack.pkid, 4);
            assert_eq!(
                ack.reasons,
                vec![
                    UnsubAckReason::NoSubscriptionExisted,
                    UnsubAckReason::Success,
                ]
            );
        }
        other => panic!("{other:?}"),
    }
}

// ------------------------------------------------------------ group 6: QoS flows

/// A subscriber on `topic` at `qos` without acknowledging anything, and a
/// publisher that published `payload` at `qos` (QoS 2: through PUBCOMP).
/// Returns the subscriber and the delivery it got.
async fn delivered(
    addr: SocketAddr,
    name: &str,
    qos: QoS,
    payload: &'static [u8],
) -> (Raw, v5::Publish) {
    let mut sub = Raw::connect(addr, &format!("{name}-sub")).await;
    sub.subscribe(name, qos).await;
    let mut publisher = Raw::connect(addr, &format!("{name}-pub")).await;
    let mut publish = v5::Publish::new(name, qos, payload, None);
    publish.pkid = publisher.pkid();
    publisher.send(Packet::Publish(publish.clone())).await;
    if qos == QoS::ExactlyOnce {
        match publisher.recv().await {
            Recv::Packet(Packet::PubRec(rec)) => assert_eq!(rec.pkid, publish.pkid),
            other => panic!("{other:?}"),
        }
        publisher
            .send(Packet::PubRel(v5::PubRel::new(publish.pkid, None)))
            .await;
    }
    match sub.recv().await {
        Recv::Packet(Packet::Publish(p)) => {
            assert_eq!((p.qos, &p.payload[..]), (qos, payload));
            (sub, p)
        }
        other => panic!("{other:?}"),
    }
}

/// 4.3.3: a PUBREC with a reason code of 0x80 or more ends the QoS 2 flow:
/// no PUBREL follows, the message is not sent again, and the next one
/// comes.
#[tokio::test]
async fn a_failed_pubrec_ends_the_qos2_flow() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let (mut sub, p) = delivered(addr, "failed-pubrec", QoS::ExactlyOnce, b"one").await;
    let mut rec = v5::PubRec::new(p.pkid, None);
    rec.reason = v5::PubRecReason::UnspecifiedError;
    sub.send(Packet::PubRec(rec)).await;
    match sub.recv_within(Duration::from_millis(500)).await {
        Recv::Timeout => {}
        other => panic!("nothing may follow a failed PUBREC, got {other:?}"),
    }
    let mut publisher = Raw::connect(addr, "failed-pubrec-again").await;
    publisher
        .publish("failed-pubrec", &b"two"[..], QoS::AtMostOnce, None)
        .await;
    match sub.recv().await {
        Recv::Packet(Packet::Publish(p)) => assert_eq!(&p.payload[..], b"two"),
        other => panic!("{other:?}"),
    }
}

/// 4.3.2: a QoS 1 delivery is acknowledged with PUBACK; a PUBREC for it
/// is a Protocol Error (DISCONNECT 0x82), not the start of a QoS 2 flow.
#[tokio::test]
async fn pubrec_for_a_qos1_delivery_is_a_protocol_error() {
    let broker = start_broker().await;
    let (mut sub, p) = delivered(broker.local_addr(), "qos1-pubrec", QoS::AtLeastOnce, b"x").await;
    sub.send(Packet::PubRec(v5::PubRec::new(p.pkid, None)))
        .await;
    let d = sub.expect_disconnect().await;
    assert_eq!(
        disconnect_reason(&d),
        Some(DisconnectReasonCode::ProtocolError)
    );
}

/// 4.3.3: a QoS 2 delivery is acknowledged with PUBREC, then PUBCOMP; a
/// PUBACK for it, before or after the PUBREC, is a Protocol Error
/// (DISCONNECT 0x82).
#[tokio::test]
async fn puback_in_a_qos2_flow_is_a_protocol_error() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let (mut sub, p) = delivered(addr, "qos2-puback", QoS::ExactlyOnce, b"x").await;
    sub.send(Packet::PubAck(v5::PubAck::new(p.pkid, None)))
        .await;
    let d = sub.expect_disconnect().await;
    assert_eq!(
        disconnect_reason(&d),
        Some(DisconnectReasonCode::ProtocolError),
        "PUBACK instead of PUBREC"
    );
    let (mut sub, p) = delivered(addr, "qos2-puback-late", QoS::ExactlyOnce, b"x").await;
    sub.send(Packet::PubRec(v5::PubRec::new(p.pkid, None)))
        .await;
    match sub.recv().await {
        Recv::Packet(Packet::PubRel(rel)) => assert_eq!(rel.pkid, p.pkid),
        other => panic!("{other:?}"),
    }
    sub.send(Packet::PubAck(v5::PubAck::new(p.pkid, None)))
        .await;
    let d = sub.expect_disconnect().await;
    assert_eq!(
        disconnect_reason(&d),
        Some(DisconnectReasonCode::ProtocolError),
        "PUBACK instead of PUBCOMP"
    );
}

/// 3.14.2.2.3: the DISCONNECT that ends a connection leaves out its Reason
/// String where it would pass the client's Maximum Packet Size.
#[tokio::test]
async fn disconnect_fits_the_clients_maximum_packet_size() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let (mut c, connack) = Raw::connect_with(addr, "small-disconnect", |c| {
        c.0.properties.as_mut().unwrap().max_packet_size = Some(20);
    })
    .await;
    assert_eq!(connack.code, ConnectReturnCode::Success);
    c.send_bytes(&packet(0xA2, &[0, 1, 0])).await;
    let mut got = Vec::new();
    let mut buf = [0u8; 512];
    loop {
        match tokio::time::timeout(Duration::from_secs(5), c.stream.read(&mut buf)).await {
            Err(_) => panic!("the broker kept the connection open"),
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
    assert!(got.len() <= 20, "{got:02x?}");
    assert_eq!(got, [0xE0, 0x02, 0x81, 0x00], "{got:02x?}");
}

// ------------------------------------------------------------ group 1: PUBREL on reconnect

/// 4.4 [MQTT-4.4.0-1]: a client resuming a session (Clean Start 0) gets
/// every PUBREL of the session again with its packet id, right after the
/// CONNACK, not when the next message for it happens to come: on a quiet
/// topic the QoS 2 exchange is completed and its packet id freed.
#[tokio::test]
async fn a_pubrel_is_resent_right_after_the_connack() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let (mut sub, _) = Raw::connect_with(addr, "pubrel-quiet", session(true, Some(600))).await;
    sub.subscribe("pubrel/quiet", QoS::ExactlyOnce).await;
    let mut publisher = Raw::connect(addr, "pubrel-quiet-pub").await;
    publish_complete(
        &mut publisher,
        "pubrel/quiet",
        b"one",
        QoS::ExactlyOnce,
        false,
    )
    .await;
    let p = next_raw_publish(&mut sub).await;
    sub.send(Packet::PubRec(v5::PubRec::new(p.pkid, None)))
        .await;
    match sub.recv().await {
        Recv::Packet(Packet::PubRel(rel)) => assert_eq!(rel.pkid, p.pkid),
        other => panic!("expected PUBREL, got {other:?}"),
    }
    // The connection breaks before the PUBCOMP; nothing more is published.
    drop(sub);
    eventually("the subscriber's connection ended", || {
        broker.connection_count() == 1
    })
    .await;
    let (mut sub, connack) =
        Raw::connect_with(addr, "pubrel-quiet", session(false, Some(600))).await;
    assert!(connack.session_present);
    // The PUBREL comes with no other message to carry it.
    match sub.recv_within(Duration::from_secs(2)).await {
        Recv::Packet(Packet::PubRel(rel)) => assert_eq!(rel.pkid, p.pkid),
        other => panic!("expected the PUBREL right after the CONNACK, got {other:?}"),
    }
    sub.send(Packet::PubComp(v5::PubComp::new(p.pkid, None)))
        .await;
    // Completed: not sent again, and the next message flows.
    match sub.recv_within(Duration::from_millis(300)).await {
        Recv::Timeout => {}
        other => panic!("nothing more after the PUBCOMP, got {other:?}"),
    }
    publish_complete(
        &mut publisher,
        "pubrel/quiet",
        b"two",
        QoS::ExactlyOnce,
        false,
    )
    .await;
    let two = next_raw_publish(&mut sub).await;
    assert_eq!(&two.payload[..], b"two");
    ack(&mut sub, &two).await;
}

// ------------------------------------------------------------ group 5: subscription identifiers

/// 3.8.4 [MQTT-3.8.4-3] and 3.8.2.1.2: a SUBSCRIBE of a filter the client
/// already has replaces that subscription, its Subscription Identifier
/// included: subscribed again without one, its messages carry none; with
/// another one, that one.
#[tokio::test]
async fn a_new_subscription_replaces_the_subscription_identifier() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut sub = Raw::connect(addr, "subid-replace").await;
    let mut publisher = Raw::connect(addr, "subid-replace-pub").await;
    let ids = |p: &v5::Publish| {
        p.properties
            .as_ref()
            .map(|p| p.subscription_identifiers.clone())
            .unwrap_or_default()
    };
    for (id, want) in [(Some(7), vec![7]), (None, vec![]), (Some(9), vec![9])] {
        let codes = subscribe_with_id(
            &mut sub,
            filter("subid/replace", QoS::AtLeastOnce, |_| {}),
            id,
        )
        .await;
        assert_eq!(codes, [v5::SubscribeReasonCode::Success(QoS::AtLeastOnce)]);
        publish_complete(
            &mut publisher,
            "subid/replace",
            b"m",
            QoS::AtLeastOnce,
            false,
        )
        .await;
        let p = next_raw_publish(&mut sub).await;
        ack(&mut sub, &p).await;
        assert_eq!(ids(&p), want, "subscribed with {id:?}");
    }
}

// ------------------------------------------------------------ group 4: wills on takeover

/// A 3.1.1 CONNECT of `client_id`, Clean Session 0, with a QoS 1 will on
/// `will_topic` (payload "offline").
fn v4_connect_with_will(client_id: &str, will_topic: &str) -> Vec<u8> {
    let payload = fields(&[client_id.as_bytes(), will_topic.as_bytes(), b"offline"]);
    connect(4, 0x04 | 0x08, &[], &payload)
}

/// 3.1.1 3.1.2.5 [MQTT-3.1.2-8] and 3.1.4 [MQTT-3.1.4-2]: a will is
/// published when its network connection closes without DISCONNECT, and
/// a takeover closes it: the will of a persistent session taken over is
/// published (3.1.1 has no Will Delay Interval to hold it back).
#[tokio::test]
async fn a_takeover_publishes_the_will_in_3_1_1() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut listener = Raw::connect(addr, "takeover4-listener").await;
    listener.subscribe("takeover4/#", QoS::AtLeastOnce).await;
    let mut old = TcpStream::connect(addr).await.unwrap();
    old.write_all(&v4_connect_with_will("takeover4", "takeover4/status"))
        .await
        .unwrap();
    let mut connack = [0u8; 4];
    old.read_exact(&mut connack).await.unwrap();
    assert_eq!(connack, [0x20, 0x02, 0x00, 0x00]);
    let mut new = TcpStream::connect(addr).await.unwrap();
    new.write_all(&connect(4, 0x00, &[], &fields(&[b"takeover4"])))
        .await
        .unwrap();
    new.read_exact(&mut connack).await.unwrap();
    assert_eq!(connack, [0x20, 0x02, 0x01, 0x00], "session present");
    assert_eq!(read_until_closed(&mut old).await, b"", "closed, no word");
    let p = listener.next_publish().await;
    assert_eq!(
        (&p.topic[..], &p.payload[..]),
        (&b"takeover4/status"[..], &b"offline"[..])
    );
}

/// MQTT 5 3.1.4 [MQTT-3.1.4-3]: a takeover closes the old connection, and
/// "if the existing Client has a Will Message, that Will Message is
/// published as described in section 3.1.2.5": after the Will Delay
/// Interval or when the session ends, unless a new connection for the
/// client id comes before the delay has passed [MQTT-3.1.2-8],
/// [MQTT-3.1.3-9]. So with Will Delay 0 the will goes out on every
/// takeover; with a Will Delay Interval > 0 a takeover that continues the
/// session (Clean Start 0) holds it back for good, and one that starts
/// clean ends the session and publishes it at once.
#[tokio::test]
async fn a_takeover_publishes_the_will_unless_its_delay_holds_it() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut listener = Raw::connect(addr, "takeover5-listener").await;
    listener.subscribe("takeover5/#", QoS::AtLeastOnce).await;
    let cases = [
        // (client id, will delay, the new connection's Clean Start, published)
        ("takeover5-nodelay", 0, false, true),
        ("takeover5-held", 60, false, false),
        ("takeover5-clean", 60, true, true),
    ];
    for (client, delay, clean, published) in cases {
        let topic = format!("takeover5/{client}");
        let (mut old, _) = Raw::connect_with(addr, client, |c| {
            session(false, Some(600))(c);
            c.1 = Some(v5::LastWill::new(
                topic.as_str(),
                "offline",
                QoS::AtLeastOnce,
                false,
                Some(v5::LastWillProperties {
                    delay_interval: Some(delay),
                    payload_format_indicator: None,
                    message_expiry_interval: None,
                    content_type: None,
                    response_topic: None,
                    correlation_data: None,
                    user_properties: Vec::new(),
                }),
            ));
        })
        .await;
        let (new, connack) = Raw::connect_with(addr, client, session(clean, Some(600))).await;
        assert_eq!(connack.session_present, !clean, "{client}");
        let d = old.expect_disconnect().await;
        assert_eq!(
            disconnect_reason(&d),
            Some(DisconnectReasonCode::SessionTakenOver),
            "{client}"
        );
        if published {
            let p = listener.next_publish().await;
            assert_eq!(
                (&p.topic[..], &p.payload[..]),
                (topic.as_bytes(), &b"offline"[..])
            );
        }
        listener.no_publish_within(Duration::from_millis(300)).await;
        common::mqtt::goodbye(new, None).await;
        listener.no_publish_within(Duration::from_millis(100)).await;
    }
}

// ------------------------------------------------------------ topic aliases to the client

/// 3.3.2.3.4: a client that accepts topic aliases (Topic Alias Maximum in
/// CONNECT, 3.1.2.11.5) gets them: a topic's first publish carries the
/// topic and a new alias, the next ones the alias and an empty topic; no
/// more aliases than it accepts; none for a client that accepts none.
#[tokio::test]
async fn the_broker_sends_topic_aliases_a_client_accepts() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let (mut sub, _) = Raw::connect_with(addr, "alias-sub", |c| {
        c.0.properties = Some(v5::ConnectProperties {
            topic_alias_max: Some(1),
            ..v5::ConnectProperties::new()
        });
    })
    .await;
    sub.subscribe("alias/#", QoS::AtLeastOnce).await;
    let mut plain = Raw::connect(addr, "alias-plain").await;
    plain.subscribe("alias/#", QoS::AtLeastOnce).await;
    let mut publisher = Raw::connect(addr, "alias-pub").await;
    for topic in ["alias/a", "alias/a", "alias/a", "alias/b"] {
        publish_complete(&mut publisher, topic, b"m", QoS::AtLeastOnce, false).await;
    }
    let mut got = Vec::new();
    for _ in 0..4 {
        let p = next_raw_publish(&mut sub).await;
        ack(&mut sub, &p).await;
        let alias = p.properties.as_ref().and_then(|p| p.topic_alias);
        got.push((String::from_utf8_lossy(&p.topic).into_owned(), alias));
    }
    assert_eq!(
        got,
        [
            ("alias/a".into(), Some(1)),
            (String::new(), Some(1)),
            (String::new(), Some(1)),
            ("alias/b".into(), None),
        ]
    );
    for want in ["alias/a", "alias/a", "alias/a", "alias/b"] {
        let p = next_raw_publish(&mut plain).await;
        ack(&mut plain, &p).await;
        assert_eq!(&p.topic[..], want.as_bytes());
        assert_eq!(p.properties.and_then(|p| p.topic_alias), None);
    }
}

// ------------------------------------------------------------ group 3: a session ended by DISCONNECT

/// 3.14.2.2.2 and 3.1.2.11.2: DISCONNECT with Session Expiry Interval 0
/// ends the session; a reconnect sent right after it (without waiting for
/// the broker to close the socket) with Clean Start 0 finds no session:
/// Session Present 0, the subscription gone. Twenty rounds, since this
/// was a race.
#[tokio::test]
async fn a_session_ended_by_disconnect_does_not_come_back() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut publisher = Raw::connect(addr, "ended-pub").await;
    for round in 0..20 {
        let (mut c, connack) = Raw::connect_with(addr, "ended", session(false, Some(600))).await;
        assert!(!connack.session_present, "round {round}: nothing left over");
        c.subscribe("ended/t", QoS::AtLeastOnce).await;
        let mut disconnect = v5::Disconnect::new(DisconnectReasonCode::NormalDisconnection);
        disconnect.properties = Some(v5::DisconnectProperties {
            session_expiry_interval: Some(0),
            reason_string: None,
            user_properties: Vec::new(),
            server_reference: None,
        });
        c.send(Packet::Disconnect(disconnect)).await;
        let (mut again, connack) =
            Raw::connect_with(addr, "ended", session(false, Some(600))).await;
        assert!(
            !connack.session_present,
            "round {round}: the session came back"
        );
        publish_complete(&mut publisher, "ended/t", b"m", QoS::AtLeastOnce, false).await;
        match again.recv_within(Duration::from_millis(100)).await {
            Recv::Timeout => {}
            other => panic!("round {round}: the old subscription delivered {other:?}"),
        }
        // Ends this session too, for the next round.
        let mut end = v5::Disconnect::new(DisconnectReasonCode::NormalDisconnection);
        end.properties = Some(v5::DisconnectProperties {
            session_expiry_interval: Some(0),
            reason_string: None,
            user_properties: Vec::new(),
            server_reference: None,
        });
        again.send(Packet::Disconnect(end)).await;
        assert!(matches!(again.recv().await, Recv::Closed));
        drop(c);
    }
}

/// 3.3.4 [MQTT-3.3.4-2], [MQTT-3.3.4-5]: a publish matching two of a
/// client's subscriptions may be delivered once per subscription (each
/// filter has its own log in the router); each copy then carries the
/// Subscription Identifier of its own subscription. (Paho's
/// test_subscribe_identifiers expects the single-copy choice, where one
/// copy carries both.)
#[tokio::test]
async fn overlapping_subscriptions_each_carry_their_identifier() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut sub = Raw::connect(addr, "overlap-ids").await;
    for (f, id) in [("overlap/a", 2), ("overlap/#", 3)] {
        let codes =
            subscribe_with_id(&mut sub, filter(f, QoS::AtLeastOnce, |_| {}), Some(id)).await;
        assert_eq!(codes, [v5::SubscribeReasonCode::Success(QoS::AtLeastOnce)]);
    }
    let mut publisher = Raw::connect(addr, "overlap-ids-pub").await;
    publish_complete(&mut publisher, "overlap/a", b"m", QoS::AtLeastOnce, false).await;
    let mut ids = Vec::new();
    for _ in 0..2 {
        let p = next_raw_publish(&mut sub).await;
        ack(&mut sub, &p).await;
        ids.push(
            p.properties
                .map(|p| p.subscription_identifiers)
                .unwrap_or_default(),
        );
    }
    ids.sort();
    assert_eq!(ids, [vec![2], vec![3]]);
    match sub.recv_within(Duration::from_millis(200)).await {
        Recv::Timeout => {}
        other => panic!("two copies, no more: {other:?}"),
    }
}

// ------------------------------------------------------------ packets with the CONNECT

/// Sends `bytes` on a new connection and returns the first byte of each of
/// the first `count` packets the broker answers (fewer if it sends no
/// more within 5 s).
async fn first_packets(addr: SocketAddr, bytes: &[u8], count: usize) -> Vec<u8> {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(bytes).await.unwrap();
    let mut buf = BytesMut::new();
    let mut kinds = Vec::new();
    while kinds.len() < count {
        // A whole packet at the front of `buf`: its first byte, then
        // the remaining length's bytes.
        let whole = (|| {
            let mut length = 0usize;
            for (i, &b) in buf.iter().enumerate().skip(1).take(4) {
                length |= usize::from(b & 0x7F) << (7 * (i - 1));
                if b & 0x80 == 0 {
                    return (buf.len() >= i + 1 + length).then_some(i + 1 + length);
                }
            }
            None
        })();
        if let Some(len) = whole {
            kinds.push(buf[0]);
            let _ = buf.split_to(len);
            continue;
        }
        match tokio::time::timeout(Duration::from_secs(5), stream.read_buf(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => {}
            _ => break,
        }
    }
    kinds
}

/// 3.1.4 (MQTT 5 and 3.1.1): a client may send packets right after its
/// CONNECT, without waiting for the CONNACK. Sent in one write with it, a
/// SUBSCRIBE, a PUBLISH to the filter and a PINGREQ are each answered
/// (they waited, unread, for the client's next packet before).
#[tokio::test]
async fn packets_sent_with_the_connect_are_answered() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    for level in [5u8, 4] {
        let id = format!("pipelined-{level}");
        let mut bytes = connect(level, 0x02, &[], &fields(&[id.as_bytes()]));
        let topic = format!("pipelined/{level}");
        let mut subscribe = vec![0, 1];
        let mut publish = s(topic.as_bytes());
        if level == 5 {
            subscribe.push(0); // no properties
            publish.push(0);
        }
        subscribe.extend(s(topic.as_bytes()));
        subscribe.push(0x00); // QoS 0
        publish.extend_from_slice(b"hello");
        bytes.extend(packet(0x82, &subscribe));
        bytes.extend(packet(0x30, &publish));
        bytes.extend(packet(0xC0, &[]));
        // The CONNACK first; the PINGRESP may pass the SUBACK (which the
        // router answers).
        let mut got = first_packets(addr, &bytes, 4).await;
        assert_eq!(got.first(), Some(&0x20), "level {level}: {got:02x?}");
        got[1..].sort_unstable();
        assert_eq!(
            got,
            [0x20, 0x30, 0x90, 0xD0],
            "level {level}: CONNACK, then the PUBLISH, SUBACK and PINGRESP"
        );
    }
}

// ------------------------------------------------------------ a PUBLISH, then DISCONNECT

/// A PUBLISH and the DISCONNECT after it, read by the broker at once (as
/// `mosquitto_pub -q 0` sends them, or with the CONNECT too): the message
/// is routed before the connection ends. MQTT 5 and 3.1.1, QoS 0 and 1.
/// (The DISCONNECT ended the connection before its PUBLISH went to the
/// router: every one was lost.)
#[tokio::test]
async fn a_publish_read_with_the_disconnect_after_it_is_delivered() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut sub = Raw::connect(addr, "goodbye-sub").await;
    sub.subscribe("goodbye/#", QoS::AtLeastOnce).await;
    for level in [5u8, 4] {
        for qos in [0u8, 1] {
            for with_connect in [false, true] {
                let id = format!("goodbye-{level}-{qos}-{with_connect}");
                let topic = format!("goodbye/{id}");
                let mut publish = s(topic.as_bytes());
                if qos > 0 {
                    publish.extend([0, 1]);
                }
                if level == 5 {
                    publish.push(0); // no properties
                }
                publish.extend_from_slice(id.as_bytes());
                let mut bytes = packet(0x30 | (qos << 1), &publish);
                bytes.extend(packet(0xE0, &[]));
                let connect = connect(level, 0x02, &[], &fields(&[id.as_bytes()]));
                let mut stream = TcpStream::connect(addr).await.unwrap();
                if with_connect {
                    stream.write_all(&[connect, bytes].concat()).await.unwrap();
                } else {
                    stream.write_all(&connect).await.unwrap();
                    let mut connack = [0u8; 2];
                    stream.read_exact(&mut connack).await.unwrap();
                    assert_eq!(connack[0], 0x20);
                    stream.write_all(&bytes).await.unwrap();
                }
                read_until_closed(&mut stream).await;
                // (`next_publish` fails the test if none comes in time.)
                let got = sub.next_publish().await;
                assert_eq!(&got.topic[..], topic.as_bytes(), "{id}");
                assert_eq!(&got.payload[..], id.as_bytes(), "{id}");
            }
        }
    }
}

/// The same as users do it: `mosquitto_pub` at QoS 0, 1 and 2, MQTT 3.1.1
/// and 5, each message reaching a subscriber.
#[tokio::test]
async fn mosquitto_pub_messages_reach_a_subscriber() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut sub = Raw::connect(addr, "mosquitto-sub").await;
    // At most QoS 1 to the subscriber (`Raw` acknowledges each).
    sub.subscribe("mosquitto/#", QoS::AtLeastOnce).await;
    for version in ["mqttv311", "mqttv5"] {
        for qos in ["0", "1", "2"] {
            let topic = format!("mosquitto/{version}/{qos}");
            let status = tokio::process::Command::new("mosquitto_pub")
                .args(["-h", "127.0.0.1", "-p", &addr.port().to_string()])
                .args(["-V", version, "-q", qos, "-t", &topic, "-m", "hello"])
                .status()
                .await
                .expect("mosquitto_pub runs (apt-get install mosquitto-clients)");
            assert!(status.success(), "{topic}");
            let got = sub.next_publish().await;
            assert_eq!(&got.topic[..], topic.as_bytes());
            assert_eq!(&got.payload[..], b"hello");
        }
    }
}

/// 3.8.3.1 [MQTT-3.8.3-4]: No Local on a shared subscription is a
/// Protocol Error (DISCONNECT 0x82); on a plain filter it is allowed.
#[tokio::test]
async fn no_local_on_a_shared_subscription_is_a_protocol_error() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let subscribe = |path: &[u8]| {
        let mut body = vec![0, 1, 0];
        body.extend(s(path));
        body.push(0x04); // No Local, QoS 0
        packet(0x82, &body)
    };
    let mut c = Raw::connect(addr, "no-local-plain").await;
    c.send_bytes(&subscribe(b"plain/x")).await;
    match c.recv().await {
        Recv::Packet(Packet::SubAck(ack)) => {
            assert_eq!(
                ack.return_codes,
                [v5::SubscribeReasonCode::Success(QoS::AtMostOnce)]
            )
        }
        other => panic!("no SUBACK: {other:?}"),
    }
    let mut c = Raw::connect(addr, "no-local-shared").await;
    c.send_bytes(&subscribe(b"$share/g/x")).await;
    let d = c.expect_disconnect().await;
    assert_eq!(
        disconnect_reason(&d),
        Some(DisconnectReasonCode::ProtocolError)
    );
}

// ------------------------------------------------------------ protocol errors (router patch 41)

/// An MQTT 5 property: `id`, then `value` as it goes on the wire.
fn property(id: u8, value: &[u8]) -> Vec<u8> {
    let mut out = vec![id];
    out.extend_from_slice(value);
    out
}

/// A string (or binary) property.
fn string_property(id: u8, value: &[u8]) -> Vec<u8> {
    property(id, &s(value))
}

/// `property` twice.
fn twice(property: &[u8]) -> Vec<u8> {
    [property, property].concat()
}

/// An MQTT 5 PUBLISH to `topic` with `byte0` (type and flags), packet id
/// `pkid` at QoS 1 and 2, `properties` and payload "x".
fn publish5(byte0: u8, topic: &[u8], pkid: u16, properties: &[u8]) -> Vec<u8> {
    let mut body = s(topic);
    if byte0 & 0b0110 != 0 {
        body.extend(pkid.to_be_bytes());
    }
    body.extend(varint(properties.len()));
    body.extend_from_slice(properties);
    body.push(b'x');
    packet(byte0, &body)
}

/// An MQTT 5 SUBSCRIBE, packet id `pkid`, with `properties` and `filters`
/// (each at QoS 1).
fn subscribe5(pkid: u16, properties: &[u8], filters: &[&[u8]]) -> Vec<u8> {
    let mut body = pkid.to_be_bytes().to_vec();
    body.extend(varint(properties.len()));
    body.extend_from_slice(properties);
    for filter in filters {
        body.extend(s(filter));
        body.push(1);
    }
    packet(0x82, &body)
}

/// On a new MQTT 5 connection: a QoS 1 PUBLISH that is acknowledged, then
/// `bytes`, which end the connection with DISCONNECT `code` and a Reason
/// String holding `says`.
async fn v5_ended_with(addr: SocketAddr, bytes: &[u8], code: DisconnectReasonCode, says: &str) {
    let mut c = Raw::connect(addr, "edge-protocol").await;
    c.send_bytes(&publish5(0x32, b"edge/ok", 9, &[])).await;
    match c.recv().await {
        Recv::Packet(Packet::PubAck(ack)) => assert_eq!(ack.pkid, 9, "{says}"),
        other => panic!("{says}: no PUBACK before: {other:?}"),
    }
    c.send_bytes(bytes).await;
    let d = c.expect_disconnect().await.expect("a DISCONNECT");
    assert_eq!(d.reason_code, code, "{says}");
    let reason = d
        .properties
        .and_then(|p| p.reason_string)
        .unwrap_or_default();
    assert!(reason.contains(says), "{says}: reason string {reason:?}");
}

/// MQTT 5 3.1.2.11 and 3.1.3.2: in a CONNECT, a property included twice,
/// Receive Maximum or Maximum Packet Size 0, Request Response or Problem
/// Information other than 0 or 1, and a will's Response Topic with a
/// wildcard ([MQTT-3.3.2-14]) are Protocol Errors: CONNACK 0x82, then
/// close (4.13). The same CONNECT with each property once is accepted.
#[tokio::test]
async fn connect_protocol_errors_are_refused_with_0x82() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let session_expiry = property(0x11, &10u32.to_be_bytes());
    let receive_maximum = property(0x21, &10u16.to_be_bytes());
    let problem = property(0x17, &[1]);
    let response = property(0x19, &[0]);
    let will_delay = property(0x18, &5u32.to_be_bytes());
    let content_type = string_property(0x03, b"text/plain");
    let will = |will_properties: &[u8]| {
        let mut payload = s(b"edge-will");
        payload.extend(varint(will_properties.len()));
        payload.extend_from_slice(will_properties);
        payload.extend(fields(&[b"will/topic", b"bye"]));
        payload
    };
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            connect(5, 0x02, &property(0x21, &[0, 0]), &fields(&[b"c"])),
            "Receive Maximum 0",
        ),
        (
            connect(5, 0x02, &property(0x27, &[0, 0, 0, 0]), &fields(&[b"c"])),
            "Maximum Packet Size 0",
        ),
        (
            connect(5, 0x02, &twice(&session_expiry), &fields(&[b"c"])),
            "Session Expiry Interval twice",
        ),
        (
            connect(5, 0x02, &twice(&receive_maximum), &fields(&[b"c"])),
            "Receive Maximum twice",
        ),
        (
            connect(5, 0x02, &twice(&problem), &fields(&[b"c"])),
            "Request Problem Information twice",
        ),
        (
            connect(5, 0x02, &property(0x17, &[2]), &fields(&[b"c"])),
            "Request Problem Information 2",
        ),
        (
            connect(5, 0x02, &property(0x19, &[2]), &fields(&[b"c"])),
            "Request Response Information 2",
        ),
        (
            connect(5, 0x06, &[], &will(&twice(&will_delay))),
            "Will Delay Interval twice",
        ),
        (
            connect(5, 0x06, &[], &will(&twice(&content_type))),
            "will Content Type twice",
        ),
        (
            connect(5, 0x06, &[], &will(&string_property(0x08, b"replies/#"))),
            "will Response Topic with a wildcard",
        ),
    ];
    for (bytes, what) in &cases {
        assert_eq!(answer(addr, bytes).await, refusal(0x82), "{what}");
    }
    // Each once, a will with its properties once: connected.
    let all = [
        session_expiry,
        receive_maximum,
        problem,
        response,
        property(0x27, &1000u32.to_be_bytes()),
    ]
    .concat();
    let will_properties = [
        will_delay,
        content_type,
        string_property(0x08, b"replies/x"),
    ]
    .concat();
    let got = answer_first(addr, &connect(5, 0x06, &all, &will(&will_properties))).await;
    assert_eq!((got[0], got[3]), (0x20, 0x00), "{got:02x?}");
}

/// MQTT 5 3.3.2.3: a PUBLISH with a property that may appear once twice, a
/// Response Topic with a wildcard ([MQTT-3.3.2-14]) or a Subscription
/// Identifier ([MQTT-3.3.4-6]) is a Protocol Error: DISCONNECT 0x82 with a
/// Reason String that says which (the last one's said "router: " and came
/// with 0x81).
#[tokio::test]
async fn publish_protocol_errors_end_the_connection_with_0x82() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    for (properties, says) in [
        (twice(&property(0x01, &[1])), "Payload Format Indicator"),
        (
            twice(&property(0x02, &60u32.to_be_bytes())),
            "Message Expiry Interval",
        ),
        (twice(&property(0x23, &[0, 1])), "Topic Alias"),
        (twice(&string_property(0x08, b"r/1")), "Response Topic"),
        (twice(&string_property(0x09, b"c")), "Correlation Data"),
        (twice(&string_property(0x03, b"text/plain")), "Content Type"),
        (string_property(0x08, b"replies/#"), "wildcard"),
        (string_property(0x08, b"replies/+/x"), "wildcard"),
        (property(0x0B, &[3]), "Subscription Identifier"),
    ] {
        let bytes = publish5(0x32, b"edge/bad", 10, &properties);
        v5_ended_with(addr, &bytes, DisconnectReasonCode::ProtocolError, says).await;
    }
    // Every one of them once, and a Response Topic without a wildcard: acknowledged.
    let mut c = Raw::connect(addr, "edge-props-once").await;
    let once = [
        property(0x01, &[1]),
        property(0x02, &60u32.to_be_bytes()),
        string_property(0x08, b"replies/x"),
        string_property(0x09, b"c"),
        string_property(0x03, b"text/plain"),
    ]
    .concat();
    c.send_bytes(&publish5(0x32, b"edge/once", 11, &once)).await;
    match c.recv().await {
        Recv::Packet(Packet::PubAck(ack)) => {
            assert_eq!((ack.pkid, ack.reason), (11, v5::PubAckReason::Success))
        }
        other => panic!("no PUBACK: {other:?}"),
    }
}

/// [MQTT-3.3.1-2]: DUP is 0 in a QoS 0 PUBLISH; DUP 1 makes it a Malformed
/// Packet (DISCONNECT 0x81). DUP 1 at QoS 1 is a resend, acknowledged.
#[tokio::test]
async fn a_qos_0_publish_with_dup_is_malformed() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let mut c = Raw::connect(addr, "edge-dup").await;
    c.send_bytes(&publish5(0x3A, b"edge/dup", 12, &[])).await;
    match c.recv().await {
        Recv::Packet(Packet::PubAck(ack)) => assert_eq!(ack.pkid, 12),
        other => panic!("no PUBACK: {other:?}"),
    }
    let bytes = publish5(0x38, b"edge/dup", 0, &[]);
    v5_ended_with(addr, &bytes, DisconnectReasonCode::MalformedPacket, "DUP").await;
    // 3.1.1 has the same rule: closed.
    let v4 = packet(0x38, &[s(b"edge/dup"), b"x".to_vec()].concat());
    v4_closes_on(addr, &v4, "3.1.1 QoS 0 with DUP").await;
}

/// MQTT 5 3.8.2.1.2: a Subscription Identifier twice, or of 0, in a
/// SUBSCRIBE is a Protocol Error (DISCONNECT 0x82; 0 was told with the
/// Reason String "router: "); one of 1 is granted.
#[tokio::test]
async fn subscription_identifier_twice_or_0_is_a_protocol_error() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let twice = subscribe5(1, &[0x0B, 1, 0x0B, 2], &[b"edge/sub"]);
    let says = "Subscription Identifier";
    v5_ended_with(addr, &twice, DisconnectReasonCode::ProtocolError, says).await;
    let zero = subscribe5(1, &[0x0B, 0], &[b"edge/sub"]);
    v5_ended_with(addr, &zero, DisconnectReasonCode::ProtocolError, says).await;
    let mut c = Raw::connect(addr, "edge-sub-id").await;
    c.send_bytes(&subscribe5(4, &[0x0B, 1], &[b"edge/sub"]))
        .await;
    match c.recv().await {
        Recv::Packet(Packet::SubAck(ack)) => assert_eq!(
            (ack.pkid, ack.return_codes),
            (4, vec![v5::SubscribeReasonCode::Success(QoS::AtLeastOnce)])
        ),
        other => panic!("no SUBACK: {other:?}"),
    }
}

/// [MQTT-4.8.2-1], [MQTT-4.8.2-2]: a shared subscription's Share Name is
/// at least one character, without `+` or `#`, followed by `/` and a Topic
/// Filter: otherwise SUBACK 0x8F Topic Filter invalid for that filter
/// (3.1.1: 0x80), the others of the SUBSCRIBE granted.
#[tokio::test]
async fn invalid_share_names_and_empty_shared_filters_are_refused() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let filters: [&[u8]; 6] = [
        b"$share//a",
        b"$share/g/",
        b"$share/+/a",
        b"$share/g+/a",
        b"edge/plain",
        b"$share/g/edge",
    ];
    let mut c = Raw::connect(addr, "edge-share").await;
    c.send_bytes(&subscribe5(5, &[], &filters)).await;
    let invalid = v5::SubscribeReasonCode::TopicFilterInvalid;
    let granted = v5::SubscribeReasonCode::Success(QoS::AtLeastOnce);
    match c.recv().await {
        Recv::Packet(Packet::SubAck(ack)) => assert_eq!(
            ack.return_codes,
            [invalid, invalid, invalid, invalid, granted, granted]
        ),
        other => panic!("no SUBACK: {other:?}"),
    }
    // 3.1.1: SUBSCRIBE id 6, the same filters at QoS 1.
    let mut stream = connected_v4(addr, "edge-share-v4").await;
    let mut body = vec![0, 6];
    for filter in filters {
        body.extend(s(filter));
        body.push(1);
    }
    stream.write_all(&packet(0x82, &body)).await.unwrap();
    let mut suback = [0u8; 10];
    stream.read_exact(&mut suback).await.unwrap();
    assert_eq!(suback, [0x90, 8, 0, 6, 0x80, 0x80, 0x80, 0x80, 1, 1]);
}

/// The other packets a client sends: a property that may appear once,
/// twice, is a Protocol Error too (DISCONNECT 0x82): a Reason String in
/// PUBACK, PUBREC, PUBREL, PUBCOMP (3.4.2.2.2 ...), and Session Expiry
/// Interval in DISCONNECT (3.14.2.2.2).
#[tokio::test]
async fn acknowledgements_and_disconnect_with_a_property_twice() {
    let broker = start_broker().await;
    let addr = broker.local_addr();
    let reason = twice(&string_property(0x1F, b"why"));
    for byte0 in [0x40, 0x50, 0x62, 0x70] {
        let mut body = vec![0, 1, 0];
        body.extend(varint(reason.len()));
        body.extend_from_slice(&reason);
        let bytes = packet(byte0, &body);
        v5_ended_with(
            addr,
            &bytes,
            DisconnectReasonCode::ProtocolError,
            "Reason String",
        )
        .await;
    }
    let expiry = twice(&property(0x11, &0u32.to_be_bytes()));
    let mut body = vec![0];
    body.extend(varint(expiry.len()));
    body.extend_from_slice(&expiry);
    let says = "Session Expiry Interval";
    v5_ended_with(
        addr,
        &packet(0xE0, &body),
        DisconnectReasonCode::ProtocolError,
        says,
    )
    .await;
}
