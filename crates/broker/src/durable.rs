//! What of the MQTT side survives a restart: retained messages and
//! persistent sessions.
//!
//! With a data directory, they are kept in the same fjall database as the
//! state store's persisted keys and go through the same group commit (see
//! [`crate::persistence`]), so they are crash-safe as the keys are:
//!
//! - a **retained message** is saved when a client publishes it (an empty
//!   retained publish removes it), and the publish reaches the router, and
//!   so its PUBACK the client, only once it is durable;
//! - a **persistent session** (Session Expiry Interval above 0) is saved at
//!   CONNECT, at every SUBSCRIBE and UNSUBSCRIBE (the SUBACK and UNSUBACK
//!   wait for it), and when its connection ends (with the time, so its
//!   expiry keeps counting while the broker is down); it is removed when it
//!   ends or expires.
//!
//! At start, before any listener opens, retained messages are given back to
//! the router (with their Message Expiry Interval reduced by the time they
//! waited; expired ones are removed), then each session is rebuilt in the
//! router: a link with the client id joins without Clean Start, subscribes
//! to the saved filters with their options (Retain Handling "never", so the
//! restore itself sends nothing), and leaves with the remaining expiry. A
//! client reconnecting finds its session (Session Present 1) and receives
//! what was published for it since the restart.
//!
//! Not kept (see the README's known limitations): messages queued for an
//! offline session or in flight at the moment of the crash or stop, and
//! outgoing QoS 2 state. mosquitto's `persistence true` keeps those, but
//! only as of its last `autosave_interval`.
//!
//! # Formats
//!
//! A retained message: `[1][stored at, Unix ms, u64 BE][the MQTT 5 PUBLISH
//! packet as the client sent it]`. A session: `[1][expiry u32 BE]
//! [disconnected at, Unix ms, u64 BE; u64::MAX while connected][count u32 BE]`
//! then per filter `[length u16 BE][filter][QoS u8][flags u8: 1 No Local,
//! 2 Retain As Published, 4 identifier follows][identifier u32 BE]`.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut, BytesMut};
use rumqttd::protocol::{
    Disconnect, DisconnectProperties, DisconnectReasonCode, Filter, Packet, Publish,
    PublishProperties, QoS, RetainForwardRule, Subscribe, SubscribeProperties,
};

use crate::clock::now_ms;
use crate::codec::Protocol;
use crate::persistence::{Pair, Persistence, Put, Space};
use crate::publisher::{Publisher, Retained};
use crate::router::{Router, poll_once};
use crate::sessions::{Journal, SavedSession, Sessions, Sub};

const VERSION: u8 = 1;
/// Larger than any packet a listener accepts.
const MAX_STORED_PACKET: usize = 1 << 30;

/// The MQTT side's way to the disk.
pub struct Durable {
    persistence: Arc<Persistence>,
}

/// What was restored at start.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Restored {
    /// Retained messages given back to the router.
    pub retained: usize,
    /// Persistent sessions rebuilt.
    pub sessions: usize,
    /// Retained messages and sessions that expired while the broker was down.
    pub expired: usize,
    /// Records that could not be read (logged and removed).
    pub unreadable: usize,
}

impl Durable {
    /// Writes through `persistence`.
    pub fn new(persistence: Arc<Persistence>) -> Arc<Durable> {
        Arc::new(Durable { persistence })
    }

    /// `publish` (a client's, with RETAIN, and a packet id if QoS 1/2) is
    /// retained: save it (an empty payload removes the topic's retained
    /// message). Returns the sequence number
    /// to wait for before the publish goes on.
    pub fn retain(&self, publish: &Publish, properties: Option<&PublishProperties>) -> u64 {
        let value = if publish.payload.is_empty() {
            None
        } else {
            match encode_retained(publish, properties, now_ms()) {
                Some(value) => Some(value),
                None => {
                    tracing::error!(topic = %String::from_utf8_lossy(&publish.topic), "cannot save a retained message: it will not survive a restart");
                    return 0;
                }
            }
        };
        self.persistence.put(vec![Put {
            space: Space::Retained,
            key: publish.topic.to_vec(),
            value,
        }])
    }

    /// Whether everything up to `seq` is durable.
    pub fn is_durable(&self, seq: u64) -> bool {
        self.persistence.is_durable(seq)
    }

    /// Waits until everything up to `seq` is durable.
    pub async fn wait(&self, seq: u64) {
        self.persistence.wait_durable(seq).await;
    }

