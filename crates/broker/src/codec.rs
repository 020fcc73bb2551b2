//! MQTT framing on one socket: which protocol a client speaks, and safe use
//! of rumqttd's codecs.
//!
//! One port serves MQTT 3.1.1 and MQTT 5: the protocol level in the CONNECT
//! packet (4 or 5) picks the codec, as mosquitto does.
//!
//! rumqttd's decoders are used as they are, with guards around the inputs
//! that would make them panic: packet types a client never sends (CONNACK,
//! SUBACK, UNSUBACK, PINGRESP) are refused before decoding (the v5 decoder
//! hits `unreachable!()` on some of them), and packets with MQTT 5 properties
//! are stripped before the 3.1.1 encoder sees them (it panics on properties).
//! A decoder panic that fuzzing has not found yet is still caught and turned
//! into a malformed-packet disconnect, never a crash of the broker.

use std::panic::{AssertUnwindSafe, catch_unwind};

use bytes::BytesMut;
use router::protocol::{Packet, Protocol as _, v4::V4, v5::V5};

/// The MQTT version a connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// MQTT 3.1.1 (protocol level 4).
    V4,
    /// MQTT 5 (protocol level 5).
    V5,
}

/// Why bytes from a client could not be turned into a packet.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// The packet is larger than the configured maximum.
    #[error("packet of {0} bytes is larger than the maximum")]
    TooLarge(usize),
    /// The bytes do not form a valid packet.
    #[error("malformed packet: {0}")]
    Malformed(String),
    /// A packet a client may not send.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The first packet is a CONNECT of a protocol level we do not serve.
    #[error("unsupported protocol level {0}")]
    UnsupportedLevel(u8),
}

/// A decoded packet and what rumqttd keeps private about it.
#[derive(Debug)]
pub struct Incoming {
    /// The packet.
    pub packet: Packet,
    /// For PUBLISH: the QoS from the fixed header.
    pub qos: u8,
    /// For PUBLISH at QoS 1 or 2: the packet identifier.
    pub pkid: u16,
    /// For PUBLISH: the DUP flag (a resend of an unacknowledged PUBLISH).
    pub dup: bool,
}

impl Incoming {
    /// A PUBACK of `pkid` without reason code or properties (see
    /// [`puback_at`]).
    pub fn puback(pkid: u16) -> Incoming {
        Incoming {
            packet: Packet::PubAck(
                router::protocol::PubAck {
                    pkid,
                    reason: router::protocol::PubAckReason::Success,
                },
                None,
            ),
            qos: 0,
            pkid: 0,
            dup: false,
        }
    }
}

/// The packet id of the PUBACK without reason code or properties at the
/// start of `buf` (3.1.1 and 5 alike; 4 bytes), if it starts with one:
/// the packet a state store client sends most after its requests (it
/// acknowledges each answer), read as the decoder reads it without the
/// decoder's round (~340 instructions). The connection looks for it
/// before it decodes (`Socket::next_puback`); [`Protocol::read`] leaves
/// it to the decoder.
pub fn puback_at(buf: &[u8], max_packet_size: usize) -> Option<u16> {
    match buf {
        [0x40, 0x02, high, low, ..] if max_packet_size >= 2 => {
            Some(u16::from_be_bytes([*high, *low]))
        }
        _ => None,
    }
}

/// The size of the next frame in `buf`: `Ok(None)` if more bytes are needed.
fn frame(buf: &[u8], max_packet_size: usize) -> Result<Option<(usize, usize)>, CodecError> {
    let mut remaining: usize = 0;
    for i in 0..4 {
        let Some(&byte) = buf.get(1 + i) else {
            return Ok(None);
        };
        remaining |= usize::from(byte & 0x7F) << (7 * i);
        if byte & 0x80 == 0 {
            if remaining > max_packet_size {
                return Err(CodecError::TooLarge(remaining));
            }
            let header_len = 2 + i;
            let total = header_len + remaining;
            return Ok((buf.len() >= total).then_some((header_len, total)));
        }
    }
    Err(CodecError::Malformed(
        "remaining length longer than 4 bytes".into(),
    ))
}

