//! Messages queued for persistent sessions, kept in etcd as well: a
//! session whose node died finds them there on the node it resumes on.
//!
//! Each QoS 1 message the router saves for persistent sessions
//! ([`router::Journal::queued`]) is written for each of them to
//! `<etcd_prefix>Q/<client id length>:<client id>/<node id>/<run>.<number>`
//! (the run: `d` on a node with a data directory, whose numbers go on
//! across restarts; otherwise when the process started; the number in 16
//! hex digits), the value the message as the data directory keeps it
//! (`crate::durable::format`). The writes leave in the background,
//! [`LINGER`] after the message was queued, in batches, and the
//! publisher's acknowledgement does not wait for them (it waits for the
//! other nodes' links and, with a data directory, for the disk): what a
//! node had queued less than that plus an etcd round trip before it died
//! is lost with it. A message the client acknowledges is removed; one
//! acknowledged before its write left is never written, so a subscriber
//! that keeps up costs etcd nothing. `[clustering] keep_queued_in_etcd =
//! false` turns the writes off.
//!
//! A node that resumes a session its owner left (no owner record: the
//! node died, or lost its lease; or an owner whose link to this node is
//! down: killed moments ago) reads them ([`Queue::read`]), in the
//! order they were written, and gives them to its router with the session
//! ([`router::RestoredSession::waiting`]) under numbers of its own (the
//! top bit set: never one the data directory gives); each is removed from
//! etcd when the client acknowledges it there, so a node that dies before
//! leaves it for the next. Its owner record then says so (see
//! `super::ownership`): a node that was paused past its lease, or cut off,
//! and comes back does not hand the same messages over again. A session that moves
//! from a live node takes its messages along over the link instead (see
//! [`super::handover`]: the old node's router gives them up, acknowledged,
//! and their copies here go).
//!
//! QoS 2 messages are not kept here: one the client had (its PUBREC
//! reached the node, whose removal from etcd had not) would come again as
//! a new message, and exactly once would need etcd to confirm each
//! delivery and each release before the client sees it. A QoS 2 message
//! queued on a node that dies is lost with it, never delivered twice; a
//! QoS 1 message may come again (QoS 1 allows it).
//!
//! The session's records go when it ends: the copies with its session
//! record, in the transaction that compares this node's claim (see
//! `super::ownership::records`), or with a clean start anywhere, or when
//! an ownerless session record is reaped.
//!
//! Bounds: at most [`MAX_PER_SESSION`] messages per session and
//! [`MAX_PENDING`] writes waiting (past either, a message is not kept in
//! etcd: counted in `statebroker_cluster_refused_total{reason=
//! "queue_backlog"}`, logged); a message over half of etcd's request limit
//! is not kept there.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use etcd_client::{GetOptions, SortOrder, SortTarget, Txn, TxnOp};
use parking_lot::Mutex;
use router::protocol::QoS;
use router::{Message, MessageId};

use super::Cluster;
use crate::durable::format::{decode_message, encode_message};

/// Messages kept in etcd per session, at most.
pub const MAX_PER_SESSION: usize = 10_000;
/// Writes waiting to leave, at most.
pub const MAX_PENDING: usize = 100_000;
/// Operations per transaction: etcd's default `--max-txn-ops`.
const BATCH_OPS: usize = 128;
/// Keys read per request when a session resumes.
const PAGE: i64 = 500;
/// The numbers of messages read back from etcd have it set.
const RESTORED: u64 = 1 << 63;
/// How long a message waits before it is written: one its client
/// acknowledges by then is never written (a subscriber that keeps up
/// costs etcd nothing).
pub const LINGER: Duration = Duration::from_millis(100);

/// See the module's documentation.
pub struct Queue {
    cluster: Arc<Cluster>,
    /// `[clustering] keep_queued_in_etcd`: messages are written (those
    /// kept earlier are read back and removed either way).
    keep: bool,
    /// `<node id>/<run>.`: this run's keys, after the client's part (node
    /// ids have no `/`).
    own: String,
    /// The numbers this node gives without a data directory.
    next: AtomicU64,
    /// The numbers of messages read back.
    next_restored: AtomicU64,
    state: Mutex<State>,
    /// Wakes the writer (shared with it: it holds no strong reference
    /// while it waits).
    wake: Arc<tokio::sync::Notify>,
}