    /// Gives the router back what was saved: retained messages through
    /// `publisher`, sessions through links of their own (and into the
    /// `sessions` mirror). Call before any client connects.
    pub async fn restore(
        &self,
        retained: Vec<Pair>,
        saved: Vec<Pair>,
        router: &Router,
        publisher: &Publisher,
        sessions: &Sessions,
    ) -> Restored {
        let now = now_ms();
        let mut restored = Restored::default();
        let mut removals = Vec::new();
        let mut messages = Vec::new();
        for (topic, value) in retained {
            let kept = match decode_retained(&value, now) {
                Ok(Some(message)) => {
                    messages.push(message);
                    true
                }
                Ok(None) => {
                    restored.expired += 1;
                    false
                }
                Err(why) => {
                    restored.unreadable += 1;
                    tracing::error!(topic = %String::from_utf8_lossy(&topic), why, "skipping a saved retained message that cannot be read");
                    false
                }
            };
            if !kept {
                removals.push(Put {
                    space: Space::Retained,
                    key: topic,
                    value: None,
                });
            }
        }
        restored.retained = messages.len();
        publisher.publish_retained(messages);
        for (client, value) in saved {
            let session = std::str::from_utf8(&client)
                .map_err(|_| "the client id is not UTF-8".to_owned())
                .and_then(|c| decode_session(&value).map(|s| (c, s)));
            let kept = match session {
                Ok((client, session)) => match remaining(&session, now) {
                    Some(left) => {
                        rebuild(router, sessions, client, session, left).await;
                        restored.sessions += 1;
                        true
                    }
                    None => {
                        restored.expired += 1;
                        false
                    }
                },
                Err(why) => {
                    restored.unreadable += 1;
                    tracing::error!(client_id = %String::from_utf8_lossy(&client), why, "skipping a saved session that cannot be read");
                    false
                }
            };
            if !kept {
                removals.push(Put {
                    space: Space::Sessions,
                    key: client,
                    value: None,
                });
            }
        }
        if !removals.is_empty() {
            self.persistence.put(removals);
        }
        restored
    }
}

impl Journal for Durable {
    fn save(&self, client: &str, session: &SavedSession) -> u64 {
        self.persistence.put(vec![Put {
            space: Space::Sessions,
            key: client.as_bytes().to_vec(),
            value: Some(encode_session(session)),
        }])
    }

    fn remove(&self, client: &str) {
        self.persistence.put(vec![Put {
            space: Space::Sessions,
            key: client.as_bytes().to_vec(),
            value: None,
        }]);
    }
}

/// How long a saved session is still kept, as of `now` (Unix ms): `None`
/// when it has expired, `Some(None)` when it never expires. A session saved
/// while connected (the broker stopped without ending it) counts from now.
fn remaining(session: &SavedSession, now: u64) -> Option<Option<Duration>> {
    if session.expiry == u32::MAX {
        return Some(None);
    }
    let waited = session
        .disconnected_at_ms
        .map_or(0, |at| now.saturating_sub(at));
    let left = (u64::from(session.expiry) * 1000).checked_sub(waited)?;
    (left > 0).then_some(Some(Duration::from_millis(left)))
}

/// Rebuilds `client`'s session in the router and the mirror.
async fn rebuild(
    router: &Router,
    sessions: &Sessions,
    client: &str,
    session: SavedSession,
    left: Option<Duration>,
) {
    // Round up: a session with 300 ms left is kept one second, not none.
    let expiry = left.map_or(u32::MAX, |d| {
        u32::try_from(d.as_millis().div_ceil(1000)).unwrap_or(u32::MAX - 1)
    });
    let (mut tx, _rx, _connack) = match router.link_async(client.to_owned(), false, expiry).await {
        Ok(link) => link,
        Err(e) => {
            tracing::error!(client_id = client, error = %e, "cannot restore a saved session");
            return;
        }
    };
    let mut packets: Vec<Packet> = session
        .filters
        .iter()
        .enumerate()
        .map(|(n, (path, sub))| {
            let filter = Filter {
                path: path.clone(),
                qos: match sub.qos {
                    0 => QoS::AtMostOnce,
                    1 => QoS::AtLeastOnce,
                    _ => QoS::ExactlyOnce,
                },
                nolocal: sub.no_local,
                preserve_retain: sub.retain_as_published,
                // Retained messages were sent when the client subscribed.
                retain_forward_rule: RetainForwardRule::Never,
            };
            let properties = sub.id.map(|id| SubscribeProperties {
                id: Some(id),
                user_properties: Vec::new(),
            });
            let pkid = u16::try_from(n % usize::from(u16::MAX)).unwrap_or(0) + 1;
            Packet::Subscribe(
                Subscribe {
                    pkid,
                    filters: vec![filter],
                },
                properties,
            )
        })
        .collect();
    packets.push(Packet::Disconnect(
        Disconnect {
            reason_code: DisconnectReasonCode::NormalDisconnection,
        },
        Some(DisconnectProperties {
            session_expiry_interval: Some(expiry),
            reason_string: None,
            user_properties: Vec::new(),
            server_reference: None,
        }),
    ));
    let last = packets.pop();
    tx.buffer().extend(packets);
    if let Some(last) = last
        && !matches!(poll_once(tx.send(last)), Some(Ok(_)))
    {
        tracing::error!(client_id = client, "cannot restore a saved session");
        return;
    }
    sessions.restore(client, session.filters, left);
}