/// QoS and packet id of an encoded PUBLISH frame (`header_len`: the length
/// of its fixed header). rumqttd keeps both private in its `Publish`.
fn publish_qos_and_id(frame: &[u8], header_len: usize) -> Result<(u8, u16), CodecError> {
    let qos = (frame[0] >> 1) & 3;
    if qos == 3 {
        return Err(CodecError::Malformed("PUBLISH with QoS 3".into()));
    }
    if qos == 0 {
        return Ok((0, 0));
    }
    let body = &frame[header_len..];
    let topic_len = body
        .get(..2)
        .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])));
    let pkid = match topic_len.and_then(|t| body.get(2 + t..4 + t)) {
        Some(b) => u16::from_be_bytes([b[0], b[1]]),
        None => return Err(CodecError::Malformed("PUBLISH without packet id".into())),
    };
    if pkid == 0 {
        return Err(CodecError::Malformed("PUBLISH with packet id 0".into()));
    }
    Ok((qos, pkid))
}

/// Where the Message Expiry Interval of an MQTT 5 PUBLISH encoded at the
/// start of `encoded` (QoS 1 or 2, as the router's encoder writes its
/// properties: Payload Format Indicator first, then Message Expiry) is,
/// and its value: the offset of its four bytes. `None` without one.
pub fn encoded_message_expiry(encoded: &[u8]) -> Option<(usize, u32)> {
    let (header_len, total) = frame(encoded, usize::MAX).ok()??;
    let frame = &encoded[..total];
    let topic_len = usize::from(u16::from_be_bytes(
        frame.get(header_len..header_len + 2)?.try_into().ok()?,
    ));
    // Topic, packet id, then the properties' length (a varint).
    let mut at = header_len + 2 + topic_len + 2;
    loop {
        let byte = *frame.get(at)?;
        at += 1;
        if byte & 0x80 == 0 {
            break;
        }
    }
    if frame.get(at) == Some(&0x01) {
        at += 2;
    }
    if frame.get(at) != Some(&0x02) {
        return None;
    }
    let value = u32::from_be_bytes(frame.get(at + 1..at + 5)?.try_into().ok()?);
    Some((at + 1, value))
}

/// QoS and packet id of the PUBLISH encoded at the start of `encoded`.
pub fn encoded_publish_id(encoded: &[u8]) -> Option<(u8, u16)> {
    let (header_len, total) = frame(encoded, usize::MAX).ok()??;
    publish_qos_and_id(&encoded[..total], header_len).ok()
}

/// Tells the protocol from the first bytes of a connection (a CONNECT).
/// `Ok(None)`: not enough bytes yet.
pub fn detect(buf: &[u8], max_packet_size: usize) -> Result<Option<Protocol>, CodecError> {
    let Some((header_len, _)) = frame(buf, max_packet_size)? else {
        return Ok(None);
    };
    if buf[0] != 0x10 {
        return Err(CodecError::Protocol(
            "the first packet must be CONNECT".into(),
        ));
    }
    let body = &buf[header_len..];
    let name_len = match body.get(..2) {
        Some(b) => usize::from(u16::from_be_bytes([b[0], b[1]])),
        None => return Err(CodecError::Malformed("CONNECT too short".into())),
    };
    let name = body.get(2..2 + name_len);
    let level = body.get(2 + name_len).copied();
    match (name, level) {
        (Some(b"MQTT"), Some(4)) => Ok(Some(Protocol::V4)),
        (Some(b"MQTT"), Some(5)) => Ok(Some(Protocol::V5)),
        (Some(_), Some(level)) => Err(CodecError::UnsupportedLevel(level)),
        _ => Err(CodecError::Malformed(
            "CONNECT without protocol level".into(),
        )),
    }
}

/// What the broker checks in the raw bytes of a frame before decoding it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameInfo {
    /// Length of the whole frame.
    pub len: usize,
    /// For PUBLISH: the QoS from the fixed header.
    pub qos: u8,
    /// For PUBLISH at QoS 1 or 2: the packet identifier.
    pub pkid: u16,
    /// For PUBLISH: the DUP flag.
    pub dup: bool,
}

