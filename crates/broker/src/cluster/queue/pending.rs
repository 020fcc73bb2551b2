//! What the queue has to write to etcd, and what it has written: no I/O
//! (the writer in `super` takes batches and sends them).
//!
//! Per session (by client id): the numbers of its messages waiting to be
//! written, and of those written and not delivered yet. A message
//! delivered before its put left is taken off the first set: its put is
//! skipped when its turn comes, and nothing is written for it. One
//! delivered after is taken off the second: its removal is written. A
//! message never kept here (refused by the bounds) costs etcd nothing
//! when delivered. A QoS 2 message is taken off either set before it is
//! sent (see [`Pending::sending`]); its copy, if it has one, is marked in
//! flight ([`Pending::mark_waited`]) and removed at its PUBREL, and each
//! of those writes says when etcd has it.
//!
//! Those writes and removals are due at once, and go before puts: they
//! are of keys whose put has left already (or of another node's keys), so
//! they need not wait behind puts that are not due yet.
//!
//! A put whose batch failed may still reach etcd (a request etcd did not
//! answer in time, e.g. one waiting at a paused member, can commit
//! later). So it is put back to be written again *and* still counts as
//! written until then: a message delivered meanwhile gets its removal
//! (before 2026-11-30 it went out with none, and a put that committed
//! late left a copy for the next node to send again: a QoS 2 message
//! twice in a long fault round). The writer fences its batches so that
//! such a late put cannot commit after the removal (`super::Queue`'s
//! fence).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use etcd_client::TxnOp;
use tokio::sync::oneshot;

use super::{BATCH_OPS, LINGER};

/// How keys are made: `<etcd_prefix>Q/<length>:<client id>/` and this
/// run's `<node id>/<run>.`, then the number.
pub struct Keys {
    pub etcd_prefix: String,
    pub own: String,
}

impl Keys {
    /// Where `client_id`'s messages are (the length, so that no client's
    /// prefix is another's).
    pub fn session(etcd_prefix: &str, client_id: &str) -> Vec<u8> {
        format!("{etcd_prefix}Q/{}:{client_id}/", client_id.len()).into_bytes()
    }

    /// Where node `node`'s messages for `client_id` are (node ids have no
    /// `/`).
    pub fn node(etcd_prefix: &str, client_id: &str, node: &str) -> Vec<u8> {
        let mut prefix = Self::session(etcd_prefix, client_id);
        prefix.extend_from_slice(format!("{node}/").as_bytes());
        prefix
    }

    /// The key of this run's message `number` for `client_id`.
    pub fn key(&self, client_id: &str, number: u64) -> Vec<u8> {
        let mut key = Self::session(&self.etcd_prefix, client_id);
        key.extend_from_slice(format!("{}{number:016x}", self.own).as_bytes());
        key
    }
}

/// A put waiting: message `number` for `client`, `value` (shared by
/// every session it is for), from `due` on.
pub struct Put {
    client: Arc<str>,
    number: u64,
    value: Arc<Vec<u8>>,
    due: Instant,
}

impl Put {
    fn size(&self) -> usize {
        self.value.len() + 128
    }
}

/// A write due at once: `key` removed, or (`value`) written again (a QoS
/// 2 message's copy marked in flight); `done` hears when etcd has it.
pub struct Now {
    key: Vec<u8>,
    value: Option<Vec<u8>>,
    done: Option<oneshot::Sender<()>>,
}

impl Now {
    fn size(&self) -> usize {
        self.key.len() + self.value.as_ref().map_or(0, Vec::len) + 64
    }
}

/// A write of a batch taken ([`Pending::take`]).
pub enum Change {
    Put(Put),
    Now(Now),
}

impl Change {
    /// Etcd has it: whoever waits for it hears.
    pub fn done(self) {
        if let Change::Now(Now {
            done: Some(done), ..
        }) = self
        {
            let _ = done.send(());
        }
    }
}

/// One session's messages.
struct Kept {
    name: Arc<str>,
    /// Waiting to be written.
    unsent: HashSet<u64>,
    /// Written, not delivered yet.
    written: HashSet<u64>,
    /// A message was refused since the last one kept (see
    /// [`Pending::refused`]).
    refused: bool,
}

