//! A state store request as it came off the wire: the parts of its
//! PUBLISH the broker uses, borrowed from the read buffer.
//!
//! Nearly every packet a state store client sends is a request: an MQTT 5
//! PUBLISH at QoS 1 on [`topics::REQUEST_TOPIC`] with a Response Topic,
//! Correlation Data and a few User Properties. [`read`] takes such a
//! PUBLISH straight from the bytes, without rumqttd's `Publish` and
//! `PublishProperties` (their strings shared out of the buffer one by one
//! and dropped again, a `Vec` of User Properties, the packet moved through
//! the decoder's enum: ~1,800 instructions of a request). It reads a
//! strict subset of what the decoder reads: anything else, valid or not (a
//! Topic Alias, a property it does not know, a string that is not
//! UTF-8, a property twice, QoS 0 or 2, RETAIN), it leaves to the
//! decoder, which accepts it or names what is wrong exactly as before.
//! What it accepts, the decoder reads the same (a property test holds
//! them to that). A request the decoder read is seen the same way through
//! [`RequestPublish::decoded`], so everything after reading is one path.

use router::protocol::{self, ByteString, Publish, PublishProperties};

use crate::topics;

/// A request's PUBLISH, as far as the broker looks at it.
#[derive(Debug, Clone, Copy)]
pub struct RequestPublish<'a> {
    /// The QoS, from the fixed header.
    pub qos: u8,
    /// The packet identifier.
    pub pkid: u16,
    /// The DUP flag, from the fixed header.
    pub dup: bool,
    /// The payload (the RESP3 request).
    pub payload: &'a [u8],
    /// The Response Topic.
    pub response_topic: Option<&'a str>,
    /// The Correlation Data.
    pub correlation_data: Option<&'a [u8]>,
    user_properties: UserProperties<'a>,
}

/// Where a request's User Properties are.
#[derive(Debug, Clone, Copy)]
enum UserProperties<'a> {
    /// In the properties as read by [`read`] (checked there).
    Read(&'a [u8]),
    /// As the decoder read them.
    Decoded(&'a [(ByteString, ByteString)]),
}

impl<'a> RequestPublish<'a> {
    /// A request the decoder read (`header`: QoS, packet id and DUP from
    /// its fixed header).
    pub fn decoded(
        publish: &'a Publish,
        properties: Option<&'a PublishProperties>,
        (qos, pkid, dup): (u8, u16, bool),
    ) -> RequestPublish<'a> {
        RequestPublish {
            qos,
            pkid,
            dup,
            payload: &publish.payload,
            response_topic: properties.and_then(|p| p.response_topic.as_deref()),
            correlation_data: properties.and_then(|p| p.correlation_data.as_deref()),
            user_properties: UserProperties::Decoded(
                properties.map_or(&[], |p| p.user_properties.as_slice()),
            ),
        }
    }

    /// The User Properties, in the order they came.
    pub fn user_properties(&self) -> impl Iterator<Item = (&'a str, &'a str)> + use<'a> {
        let (mut read, decoded) = match self.user_properties {
            UserProperties::Read(read) => (read, &[][..]),
            UserProperties::Decoded(decoded) => (&[][..], decoded),
        };
        let from_read = std::iter::from_fn(move || {
            while let Some((&id, rest)) = read.split_first() {
                // Checked by `read`, the only maker of `Read`.
                let (value, rest) = property::<false>(id, rest)?;
                read = rest;
                if let Value::Pair(k, v) = value {
                    return Some((k, v));
                }
            }
            None
        });
        from_read.chain(decoded.iter().map(|(k, v)| (&**k, &**v)))
    }
}