/// Checks the next frame in `buf` before decoding: its size, that a client
/// may send its packet type, and for PUBLISH the QoS and packet id (which
/// rumqttd keeps private). `Ok(None)`: more bytes are needed.
pub fn inspect(buf: &[u8], max_packet_size: usize) -> Result<Option<FrameInfo>, CodecError> {
    let Some((header_len, total)) = frame(buf, max_packet_size)? else {
        return Ok(None);
    };
    let (mut qos, mut pkid, mut dup) = (0, 0, false);
    match buf[0] >> 4 {
        3 => {
            (qos, pkid) = publish_qos_and_id(&buf[..total], header_len)?;
            dup = buf[0] & 0b1000 != 0;
        }
        1 | 4 | 5 | 6 | 7 | 8 | 10 | 12 | 14 => {}
        15 => return Err(CodecError::Protocol("AUTH is not supported".into())),
        other => {
            return Err(CodecError::Protocol(format!(
                "a client may not send packet type {other}"
            )));
        }
    }
    Ok(Some(FrameInfo {
        len: total,
        qos,
        pkid,
        dup,
    }))
}

impl Protocol {
    /// "MQTT 5" or "MQTT 3.1.1", as people write it.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::V5 => "MQTT 5",
            Protocol::V4 => "MQTT 3.1.1",
        }
    }

    /// Decodes the next packet from `buf`, consuming its bytes.
    /// `Ok(None)`: not enough bytes yet.
    pub fn read(
        self,
        buf: &mut BytesMut,
        max_packet_size: usize,
    ) -> Result<Option<Incoming>, CodecError> {
        let Some(info) = inspect(buf, max_packet_size)? else {
            return Ok(None);
        };
        let decoded = catch_unwind(AssertUnwindSafe(|| self.decode(buf, max_packet_size)));
        match decoded {
            Ok(Ok(packet)) => Ok(Some(Incoming {
                packet,
                qos: info.qos,
                pkid: info.pkid,
                dup: info.dup,
            })),
            // What the decoder read but MQTT 5 does not allow (a property
            // twice, Receive Maximum 0, ...) is a Protocol Error (0x82),
            // the rest a Malformed Packet (0x81).
            Ok(Err(e)) if e.is_protocol_error() => Err(CodecError::Protocol(e.to_string())),
            Ok(Err(e)) => Err(CodecError::Malformed(e.to_string())),
            Err(_) => Err(CodecError::Malformed("decoder failure".into())),
        }
    }

    /// rumqttd's decoder, unguarded: call [`inspect`] first. Public for the
    /// fuzz target, which must see a decoder panic rather than its catch.
    pub fn decode(
        self,
        buf: &mut BytesMut,
        max_packet_size: usize,
    ) -> Result<Packet, router::protocol::Error> {
        match self {
            Protocol::V4 => V4.read_mut(buf, max_packet_size),
            Protocol::V5 => V5.read_mut(buf, max_packet_size),
        }
    }

    /// Encodes `packet` for this protocol. Packets 3.1.1 has no form for
    /// (DISCONNECT from a server) are skipped; MQTT 5 properties are dropped
    /// for 3.1.1 clients.
    pub fn write(self, packet: Packet, out: &mut BytesMut) -> Result<(), CodecError> {
        let result = match self {
            Protocol::V5 => V5.write(packet, out),
            Protocol::V4 => match strip_properties(packet) {
                Some(packet) => V4.write(packet, out),
                None => return Ok(()),
            },
        };
        result
            .map(|_| ())
            .map_err(|e| CodecError::Malformed(format!("cannot encode: {e:?}")))
    }
}

