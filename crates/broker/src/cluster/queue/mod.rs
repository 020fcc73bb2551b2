//! Messages queued for persistent sessions, kept in etcd as well: a
//! session whose node died finds them there on the node it resumes on.
//!
//! Each QoS 1 and 2 message the router saves for persistent sessions
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
//! and their copies here go). The new node keeps the QoS 1 messages
//! handed over to it here too ([`Queue::keep_handed_over`], numbers with
//! the second bit set, from when the process started: never one the data
//! directory gives, nor one of an earlier run's), until its client has
//! them: a new node that dies before leaves them to the next one.
//!
//! QoS 2 messages are kept too, but a copy in etcd must say, once the
//! client may have its message, under which packet id: the next node
//! sends it again under that id, with DUP, which the client takes for the
//! same message if it had it (it keeps the id until the PUBREL, MQTT 5
//! 4.3.3), and gets if it had not. So the connection asks before it sends
//! one ([`Queue::sending`]): a put that has not left is not made, and a
//! copy written (or read back) is written again marked in flight under
//! the delivery's packet id (`crate::durable::format::encode_in_flight`),
//! and the delivery waits until etcd has it. The copy goes before the
//! PUBREL ([`Queue::releasing`]: the client forgets the id then, and a
//! copy sent again would be a new message), which waits until etcd has
//! the removal. So a QoS 2 message in flight when its node dies comes
//! exactly once: the client had it, or gets it (since 2026-11-30; before,
//! the copy went before the PUBLISH, and a message the client never got
//! was lost). A QoS 1 message may come again (QoS 1 allows it).

//! A batch etcd did not answer in time may still commit later, after
//! the removals sent since: every batch goes behind the node's fence
//! ([`fence`]), put again after a failure, and a failed batch's puts
//! count as written until they go again (see [`pending`]).

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

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{DeleteOptions, TxnOp};
use parking_lot::Mutex;
use router::protocol::{Publish, PublishProperties, QoS};
use router::{Message, MessageId};
use tokio::sync::oneshot;

use super::{Cluster, backlog};
use crate::durable::format::{encode_in_flight, encode_message};

mod fence;
mod pending;
mod read;
use fence::Fence;
use pending::{Keys, Pending};

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
/// The numbers of messages handed over to this node have it set.
const HANDED_OVER: u64 = 1 << 62;
/// How long a message waits before it is written: one its client
/// acknowledges by then is never written (a subscriber that keeps up
/// costs etcd nothing).
pub const LINGER: Duration = Duration::from_millis(100);

/// One session's QoS 2 messages whose copy is marked in flight, by packet
/// id: their numbers and keys.
type InFlight = HashMap<u16, (u64, Vec<u8>)>;

/// A message read back from etcd ([`Queue::read`]).
pub struct Queued {
    pub key: Vec<u8>,
    pub message: Message,
    /// The packet id it was in flight to its client under when its node
    /// wrote it (see [`Queue::sending`]): it goes again under that id.
    pub in_flight: Option<u16>,
}

impl Queued {
    /// Its key, and the message as another node hands one over (see
    /// `crate::sessions::Direct::handed_over`): its stamp removed, at QoS
    /// 1 at most, or at QoS 2 under the id it was in flight under.
    pub fn handed_over(self) -> (Vec<u8>, crate::sessions::Direct) {
        let mut properties = self.message.properties;
        if let Some(properties) = &mut properties {
            crate::publisher::unstamp(properties);
        }
        let direct =
            crate::sessions::Direct::handed_over(self.message.publish, properties, self.in_flight);
        (self.key, direct)
    }
}

