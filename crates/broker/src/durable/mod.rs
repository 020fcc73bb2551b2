//! What of the MQTT side survives a restart: retained messages, persistent
//! sessions, and the messages queued for them.
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
//!   ends or expires;
//! - a **QoS 1/2 message for a persistent session** (`queue.rs`) is saved,
//!   once per session it reaches, before the publisher's PUBACK / PUBREC,
//!   and removed when that session's client acknowledges it (PUBACK, or
//!   PUBREC at QoS 2), when it is discarded for it, or with the session.
//!   It travels through the router marked with its number ([`tag`]).
//!
//! At start, before any listener opens, retained messages are given back to
//! the router (with their Message Expiry Interval reduced by the time they
//! waited; expired ones are removed), then each session is rebuilt in the
//! router: a link with the client id joins without Clean Start, subscribes
//! to the saved filters with their options (Retain Handling "never", so the
//! restore itself sends nothing), and leaves with the remaining expiry. A
//! session that still waited for messages also subscribes to its own
//! restore topic ([`crate::topics::restored_topic`], private like its
//! notifications), and once every session is back those messages are
//! published there, in their order, each at the QoS and with the
//! subscription identifiers of the session's subscriptions that match it;
//! the client's connection gives each its own topic back. A client
//! reconnecting finds its session (Session Present 1) and receives what
//! waited for it, then what was published since the restart.
//!
//! Not kept (see the README's known limitations): where an outgoing QoS 2
//! delivery stood after PUBREC (the PUBREL is not sent again after a
//! restart), the packet ids of deliveries in flight (they are sent again
//! with new ones), QoS 0 messages, and messages for shared subscriptions.
//!
//! # Formats
//!
//! A retained or queued message: `[1][stored at, Unix ms, u64 BE][the MQTT
//! 5 PUBLISH packet as the client sent it]`, under its topic (retained) or
//! `[client id length u16 BE][client id][number u64 BE]` (queued). A
//! session: `[1][expiry u32 BE][disconnected at, Unix ms, u64 BE; u64::MAX
//! while connected][count u32 BE]` then per filter `[length u16 BE][filter]
//! [QoS u8][flags u8: 1 No Local, 2 Retain As Published, 4 identifier
//! follows][identifier u32 BE]`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use router::protocol::{
    Disconnect, DisconnectProperties, DisconnectReasonCode, Filter, Packet, Publish,
    PublishProperties, QoS, RetainForwardRule, Subscribe, SubscribeProperties,
};

use crate::clock::now_ms;
use crate::persistence::{Pair, Persistence, Put, Space};
use crate::publisher::{Publisher, SavedMessage};
use crate::sessions::{Journal, SavedSession, Sessions, granted};
use crate::topics;

mod format;
mod queue;
pub mod tag;

use format::{decode_message, decode_session, encode_message, encode_session};
use queue::Queue;

/// The MQTT side's way to the disk.
pub struct Durable {
    persistence: Arc<Persistence>,
    queue: Queue,
}

/// What was restored at start.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Restored {
    /// Retained messages given back to the router.
    pub retained: usize,
    /// Persistent sessions rebuilt.
    pub sessions: usize,
    /// Messages given back to persistent sessions.
    pub queued: usize,
    /// Retained messages, sessions and queued messages that expired while
    /// the broker was down.
    pub expired: usize,
    /// Records that could not be read (logged and removed).
    pub unreadable: usize,
}

impl Durable {
    /// Writes through `persistence`.
    pub fn new(persistence: Arc<Persistence>) -> Arc<Durable> {
        Arc::new(Durable {
            persistence,
            queue: Queue::default(),
        })
    }

