//! How retained messages, queued messages and sessions are stored (the
//! formats are described in [`crate::durable`]).

use bytes::{Buf, BufMut, BytesMut};
use router::protocol::{Packet, Publish, PublishProperties};

use router::{Message, QueueFull, SessionRecord, SubOptions};

use crate::codec::Protocol;

const VERSION: u8 = 1;
/// A session with its own `queue_full`: version 1's fields, then one byte
/// (1: drop_oldest, 2: refuse). A session without one is still written as
/// version 1, which binaries from before can read.
const SESSION_WITH_QUEUE_FULL: u8 = 2;
/// A QoS 2 message queued in etcd and in flight to its client (a cluster
/// node's, see `crate::cluster::queue`): `[3][packet id u16 BE]`, then a
/// message's saved form without its version byte.
#[cfg(any(test, feature = "cluster"))]
const IN_FLIGHT: u8 = 3;
/// Larger than any packet a listener accepts.
const MAX_STORED_PACKET: usize = 1 << 30;

/// A message's saved form (`None` if it cannot be encoded). The packet
/// id kept means nothing (whoever reads it back numbers it): a QoS 1 or 2
/// message without one (the broker's own) is saved with 1, which the
/// encoder takes (it refuses 0 at QoS 1 and 2).
pub(crate) fn encode_message(
    publish: &Publish,
    properties: Option<&PublishProperties>,
    now: u64,
) -> Option<Vec<u8>> {
    let mut out = BytesMut::with_capacity(16 + publish.topic.len() + publish.payload.len());
    out.put_u8(VERSION);
    out.put_u64(now);
    let mut publish = publish.clone();
    if publish.qos != router::protocol::QoS::AtMostOnce && publish.pkid == 0 {
        publish.pkid = 1;
    }
    Protocol::V5
        .write(Packet::Publish(publish, properties.cloned()), &mut out)
        .ok()?;
    Some(out.to_vec())
}

/// `publish`'s saved form (see [`encode_message`]) marked as in flight to
/// its client under packet id `pkid` (a cluster node's queue in etcd: the
/// next node sends it again under that id, with DUP).
#[cfg(any(test, feature = "cluster"))]
pub(crate) fn encode_in_flight(
    publish: &Publish,
    properties: Option<&PublishProperties>,
    now: u64,
    pkid: u16,
) -> Option<Vec<u8>> {
    let saved = encode_message(publish, properties, now)?;
    let mut out = Vec::with_capacity(saved.len() + 2);
    out.put_u8(IN_FLIGHT);
    out.put_u16(pkid);
    out.extend_from_slice(&saved[1..]);
    Some(out)
}

/// A queued message's saved form, either kind (see [`decode_message`]),
/// with the packet id it is in flight under if it is marked so (see
/// [`encode_in_flight`]).
#[cfg(any(test, feature = "cluster"))]
pub(crate) fn decode_queued(
    value: &[u8],
    now: u64,
) -> Result<Option<(Message, Option<u16>)>, String> {
    match value.first() {
        Some(&IN_FLIGHT) if value.len() >= 3 => {
            let pkid = u16::from_be_bytes([value[1], value[2]]);
            if pkid == 0 {
                return Err("in flight under packet id 0".into());
            }
            Ok(decode_saved(&value[3..], now)?.map(|m| (m, Some(pkid))))
        }
        _ => Ok(decode_message(value, now)?.map(|m| (m, None))),
    }
}

/// A saved retained message, with its Message Expiry Interval reduced by
/// the time it waited; `Ok(None)` if it has expired.
pub(crate) fn decode_message(value: &[u8], now: u64) -> Result<Option<Message>, String> {
    match value.split_first() {
        Some((&VERSION, rest)) => decode_saved(rest, now),
        _ => Err("unknown format".into()),
    }
}

/// [`decode_message`] after the version byte.
fn decode_saved(value: &[u8], now: u64) -> Result<Option<Message>, String> {
    let mut cursor = value;
    if cursor.len() < 8 {
        return Err("unknown format".into());
    }
    let stored_at = cursor.get_u64();
    let mut packet = BytesMut::from(cursor);
    let incoming = Protocol::V5
        .read(&mut packet, MAX_STORED_PACKET)
        .map_err(|e| e.to_string())?
        .ok_or("truncated")?;
    let Packet::Publish(publish, mut properties) = incoming.packet else {
        return Err("not a PUBLISH".into());
    };
    if let Some(expiry) = properties
        .as_mut()
        .and_then(|p| p.message_expiry_interval.as_mut())
    {
        let waited = now.saturating_sub(stored_at) / 1000;
        match u64::from(*expiry).checked_sub(waited) {
            Some(left) if left > 0 => *expiry = u32::try_from(left).unwrap_or(u32::MAX),
            _ => return Ok(None),
        }
    }
    Ok(Some(Message {
        publish,
        properties,
    }))
}

