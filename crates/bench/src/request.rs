//! A state store request over MQTT 5, written and its answer read by hand:
//! the load run's hot path.
//!
//! Why not rumqttc's codec here (as `wire.rs` uses for everything else):
//! a request built as a `Publish` with `PublishProperties` (a `String` for
//! the response topic and each user property, `format!` for `__ts` and
//! the key) and an answer decoded into one cost the load generator 13,500
//! instructions a request, against 4,400 for the same GET or SET to Redis
//! and 7,300 for the broker serving it (callgrind, 64 connections,
//! 2026-12-03). At 64 connections its core was as busy as the server's
//! (97% against 96%, `/proc`), so the run measured the client as much as
//! the server. Here the bytes that are the same in every request are
//! encoded once per connection, and an answer is read without a copy:
//! its packet id, its Correlation Data and what its payload says.
//!
//! The bytes are the ones rumqttc writes (the same properties in the same
//! order, which the tests check by decoding them with rumqttc), so the
//! server's work per request does not change.

use bytes::{BufMut, BytesMut};

/// PUBLISH property identifiers (MQTT 5, 2.2.2.2).
const PAYLOAD_FORMAT: u8 = 0x01;
const MESSAGE_EXPIRY: u8 = 0x02;
const CONTENT_TYPE: u8 = 0x03;
const RESPONSE_TOPIC: u8 = 0x08;
const CORRELATION_DATA: u8 = 0x09;
const SUBSCRIPTION_ID: u8 = 0x0B;
const TOPIC_ALIAS: u8 = 0x23;
const USER_PROPERTY: u8 = 0x26;

/// The content type every request carries, as the SDK's.
const OCTET_STREAM: &[u8] = b"application/octet-stream";

/// A connection's requests: what is the same in each.
pub struct Template {
    topic: Vec<u8>,
    response_topic: Vec<u8>,
    /// `__ts`'s node id: the client id.
    node: Vec<u8>,
    /// The last wall time written into `__ts`, and its 15 digits.
    last_ms: u64,
    digits: [u8; 15],
}

impl Template {
    /// Requests on `topic`, answered on `response_topic`, stamped by
    /// `node` (the client id, as the SDK stamps `__ts`).
    pub fn new(topic: &str, response_topic: &str, node: &str) -> Template {
        Template {
            topic: topic.as_bytes().to_vec(),
            response_topic: response_topic.as_bytes().to_vec(),
            node: node.as_bytes().to_vec(),
            last_ms: u64::MAX,
            digits: [b'0'; 15],
        }
    }

    /// Whether this template's requests go to `topic`.
    pub fn is_for(&self, topic: &str) -> bool {
        self.topic == topic.as_bytes()
    }