    /// `publish` (a client's, QoS 1/2) reaches the persistent sessions of
    /// `clients`: save it for each of them until it is delivered. Returns
    /// the number to mark the publish with ([`tag::mark`]) and the sequence
    /// number to wait for before the publish goes on.
    pub fn queue(
        &self,
        clients: &[Arc<str>],
        publish: &Publish,
        properties: Option<&PublishProperties>,
    ) -> Option<(u64, u64)> {
        let Some(value) = encode_message(publish, properties, now_ms()) else {
            tracing::error!(topic = %String::from_utf8_lossy(&publish.topic), "cannot save a message for persistent sessions: it will not survive a restart");
            return None;
        };
        let seq = self.queue.number();
        let puts = self.queue.add(clients.iter().map(|c| &**c), seq, &value);
        Some((seq, self.persistence.put(puts)))
    }

    /// `client` has message `seq` (acknowledged, or discarded for it): its
    /// copy is no longer needed.
    pub fn delivered(&self, client: &str, seq: u64) {
        if let Some(put) = self.queue.done(client, seq) {
            self.persistence.put(vec![put]);
        }
    }

    /// Saved messages `client`'s session still waits for.
    pub fn waiting(&self, client: &str) -> usize {
        self.queue.waiting(client)
    }

    /// Saved messages all persistent sessions still wait for.
    pub fn waiting_total(&self) -> usize {
        self.queue.total()
    }