/// See the module's documentation.
pub struct Pending {
    keys: Keys,
    /// Puts, in order.
    puts: VecDeque<Put>,
    /// Writes due at once (removals, marks), in order.
    now: VecDeque<Now>,
    sessions: HashMap<String, Kept>,
    /// A message of a session with nothing here was refused since the
    /// last message kept (see [`Pending::refused`]).
    refused_unkept: bool,
}

impl Pending {
    pub fn new(keys: Keys) -> Pending {
        Pending {
            keys,
            puts: VecDeque::new(),
            now: VecDeque::new(),
            sessions: HashMap::new(),
            refused_unkept: false,
        }
    }

    /// Writes waiting.
    pub fn len(&self) -> usize {
        self.puts.len() + self.now.len()
    }

    /// Messages `client` has here, written or not (one whose batch
    /// failed and waits to go again counts twice until it goes: the bound
    /// this serves is met a little early, never late).
    pub fn count(&self, client: &str) -> usize {
        self.sessions
            .get(client)
            .map_or(0, |k| k.unsent.len() + k.written.len())
    }

    /// Message `number` (`value`) for `client`, written [`LINGER`] after
    /// `now` unless delivered first.
    pub fn put(&mut self, client: &str, number: u64, value: Arc<Vec<u8>>, now: Instant) {
        let kept = match self.sessions.get_mut(client) {
            Some(kept) => kept,
            None => self
                .sessions
                .entry(client.to_owned())
                .or_insert_with(|| Kept {
                    name: Arc::from(client),
                    unsent: HashSet::new(),
                    written: HashSet::new(),
                    refused: false,
                }),
        };
        kept.refused = false;
        kept.unsent.insert(number);
        self.refused_unkept = false;
        let client = Arc::clone(&kept.name);
        self.puts.push_back(Put {
            client,
            number,
            value,
            due: now + LINGER,
        });
    }

    /// A message for `client` was not kept (a bound): `true` the first
    /// time since the session's last message kept, so that it is told
    /// once, not for every message past the bound.
    pub fn refused(&mut self, client: &str) -> bool {
        match self.sessions.get_mut(client) {
            Some(kept) => !std::mem::replace(&mut kept.refused, true),
            // A session with nothing here: all writes are full.
            None => !std::mem::replace(&mut self.refused_unkept, true),
        }
    }

    /// `client` has message `number`: `true` if that is a removal to
    /// write (`false`: its put had not left, and now will not; or it was
    /// never kept here).
    pub fn delivered(&mut self, client: &str, number: u64) -> bool {
        let written = self.forget_message(client, number);
        if written {
            self.remove(self.keys.key(client, number));
        }
        written
    }

    /// Takes message `number` off `client`'s sets: `true` if its put had
    /// left (its copy is, or may be, in etcd: a put whose batch failed is
    /// in both sets), `false` if it had not (it now will not) or it was
    /// never kept here.
    fn forget_message(&mut self, client: &str, number: u64) -> bool {
        let Some(kept) = self.sessions.get_mut(client) else {
            return false;
        };
        kept.unsent.remove(&number);
        let written = kept.written.remove(&number);
        if kept.unsent.is_empty() && kept.written.is_empty() {
            self.sessions.remove(client);
        }
        written
    }

    /// `client` is about to be sent message `number` at QoS 2: it is
    /// taken off the sets, its put not made if it has not left (`None`);
    /// if it has, the key of its copy is returned, for the caller to mark
    /// or remove (`None` too for a message never kept here).
    pub fn sending(&mut self, client: &str, number: u64) -> Option<Vec<u8>> {
        self.forget_message(client, number)
            .then(|| self.keys.key(client, number))
    }

    /// `client`'s session leaves this node (handed over): its puts that
    /// have not left are not made, and it is forgotten; returns the
    /// numbers and keys of the copies written, oldest first, for the
    /// caller to remove.
    pub fn hand_over(&mut self, client: &str) -> Vec<(u64, Vec<u8>)> {
        let Some(kept) = self.sessions.remove(client) else {
            return Vec::new();
        };
        let mut written: Vec<u64> = kept.written.into_iter().collect();
        written.sort_unstable();
        written
            .into_iter()
            .map(|number| (number, self.keys.key(client, number)))
            .collect()
    }