/// See the module's documentation.
pub struct Queue {
    cluster: Arc<Cluster>,
    /// `[clustering] keep_queued_in_etcd`: messages are written (those
    /// kept earlier are read back and removed either way).
    keep: bool,
    /// The numbers this node gives without a data directory.
    next: AtomicU64,
    /// The numbers of messages read back.
    next_restored: AtomicU64,
    /// The numbers of messages handed over.
    next_handed_over: AtomicU64,
    pending: Mutex<Pending>,
    /// The keys of the messages read back, by client and number.
    restored: Mutex<HashMap<(String, u64), Vec<u8>>>,
    /// QoS 2 messages whose copy is marked in flight (see
    /// [`Queue::sending`]), by client. At most the router's in flight per
    /// session kept here.
    in_flight: Mutex<HashMap<String, InFlight>>,
    /// Wakes the writer (shared with it: it holds no strong reference
    /// while it waits).
    wake: Arc<tokio::sync::Notify>,
    /// What every batch goes behind (see [`fence`]).
    fence: Fence,
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
        let keys = Keys {
            etcd_prefix: cluster.settings.etcd_prefix.clone(),
            // Node ids have no `/`.
            own: format!("{}/{run}.", cluster.node_id()),
        };
        let queue = Arc::new(Queue {
            keep,
            next: AtomicU64::new(0),
            next_restored: AtomicU64::new(RESTORED),
            // From the time: an earlier run's copies may still be there
            // (with a data directory, under the same run).
            next_handed_over: AtomicU64::new(
                HANDED_OVER | (crate::clock::now_nanos() as u64 & (HANDED_OVER - 1)),
            ),
            pending: Mutex::new(Pending::new(keys)),
            restored: Mutex::new(HashMap::new()),
            in_flight: Mutex::new(HashMap::new()),
            wake: Arc::new(tokio::sync::Notify::new()),
            fence: Fence::new(&cluster.settings.etcd_prefix, cluster.node_id()),
            cluster,
        });
        backlog::start(&queue);
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

    /// Removes every message kept for `client_id`'s session (by any node):
    /// one operation, for the transaction that ends the session.
    pub fn delete_session(etcd_prefix: &str, client_id: &str) -> TxnOp {
        let prefix = Keys::session(etcd_prefix, client_id);
        TxnOp::delete(prefix, Some(DeleteOptions::new().with_prefix()))
    }

    /// `message` was handed over to this node for `client`'s session (see
    /// `super::handover`): kept like a queued message, under a number of
    /// its own, returned for [`Queue::delivered`] (`None`: QoS 0, or
    /// nothing is kept).
    pub fn keep_handed_over(&self, client: &str, message: &Message) -> Option<MessageId> {
        if !self.keep || message.publish.qos == QoS::AtMostOnce {
            return None;
        }
        let number = MessageId(self.next_handed_over.fetch_add(1, Ordering::Relaxed));
        self.keep(&[client], number, message);
        Some(number)
    }

    /// A QoS 1 `message` handed over for `client`'s session (or given it
    /// from another node's log, see `super::recent`) is kept in etcd here
    /// too until the client has it ([`Queue::keep_handed_over`]): its
    /// `on_done` removes the copy.
    pub fn keep_direct(self: &Arc<Queue>, client: &str, message: &mut crate::sessions::Direct) {
        if message.qos != 1 || message.kept_pkid.is_some() {
            return;
        }
        let publish = Publish {
            dup: false,
            qos: QoS::AtLeastOnce,
            pkid: 0,
            retain: message.retain,
            topic: message.topic.clone(),
            payload: message.payload.clone(),
        };
        let copy = Message {
            publish,
            properties: Some(message.properties.clone().into_publish()),
        };
        let Some(number) = self.keep_handed_over(client, &copy) else {
            return;
        };
        let (queue, client) = (Arc::downgrade(self), client.to_owned());
        let earlier = message.on_done.take();
        message.on_done = Some(crate::sessions::OnDone::new(move || {
            if let Some(queue) = queue.upgrade() {
                queue.delivered(&client, number);
            }
            if let Some(earlier) = &earlier {
                earlier.run();
            }
        }));
    }