    /// `publish` (a client's, with RETAIN, and a packet id if QoS 1/2) is
    /// retained: save it (an empty payload removes the topic's retained
    /// message). Returns the sequence number
    /// to wait for before the publish goes on.
    pub fn retain(&self, publish: &Publish, properties: Option<&PublishProperties>) -> u64 {
        let value = if publish.payload.is_empty() {
            None
        } else {
            match encode_message(publish, properties, now_ms()) {
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
    /// `sessions` mirror), then the messages each session still waited
    /// for, through its restore topic. Call before any client connects.
    pub async fn restore(
        &self,
        saved: Saved,
        router: &router::RouterHandle,
        publisher: &Publisher,
        sessions: &Sessions,
    ) -> Restored {
        let now = now_ms();
        let mut restored = Restored::default();
        let mut removals = Vec::new();
        let mut messages = Vec::new();
        for (topic, value) in saved.retained {
            let kept = match decode_message(&value, now) {
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
        publisher.publish_saved(messages, true);
        let mut queued = self.group_queued(saved.queued, &mut restored, &mut removals);
        let mut backlog = Vec::new();
        for (client, value) in saved.sessions {
            let session = std::str::from_utf8(&client)
                .map_err(|_| "the client id is not UTF-8".to_owned())
                .and_then(|c| decode_session(&value).map(|s| (c, s)));
            let kept = match session {
                Ok((client, session)) => match remaining(&session, now) {
                    Some(left) => {
                        let waiting = queued.remove(client).unwrap_or_default();
                        let messages = self.waiting_for(
                            client,
                            &session,
                            waiting,
                            now,
                            &mut restored,
                            &mut removals,
                        );
                        rebuild(
                            router,
                            sessions,
                            client,
                            session,
                            left,
                            !messages.is_empty(),
                        )
                        .await;
                        backlog.extend(messages);
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
        // Messages of sessions that are gone.
        for (client, waiting) in queued {
            removals.extend(
                waiting
                    .into_iter()
                    .map(|(seq, _)| queue::removal(&client, seq)),
            );
        }
        if !removals.is_empty() {
            self.persistence.put(removals);
        }
        restored.queued = backlog.len();
        publisher.publish_saved(backlog, false);
        restored
    }

    /// The saved queued messages by client id, in the order they arrived;
    /// numbering goes on after the highest.
    fn group_queued(
        &self,
        queued: Vec<Pair>,
        restored: &mut Restored,
        removals: &mut Vec<Put>,
    ) -> HashMap<String, Vec<(u64, Vec<u8>)>> {
        let mut by_client: HashMap<String, Vec<(u64, Vec<u8>)>> = HashMap::new();
        for (key, value) in queued {
            match queue::parse_key(&key) {
                Some((client, seq)) => {
                    self.queue.start_after(seq);
                    by_client.entry(client).or_default().push((seq, value));
                }
                None => {
                    restored.unreadable += 1;
                    tracing::error!(
                        key = hex::encode_upper(&key),
                        "skipping a queued message with a key that cannot be read"
                    );
                    removals.push(Put {
                        space: Space::Queued,
                        key,
                        value: None,
                    });
                }
            }
        }
        // Keys sort by client id, then number: each list is in order.
        by_client
    }

    /// What `client`'s restored `session` still waits for, as publishes on
    /// its restore topic: each at the QoS and with the subscription
    /// identifiers of the subscriptions that match it now, its Message
    /// Expiry Interval reduced by the wait. Expired messages, and those no
    /// subscription matches any more, are removed.
    fn waiting_for(
        &self,
        client: &str,
        session: &SavedSession,
        waiting: Vec<(u64, Vec<u8>)>,
        now: u64,
        restored: &mut Restored,
        removals: &mut Vec<Put>,
    ) -> Vec<SavedMessage> {
        let restore_topic = bytes::Bytes::from(topics::restored_topic(client));
        let mut messages = Vec::new();
        for (seq, value) in waiting {
            let mut message = match decode_message(&value, now) {
                Ok(Some(message)) => message,
                Ok(None) => {
                    restored.expired += 1;
                    removals.push(queue::removal(client, seq));
                    continue;
                }
                Err(why) => {
                    restored.unreadable += 1;
                    tracing::error!(
                        client_id = client,
                        why,
                        "skipping a queued message that cannot be read"
                    );
                    removals.push(queue::removal(client, seq));
                    continue;
                }
            };
            let topic = std::str::from_utf8(&message.topic).unwrap_or("");
            // Saved only for QoS 1/2 subscriptions, not shared ones.
            let filters = session.filters.iter().map(|(f, s)| (f, s));
            let Some((granted, ids)) = granted(filters, topic, false).filter(|(q, _)| *q > 0)
            else {
                removals.push(queue::removal(client, seq));
                continue;
            };
            message.qos = message.qos.min(granted);
            let mut properties = message.properties.take().unwrap_or_default();
            tag::mark_restored(&mut properties, &message.topic, &ids);
            let mut properties = Some(properties);
            tag::mark(&mut properties, seq);
            message.properties = properties;
            message.topic = restore_topic.clone();
            self.queue.restore(client, seq);
            messages.push(message);
        }
        messages
    }
}

/// What the MQTT side saved, as read at start.
#[derive(Default)]
pub struct Saved {
    /// Retained messages.
    pub retained: Vec<Pair>,
    /// Persistent sessions.
    pub sessions: Vec<Pair>,
    /// Messages queued for persistent sessions.
    pub queued: Vec<Pair>,
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
        let mut puts = self.queue.forget(client);
        puts.push(Put {
            space: Space::Sessions,
            key: client.as_bytes().to_vec(),
            value: None,
        });
        self.persistence.put(puts);
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
    router: &router::RouterHandle,
    sessions: &Sessions,
    client: &str,
    session: SavedSession,
    left: Option<Duration>,
    restore_topic: bool,
) {
    // Round up: a session with 300 ms left is kept one second, not none.
    let expiry = left.map_or(u32::MAX, |d| {
        u32::try_from(d.as_millis().div_ceil(1000)).unwrap_or(u32::MAX - 1)
    });
    let (mut tx, _rx, _connack) = match router.link(client, false, expiry).await {
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
    if restore_topic {
        // Where what the session waited for comes back (see `waiting_for`).
        packets.push(Packet::Subscribe(
            Subscribe {
                pkid: 1,
                filters: vec![Filter {
                    path: topics::restored_topic(client),
                    qos: QoS::ExactlyOnce,
                    nolocal: false,
                    preserve_retain: false,
                    retain_forward_rule: RetainForwardRule::Never,
                }],
            },
            None,
        ));
    }
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
    if tx.send_all(packets).is_err() {
        tracing::error!(client_id = client, "cannot restore a saved session");
        return;
    }
    sessions.restore(client, session.filters, left);
}

#[cfg(test)]
mod tests {
    use super::*;

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