/// A property's value, as [`property`] reads it.
enum Value<'a> {
    Fixed,
    Bytes(&'a [u8]),
    Str(&'a str),
    Pair(&'a str, &'a str),
}

/// The value of the property `id` at the start of `rest`, and what follows
/// it; `None` for a property [`read`] does not take, or one cut short or
/// (`CHECK`) not an MQTT string where it must be. Without `CHECK`, `rest`
/// must be what [`read`] checked.
#[inline(always)]
fn property<const CHECK: bool>(id: u8, rest: &[u8]) -> Option<(Value<'_>, &[u8])> {
    match id {
        // Payload Format Indicator, Message Expiry Interval.
        0x01 => Some((Value::Fixed, rest.get(1..)?)),
        0x02 => Some((Value::Fixed, rest.get(4..)?)),
        // Content Type, Response Topic.
        0x03 | 0x08 => {
            let (s, rest) = string::<CHECK>(rest)?;
            Some((Value::Str(s), rest))
        }
        // Correlation Data.
        0x09 => {
            let (b, rest) = binary(rest)?;
            Some((Value::Bytes(b), rest))
        }
        // User Property.
        0x26 => {
            let (k, rest) = string::<CHECK>(rest)?;
            let (v, rest) = string::<CHECK>(rest)?;
            Some((Value::Pair(k, v), rest))
        }
        _ => None,
    }
}

/// Binary Data (1.5.6) at the start of `bytes`, and what follows.
#[inline(always)]
fn binary(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let (len, rest) = bytes.split_first_chunk::<2>()?;
    let len = usize::from(u16::from_be_bytes(*len));
    (rest.len() >= len).then(|| rest.split_at(len))
}

/// A UTF-8 Encoded String (1.5.4) at the start of `bytes`, checked as the
/// decoder checks it (`CHECK`), and what follows.
#[inline(always)]
fn string<const CHECK: bool>(bytes: &[u8]) -> Option<(&str, &[u8])> {
    let (s, rest) = binary(bytes)?;
    if CHECK {
        return Some((protocol::mqtt_str(s)?, rest));
    }
    debug_assert!(protocol::mqtt_str(s).is_some());
    // SAFETY: without CHECK, `bytes` are properties `read` took, which
    // checked each of their strings with `mqtt_str` (valid UTF-8).
    Some((unsafe { std::str::from_utf8_unchecked(s) }, rest))
}

/// A Variable Byte Integer (1.5.5) at the start of `bytes`: its value and
/// its length.
fn variable(bytes: &[u8]) -> Option<(usize, usize)> {
    let mut value = 0usize;
    for (i, &byte) in bytes.iter().take(4).enumerate() {
        value |= usize::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((value, i + 1));
        }
    }
    None
}

/// The request at the start of `buf` and the length of its packet, if
/// `buf` starts with a whole MQTT 5 PUBLISH that this reads (see the
/// module's documentation); `None` leaves it to the decoder (also when
/// more bytes are needed, or the packet is larger than `max_packet_size`).
pub fn read(buf: &[u8], max_packet_size: usize) -> Option<(RequestPublish<'_>, usize)> {
    // PUBLISH, QoS 1, RETAIN 0; DUP either.
    if buf.first()? & 0b1111_0111 != 0b0011_0010 {
        return None;
    }
    let dup = buf[0] & 0b1000 != 0;
    let (remaining, len_len) = variable(&buf[1..])?;
    if remaining > max_packet_size {
        return None;
    }
    let total = 1 + len_len + remaining;
    let body = buf.get(1 + len_len..total)?;
    let topic = topics::REQUEST_TOPIC.as_bytes();
    let (got, body) = binary(body)?;
    if got != topic {
        return None;
    }
    let (pkid, body) = body.split_first_chunk::<2>()?;
    let pkid = u16::from_be_bytes(*pkid);
    if pkid == 0 {
        return None;
    }
    let (properties_len, len_len) = variable(body)?;
    let payload = body.get(len_len + properties_len..)?;
    let properties = &body[len_len..len_len + properties_len];
    let mut request = RequestPublish {
        qos: 1,
        pkid,
        dup,
        payload,
        response_topic: None,
        correlation_data: None,
        user_properties: UserProperties::Read(properties),
    };
    // Each property but User Property at most once (the decoder refuses
    // a second, MQTT 5 2.2.2.2).
    let mut seen = 0u64;
    let mut rest = properties;
    while let Some((&id, after)) = rest.split_first() {
        let (value, after) = property::<true>(id, after)?;
        rest = after;
        if id != 0x26 {
            if seen & (1 << id) != 0 {
                return None;
            }
            seen |= 1 << id;
        }
        match (id, value) {
            (0x08, Value::Str(topic)) => {
                // A Response Topic with a wildcard is refused by its own
                // check (codec::check_from_client); an empty one too.
                if topic.is_empty() || !protocol::valid_topic(topic) {
                    return None;
                }
                request.response_topic = Some(topic);
            }
            (0x09, Value::Bytes(data)) => request.correlation_data = Some(data),
            _ => {}
        }
    }
    Some((request, total))
}