#[derive(Default)]
struct State {
    /// Writes to make, in order (puts due [`LINGER`] after they came).
    changes: VecDeque<Change>,
    /// The keys of the puts in `changes`.
    unsent: HashSet<Vec<u8>>,
    /// Puts in `changes` not to make after all (delivered first).
    cancelled: HashSet<Vec<u8>>,
    /// How many messages each session has in etcd (by this node).
    counts: HashMap<String, usize>,
    /// The keys of the messages read back, by client and number.
    restored: HashMap<(String, u64), Vec<u8>>,
}

impl Queue {
    /// Starts the writer; it ends when the returned value is dropped.
    /// `data_dir`: the node has one (its message numbers go on across
    /// restarts).
    pub fn start(cluster: Arc<Cluster>, data_dir: bool) -> Arc<Queue> {
        let keep = cluster.settings.keep_queued_in_etcd;
        let run = if data_dir {
            "d".to_owned()
        } else {
            format!("{:x}", crate::clock::now_nanos() as u64)
        };
        let own = format!("{}/{run}.", cluster.node_id());
        let queue = Arc::new(Queue {
            cluster,
            keep,
            own,
            next: AtomicU64::new(0),
            next_restored: AtomicU64::new(RESTORED),
            state: Mutex::new(State::default()),
            wake: Arc::new(tokio::sync::Notify::new()),
        });
        tokio::spawn(write(
            Arc::downgrade(&queue),
            queue.cluster.stop.subscribe(),
        ));
        queue
    }

    /// Whether it keeps messages (`[clustering] keep_queued_in_etcd`).
    pub fn keeps(&self) -> bool {
        self.keep
    }

    /// A number for a message, given no data directory.
    pub fn number(&self) -> MessageId {
        MessageId(self.next.fetch_add(1, Ordering::Relaxed) + 1)
    }

    /// Where `client_id`'s messages are: `<etcd_prefix>Q/<length>:<client
    /// id>/` (the length, so that no client's prefix is another's).
    pub fn session_prefix(prefix: &str, client_id: &str) -> Vec<u8> {
        format!("{prefix}Q/{}:{client_id}/", client_id.len()).into_bytes()
    }

    fn key(&self, client: &str, number: MessageId) -> Vec<u8> {
        let mut key = Self::session_prefix(&self.cluster.settings.etcd_prefix, client);
        key.extend_from_slice(format!("{}{:016x}", self.own, number.0).as_bytes());
        key
    }

    /// `message`, numbered `number`, is queued for the persistent sessions
    /// of `clients`: written for each (see the module's documentation).
    pub fn keep(&self, clients: &[&str], number: MessageId, message: &Message) {
        if !self.keep || message.publish.qos != QoS::AtLeastOnce {
            return;
        }
        let Some(value) = encode_message(
            &message.publish,
            message.properties.as_ref(),
            crate::clock::now_ms(),
        ) else {
            return;
        };
        if value.len() + 256 > self.cluster.settings.max_request_bytes / 2 {
            tracing::warn!(
                topic = %String::from_utf8_lossy(&message.publish.topic),
                bytes = value.len(),
                "clustering: a message queued for persistent sessions is larger than etcd takes: not kept there (lost if this node dies before its clients have it)"
            );
            return;
        }
        let now = Instant::now();
        let mut state = self.state.lock();
        for client in clients {
            let count = state.counts.get(*client).copied().unwrap_or(0);
            if count >= MAX_PER_SESSION || state.changes.len() >= MAX_PENDING {
                crate::metrics::cluster_refused("queue_backlog");
                tracing::warn!(
                    client_id = client,
                    count,
                    waiting = state.changes.len(),
                    "clustering: a message queued for a persistent session is not kept in etcd: the session has too many there, or too many writes wait"
                );
                continue;
            }
            *state.counts.entry((*client).to_owned()).or_default() += 1;
            state.put(self.key(client, number), value.clone(), now);
        }
        drop(state);
        self.wake.notify_one();
    }