    /// Appends a QoS 1 PUBLISH of `payload` (packet id `pkid`) to `tx`:
    /// Response Topic, Correlation Data (`correlation`, 8 bytes big
    /// endian), the user properties `__ts` (`now_ms` as 15 digits, a
    /// zero counter, the node id) and `__protVer` 1.0 (and
    /// `aio-persistence` true with `persist`), and the content type, as
    /// rumqttc writes them.
    pub fn encode(
        &mut self,
        tx: &mut BytesMut,
        pkid: u16,
        correlation: u64,
        persist: bool,
        now_ms: u64,
        payload: &[u8],
    ) {
        if now_ms != self.last_ms {
            self.last_ms = now_ms;
            // Zero-padded to 15 (every time until the year 33658).
            let mut buffer = itoa::Buffer::new();
            let digits = buffer.format(now_ms % 1_000_000_000_000_000).as_bytes();
            let pad = self.digits.len() - digits.len();
            self.digits[..pad].fill(b'0');
            self.digits[pad..].copy_from_slice(digits);
        }
        const TS: &[u8] = b"__ts";
        const COUNTER: &[u8] = b":00000:";
        const PROT_VER: (&[u8], &[u8]) = (b"__protVer", b"1.0");
        const PERSIST: (&[u8], &[u8]) = (b"aio-persistence", b"true");
        let user = |(k, v): (&[u8], &[u8])| 1 + 2 + k.len() + 2 + v.len();
        let ts_len = self.digits.len() + COUNTER.len() + self.node.len();
        let properties = (1 + 2 + self.response_topic.len())
            + (1 + 2 + 8)
            + (1 + 2 + TS.len() + 2 + ts_len)
            + user(PROT_VER)
            + if persist { user(PERSIST) } else { 0 }
            + (1 + 2 + OCTET_STREAM.len());
        let remaining =
            2 + self.topic.len() + 2 + varint_len(properties) + properties + payload.len();
        tx.reserve(1 + varint_len(remaining) + remaining);
        tx.put_u8(0x32);
        put_varint(tx, remaining);
        put_bytes(tx, &self.topic);
        tx.put_u16(pkid);
        put_varint(tx, properties);
        tx.put_u8(RESPONSE_TOPIC);
        put_bytes(tx, &self.response_topic);
        tx.put_u8(CORRELATION_DATA);
        put_bytes(tx, &correlation.to_be_bytes());
        tx.put_u8(USER_PROPERTY);
        put_bytes(tx, TS);
        tx.put_u16(ts_len as u16);
        tx.put_slice(&self.digits);
        tx.put_slice(COUNTER);
        tx.put_slice(&self.node);
        for (key, value) in [PROT_VER].into_iter().chain(persist.then_some(PERSIST)) {
            tx.put_u8(USER_PROPERTY);
            put_bytes(tx, key);
            put_bytes(tx, value);
        }
        tx.put_u8(CONTENT_TYPE);
        put_bytes(tx, OCTET_STREAM);
        tx.put_slice(payload);
    }
}

/// Appends a PUBACK of `pkid` (success, no properties: MQTT 5, 3.4.2.1).
pub fn put_puback(tx: &mut BytesMut, pkid: u16) {
    tx.put_slice(&[0x40, 0x02]);
    tx.put_u16(pkid);
}

/// What an answer's payload is, as the load run judges it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    /// `+OK` (a SET's).
    Ok,
    /// A bulk string, or `$-1` for none (a GET's).
    Bulk,
    /// Anything else (an error, say).
    Other,
}

impl Reply {
    /// What `payload` is (RESP or RESP3).
    pub fn of(payload: &[u8]) -> Reply {
        if payload == b"+OK\r\n" {
            Reply::Ok
        } else if payload.first() == Some(&b'$') {
            Reply::Bulk
        } else {
            Reply::Other
        }
    }
}

/// A PUBLISH from the server: its packet id (QoS 1 or 2), its Correlation
/// Data as a number (0 if it has none of 8 bytes) and its payload's kind.
/// (QoS 2 is refused: the load run subscribes at QoS 1.)
#[derive(Debug, PartialEq, Eq)]
pub struct Answer {
    pub pkid: Option<u16>,
    pub correlation: u64,
    pub reply: Reply,
}

/// The first packet in `buf`, if it is all there: `Some((answer, len))`,
/// `answer` `None` for a packet other than a PUBLISH (the PUBACK of a
/// request). An error: not an MQTT 5 packet this run can read.
pub fn read_answer(buf: &[u8]) -> Result<Option<(Option<Answer>, usize)>, String> {
    let Some(&first) = buf.first() else {
        return Ok(None);
    };
    let Some((remaining, header)) = varint(&buf[1..])? else {
        return Ok(None);
    };
    let len = 1 + header + remaining;
    if buf.len() < len {
        return Ok(None);
    }
    if first >> 4 != 3 {
        return Ok(Some((None, len)));
    }
    let qos = (first >> 1) & 0b11;
    if qos > 1 {
        return Err(format!(
            "a PUBLISH at QoS {qos}: the load run subscribes at QoS 1"
        ));
    }
    let mut at = Reader(&buf[1 + header..len]);
    at.bytes()?; // topic
    let pkid = if qos > 0 { Some(at.u16()?) } else { None };
    let properties = at.varint()?;
    let mut props = Reader(at.take(properties)?);
    let mut correlation = 0;
    while !props.0.is_empty() {
        match props.u8()? {
            PAYLOAD_FORMAT => drop(props.take(1)?),
            MESSAGE_EXPIRY => drop(props.take(4)?),
            TOPIC_ALIAS => drop(props.take(2)?),
            RESPONSE_TOPIC | CONTENT_TYPE => drop(props.bytes()?),
            CORRELATION_DATA => {
                correlation = <[u8; 8]>::try_from(props.bytes()?).map_or(0, u64::from_be_bytes);
            }
            USER_PROPERTY => {
                props.bytes()?;
                props.bytes()?;
            }
            SUBSCRIPTION_ID => drop(props.varint()?),
            other => {
                return Err(format!(
                    "a PUBLISH property this client does not read: {other:#x}"
                ));
            }
        }
    }
    Ok(Some((
        Some(Answer {
            pkid,
            correlation,
            reply: Reply::of(at.0),
        }),
        len,
    )))
}