pub(crate) fn encode_session(session: &SessionRecord) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + session.filters.len() * 32);
    out.put_u8(match session.queue_full {
        None => VERSION,
        Some(_) => SESSION_WITH_QUEUE_FULL,
    });
    out.put_u32(session.expiry);
    out.put_u64(session.disconnected_at_ms.unwrap_or(u64::MAX));
    out.put_u32(u32::try_from(session.filters.len()).unwrap_or(u32::MAX));
    for (filter, sub) in &session.filters {
        // Filters are at most 65,535 bytes (MQTT strings).
        out.put_u16(u16::try_from(filter.len()).unwrap_or(u16::MAX));
        out.put_slice(&filter.as_bytes()[..filter.len().min(usize::from(u16::MAX))]);
        out.put_u8(sub.qos);
        let id = sub.id.and_then(|id| u32::try_from(id).ok());
        out.put_u8(
            u8::from(sub.no_local)
                | u8::from(sub.retain_as_published) << 1
                | u8::from(id.is_some()) << 2,
        );
        if let Some(id) = id {
            out.put_u32(id);
        }
    }
    match session.queue_full {
        None => {}
        Some(QueueFull::DropOldest) => out.put_u8(1),
        Some(QueueFull::Refuse) => out.put_u8(2),
    }
    out
}

