//! What of the MQTT side survives a restart: retained messages, persistent
//! sessions, and the messages queued for them.
//!
//! The router decides what must survive (see [`router::Journal`]); this is
//! its journal. With a data directory, everything goes into the same fjall
//! database as the state store's persisted keys, through the same group
//! commit (see [`crate::persistence`]), so it is crash-safe as the keys are:
//!
//! - a **retained message** is saved when a client publishes it (an empty
//!   retained publish removes it), and its PUBACK waits for the disk;
//! - a **persistent session** (Session Expiry Interval above 0) is saved at
//!   CONNECT, at every SUBSCRIBE and UNSUBSCRIBE (the SUBACK and UNSUBACK
//!   wait for it), and when its connection ends (with the time, so its
//!   expiry keeps counting while the broker is down); it is removed when it
//!   ends or expires;
//! - a **QoS 1/2 message for a persistent session** (`queue.rs`) is saved,
//!   once per session it reaches, before the publisher's PUBACK / PUBREC,
//!   and removed when that session's client acknowledges it (PUBACK, or
//!   PUBREC at QoS 2), gets it at QoS 0, or with the session.
//!
//! The broker's own retained messages (`$SYS`) are not saved: they are
//! published afresh by the running broker.
//!
//! At start, before any listener opens, [`Durable::restore`] reads it all
//! back into a [`router::Restore`]: retained messages with their Message
//! Expiry Interval reduced by the time they waited (expired ones are
//! removed), and each session with its subscriptions, its remaining
//! expiry, and the messages it still waits for, each at the QoS and with
//! the Subscription Identifiers of the session's subscriptions that match
//! it now (expired ones, and those no subscription matches, are removed).
//! The router gives the session those messages first when its client
//! comes back.
//!
//! Not kept (see the README's known limitations): where an outgoing QoS 2
//! delivery stood after PUBREC (the PUBREL is not sent again after a
//! restart), the packet ids of deliveries in flight (they are sent again
//! with new ones, of the run's own block: see
//! [`crate::sessions::PacketIdBlock`]), QoS 0 messages, and messages for
//! shared subscriptions.
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

use router::protocol::{self, QoS};
use router::{
    Journal, Message, MessageId, Receipt, Restore, RestoredSession, SessionRecord, granted,
};

use crate::clock::now_ms;
use crate::persistence::{Pair, Persistence, Put, Space};

pub(crate) mod format;
mod queue;

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

impl Durable {
    /// Writes through `persistence`.
    pub fn new(persistence: Arc<Persistence>) -> Arc<Durable> {
        Arc::new(Durable {
            persistence,
            queue: Queue::default(),
        })
    }

    /// Saved messages all persistent sessions still wait for.
    pub fn waiting_total(&self) -> usize {
        self.queue.total()
    }

    /// Queues `puts`; the receipt of the batch.
    fn put(&self, puts: Vec<Put>) -> Option<Receipt> {
        Some(self.persistence.put(puts).into())
    }

    /// What was saved, for the router to take back (see the module's
    /// documentation), and what of it was kept, expired or unreadable.
    /// Records that expired or cannot be read are removed from the disk.
    ///
    /// A session is kept at most `max_expiry` seconds after its connection
    /// ended (0: no maximum), whatever its record says: records saved
    /// before the maximum (or under a larger one) are held to it.
    pub fn restore(&self, saved: Saved, max_expiry: u32) -> (Restore, Restored) {
        let now = now_ms();
        let mut restored = Restored::default();
        let mut removals = Vec::new();
        let mut retained = Vec::new();
        for (topic, value) in saved.retained {
            match decode_message(&value, now) {
                Ok(Some(message)) => {
                    retained.push(message);
                    continue;
                }
                Ok(None) => restored.expired += 1,
                Err(why) => {
                    restored.unreadable += 1;
                    tracing::error!(topic = %String::from_utf8_lossy(&topic), why, "skipping a saved retained message that cannot be read");
                }
            }
            removals.push(Put {
                space: Space::Retained,
                key: topic,
                value: None,
            });
        }
        restored.retained = retained.len();
        let mut queued = self.group_queued(saved.queued, &mut restored, &mut removals);
        let mut sessions = Vec::new();
        for (client, value) in saved.sessions {
            let session = std::str::from_utf8(&client)
                .map_err(|_| "the client id is not UTF-8".to_owned())
                .and_then(|c| decode_session(&value).map(|s| (c, s)));
            match session {
                Ok((client_id, session)) => match remaining(&session, now, max_expiry) {
                    Some(expires_in) => {
                        let waiting = queued.remove(client_id).unwrap_or_default();
                        let waiting = self.waiting_for(
                            client_id,
                            &session,
                            waiting,
                            now,
                            &mut restored,
                            &mut removals,
                        );
                        restored.queued += waiting.len();
                        restored.sessions += 1;
                        sessions.push(RestoredSession {
                            client_id: client_id.to_owned(),
                            filters: session.filters,
                            expires_in,
                            queue_full: session.queue_full,
                            waiting,
                        });
                        continue;
                    }
                    None => restored.expired += 1,
                },
                Err(why) => {
                    restored.unreadable += 1;
                    tracing::error!(client_id = %String::from_utf8_lossy(&client), why, "skipping a saved session that cannot be read");
                }
            }
            removals.push(Put {
                space: Space::Sessions,
                key: client,
                value: None,
            });
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
        (Restore { retained, sessions }, restored)
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

    /// What `client`'s restored `session` still waits for: each message at
    /// the QoS and with the subscription identifiers of the subscriptions
    /// that match it now, its Message Expiry Interval reduced by the wait.
    /// Expired messages, and those no subscription matches any more, are
    /// removed.
    fn waiting_for(
        &self,
        client: &str,
        session: &SessionRecord,
        waiting: Vec<(u64, Vec<u8>)>,
        now: u64,
        restored: &mut Restored,
        removals: &mut Vec<Put>,
    ) -> Vec<(MessageId, Message)> {
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
            if !for_session(session, &mut message) {
                removals.push(queue::removal(client, seq));
                continue;
            }
            self.queue.restore(client, seq);
            messages.push((MessageId(seq), message));
        }
        messages
    }
}

impl Journal for Durable {
    fn session(&self, client: &str, session: Option<&SessionRecord>) -> Option<Receipt> {
        match session {
            Some(session) => self.put(vec![Put {
                space: Space::Sessions,
                key: client.as_bytes().to_vec(),
                value: Some(encode_session(session)),
            }]),
            None => {
                let mut puts = self.queue.forget(client);
                puts.push(Put {
                    space: Space::Sessions,
                    key: client.as_bytes().to_vec(),
                    value: None,
                });
                self.put(puts)
            }
        }
    }

