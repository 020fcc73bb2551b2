//! Messages saved for persistent sessions until their clients have them.
//!
//! A QoS 1/2 publish that reaches a persistent session (a subscription of
//! QoS 1 or 2, not a shared one) is saved once per such session before the
//! publisher's PUBACK / PUBREC, under one number that travels with the
//! message through the router's logs ([`router::MessageId`]). A session's
//! copy is removed when its client acknowledges the delivery (PUBACK, or
//! PUBREC at QoS 2) or gets it at QoS 0, and with the session. What is left
//! at a restart is given back to each session by the router, before
//! anything newer.
//!
//! Key: `[client id length u16 BE][client id][number u64 BE]`; value: the
//! message as a retained one is stored ([`super::format`]).

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{Buf, BufMut};
use parking_lot::Mutex;

use crate::persistence::{Put, Space};

/// Which saved messages each persistent session still waits for.
#[derive(Default)]
pub(super) struct Queue {
    waiting: Mutex<HashMap<String, BTreeSet<u64>>>,
    next: AtomicU64,
}

impl Queue {
    /// Numbers go on after `last`.
    pub fn start_after(&self, last: u64) {
        self.next.fetch_max(last, Ordering::AcqRel);
    }

    /// A new number.
    pub fn number(&self) -> u64 {
        self.next.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// `clients` wait for message `seq`, saved as `value`: the writes.
    pub fn add<'a>(
        &self,
        clients: impl Iterator<Item = &'a str>,
        seq: u64,
        value: &[u8],
    ) -> Vec<Put> {
        let mut waiting = self.waiting.lock();
        clients
            .map(|client| {
                waiting.entry(client.to_owned()).or_default().insert(seq);
                Put {
                    space: Space::Queued,
                    key: key(client, seq),
                    value: Some(value.to_vec()),
                }
            })
            .collect()
    }

    /// `client` still waits for message `seq`, saved before a restart.
    pub fn restore(&self, client: &str, seq: u64) {
        self.waiting
            .lock()
            .entry(client.to_owned())
            .or_default()
            .insert(seq);
    }

    /// `client` has message `seq`: the removal, if it was waiting for it.
    pub fn done(&self, client: &str, seq: u64) -> Option<Put> {
        let mut waiting = self.waiting.lock();
        let set = waiting.get_mut(client)?;
        if !set.remove(&seq) {
            return None;
        }
        if set.is_empty() {
            waiting.remove(client);
        }
        Some(removal(client, seq))
    }

    /// `client`'s session ended: the removals of all it waited for.
    pub fn forget(&self, client: &str) -> Vec<Put> {
        self.waiting
            .lock()
            .remove(client)
            .map(|set| set.into_iter().map(|seq| removal(client, seq)).collect())
            .unwrap_or_default()
    }

    /// Messages `client` waits for.
    #[cfg(test)]
    pub fn waiting(&self, client: &str) -> usize {
        self.waiting.lock().get(client).map_or(0, BTreeSet::len)
    }

    /// Saved copies all sessions together wait for.
    pub fn total(&self) -> usize {
        self.waiting.lock().values().map(BTreeSet::len).sum()
    }
}

/// The key of `client`'s copy of message `seq`.
pub(super) fn key(client: &str, seq: u64) -> Vec<u8> {
    let id = &client.as_bytes()[..client.len().min(usize::from(u16::MAX))];
    let mut key = Vec::with_capacity(2 + id.len() + 8);
    key.put_u16(u16::try_from(id.len()).unwrap_or(u16::MAX));
    key.put_slice(id);
    key.put_u64(seq);
    key
}

/// The client id and number in a key.
pub(super) fn parse_key(key: &[u8]) -> Option<(String, u64)> {
    let mut cursor = key;
    if cursor.len() < 2 {
        return None;
    }
    let len = usize::from(cursor.get_u16());
    if cursor.len() != len + 8 {
        return None;
    }
    let client = std::str::from_utf8(&cursor[..len]).ok()?.to_owned();
    cursor.advance(len);
    Some((client, cursor.get_u64()))
}

pub(super) fn removal(client: &str, seq: u64) -> Put {
    Put {
        space: Space::Queued,
        key: key(client, seq),
        value: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_sort_by_client_then_number() {
        assert_eq!(parse_key(&key("c1", 7)), Some(("c1".into(), 7)));
        assert!(key("c1", 2) < key("c1", 10));
        assert_eq!(parse_key(&key("c1", 7)[..5]), None);
        assert_eq!(parse_key(b""), None);
    }

    #[test]
    fn copies_are_removed_once_each() {
        let q = Queue::default();
        q.start_after(10);
        let seq = q.number();
        assert_eq!(seq, 11);
        let puts = q.add(["a", "b"].into_iter(), seq, b"m");
        assert_eq!(puts.len(), 2);
        assert!(q.done("a", seq).is_some());
        assert!(q.done("a", seq).is_none(), "only once");
        assert!(q.done("c", seq).is_none(), "c never waited for it");
        assert_eq!(q.waiting("b"), 1);
        assert_eq!(q.forget("b").len(), 1);
        assert_eq!(q.waiting("b"), 0);
    }
}