    /// `client` has message `number`: its copy goes (or is not written).
    pub fn delivered(&self, client: &str, number: MessageId) {
        let mut state = self.state.lock();
        let key = if number.0 & RESTORED != 0 {
            match state.restored.remove(&(client.to_owned(), number.0)) {
                Some(key) => key,
                None => return,
            }
        } else {
            if let Some(count) = state.counts.get_mut(client) {
                *count = count.saturating_sub(1);
            }
            self.key(client, number)
        };
        if state.remove(key, Instant::now()) {
            drop(state);
            self.wake.notify_one();
        }
    }

    /// `client`'s session ended here: what is kept of it in memory goes,
    /// and its writes not made yet are not made. Its copies in etcd go
    /// with its session record (see the module's documentation).
    pub fn forget(&self, client: &str) {
        let mut state = self.state.lock();
        state.counts.remove(client);
        state.restored.retain(|(c, _), _| c != client);
        let prefix = Self::session_prefix(&self.cluster.settings.etcd_prefix, client);
        state.cancel_puts(&prefix);
    }

    /// The messages kept in etcd for `client_id`, in the order they were
    /// written, each with its key (those that cannot be read, or have
    /// expired, are removed). Read in pages at one revision.
    pub async fn read(&self, client_id: &str) -> Result<Vec<(Vec<u8>, Message)>, String> {
        let prefix = Self::session_prefix(&self.cluster.settings.etcd_prefix, client_id);
        self.read_prefix(client_id, prefix).await
    }

    /// The same, of those node `node` wrote.
    pub async fn read_from(
        &self,
        client_id: &str,
        node: &str,
    ) -> Result<Vec<(Vec<u8>, Message)>, String> {
        let mut prefix = Self::session_prefix(&self.cluster.settings.etcd_prefix, client_id);
        prefix.extend_from_slice(format!("{node}/").as_bytes());
        self.read_prefix(client_id, prefix).await
    }

    async fn read_prefix(
        &self,
        client_id: &str,
        prefix: Vec<u8>,
    ) -> Result<Vec<(Vec<u8>, Message)>, String> {
        let mut client = self.cluster.client.clone();
        let timeout = self.cluster.settings.request_timeout;
        let now = crate::clock::now_ms();
        let (mut revision, mut from) = (0, 0);
        let mut seen = HashSet::new();
        let mut messages = Vec::new();
        let mut gone = Vec::new();
        loop {
            let mut options = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend)
                .with_limit(PAGE)
                .with_min_create_revision(from);
            if revision > 0 {
                options = options.with_revision(revision);
            }
            let response = tokio::time::timeout(timeout, client.get(prefix.clone(), Some(options)))
                .await
                .map_err(|_| "etcd did not answer in time".to_owned())?
                .map_err(|e| e.to_string())?;
            if revision == 0 {
                revision = response.header().map_or(0, |h| h.revision());
            }
            let mut new = 0;
            for kv in response.kvs() {
                // A page starts at the last one's revision: keys written
                // together share it.
                from = kv.create_revision();
                if !seen.insert(kv.key().to_vec()) {
                    continue;
                }
                new += 1;
                match decode_message(kv.value(), now) {
                    Ok(Some(message)) => {
                        messages.push((kv.create_revision(), kv.key().to_vec(), message));
                    }
                    Ok(None) => gone.push(kv.key().to_vec()),
                    Err(why) => {
                        tracing::error!(
                            client_id,
                            why,
                            "clustering: a queued message in etcd cannot be read: skipped"
                        );
                        gone.push(kv.key().to_vec());
                    }
                }
            }
            if !response.more() || new == 0 {
                break;
            }
        }
        if !gone.is_empty() {
            self.remove(gone);
        }
        // Written together, in the order of their numbers (etcd's sort
        // leaves keys of one revision in any order).
        messages.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        Ok(messages.into_iter().map(|(_, k, m)| (k, m)).collect())
    }

    /// A number for a message read back from etcd.
    pub fn restored_number(&self) -> MessageId {
        MessageId(self.next_restored.fetch_add(1, Ordering::Relaxed))
    }

    /// `client`'s router took the messages read back (`key` by number): each
    /// goes from etcd when the client has it.
    pub fn restored(&self, client: &str, messages: Vec<(MessageId, Vec<u8>)>) {
        let mut state = self.state.lock();
        for (number, key) in messages {
            state.restored.insert((client.to_owned(), number.0), key);
        }
    }

    /// Removes `keys` (read back and not for the session).
    pub fn remove(&self, keys: Vec<Vec<u8>>) {
        let mut state = self.state.lock();
        let now = Instant::now();
        for key in keys {
            state.remove(key, now);
        }
        drop(state);
        self.wake.notify_one();
    }
}