/// The decoder's reading of `buf`: the PUBLISH (if it reads one) and how
/// many bytes it took.
fn decode(buf: &[u8]) -> Option<(Publish, Option<PublishProperties>, usize)> {
    let mut owned = bytes::BytesMut::from(buf);
    match crate::codec::Protocol::V5.read(&mut owned, 1 << 20) {
        Ok(Some(crate::codec::Incoming {
            packet: protocol::Packet::Publish(p, props),
            ..
        })) => Some((p, props, buf.len() - owned.len())),
        _ => None,
    }
}

/// Panics unless the decoder reads what [`read`] takes from `buf` the
/// same: the same length, every field the broker uses, the same User
/// Properties in the same order, and nothing `codec::check_from_client`
/// refuses. The check of the property test here and of the `mqtt` fuzz
/// target.
#[doc(hidden)]
pub fn assert_read_as_decoded(buf: &[u8]) {
    let Some((request, len)) = read(buf, 1 << 20) else {
        return;
    };
    let (publish, props, taken) = decode(buf).expect("what read takes, the decoder reads");
    assert_eq!(len, taken);
    let header = (1, publish.pkid, publish.dup);
    let view = RequestPublish::decoded(&publish, props.as_ref(), header);
    assert_eq!(&*publish.topic, topics::REQUEST_TOPIC.as_bytes());
    assert_eq!(publish.qos, protocol::QoS::AtLeastOnce);
    assert!(!publish.retain);
    assert_eq!((request.qos, request.pkid, request.dup), header);
    assert_eq!(request.payload, view.payload);
    assert_eq!(request.response_topic, view.response_topic);
    assert_eq!(request.correlation_data, view.correlation_data);
    assert!(
        request.user_properties().eq(view.user_properties()),
        "the same User Properties"
    );
    let packet = protocol::Packet::Publish(publish, props);
    assert!(crate::codec::check_from_client(&packet).is_ok());
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;
    use router::protocol::QoS;

    /// A request's properties: Response Topic, Correlation Data, three
    /// User Properties, as the official client sends them.
    fn properties() -> PublishProperties {
        PublishProperties {
            payload_format_indicator: Some(0),
            message_expiry_interval: Some(10),
            content_type: Some("application/octet-stream".into()),
            response_topic: Some("clients/c/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke/response".into()),
            correlation_data: Some(bytes::Bytes::from_static(&[7; 16])),
            user_properties: vec![
                ("__srcId".into(), "c".into()),
                ("__ts".into(), "0000001732620000000:00000:c".into()),
                ("__protVer".into(), "1.0".into()),
            ],
            ..PublishProperties::default()
        }
    }

    fn encode(
        topic: &str,
        qos: QoS,
        pkid: u16,
        properties: Option<PublishProperties>,
        payload: &[u8],
    ) -> BytesMut {
        let publish = crate::codec::publish(topic.as_bytes(), payload, qos as u8, pkid, false);
        let mut buf = BytesMut::new();
        crate::codec::Protocol::V5
            .write(
                router::protocol::Packet::Publish(publish, properties),
                &mut buf,
            )
            .unwrap();
        buf
    }

    #[test]
    fn a_request_reads_as_the_decoder_reads_it() {
        let buf = encode(
            topics::REQUEST_TOPIC,
            QoS::AtLeastOnce,
            9,
            Some(properties()),
            b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n",
        );
        let (request, len) = read(&buf, 1 << 20).expect("read");
        assert_eq!(len, buf.len());
        assert_eq!(request.pkid, 9);
        assert_eq!(request.correlation_data, Some(&[7u8; 16][..]));
        assert_eq!(
            request.user_properties().find(|(k, _)| *k == "__ts"),
            Some(("__ts", "0000001732620000000:00000:c"))
        );
        assert_read_as_decoded(&buf);
        // Followed by more bytes: the packet's length.
        let mut two = buf.clone();
        two.extend_from_slice(&buf);
        assert_eq!(read(&two, 1 << 20).map(|(_, len)| len), Some(buf.len()));
        // Cut short anywhere: nothing yet.
        for cut in 0..buf.len() {
            assert!(read(&buf[..cut], 1 << 20).is_none(), "cut at {cut}");
        }
        // Larger than the listener takes: the decoder's to refuse.
        assert!(read(&buf, buf.len() - 10).is_none());
    }

    /// What the decoder reads differently, or refuses, is left to it.
    #[test]
    fn what_is_not_a_plain_request_is_left_to_the_decoder() {
        let payload = b"*1\r\n$4\r\nPING\r\n";
        let plain = |props: PublishProperties| {
            encode(
                topics::REQUEST_TOPIC,
                QoS::AtLeastOnce,
                3,
                Some(props),
                payload,
            )
        };
        let cases: Vec<(&str, BytesMut)> = vec![
            (
                "another topic",
                encode(
                    "statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke/x",
                    QoS::AtLeastOnce,
                    3,
                    Some(properties()),
                    payload,
                ),
            ),
            (
                "QoS 0",
                encode(
                    topics::REQUEST_TOPIC,
                    QoS::AtMostOnce,
                    0,
                    Some(properties()),
                    payload,
                ),
            ),
            (
                "QoS 2",
                encode(
                    topics::REQUEST_TOPIC,
                    QoS::ExactlyOnce,
                    3,
                    Some(properties()),
                    payload,
                ),
            ),
            (
                "a topic alias",
                plain(PublishProperties {
                    topic_alias: Some(1),
                    ..properties()
                }),
            ),
            (
                "a wildcard response topic",
                plain(PublishProperties {
                    response_topic: Some("a/+/b".into()),
                    ..properties()
                }),
            ),
            (
                "an empty response topic",
                plain(PublishProperties {
                    response_topic: Some("".into()),
                    ..properties()
                }),
            ),
            (
                "a subscription identifier",
                plain(PublishProperties {
                    subscription_identifiers: vec![4],
                    ..properties()
                }),
            ),
        ];
        for (what, buf) in cases {
            assert!(read(&buf, 1 << 20).is_none(), "{what}");
        }
        // RETAIN set, packet id 0, a property twice, a string not UTF-8,
        // a NUL in a string: bytes the encoder will not write.
        let buf = plain(properties());
        let mut retain = buf.clone();
        retain[0] |= 1;
        assert!(read(&retain, 1 << 20).is_none(), "RETAIN");
        let at = 3 + 2 + topics::REQUEST_TOPIC.len();
        let mut zero = buf.clone();
        zero[at] = 0;
        zero[at + 1] = 0;
        assert!(read(&zero, 1 << 20).is_none(), "packet id 0");
        for (what, bad) in [("not UTF-8", 0xffu8), ("NUL", 0)] {
            let mut b = buf.clone();
            let i = b.windows(4).position(|w| w == b"__ts").unwrap();
            b[i + 2] = bad;
            assert!(read(&b, 1 << 20).is_none(), "{what}");
            assert!(decode(&b).is_none(), "the decoder refuses it too: {what}");
        }
        // Correlation Data twice: its id where Message Expiry's was, with
        // the same length of property (4 bytes: a length of 2 and 2
        // bytes). The encoder writes Payload Format Indicator first, then
        // Message Expiry Interval.
        let (remaining_len_len, body) = (2, 1 + 2);
        let (_, props_len_len) =
            variable(&buf[body + 2 + topics::REQUEST_TOPIC.len() + 2..]).unwrap();
        let expiry = body + 2 + topics::REQUEST_TOPIC.len() + 2 + props_len_len + 2;
        assert_eq!(
            buf[1] & 0x80,
            0x80,
            "a remaining length of {remaining_len_len} bytes"
        );
        assert_eq!(buf[expiry], 0x02);
        let mut twice = buf.clone();
        twice[expiry..expiry + 5].copy_from_slice(&[0x09, 0, 2, 1, 2]);
        assert!(read(&twice, 1 << 20).is_none(), "a property twice");
        assert!(decode(&twice).is_none(), "the decoder refuses it too");
    }

    /// Random changes to a request: wherever [`read`] takes the result,
    /// the decoder reads the same.
    #[test]
    fn read_agrees_with_the_decoder_on_changed_bytes() {
        let buf = encode(
            topics::REQUEST_TOPIC,
            QoS::AtLeastOnce,
            0x1234,
            Some(properties()),
            b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n",
        );
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut taken = 0;
        for _ in 0..20_000 {
            let mut b = buf.to_vec();
            for _ in 0..1 + next() % 3 {
                let i = (next() as usize) % b.len();
                b[i] = match next() % 4 {
                    0 => next() as u8,
                    1 => b[i] ^ 1,
                    2 => 0x26,
                    _ => b[i].wrapping_add(1),
                };
            }
            if read(&b, 1 << 20).is_some() {
                taken += 1;
            }
            assert_read_as_decoded(&b);
        }
        assert!(taken > 100, "read took {taken} changed requests");
    }
}