/// A PUBLISH's bytes, read front to back.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("a PUBLISH shorter than its fields".into());
        }
        let (taken, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(taken)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, String> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    /// Two bytes of length, then that many.
    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = self.u16()?;
        self.take(usize::from(n))
    }

    fn varint(&mut self) -> Result<usize, String> {
        match varint(self.0)? {
            Some((value, used)) => {
                self.0 = &self.0[used..];
                Ok(value)
            }
            None => Err("a PUBLISH shorter than its fields".into()),
        }
    }
}

/// A variable byte integer (MQTT 5, 1.5.5) at the start of `buf`: its
/// value and length, `None` if not all there.
fn varint(buf: &[u8]) -> Result<Option<(usize, usize)>, String> {
    let mut value = 0usize;
    for (i, &byte) in buf.iter().take(4).enumerate() {
        value |= usize::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Ok(Some((value, i + 1)));
        }
    }
    if buf.len() >= 4 {
        return Err("a length of more than four bytes".into());
    }
    Ok(None)
}

fn varint_len(n: usize) -> usize {
    match n {
        0..=127 => 1,
        128..=16_383 => 2,
        16_384..=2_097_151 => 3,
        _ => 4,
    }
}

fn put_varint(tx: &mut BytesMut, mut n: usize) {
    loop {
        let byte = (n % 128) as u8;
        n /= 128;
        if n == 0 {
            tx.put_u8(byte);
            return;
        }
        tx.put_u8(byte | 0x80);
    }
}