/// What a client may not send in a packet the decoder reads as well from
/// a server: a Subscription Identifier in a PUBLISH ([MQTT-3.3.4-6], a
/// Protocol Error; the decoder reads the broker's own deliveries too,
/// which carry them).
pub fn check_from_client(packet: &Packet) -> Result<(), CodecError> {
    let Packet::Publish(publish, properties) = packet else {
        return Ok(());
    };
    if publish.dup && publish.qos == router::protocol::QoS::AtMostOnce {
        // 3.1.1 too ([MQTT-3.3.1-2] of both).
        return Err(CodecError::Malformed(
            "PUBLISH of QoS 0 with DUP 1 [MQTT-3.3.1-2]".into(),
        ));
    }
    let Some(p) = properties else {
        return Ok(());
    };
    if !p.subscription_identifiers.is_empty() {
        return Err(CodecError::Protocol(
            "Subscription Identifier in a PUBLISH from a client [MQTT-3.3.4-6]".into(),
        ));
    }
    if p.response_topic
        .as_deref()
        .is_some_and(|topic| !router::protocol::valid_topic(topic))
    {
        // Named by no reason code; read fine, it holds what is not
        // allowed: a Protocol Error (1.2).
        return Err(CodecError::Protocol(
            "Response Topic with a wildcard [MQTT-3.3.2-14]".into(),
        ));
    }
    Ok(())
}

/// A PUBLISH with the given QoS and packet id. rumqttd keeps both fields of
/// its `Publish` private; its documented byte form (`Publish::deserialize`)
/// is the way to set them.
pub fn publish(
    topic: &[u8],
    payload: &[u8],
    qos: u8,
    pkid: u16,
    retain: bool,
) -> router::protocol::Publish {
    use bytes::BufMut;
    let mut raw = BytesMut::with_capacity(5 + topic.len() + payload.len());
    raw.put_u8(0b0011_0000 | ((qos & 3) << 1) | u8::from(retain));
    raw.put_u16(pkid);
    raw.put_u16(topic.len() as u16);
    raw.put_slice(topic);
    raw.put_slice(payload);
    router::protocol::Publish::deserialize(raw.freeze())
}

/// The MQTT 5 properties of a PUBLISH the broker encodes itself
/// ([`encode_publish`]): a publish's own, or a direct delivery's (see
/// `sessions::DirectProperties`).
pub trait EncodeProperties {
    /// Their encoded length, without the length field in front.
    fn encoded_len(&self) -> usize;
    /// Writes them, without the length field.
    fn put(&self, out: &mut BytesMut);
}

impl EncodeProperties for router::protocol::PublishProperties {
    fn encoded_len(&self) -> usize {
        let p = self;
        p.payload_format_indicator.map_or(0, |_| 2)
            + p.message_expiry_interval.map_or(0, |_| 5)
            + p.content_type.as_ref().map_or(0, |s| string_len(s.len()))
            + p.response_topic.as_ref().map_or(0, |s| string_len(s.len()))
            + p.correlation_data
                .as_ref()
                .map_or(0, |s| string_len(s.len()))
            + subscription_identifiers_len(&p.subscription_identifiers)
            + p.user_properties
                .iter()
                .map(|(k, v)| user_property_len(k, v))
                .sum::<usize>()
    }

    fn put(&self, out: &mut BytesMut) {
        use bytes::BufMut;
        let p = self;
        if let Some(v) = p.payload_format_indicator {
            out.put_u8(0x01);
            out.put_u8(v);
        }
        if let Some(v) = p.message_expiry_interval {
            out.put_u8(0x02);
            out.put_u32(v);
        }
        if let Some(v) = &p.content_type {
            put_property_string(out, 0x03, v.as_bytes());
        }
        if let Some(v) = &p.response_topic {
            put_property_string(out, 0x08, v.as_bytes());
        }
        if let Some(v) = &p.correlation_data {
            put_property_string(out, 0x09, v);
        }
        put_subscription_identifiers(out, &p.subscription_identifiers);
        for (k, v) in &p.user_properties {
            put_user_property(out, k, v);
        }
    }
}