    /// Removes `key` (a message read back, or not wanted).
    pub fn remove(&mut self, key: Vec<u8>) {
        self.now.push_back(Now {
            key,
            value: None,
            done: None,
        });
    }

    /// Removes `key`; the receiver hears when etcd has the removal.
    pub fn remove_waited(&mut self, key: Vec<u8>) -> oneshot::Receiver<()> {
        self.write_now(key, None)
    }

    /// Writes `value` (a copy marked in flight) at `key`, at once; the
    /// receiver hears when etcd has it.
    pub fn mark_waited(&mut self, key: Vec<u8>, value: Vec<u8>) -> oneshot::Receiver<()> {
        self.write_now(key, Some(value))
    }

    fn write_now(&mut self, key: Vec<u8>, value: Option<Vec<u8>>) -> oneshot::Receiver<()> {
        let (done, heard) = oneshot::channel();
        self.now.push_back(Now {
            key,
            value,
            done: Some(done),
        });
        heard
    }

    /// `client`'s session ended here: its puts that have not left will
    /// not, and its messages are forgotten (those in etcd go with its
    /// session record).
    pub fn forget(&mut self, client: &str) {
        self.sessions.remove(client);
    }

    /// Whether a put is still wanted.
    fn wanted(&self, client: &str, number: u64) -> bool {
        self.sessions
            .get(client)
            .is_some_and(|k| k.unsent.contains(&number))
    }

    /// Up to [`BATCH_OPS`] writes due by `now`, taken out in order, within
    /// `budget` bytes (one at least), no key twice (etcd refuses a
    /// transaction that writes a key twice), with their operations.
    pub fn take(&mut self, budget: usize, now: Instant) -> (Vec<Change>, Vec<TxnOp>) {
        let mut batch = Vec::new();
        let mut ops = Vec::new();
        let mut keys = HashSet::new();
        let mut bytes = 0;
        while batch.len() < BATCH_OPS {
            let Some(write) = self.now.front() else {
                break;
            };
            if keys.contains(&write.key) || (!batch.is_empty() && bytes + write.size() > budget) {
                return (batch, ops);
            }
            bytes += write.size();
            let Some(write) = self.now.pop_front() else {
                break;
            };
            ops.push(match &write.value {
                None => TxnOp::delete(write.key.clone(), None),
                Some(value) => TxnOp::put(write.key.clone(), value.clone(), None),
            });
            keys.insert(write.key.clone());
            batch.push(Change::Now(write));
        }
        while batch.len() < BATCH_OPS {
            let Some(put) = self.puts.front() else {
                break;
            };
            if !self.wanted(&put.client, put.number) {
                self.puts.pop_front();
                continue;
            }
            if put.due > now {
                break;
            }
            let key = self.keys.key(&put.client, put.number);
            if keys.contains(&key) || (!batch.is_empty() && bytes + put.size() > budget) {
                break;
            }
            bytes += put.size();
            let Some(put) = self.puts.pop_front() else {
                break;
            };
            if let Some(kept) = self.sessions.get_mut(&*put.client) {
                kept.unsent.remove(&put.number);
                kept.written.insert(put.number);
            }
            ops.push(TxnOp::put(key.clone(), put.value.to_vec(), None));
            keys.insert(key);
            batch.push(Change::Put(put));
        }
        (batch, ops)
    }

    /// When the first write waiting may leave.
    pub fn next_due(&self) -> Option<Instant> {
        if !self.now.is_empty() {
            return Some(Instant::now());
        }
        self.puts.front().map(|put| put.due)
    }

    /// Puts a batch that failed back in front, in its order, due at once
    /// (but the puts of messages delivered meanwhile: the removal that
    /// follows covers a put that reached etcd after all). A put put back
    /// still counts as written (see the module's documentation).
    pub fn put_back(&mut self, batch: Vec<Change>, now: Instant) {
        for change in batch.into_iter().rev() {
            match change {
                Change::Put(put) => {
                    let Some(kept) = self.sessions.get_mut(&*put.client) else {
                        continue;
                    };
                    if !kept.written.contains(&put.number) {
                        continue;
                    }
                    kept.unsent.insert(put.number);
                    self.puts.push_front(Put { due: now, ..put });
                }
                Change::Now(write) => self.now.push_front(write),
            }
        }
    }
}

#[cfg(test)]
mod tests;
