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
mod tests;