/// Encodes a PUBLISH straight from borrowed parts (no intermediate packet,
/// no copies of the properties): the broker's own deliveries go this way.
pub fn encode_publish(
    protocol: Protocol,
    topic: &[u8],
    payload: &[u8],
    qos: u8,
    pkid: u16,
    properties: &impl EncodeProperties,
    out: &mut BytesMut,
) {
    use bytes::BufMut;
    let props_len = match protocol {
        Protocol::V4 => 0,
        Protocol::V5 => properties.encoded_len(),
    };
    let mut remaining = 2 + topic.len() + payload.len();
    if qos > 0 {
        remaining += 2;
    }
    if protocol == Protocol::V5 {
        remaining += varint_len(props_len) + props_len;
    }
    out.reserve(5 + remaining);
    out.put_u8(0b0011_0000 | ((qos & 3) << 1));
    put_varint(out, remaining);
    out.put_u16(topic.len() as u16);
    out.put_slice(topic);
    if qos > 0 {
        out.put_u16(pkid);
    }
    if protocol == Protocol::V5 {
        put_varint(out, props_len);
        properties.put(out);
    }
    out.put_slice(payload);
}

/// The encoded length of a string property of `len` bytes.
pub(crate) fn string_len(len: usize) -> usize {
    1 + 2 + len
}

/// The encoded length of a User Property.
pub(crate) fn user_property_len(k: &str, v: &str) -> usize {
    1 + 2 + k.len() + 2 + v.len()
}

/// The encoded length of Subscription Identifiers.
pub(crate) fn subscription_identifiers_len(ids: &[usize]) -> usize {
    ids.iter().map(|id| 1 + varint_len(*id)).sum()
}

/// Writes property `id` with a string (or binary) value.
pub(crate) fn put_property_string(out: &mut BytesMut, id: u8, s: &[u8]) {
    // The identifier and the length in one write (each write of a few
    // bytes is a call).
    let [hi, lo] = (s.len() as u16).to_be_bytes();
    out.extend_from_slice(&[id, hi, lo]);
    out.extend_from_slice(s);
}

/// Writes a User Property.
pub(crate) fn put_user_property(out: &mut BytesMut, k: &str, v: &str) {
    put_property_string(out, 0x26, k.as_bytes());
    put_string(out, v.as_bytes());
}

/// Writes Subscription Identifiers.
pub(crate) fn put_subscription_identifiers(out: &mut BytesMut, ids: &[usize]) {
    use bytes::BufMut;
    for id in ids {
        out.put_u8(0x0B);
        put_varint(out, *id);
    }
}

fn varint_len(mut n: usize) -> usize {
    let mut len = 1;
    while n >= 128 {
        n /= 128;
        len += 1;
    }
    len
}

fn put_varint(out: &mut BytesMut, mut n: usize) {
    use bytes::BufMut;
    loop {
        let mut byte = (n % 128) as u8;
        n /= 128;
        if n > 0 {
            byte |= 0x80;
        }
        out.put_u8(byte);
        if n == 0 {
            break;
        }
    }
}

fn put_string(out: &mut BytesMut, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s);
}