fn put_bytes(tx: &mut BytesMut, bytes: &[u8]) {
    tx.put_u16(bytes.len() as u16);
    tx.put_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::mqttbytes::v5::{Packet, PubAck, Publish, PublishProperties};

    /// What the load run wrote with rumqttc before: the same request.
    fn with_rumqttc(correlation: u64, persist: bool, ts: &str, payload: &[u8]) -> BytesMut {
        let mut user_properties = vec![
            ("__ts".to_owned(), ts.to_owned()),
            ("__protVer".to_owned(), "1.0".to_owned()),
        ];
        if persist {
            user_properties.push(("aio-persistence".into(), "true".into()));
        }
        let properties = PublishProperties {
            response_topic: Some("bench/c-1/response".into()),
            correlation_data: Some(Bytes::copy_from_slice(&correlation.to_be_bytes())),
            content_type: Some("application/octet-stream".into()),
            user_properties,
            ..PublishProperties::default()
        };
        let mut publish = Publish::new(
            "statestore/v1/x/command/invoke",
            QoS::AtLeastOnce,
            payload.to_vec(),
            Some(properties),
        );
        publish.pkid = 7;
        let mut out = BytesMut::new();
        Packet::Publish(publish).write(&mut out, None).unwrap();
        out
    }

    /// The bytes are rumqttc's, with and without persistence, for a small
    /// and a large payload (a two-byte remaining length), and `__ts`
    /// follows the clock.
    #[test]
    fn a_request_is_the_bytes_rumqttc_writes() {
        let mut template = Template::new(
            "statestore/v1/x/command/invoke",
            "bench/c-1/response",
            "c-1",
        );
        for (now_ms, persist, payload) in [
            (
                1_764_547_200_123,
                false,
                &b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"[..],
            ),
            (1_764_547_200_123, true, &[b'v'; 300][..]),
            (1_764_547_200_999, false, &b""[..]),
            (0, true, &b"x"[..]),
        ] {
            let mut ours = BytesMut::new();
            template.encode(
                &mut ours,
                7,
                0x0102_0304_0506_0708,
                persist,
                now_ms,
                payload,
            );
            let ts = format!("{now_ms:015}:00000:c-1");
            assert_eq!(
                ours,
                with_rumqttc(0x0102_0304_0506_0708, persist, &ts, payload),
                "{now_ms} {persist}"
            );
        }
    }

    /// An answer as the broker writes it (rumqttc's encoding here): read
    /// whole, with its packet id, correlation and kind; a PUBACK is passed
    /// over; a packet cut short waits for the rest.
    #[test]
    fn an_answer_is_read_as_rumqttc_wrote_it() {
        let mut buf = BytesMut::new();
        Packet::PubAck(PubAck::new(3, None))
            .write(&mut buf, None)
            .unwrap();
        let puback_len = buf.len();
        let properties = PublishProperties {
            payload_format_indicator: Some(0),
            message_expiry_interval: Some(60),
            correlation_data: Some(Bytes::copy_from_slice(&42u64.to_be_bytes())),
            user_properties: vec![("__ts".into(), "000001764547200123:00000:n".into())],
            content_type: Some("application/octet-stream".into()),
            ..PublishProperties::default()
        };
        let mut publish = Publish::new(
            "bench/c-1/response",
            QoS::AtLeastOnce,
            b"+OK\r\n".to_vec(),
            Some(properties),
        );
        publish.pkid = 9;
        Packet::Publish(publish).write(&mut buf, None).unwrap();

        assert_eq!(read_answer(&buf).unwrap(), Some((None, puback_len)));
        let rest = &buf[puback_len..];
        let answer = Answer {
            pkid: Some(9),
            correlation: 42,
            reply: Reply::Ok,
        };
        assert_eq!(read_answer(rest).unwrap(), Some((Some(answer), rest.len())));
        for cut in 0..rest.len() {
            assert_eq!(read_answer(&rest[..cut]).unwrap(), None, "{cut}");
        }

        let qos0 = Publish::new("t", QoS::AtMostOnce, b"$3\r\nabc\r\n".to_vec(), None);
        let mut buf = BytesMut::new();
        Packet::Publish(qos0).write(&mut buf, None).unwrap();
        let read = read_answer(&buf).unwrap().unwrap().0.unwrap();
        assert_eq!(
            (read.pkid, read.correlation, read.reply),
            (None, 0, Reply::Bulk)
        );
    }

    #[test]
    fn what_this_client_cannot_read_is_an_error() {
        // A property PUBLISH does not have (0x11, Session Expiry).
        assert!(
            read_answer(&[0x32, 0x08, 0x00, 0x01, b't', 0x00, 0x01, 0x02, 0x11, 0x00]).is_err()
        );
        // Fields longer than the packet.
        assert!(read_answer(&[0x30, 0x03, 0x00, 0x09, b't']).is_err());
        // QoS 2 (the run subscribes at QoS 1).
        assert!(read_answer(&[0x34, 0x05, 0x00, 0x01, b't', 0x00, 0x01]).is_err());
        // A remaining length of five bytes.
        assert!(read_answer(&[0x30, 0xff, 0xff, 0xff, 0xff, 0x01]).is_err());
        assert_eq!(Reply::of(b"-ERR x\r\n"), Reply::Other);
        let mut tx = BytesMut::new();
        put_puback(&mut tx, 0x1234);
        assert_eq!(
            Packet::read(&mut tx, None).unwrap(),
            Packet::PubAck(PubAck::new(0x1234, None))
        );
    }
}