/// A retained message's saved form (`None` if it cannot be encoded).
fn encode_retained(
    publish: &Publish,
    properties: Option<&PublishProperties>,
    now: u64,
) -> Option<Vec<u8>> {
    let mut out = BytesMut::with_capacity(16 + publish.topic.len() + publish.payload.len());
    out.put_u8(VERSION);
    out.put_u64(now);
    Protocol::V5
        .write(
            Packet::Publish(publish.clone(), properties.cloned()),
            &mut out,
        )
        .ok()?;
    Some(out.to_vec())
}

/// A saved retained message, with its Message Expiry Interval reduced by
/// the time it waited; `Ok(None)` if it has expired.
fn decode_retained(value: &[u8], now: u64) -> Result<Option<Retained>, String> {
    let mut cursor = value;
    if cursor.len() < 9 || cursor.get_u8() != VERSION {
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
    Ok(Some(Retained {
        topic: publish.topic,
        payload: publish.payload,
        qos: incoming.qos,
        properties,
    }))
}

fn encode_session(session: &SavedSession) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + session.filters.len() * 32);
    out.put_u8(VERSION);
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
    out
}

fn decode_session(value: &[u8]) -> Result<SavedSession, String> {
    fn need(cursor: &[u8], n: usize) -> Result<(), String> {
        if cursor.len() < n {
            Err("truncated".into())
        } else {
            Ok(())
        }
    }
    let mut cursor = value;
    need(cursor, 17)?;
    if cursor.get_u8() != VERSION {
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
            Sub {
                qos,
                id,
                no_local: flags & 1 != 0,
                retain_as_published: flags & 2 != 0,
            },
        ));
    }
    if !cursor.is_empty() {
        return Err("trailing bytes".into());
    }
    Ok(SavedSession {
        expiry,
        disconnected_at_ms,
        filters,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_round_trip_and_garbage_is_refused() {
        let session = SavedSession {
            expiry: 3600,
            disconnected_at_ms: Some(1_700_000_000_000),
            filters: vec![
                ("a/+/c".into(), Sub::default()),
                (
                    "$share/g/jobs/#".into(),
                    Sub {
                        qos: 2,
                        id: Some(268_435_455),
                        no_local: true,
                        retain_as_published: true,
                    },
                ),
            ],
        };
        let encoded = encode_session(&session);
        assert_eq!(decode_session(&encoded), Ok(session.clone()));
        let connected = SavedSession {
            disconnected_at_ms: None,
            ..session
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
        let mut long = encoded;
        long.push(0);
        assert!(decode_session(&long).is_err());
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
        let value = encode_retained(&publish, Some(&properties), at).unwrap();
        let got = decode_retained(&value, at + 20_500).unwrap().unwrap();
        assert_eq!(
            (&got.topic[..], &got.payload[..], got.qos),
            (&b"sensors/1"[..], &b"21.5"[..], 2)
        );
        let props = got.properties.unwrap();
        assert_eq!(props.message_expiry_interval, Some(40), "20 s waited");
        assert_eq!(props.content_type.as_deref(), Some("text/plain"));
        assert_eq!(props.user_properties, properties.user_properties);
        assert_eq!(decode_retained(&value, at + 60_000), Ok(None), "expired");
        // Without an expiry, it never expires.
        let plain = encode_retained(&publish, None, at).unwrap();
        assert!(decode_retained(&plain, u64::MAX).unwrap().is_some());
        for len in 0..value.len() {
            assert!(decode_retained(&value[..len], at).is_err(), "{len} bytes");
        }
    }

    #[test]
    fn what_is_left_of_a_session() {
        let at = |expiry, disconnected_at_ms| SavedSession {
            expiry,
            disconnected_at_ms,
            filters: Vec::new(),
        };
        assert_eq!(remaining(&at(u32::MAX, Some(0)), u64::MAX), Some(None));
        assert_eq!(
            remaining(&at(10, Some(1_000)), 4_000),
            Some(Some(Duration::from_secs(7)))
        );
        assert_eq!(remaining(&at(10, Some(1_000)), 11_000), None);
        assert_eq!(
            remaining(&at(10, None), 99_000),
            Some(Some(Duration::from_secs(10))),
            "still connected when the broker stopped: counts from now"
        );
    }
}