    fn retained(&self, topic: &str, message: Option<&Message>) -> Option<Receipt> {
        if crate::topics::is_sys_topic(topic) {
            return None;
        }
        let value = match message {
            None => None,
            Some(message) => {
                let encoded =
                    encode_message(&message.publish, message.properties.as_ref(), now_ms());
                if encoded.is_none() {
                    tracing::error!(
                        topic,
                        "cannot save a retained message: it will not survive a restart"
                    );
                    return None;
                }
                encoded
            }
        };
        self.put(vec![Put {
            space: Space::Retained,
            key: topic.as_bytes().to_vec(),
            value,
        }])
    }

    fn queued(&self, clients: &[&str], message: &Message) -> Option<(MessageId, Option<Receipt>)> {
        let Some(value) = encode_message(&message.publish, message.properties.as_ref(), now_ms())
        else {
            tracing::error!(topic = %String::from_utf8_lossy(&message.publish.topic), "cannot save a message for persistent sessions: it will not survive a restart");
            return None;
        };
        let number = self.queue.number();
        let puts = self.queue.add(clients.iter().copied(), number, &value);
        crate::metrics::queued_saved(clients.len());
        Some((MessageId(number), Some(self.put(puts)?)))
    }

    fn delivered(&self, client: &str, message: MessageId) {
        if let Some(put) = self.queue.done(client, message.0) {
            self.persistence.put(vec![put]);
        }
    }
}

/// Makes a saved `message` one for `session` to wait for: at the QoS and
/// with the subscription identifiers of its subscriptions that match it
/// now. `false`: none does (at QoS 1 or 2; messages are saved only for
/// those, and not for shared subscriptions): it is not for the session.
pub(crate) fn for_session(session: &SessionRecord, message: &mut Message) -> bool {
    let topic = std::str::from_utf8(&message.publish.topic).unwrap_or("");
    let filters = session.filters.iter().map(|(f, s)| (f, s));
    let Some((granted, ids)) = granted(filters, topic, false).filter(|(q, _)| *q > 0) else {
        return false;
    };
    let qos = (message.publish.qos as u8).min(granted);
    message.publish.qos = protocol::qos(qos).unwrap_or(QoS::AtLeastOnce);
    message
        .properties
        .get_or_insert_with(Default::default)
        .subscription_identifiers = ids;
    true
}

/// How long a saved session is still kept, as of `now` (Unix ms): `None`
/// when it has expired, `Some(None)` when it never expires. A session saved
/// while connected (the broker stopped without ending it) counts from now.
pub(crate) fn remaining(
    session: &SessionRecord,
    now: u64,
    max_expiry: u32,
) -> Option<Option<Duration>> {
    let expiry = match max_expiry {
        0 => session.expiry,
        max => session.expiry.min(max),
    };
    if expiry == u32::MAX {
        return Some(None);
    }
    let waited = session
        .disconnected_at_ms
        .map_or(0, |at| now.saturating_sub(at));
    let left = (u64::from(expiry) * 1000).checked_sub(waited)?;
    (left > 0).then_some(Some(Duration::from_millis(left)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_left_of_a_session() {
        let at = |expiry, disconnected_at_ms| SessionRecord {
            expiry,
            disconnected_at_ms,
            filters: Vec::new(),
            queue_full: None,
        };
        assert_eq!(remaining(&at(u32::MAX, Some(0)), u64::MAX, 0), Some(None));
        assert_eq!(
            remaining(&at(10, Some(1_000)), 4_000, 0),
            Some(Some(Duration::from_secs(7)))
        );
        assert_eq!(remaining(&at(10, Some(1_000)), 11_000, 0), None);
        assert_eq!(
            remaining(&at(10, None), 99_000, 0),
            Some(Some(Duration::from_secs(10))),
            "still connected when the broker stopped: counts from now"
        );
        // `[broker] max_session_expiry_secs` holds records saved under a
        // larger one (or none: 3.1.1's "for ever") to it.
        assert_eq!(
            remaining(&at(u32::MAX, Some(1_000)), 4_000, 10),
            Some(Some(Duration::from_secs(7)))
        );
        assert_eq!(remaining(&at(u32::MAX, Some(1_000)), 11_000, 10), None);
        assert_eq!(
            remaining(&at(5, Some(1_000)), 4_000, 10),
            Some(Some(Duration::from_secs(2))),
            "a shorter expiry stays"
        );
    }
}