/// A write: a put (`Some`) or a removal.
type Write = (Vec<u8>, Option<Vec<u8>>);

/// A write waiting, and from when it may leave.
struct Change {
    key: Vec<u8>,
    value: Option<Vec<u8>>,
    due: Instant,
}

impl State {
    /// Puts `value` at `key` (a new key), [`LINGER`] after `now`.
    fn put(&mut self, key: Vec<u8>, value: Vec<u8>, now: Instant) {
        self.unsent.insert(key.clone());
        self.changes.push_back(Change {
            key,
            value: Some(value),
            due: now + LINGER,
        });
    }

    /// Removes `key`: `true` if that is a write to make (`false`: its put
    /// had not left, and now will not).
    fn remove(&mut self, key: Vec<u8>, now: Instant) -> bool {
        if self.unsent.remove(&key) {
            self.cancelled.insert(key);
            return false;
        }
        self.changes.push_back(Change {
            key,
            value: None,
            due: now,
        });
        true
    }

    /// The puts of keys starting with `prefix` that have not left will not.
    fn cancel_puts(&mut self, prefix: &[u8]) {
        let unsent: Vec<Vec<u8>> = self
            .unsent
            .iter()
            .filter(|key| key.starts_with(prefix))
            .cloned()
            .collect();
        for key in unsent {
            self.unsent.remove(&key);
            self.cancelled.insert(key);
        }
    }

    /// Up to [`BATCH_OPS`] writes due by `now`, taken out in order, within
    /// `budget` bytes (one at least), no key twice (etcd refuses a
    /// transaction that writes a key twice).
    fn take(&mut self, budget: usize, now: Instant) -> Vec<Write> {
        let mut batch = Vec::new();
        let mut keys = HashSet::new();
        let mut bytes = 0;
        while batch.len() < BATCH_OPS {
            let Some(change) = self.changes.front() else {
                break;
            };
            if change.value.is_some() && self.cancelled.contains(&change.key) {
                if let Some(change) = self.changes.pop_front() {
                    self.cancelled.remove(&change.key);
                }
                continue;
            }
            let size = change.key.len() + change.value.as_ref().map_or(0, Vec::len) + 64;
            if change.due > now
                || keys.contains(&change.key)
                || (!batch.is_empty() && bytes + size > budget)
            {
                break;
            }
            bytes += size;
            let Some(Change { key, value, .. }) = self.changes.pop_front() else {
                break;
            };
            if value.is_some() {
                self.unsent.remove(&key);
            }
            keys.insert(key.clone());
            batch.push((key, value));
        }
        batch
    }

    /// When the first write waiting may leave.
    fn next_due(&self) -> Option<Instant> {
        self.changes.front().map(|c| c.due)
    }

    /// Puts a batch that failed back in front, in its order, due at `now`.
    fn put_back(&mut self, batch: Vec<Write>, now: Instant) {
        for (key, value) in batch.into_iter().rev() {
            if value.is_some() {
                self.unsent.insert(key.clone());
            }
            self.changes.push_front(Change {
                key,
                value,
                due: now,
            });
        }
    }
}