    /// `message`, numbered `number`, is queued for the persistent sessions
    /// of `clients`: written for each (see the module's documentation).
    pub fn keep(&self, clients: &[&str], number: MessageId, message: &Message) {
        if !self.keep || message.publish.qos == QoS::AtMostOnce {
            return;
        }
        let Some(value) = encode_message(
            &message.publish,
            message.properties.as_ref(),
            crate::clock::now_ms(),
        ) else {
            tracing::error!(
                topic = %String::from_utf8_lossy(&message.publish.topic),
                "clustering: a message queued for persistent sessions cannot be encoded: not kept in etcd"
            );
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
        let value = Arc::new(value);
        let now = Instant::now();
        let mut pending = self.pending.lock();
        let idle = pending.len() == 0;
        for client in clients {
            let count = pending.count(client);
            if count >= MAX_PER_SESSION || pending.len() >= MAX_PENDING {
                crate::metrics::cluster_refused("queue_backlog");
                // Once as the bound is reached, not for every message past
                // it (before, once per message while the count stayed at
                // the bound: 24,699 lines in one fault round).
                if pending.refused(client) {
                    tracing::warn!(
                        client_id = client,
                        count,
                        waiting = pending.len(),
                        "clustering: messages queued for a persistent session are not kept in etcd from now: the session has too many there, or too many writes wait"
                    );
                }
                continue;
            }
            pending.put(client, number.0, Arc::clone(&value), now);
        }
        drop(pending);
        // A writer with something to write has its time to wake already.
        if idle {
            self.wake.notify_one();
        }
    }

    /// `client` has message `number`: its copy goes (or is not written).
    pub fn delivered(&self, client: &str, number: MessageId) {
        let key = self.take_restored(client, number);
        let mut pending = self.pending.lock();
        let idle = pending.len() == 0;
        let removal = match key {
            Some(key) => {
                pending.remove(key);
                true
            }
            None => pending.delivered(client, number.0),
        };
        drop(pending);
        if removal && idle {
            self.wake.notify_one();
        }
    }

    /// `client`'s connection is about to send it message `number` at QoS
    /// 2, `publish` (see the module's documentation): what to wait for
    /// before it does, if anything (its copy in etcd marked in flight
    /// under `publish`'s packet id).
    pub fn sending(
        &self,
        client: &str,
        number: MessageId,
        publish: &Publish,
        properties: Option<&PublishProperties>,
    ) -> Option<oneshot::Receiver<()>> {
        let key = if number.0 & RESTORED != 0 {
            self.take_restored(client, number)?
        } else {
            self.pending.lock().sending(client, number.0)?
        };
        let marked = (publish.pkid != 0)
            .then(|| encode_in_flight(publish, properties, crate::clock::now_ms(), publish.pkid))
            .flatten();
        tracing::trace!(
            client,
            number = number.0,
            pkid = publish.pkid,
            key = %String::from_utf8_lossy(&key),
            marked = marked.is_some(),
            "clustering: a QoS 2 delivery's copy in etcd is marked in flight before it is sent"
        );
        let heard = match marked {
            Some(value) => {
                self.in_flight
                    .lock()
                    .entry(client.to_owned())
                    .or_default()
                    .insert(publish.pkid, (number.0, key.clone()));
                self.pending.lock().mark_waited(key, value)
            }
            // It cannot be marked (it was encoded once): gone before it is
            // sent, as never twice.
            None => self.pending.lock().remove_waited(key),
        };
        self.wake.notify_one();
        Some(heard)
    }

    /// `client`'s connection is about to send the PUBREL of the QoS 2
    /// delivery under `pkid`: what to wait for before it does, if
    /// anything (the message's copy marked in flight going from etcd).
    pub fn releasing(&self, client: &str, pkid: u16) -> Option<oneshot::Receiver<()>> {
        let (_, key) = {
            let mut in_flight = self.in_flight.lock();
            let of_client = in_flight.get_mut(client)?;
            let copy = of_client.remove(&pkid)?;
            if of_client.is_empty() {
                in_flight.remove(client);
            }
            copy
        };
        tracing::trace!(
            client,
            pkid,
            key = %String::from_utf8_lossy(&key),
            "clustering: a QoS 2 delivery's copy in etcd goes before its PUBREL"
        );
        Some(self.remove_waited(key))
    }

    /// The key of message `number` read back for `client`, no longer kept
    /// here (`None`: not a message read back, or already taken).
    fn take_restored(&self, client: &str, number: MessageId) -> Option<Vec<u8>> {
        if number.0 & RESTORED == 0 {
            return None;
        }
        self.restored.lock().remove(&(client.to_owned(), number.0))
    }

    /// `client`'s session is handed over to another node (see
    /// `super::handover`): forgotten here, its puts not made are not made;
    /// returns, by number, the keys of the copies of its messages in etcd
    /// this node wrote or read back, for the handover to remove (a node
    /// that read the session's queue later would send them again). To call
    /// before the router gives the session up: that forgets it here (see
    /// [`Queue::forget`]), and the copies would stay in etcd until the
    /// session ends.
    pub fn hand_over(&self, client: &str) -> HashMap<MessageId, Vec<u8>> {
        let mut copies: HashMap<MessageId, Vec<u8>> = HashMap::new();
        {
            let mut restored = self.restored.lock();
            restored.retain(|(c, n), key| {
                if c != client {
                    return true;
                }
                copies.insert(MessageId(*n), std::mem::take(key));
                false
            });
        }
        for (n, key) in self.pending.lock().hand_over(client) {
            copies.insert(MessageId(n), key);
        }
        for (_, (n, key)) in self.in_flight.lock().remove(client).unwrap_or_default() {
            copies.insert(MessageId(n), key);
        }
        copies
    }

    /// `client`'s session ended here: what is kept of it in memory goes,
    /// and its writes not made yet are not made. Its copies in etcd go
    /// with its session record (see the module's documentation).
    pub fn forget(&self, client: &str) {
        self.restored.lock().retain(|(c, _), _| c != client);
        self.in_flight.lock().remove(client);
        self.pending.lock().forget(client);
    }

    /// Node `node` holds a session this node takes, but has no link here:
    /// its fence goes first (see [`fence`]), so that no batch of its
    /// commits after this node reads the session's copies.
    pub async fn fence_off(&self, node: &str) -> Result<(), String> {
        let mut client = self.cluster.client.clone();
        let prefix = &self.cluster.settings.etcd_prefix;
        tokio::time::timeout(
            self.cluster.settings.request_timeout,
            fence::fence_off(&mut client, prefix, node),
        )
        .await
        .map_err(|_| "etcd did not answer in time".to_owned())?
        .map_err(|e| e.to_string())
    }

    /// A number for a message read back from etcd.
    pub fn restored_number(&self) -> MessageId {
        MessageId(self.next_restored.fetch_add(1, Ordering::Relaxed))
    }

    /// `client`'s router took the messages read back (`key` by number): each
    /// goes from etcd when the client has it.
    pub fn restored(&self, client: &str, messages: Vec<(MessageId, Vec<u8>)>) {
        let mut restored = self.restored.lock();
        for (number, key) in messages {
            restored.insert((client.to_owned(), number.0), key);
        }
    }

    /// Removes `key`; the receiver hears when etcd has the removal.
    pub fn remove_waited(&self, key: Vec<u8>) -> oneshot::Receiver<()> {
        let heard = self.pending.lock().remove_waited(key);
        self.wake.notify_one();
        heard
    }

    /// Removes `keys` (read back and not for the session).
    pub fn remove(&self, keys: Vec<Vec<u8>>) {
        let mut pending = self.pending.lock();
        for key in keys {
            pending.remove(key);
        }
        drop(pending);
        self.wake.notify_one();
    }
}

/// What the writer takes at a time: the changes, and their operations.
impl Queue {
    /// Writes what waits to be written now, [`LINGER`] or not: the node
    /// stops, and the next node to resume one of its sessions reads them
    /// here. Waits at most `timeout`; returns how many writes are left.
    pub async fn flush(&self, timeout: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut client = self.cluster.client.clone();
        let budget = self.cluster.settings.max_request_bytes / 2;
        loop {
            let (changes, ops) = self.pending.lock().take(budget, Instant::now() + LINGER);
            if changes.is_empty() {
                return 0;
            }
            let txn = self.fence.commit(&mut client, &self.cluster, ops);
            if !matches!(tokio::time::timeout_at(deadline, txn).await, Ok(Ok(true))) {
                self.failed(changes);
                return self.pending.lock().len();
            }
            changes.into_iter().for_each(pending::Change::done);
        }
    }
}

impl Queue {
    /// A batch of `changes` etcd did not take: they go back, and as the
    /// batch may still commit, the fence goes up again before the next.
    fn failed(&self, changes: Vec<pending::Change>) {
        self.fence.lower();
        self.pending.lock().put_back(changes, Instant::now());
    }
}

pub struct Batch {
    changes: Vec<pending::Change>,
    ops: Vec<TxnOp>,
}

impl backlog::Backlog for Queue {
    type Batch = Batch;
    const WHAT: &'static str = "queued messages";

    fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    fn wake(&self) -> &Arc<tokio::sync::Notify> {
        &self.wake
    }

    fn take(&self) -> Option<Batch> {
        let budget = self.cluster.settings.max_request_bytes / 2;
        let (changes, ops) = self.pending.lock().take(budget, Instant::now());
        (!changes.is_empty()).then_some(Batch { changes, ops })
    }

    fn next_due(&self) -> Option<Instant> {
        self.pending.lock().next_due()
    }

    async fn commit(
        &self,
        client: &mut etcd_client::Client,
        batch: &mut Batch,
    ) -> Result<(), etcd_client::Error> {
        let ops = std::mem::take(&mut batch.ops);
        if !self.fence.commit(client, &self.cluster, ops).await? {
            return Err(etcd_client::Error::InvalidArgs(
                "the queue's fence moved: written again".into(),
            ));
        }
        // Those waiting for a removal hear (a QoS 2 delivery, see
        // `Queue::sending`).
        std::mem::take(&mut batch.changes)
            .into_iter()
            .for_each(pending::Change::done);
        Ok(())
    }

    fn put_back(&self, batch: Batch) {
        self.failed(batch.changes);
    }
}

/// Against a real etcd member (`etcd` on PATH).
#[cfg(test)]
mod etcd_tests;
