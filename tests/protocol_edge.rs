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
use common::raw::{Raw, Recv, disconnect_reason, v5};
use common::start_broker;
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