pub(crate) fn decode_session(value: &[u8]) -> Result<SessionRecord, String> {
    fn need(cursor: &[u8], n: usize) -> Result<(), String> {
        if cursor.len() < n {
            Err("truncated".into())
        } else {
            Ok(())
        }
    }
    let mut cursor = value;
    need(cursor, 17)?;
    let version = cursor.get_u8();
    if version != VERSION && version != SESSION_WITH_QUEUE_FULL {
        return Err("unknown format".into());
    }
    let expiry = cursor.get_u32();
    let disconnected_at_ms = Some(cursor.get_u64()).filter(|&at| at != u64::MAX);
    let count = cursor.get_u32();
    let mut filters = Vec::new();
    for _ in 0..count {
        need(cursor, 2)?;
        let len = usize::from(cursor.get_u16());
        need(cursor, len + 2)?;
        let filter = std::str::from_utf8(&cursor[..len])
            .map_err(|_| "a filter is not UTF-8")?
            .to_owned();
        cursor.advance(len);
        let qos = cursor.get_u8();
        let flags = cursor.get_u8();
        if qos > 2 || flags > 7 {
            return Err("bad subscription options".into());
        }
        let id = if flags & 4 != 0 {
            need(cursor, 4)?;
            Some(cursor.get_u32() as usize)
        } else {
            None
        };
        filters.push((
            filter,
            SubOptions {
                qos,
                id,
                no_local: flags & 1 != 0,
                retain_as_published: flags & 2 != 0,
            },
        ));
    }
    let queue_full = if version == SESSION_WITH_QUEUE_FULL {
        need(cursor, 1)?;
        match cursor.get_u8() {
            1 => Some(QueueFull::DropOldest),
            2 => Some(QueueFull::Refuse),
            _ => return Err("bad queue_full".into()),
        }
    } else {
        None
    };
    if !cursor.is_empty() {
        return Err("trailing bytes".into());
    }
    Ok(SessionRecord {
        expiry,
        disconnected_at_ms,
        filters,
        queue_full,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_round_trip_and_garbage_is_refused() {
        let session = SessionRecord {
            expiry: 3600,
            disconnected_at_ms: Some(1_700_000_000_000),
            filters: vec![
                ("a/+/c".into(), SubOptions::default()),
                (
                    "$share/g/jobs/#".into(),
                    SubOptions {
                        qos: 2,
                        id: Some(268_435_455),
                        no_local: true,
                        retain_as_published: true,
                    },
                ),
            ],
            queue_full: None,
        };
        let encoded = encode_session(&session);
        assert_eq!(decode_session(&encoded), Ok(session.clone()));
        let connected = SessionRecord {
            disconnected_at_ms: None,
            ..session.clone()
        };
        assert_eq!(
            decode_session(&encode_session(&connected)),
            Ok(connected.clone())
        );
        for len in 0..encoded.len() {
            assert!(decode_session(&encoded[..len]).is_err(), "{len} bytes");
        }
        let mut bad = encoded.clone();
        bad[0] = 9;
        assert!(decode_session(&bad).is_err());
        let mut long = encoded.clone();
        long.push(0);
        assert!(decode_session(&long).is_err());
        // A session's own queue_full: one more byte, in version 2; version
        // 1 stays what binaries from before read.
        assert_eq!(encoded[0], 1);
        for choice in [QueueFull::DropOldest, QueueFull::Refuse] {
            let chose = SessionRecord {
                queue_full: Some(choice),
                ..session.clone()
            };
            let with = encode_session(&chose);
            assert_eq!((with[0], with.len()), (2, encoded.len() + 1));
            assert_eq!(decode_session(&with), Ok(chose));
            assert!(decode_session(&with[..with.len() - 1]).is_err());
            let mut bad = with.clone();
            *bad.last_mut().unwrap() = 3;
            assert!(decode_session(&bad).is_err());
        }
    }

    #[test]
    fn retained_messages_round_trip_with_the_expiry_reduced() {
        let publish = crate::codec::publish(b"sensors/1", b"21.5", 2, 7, true);
        let properties = PublishProperties {
            message_expiry_interval: Some(60),
            content_type: Some("text/plain".into()),
            user_properties: vec![("k".into(), "v".into())],
            ..PublishProperties::default()
        };
        let at = 1_000_000;
        let value = encode_message(&publish, Some(&properties), at).unwrap();
        let got = decode_message(&value, at + 20_500).unwrap().unwrap();
        assert_eq!(
            (
                &got.publish.topic[..],
                &got.publish.payload[..],
                got.publish.qos as u8,
                got.publish.retain
            ),
            (&b"sensors/1"[..], &b"21.5"[..], 2, true)
        );
        let props = got.properties.unwrap();
        assert_eq!(props.message_expiry_interval, Some(40), "20 s waited");
        assert_eq!(props.content_type.as_deref(), Some("text/plain"));
        assert_eq!(props.user_properties, properties.user_properties);
        assert_eq!(decode_message(&value, at + 60_000), Ok(None), "expired");
        // Without an expiry, it never expires.
        let plain = encode_message(&publish, None, at).unwrap();
        assert!(decode_message(&plain, u64::MAX).unwrap().is_some());
        for len in 0..value.len() {
            assert!(decode_message(&value[..len], at).is_err(), "{len} bytes");
        }
    }

    /// A QoS 2 message marked in flight keeps its packet id and the rest
    /// of its saved form; an unmarked one reads as none in flight.
    #[test]
    fn a_message_in_flight_round_trips_with_its_packet_id() {
        let publish = crate::codec::publish(b"a/b", b"x", 2, 9, false);
        let properties = PublishProperties {
            message_expiry_interval: Some(60),
            ..PublishProperties::default()
        };
        let at = 5_000;
        let value = encode_in_flight(&publish, Some(&properties), at, 513).unwrap();
        let (got, pkid) = decode_queued(&value, at + 10_000).unwrap().unwrap();
        assert_eq!(pkid, Some(513));
        assert_eq!(
            (&got.publish.topic[..], got.publish.qos as u8),
            (&b"a/b"[..], 2)
        );
        assert_eq!(got.properties.unwrap().message_expiry_interval, Some(50));
        assert_eq!(decode_queued(&value, at + 60_000), Ok(None), "expired");
        assert!(decode_message(&value, at).is_err(), "not a plain message");
        let plain = encode_message(&publish, None, at).unwrap();
        assert_eq!(decode_queued(&plain, at).unwrap().unwrap().1, None);
        for len in 0..value.len() {
            assert!(decode_queued(&value[..len], at).is_err(), "{len} bytes");
        }
        let mut zero = value.clone();
        zero[1..3].copy_from_slice(&[0, 0]);
        assert!(decode_queued(&zero, at).is_err(), "packet id 0");
    }

    /// A QoS 1 message the broker made itself has no packet id: it is
    /// saved all the same (before, the encoder refused it, and a message
    /// handed over to a cluster node was silently not kept in etcd).
    #[test]
    fn a_message_without_a_packet_id_is_saved() {
        let publish = crate::codec::publish(b"t", b"x", 1, 0, false);
        let value = encode_message(&publish, None, 0).expect("encoded");
        let got = decode_message(&value, 0).unwrap().unwrap();
        assert_eq!(
            (&got.publish.topic[..], got.publish.qos as u8),
            (&b"t"[..], 1)
        );
    }
}