/// The 3.1.1 form of a packet: no properties; `None` if it has none.
fn strip_properties(packet: Packet) -> Option<Packet> {
    Some(match packet {
        Packet::Publish(p, _) => Packet::Publish(p, None),
        Packet::PubAck(p, _) => Packet::PubAck(p, None),
        Packet::PubRec(p, _) => Packet::PubRec(p, None),
        Packet::PubRel(p, _) => Packet::PubRel(p, None),
        Packet::PubComp(p, _) => Packet::PubComp(p, None),
        Packet::SubAck(p, _) => Packet::SubAck(p, None),
        Packet::UnsubAck(p, _) => Packet::UnsubAck(p, None),
        Packet::ConnAck(p, _) => Packet::ConnAck(p, None),
        Packet::Subscribe(p, _) => Packet::Subscribe(p, None),
        Packet::Unsubscribe(p, _) => Packet::Unsubscribe(p, None),
        Packet::Connect(c, _, will, _, login) => Packet::Connect(c, None, will, None, login),
        Packet::Disconnect(..) => return None,
        p @ (Packet::PingReq(_) | Packet::PingResp(_)) => p,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connect(level: u8) -> Vec<u8> {
        // CONNECT, "MQTT", level, flags (clean), keep alive 60, [props], client id "a"
        let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', level, 0x02, 0, 60];
        if level == 5 {
            body.push(0);
        }
        body.extend_from_slice(&[0, 1, b'a']);
        let mut packet = vec![0x10, body.len() as u8];
        packet.extend(body);
        packet
    }

    #[test]
    fn a_plain_puback_reads_as_the_decoder_reads_it() {
        for protocol in [Protocol::V4, Protocol::V5] {
            for pkid in [0u16, 1, 0x00ff, 0x8000, u16::MAX] {
                let [high, low] = pkid.to_be_bytes();
                // Followed by the start of another packet.
                let bytes = [0x40, 0x02, high, low, 0x30];
                let read = Incoming::puback(puback_at(&bytes, 1 << 20).unwrap());
                let mut slow = BytesMut::from(&bytes[..]);
                let decoded = protocol.decode(&mut slow, 1 << 20).unwrap();
                assert_eq!(read.packet, decoded, "{protocol:?} {pkid}");
                assert_eq!((read.qos, read.pkid, read.dup), (0, 0, false));
                assert_eq!(&bytes[4..], &slow[..], "the same bytes left");
            }
            // Not whole yet, or with a reason code: the decoder's.
            let mut short = BytesMut::from(&[0x40, 0x02, 0x00][..]);
            assert_eq!(puback_at(&short, 1 << 20), None);
            assert!(protocol.read(&mut short, 1 << 20).unwrap().is_none());
            assert_eq!(short.len(), 3);
        }
        assert_eq!(puback_at(&[0x40, 0x03, 0x00, 0x07, 0x10], 1 << 20), None);
        let mut with_reason = BytesMut::from(&[0x40, 0x03, 0x00, 0x07, 0x10][..]);
        let read = Protocol::V5
            .read(&mut with_reason, 1 << 20)
            .unwrap()
            .unwrap();
        assert!(matches!(
            read.packet,
            Packet::PubAck(
                router::protocol::PubAck {
                    pkid: 7,
                    reason: router::protocol::PubAckReason::NoMatchingSubscribers
                },
                _
            )
        ));
    }

    #[test]
    fn detects_protocol_level() {
        assert_eq!(detect(&connect(4), 1024), Ok(Some(Protocol::V4)));
        assert_eq!(detect(&connect(5), 1024), Ok(Some(Protocol::V5)));
        assert_eq!(
            detect(&connect(3), 1024),
            Err(CodecError::UnsupportedLevel(3))
        );
        assert_eq!(detect(&connect(5)[..5], 1024), Ok(None));
        assert!(detect(&[0x30, 0x00], 1024).is_err());
        assert!(matches!(
            detect(&[0x10, 0xFF, 0xFF, 0xFF, 0x7F], 1024),
            Err(CodecError::TooLarge(_))
        ));
        assert!(matches!(
            detect(&[0x10, 0xFF, 0xFF, 0xFF, 0xFF, 0x01], usize::MAX),
            Err(CodecError::Malformed(_))
        ));
    }

    #[test]
    fn reads_connect() {
        for (level, protocol) in [(4, Protocol::V4), (5, Protocol::V5)] {
            let mut buf = BytesMut::from(&connect(level)[..]);
            let incoming = protocol.read(&mut buf, 1024).unwrap().unwrap();
            assert!(matches!(incoming.packet, Packet::Connect(..)));
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn refuses_server_only_packets_without_decoding() {
        // CONNACK, SUBACK, UNSUBACK, PINGRESP from a client; the v5 decoder
        // would reach `unreachable!()` on some of these.
        for bytes in [
            &[0x20u8, 0x03, 0, 0, 0][..],
            &[0x90, 3, 0, 1, 0],
            &[0xB0, 3, 0, 1, 0],
            &[0xD0, 0],
        ] {
            for protocol in [Protocol::V4, Protocol::V5] {
                let mut buf = BytesMut::from(bytes);
                assert!(
                    matches!(protocol.read(&mut buf, 1024), Err(CodecError::Protocol(_))),
                    "{bytes:?}"
                );
            }
        }
    }

    #[test]
    fn publish_qos_and_packet_id_from_the_raw_header() {
        // QoS 1 PUBLISH "t" pkid 7, v5 with empty properties, payload "x"
        let mut buf = BytesMut::from(&[0x32, 7, 0, 1, b't', 0, 7, 0, b'x'][..]);
        let incoming = Protocol::V5.read(&mut buf, 1024).unwrap().unwrap();
        assert_eq!((incoming.qos, incoming.pkid), (1, 7));
        let mut buf = BytesMut::from(&[0x36, 7, 0, 1, b't', 0, 7, 0, b'x'][..]);
        assert!(Protocol::V5.read(&mut buf, 1024).is_err(), "QoS 3");
        let mut buf = BytesMut::from(&[0x32, 3, 0, 1, b't'][..]);
        assert!(Protocol::V5.read(&mut buf, 1024).is_err(), "no packet id");
    }

    #[test]
    fn publish_with_qos_and_packet_id() {
        let p = publish(b"topic", b"payload", 1, 4242, false);
        let mut buf = BytesMut::new();
        Protocol::V5
            .write(Packet::Publish(p, None), &mut buf)
            .unwrap();
        assert_eq!(encoded_publish_id(&buf), Some((1, 4242)));
        let incoming = Protocol::V5.read(&mut buf, 1024).unwrap().unwrap();
        match incoming.packet {
            Packet::Publish(p, _) => assert_eq!(
                (&p.topic[..], &p.payload[..]),
                (&b"topic"[..], &b"payload"[..])
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn own_publish_encoding_matches_rumqttds_decoder() {
        use bytes::Bytes;
        use router::protocol::PublishProperties;
        let properties = PublishProperties {
            payload_format_indicator: Some(1),
            message_expiry_interval: Some(60),
            content_type: Some("application/octet-stream".into()),
            response_topic: Some("reply/here".into()),
            correlation_data: Some(Bytes::from_static(b"\x00\x01corr")),
            subscription_identifiers: vec![7, 300, 70_000],
            user_properties: vec![
                ("__stat".into(), "200".into()),
                ("__ts".into(), "1:2:n".into()),
            ],
            ..PublishProperties::default()
        };
        let big = vec![b'x'; 20_000];
        for (qos, pkid, payload) in [
            (0u8, 0u16, &b"p"[..]),
            (1, 4242, &b""[..]),
            (1, 65535, &big[..]),
        ] {
            let mut buf = BytesMut::new();
            encode_publish(
                Protocol::V5,
                b"a/topic",
                payload,
                qos,
                pkid,
                &properties,
                &mut buf,
            );
            assert_eq!(encoded_publish_id(&buf), Some((qos, pkid)));
            match Protocol::V5
                .read(&mut buf, 1 << 20)
                .unwrap()
                .unwrap()
                .packet
            {
                Packet::Publish(p, Some(props)) => {
                    assert_eq!((&p.topic[..], &p.payload[..]), (&b"a/topic"[..], payload));
                    assert_eq!(props, properties);
                }
                other => panic!("{other:?}"),
            }
            assert!(buf.is_empty(), "exactly one packet");
            let mut buf = BytesMut::new();
            encode_publish(
                Protocol::V4,
                b"a/topic",
                payload,
                qos,
                pkid,
                &properties,
                &mut buf,
            );
            match Protocol::V4
                .read(&mut buf, 1 << 20)
                .unwrap()
                .unwrap()
                .packet
            {
                Packet::Publish(p, None) => assert_eq!(&p.payload[..], payload),
                other => panic!("{other:?}"),
            }
        }
    }

    /// What the decoder reads but MQTT 5 does not allow is a Protocol
    /// Error (DISCONNECT or CONNACK 0x82), what it cannot read malformed
    /// (0x81); a client's PUBLISH may not carry a Subscription Identifier,
    /// the broker's may.
    /// The Message Expiry Interval of an encoded PUBLISH is found where the
    /// encoder puts it, after a Payload Format Indicator or without one.
    #[test]
    fn an_encoded_publishs_message_expiry_is_found() {
        use router::protocol::PublishProperties;
        let encode = |properties: Option<PublishProperties>| {
            let publish = publish(b"t/x", b"payload", 1, 9, false);
            let mut out = BytesMut::new();
            Protocol::V5
                .write(Packet::Publish(publish, properties), &mut out)
                .unwrap();
            out
        };
        let with = |pfi: Option<u8>, expiry: Option<u32>| PublishProperties {
            payload_format_indicator: pfi,
            message_expiry_interval: expiry,
            content_type: Some("text/plain".into()),
            ..PublishProperties::default()
        };
        for pfi in [None, Some(1)] {
            let out = encode(Some(with(pfi, Some(0x0102_0304))));
            let (at, secs) = encoded_message_expiry(&out).unwrap();
            assert_eq!(secs, 0x0102_0304);
            assert_eq!(&out[at..at + 4], &[1, 2, 3, 4]);
            assert_eq!(encoded_message_expiry(&encode(Some(with(pfi, None)))), None);
        }
        assert_eq!(encoded_message_expiry(&encode(None)), None);
    }

    #[test]
    fn protocol_errors_and_malformed_packets() {
        // PUBLISH QoS 1 "t" id 1 with `props` and payload "x".
        let publish = |props: &[u8]| {
            let mut p = vec![0x32, (6 + props.len()) as u8, 0, 1, b't', 0, 1];
            p.push(props.len() as u8);
            p.extend_from_slice(props);
            p.push(b'x');
            BytesMut::from(&p[..])
        };
        let twice = publish(&[0x01, 1, 0x01, 1]);
        assert!(matches!(
            Protocol::V5.read(&mut twice.clone(), 1024),
            Err(CodecError::Protocol(e)) if e.contains("Payload Format Indicator")
        ));
        // Read (stored messages must stay readable), refused from clients.
        for protocol in [Protocol::V5, Protocol::V4] {
            let body: &[u8] = match protocol {
                Protocol::V5 => &[0x38, 5, 0, 1, b't', 0, b'x'],
                Protocol::V4 => &[0x38, 4, 0, 1, b't', b'x'],
            };
            let dup = protocol
                .read(&mut BytesMut::from(body), 1024)
                .unwrap()
                .unwrap();
            assert!(matches!(
                check_from_client(&dup.packet),
                Err(CodecError::Malformed(e)) if e.contains("MQTT-3.3.1-2")
            ));
        }
        let wildcard = Protocol::V5
            .read(&mut publish(&[0x08, 0, 3, b'a', b'/', b'#']), 1024)
            .unwrap()
            .unwrap();
        assert!(matches!(
            check_from_client(&wildcard.packet),
            Err(CodecError::Protocol(e)) if e.contains("MQTT-3.3.2-14")
        ));
        let with_id = Protocol::V5
            .read(&mut publish(&[0x0B, 3]), 1024)
            .unwrap()
            .unwrap();
        assert!(matches!(
            check_from_client(&with_id.packet),
            Err(CodecError::Protocol(e)) if e.contains("MQTT-3.3.4-6")
        ));
        let without = Protocol::V5.read(&mut publish(&[]), 1024).unwrap().unwrap();
        assert_eq!(check_from_client(&without.packet), Ok(()));
    }

    #[test]
    fn too_large_and_partial() {
        let mut buf = BytesMut::from(&[0x30, 0x80, 0x01][..]);
        assert!(matches!(
            Protocol::V4.read(&mut buf, 100),
            Err(CodecError::TooLarge(128))
        ));
        let mut buf = BytesMut::from(&[0x30, 0x05, 0, 1][..]);
        assert!(Protocol::V4.read(&mut buf, 100).unwrap().is_none());
        assert_eq!(buf.len(), 4, "partial frames are left in the buffer");
    }
}
