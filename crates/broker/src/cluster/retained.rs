//! Retained messages kept in etcd, so that a node that joins (or starts
//! again without its data directory) serves the same set as the others.
//!
//! The node a client published a retained message on writes it to etcd,
//! `<etcd_prefix>R/<topic>`: when the node took it in (Unix nanoseconds,
//! u64 big-endian), then the message as the data directory keeps it; a
//! client clearing the topic leaves a tombstone (the time only) under a
//! lease of `tombstone_ttl_s`. The writes leave in the background, the newest
//! message per topic only, in batches; the PUBACK does not wait for them.
//!
//! Nodes write independently, so a write compares first: it replaces the
//! record only if the record is older (etcd compares the values as bytes,
//! and the time comes first), and a clear made after a publish on another
//! node wins even if its write reaches etcd first. Times are the nodes'
//! clocks: two publishes on one topic on two nodes closer together than
//! the clocks' difference may be kept in either order.
//! Live, retained messages reach the other nodes with the publish (see
//! [`super::peers`]); etcd is read when a node starts.
//!
//! Bounds: at most [`MAX_PENDING`] topics wait to be written (past it,
//! the message is not kept in etcd: counted, logged); a message larger
//! than etcd takes is not kept there (logged).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use parking_lot::Mutex;
use router::Message;
use router::protocol::{Publish, PublishProperties};

use super::{Cluster, backlog};
use crate::durable::format::{decode_message, encode_message};

/// Topics waiting to be written, at most.
pub const MAX_PENDING: usize = 100_000;
/// Topics per transaction: each is a nested transaction of up to three
/// operations, within etcd's default `--max-txn-ops` of 128.
const BATCH_OPS: usize = 32;
/// A tombstone's length: the time only.
const TOMBSTONE_LEN: usize = 8;

/// The retained messages this node's clients published, on their way to
/// etcd.
pub struct Retained {
    cluster: Arc<Cluster>,
    /// `<etcd_prefix>R/`.
    prefix: Vec<u8>,
    /// Topic -> the newest record (a message, or a tombstone), not
    /// written yet.
    pending: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
    /// Wakes the writer (shared with it: it holds no strong reference
    /// while it waits).
    wake: Arc<tokio::sync::Notify>,
}

impl Retained {
    /// Starts the writer; it ends when the returned value is dropped.
    pub fn start(cluster: Arc<Cluster>) -> Arc<Retained> {
        let prefix = format!("{}R/", cluster.settings.etcd_prefix).into_bytes();
        let retained = Arc::new(Retained {
            cluster,
            prefix,
            pending: Mutex::new(HashMap::new()),
            wake: Arc::new(tokio::sync::Notify::new()),
        });
        backlog::start(&retained);
        retained
    }

    /// A client of this node published `publish` with RETAIN: kept in
    /// etcd (an empty payload clears the topic).
    pub fn keep(&self, publish: &Publish, properties: Option<&PublishProperties>) {
        let stamp = stamp();
        let value = if publish.payload.is_empty() {
            stamp.to_vec()
        } else {
            match encode_message(publish, properties, crate::clock::now_ms()) {
                Some(message)
                    if message.len() + publish.topic.len() + 512
                        <= self.cluster.settings.max_request_bytes =>
                {
                    [stamp.as_slice(), &message].concat()
                }
                _ => {
                    tracing::warn!(
                        topic = %String::from_utf8_lossy(&publish.topic),
                        "clustering: a retained message larger than etcd takes is not kept in etcd (nodes that join later will not have it)"
                    );
                    return;
                }
            }
        };
        let mut pending = self.pending.lock();
        if pending.len() >= MAX_PENDING && !pending.contains_key(publish.topic.as_ref()) {
            drop(pending);
            crate::metrics::cluster_refused("retained_backlog");
            tracing::warn!(
                topic = %String::from_utf8_lossy(&publish.topic),
                "clustering: too many retained messages waiting for etcd: this one is not kept there"
            );
            return;
        }
        pending.insert(publish.topic.to_vec(), value);
        drop(pending);
        self.wake.notify_one();
    }