/// Writes what waits, batch by batch, until the owner is dropped.
async fn write(queue: Weak<Queue>, mut stop: tokio::sync::watch::Receiver<()>) {
    loop {
        let Some(q) = queue.upgrade() else { return };
        let budget = q.cluster.settings.max_request_bytes / 2;
        let batch = q.state.lock().take(budget, Instant::now());
        if batch.is_empty() {
            let wake = Arc::clone(&q.wake);
            let woken = wake.notified();
            tokio::pin!(woken);
            // Registered before the last look: a write after it wakes us.
            woken.as_mut().enable();
            let due = q.state.lock().next_due();
            drop(q);
            let until = due.map_or(far_future(), tokio::time::Instant::from_std);
            tokio::select! {
                () = woken => {}
                () = tokio::time::sleep_until(until) => {}
                _ = stop.changed() => return,
            }
            continue;
        }
        let ops: Vec<TxnOp> = batch
            .iter()
            .map(|(key, value)| match value {
                Some(value) => TxnOp::put(key.clone(), value.clone(), None),
                None => TxnOp::delete(key.clone(), None),
            })
            .collect();
        let mut client = q.cluster.client.clone();
        let timeout = q.cluster.settings.request_timeout;
        let written = tokio::time::timeout(timeout, client.txn(Txn::new().and_then(ops))).await;
        if !matches!(written, Ok(Ok(_))) {
            tracing::debug!("clustering: queued messages not written to etcd yet: trying again");
            q.state.lock().put_back(batch, Instant::now());
            drop(q);
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(250)) => {}
                _ = stop.changed() => return,
            }
        }
    }
}

/// An instant nothing waits for (a day from now).
fn far_future() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(86_400)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(n: u8) -> Vec<u8> {
        vec![b'k', n]
    }

    const ALL: usize = 1 << 20;

    #[test]
    fn a_message_waits_before_it_is_written_and_goes_unwritten_if_delivered() {
        let t = Instant::now();
        let mut state = State::default();
        state.put(k(1), b"one".to_vec(), t);
        state.put(k(2), b"two".to_vec(), t);
        assert!(state.take(ALL, t).is_empty(), "not due yet");
        assert_eq!(state.next_due(), Some(t + LINGER));
        assert!(!state.remove(k(1), t), "nothing to write for it");
        let batch = state.take(ALL, t + LINGER);
        assert_eq!(batch, [(k(2), Some(b"two".to_vec()))]);
        // Its put left: the removal is a write, at once.
        assert!(state.remove(k(2), t + LINGER));
        assert_eq!(state.take(ALL, t + LINGER), [(k(2), None)]);
        assert!(state.take(ALL, t + LINGER * 2).is_empty());
        assert_eq!(state.next_due(), None);
    }

    #[test]
    fn a_batch_writes_no_key_twice_and_stays_in_order() {
        let t = Instant::now();
        let later = t + LINGER;
        let mut state = State::default();
        state.put(k(1), b"one".to_vec(), t);
        let failed = state.take(ALL, later);
        // Removed while its put was on its way, which then failed.
        assert!(state.remove(k(1), later));
        state.put_back(failed, later);
        state.put(k(2), b"two".to_vec(), t);
        assert_eq!(state.take(ALL, later), [(k(1), Some(b"one".to_vec()))]);
        assert_eq!(
            state.take(ALL, later),
            [(k(1), None), (k(2), Some(b"two".to_vec()))]
        );
    }

    #[test]
    fn a_batch_is_bounded_in_operations_and_bytes() {
        let t = Instant::now();
        let mut state = State::default();
        for n in 0..200u8 {
            state.put(vec![b'k', n], vec![0; 10], t);
        }
        let due = t + LINGER;
        assert_eq!(state.take(ALL, due).len(), BATCH_OPS);
        assert_eq!(state.take(200, due).len(), 2, "(2 + 10 + 64) bytes each");
        assert_eq!(state.take(1, due).len(), 1, "one at least");
    }

    #[test]
    fn an_ended_sessions_puts_do_not_leave() {
        let t = Instant::now();
        let mut state = State::default();
        state.put(b"Q/1:a/x".to_vec(), b"1".to_vec(), t);
        state.put(b"Q/2:ab/x".to_vec(), b"2".to_vec(), t);
        state.cancel_puts(b"Q/1:a/");
        assert_eq!(
            state.take(ALL, t + LINGER),
            [(b"Q/2:ab/x".to_vec(), Some(b"2".to_vec()))]
        );
    }
}