    /// The retained messages in etcd (expired ones left out).
    pub async fn load(&self) -> Result<Vec<Message>, String> {
        let mut client = self.cluster.client.clone();
        let read = client.get(self.prefix.clone(), Some(GetOptions::new().with_prefix()));
        let response = tokio::time::timeout(self.cluster.settings.request_timeout * 5, read)
            .await
            .map_err(|_| "etcd did not answer in time".to_owned())?
            .map_err(|e| e.to_string())?;
        let now = crate::clock::now_ms();
        let mut messages = Vec::new();
        for kv in response.kvs() {
            let Some(message) = kv.value().get(TOMBSTONE_LEN..).filter(|m| !m.is_empty()) else {
                continue;
            };
            match decode_message(message, now) {
                Ok(Some(message)) => messages.push(message),
                Ok(None) => {}
                Err(e) => tracing::warn!(
                    key = %String::from_utf8_lossy(kv.key()),
                    error = e,
                    "clustering: a retained message in etcd cannot be read: skipped"
                ),
            }
        }
        Ok(messages)
    }
}

impl backlog::Backlog for Retained {
    /// Topics and their records.
    type Batch = Vec<(Vec<u8>, Vec<u8>)>;
    const WHAT: &'static str = "retained messages";

    fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    fn wake(&self) -> &Arc<tokio::sync::Notify> {
        &self.wake
    }

    /// Up to [`BATCH_OPS`] waiting topics, taken out, within half of
    /// etcd's request size (one at least).
    fn take(&self) -> Option<Self::Batch> {
        let budget = self.cluster.settings.max_request_bytes / 2;
        let mut pending = self.pending.lock();
        let mut bytes = 0;
        let topics: Vec<Vec<u8>> = pending
            .iter()
            .take(BATCH_OPS)
            .take_while(|(topic, value)| {
                let first = bytes == 0;
                bytes += topic.len() + value.len() + 64;
                first || bytes <= budget
            })
            .map(|(topic, _)| topic.clone())
            .collect();
        let batch: Self::Batch = topics
            .into_iter()
            .filter_map(|t| pending.remove_entry(&t))
            .collect();
        (!batch.is_empty()).then_some(batch)
    }

    fn next_due(&self) -> Option<Instant> {
        (!self.pending.lock().is_empty()).then(Instant::now)
    }

    /// Writes `batch` in one transaction: each record replaces what etcd
    /// has of its topic only if that is older (or absent); tombstones
    /// under a lease of `tombstone_ttl_s`.
    async fn commit(
        &self,
        client: &mut etcd_client::Client,
        batch: &mut Self::Batch,
    ) -> Result<(), etcd_client::Error> {
        let tombstones = batch.iter().any(|(_, v)| v.len() == TOMBSTONE_LEN);
        let lease = if tombstones {
            let ttl = self.cluster.settings.tombstone_ttl.as_secs().max(1) as i64;
            Some(client.lease_grant(ttl, None).await?.id())
        } else {
            None
        };
        let ops = batch.iter().map(|(topic, value)| {
            let key = [self.prefix.as_slice(), topic].concat();
            let options = (value.len() == TOMBSTONE_LEN)
                .then(|| lease.map(|l| PutOptions::new().with_lease(l)))
                .flatten();
            let put = TxnOp::put(key.clone(), value.clone(), options);
            let newer = Txn::new()
                .when([Compare::value(key.clone(), CompareOp::Less, value.clone())])
                .and_then([put.clone()]);
            TxnOp::txn(
                Txn::new()
                    .when([Compare::create_revision(key, CompareOp::Equal, 0)])
                    .and_then([put])
                    .or_else([TxnOp::txn(newer)]),
            )
        });
        client
            .txn(Txn::new().and_then(ops.collect::<Vec<_>>()))
            .await?;
        Ok(())
    }

    /// Unless newer records came meanwhile.
    fn put_back(&self, batch: Self::Batch) {
        let mut pending = self.pending.lock();
        for (topic, value) in batch {
            pending.entry(topic).or_insert(value);
        }
    }
}

/// Now, as a record starts: Unix nanoseconds, big-endian (so etcd's byte
/// comparison orders records by it).
fn stamp() -> [u8; TOMBSTONE_LEN] {
    (crate::clock::now_nanos() as u64).to_be_bytes()
}
