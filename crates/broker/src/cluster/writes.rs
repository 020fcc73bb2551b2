//! A node's writes of keys' records, batched.
//!
//! A write commits with `If mod_revision(key) == m Then Put(record) Else
//! Get(key)` (see [`super::kv`]). Sent one by one, 64 concurrent writes
//! are 64 etcd transactions; here the writes that arrive while others are
//! on their way go together as one: `If` every key's compare `Then` every
//! put `Else` every get. Each write still commits only on the record it
//! was planned against, and atomically: the transaction is all or
//! nothing, at one point between its sending and its answer.
//!
//! When a compare fails, nothing is put: each key's current record comes
//! back; the writes whose key moved get it (to plan again, as alone), and
//! the others, whose compare held, are sent again at once, in a batch of
//! their own, so each round ends at least one write and the rounds end.
//! An error (a timeout: the transaction may have committed) is every
//! write's, and each one finds out by reading, as alone.
//!
//! One task owns the queue ([`batches::run`], as [`super::reads`]); it
//! ends when the [`Writes`] handle (the cluster) is dropped. A batch holds distinct keys, at most [`MAX_KEYS`] of them and
//! records of at most etcd's request limit together.

use std::collections::HashSet;
use std::sync::Arc;

use etcd_client::{Compare, CompareOp, KeyValue, KvClient, Txn, TxnOp, TxnOpResponse};
use tokio::sync::oneshot;

use super::batches::{self, Batch as _};
use super::leader::Leader;
use super::route::Route;

/// Keys in one batch: each is a compare, a put and a get (etcd's
/// `--max-txn-ops`, 128 by default, bounds each of the three lists).
pub(super) const MAX_KEYS: usize = 64;

/// Bytes of a batch's request beyond its keys and records: etcd's framing
/// of each operation and the request's header.
const PER_KEY_FRAMING: usize = 64;
const FRAMING: usize = 4096;

/// What became of a write.
pub(super) enum Outcome {
    /// Its record was put, at etcd revision `revision`.
    Committed { revision: i64 },
    /// The key had changed: its current key-value (none: absent), as of
    /// revision `revision`.
    Changed { kv: Option<KeyValue>, revision: i64 },
}

/// A write waiting for its batch.
struct Wanted {
    /// The etcd key.
    key: Vec<u8>,
    /// The key's mod revision the record was planned against (0: absent).
    revision: i64,
    /// The encoded record.
    record: Vec<u8>,
    answer: oneshot::Sender<Result<Outcome, String>>,
}

impl Wanted {
    fn bytes(&self) -> usize {
        request_bytes(self.key.len(), self.record.len())
    }
}

/// What one write counts in a batch's request: its etcd key three times
/// (compare, put, get), its record, and their framing.
fn request_bytes(etcd_key: usize, record: usize) -> usize {
    etcd_key * 3 + record + PER_KEY_FRAMING
}

/// Whether a write of `record` bytes at an etcd key of `etcd_key` bytes,
/// in a batch of its own, stays within etcd's `max_request_bytes`: one
/// that does not would be refused by etcd, whatever the batch.
pub(super) fn fits_a_request(etcd_key: usize, record: usize, max_request_bytes: usize) -> bool {
    request_bytes(etcd_key, record) <= max_request_bytes.saturating_sub(FRAMING)
}

/// The handle: writes go to etcd through it.
pub(super) struct Writes {
    batcher: batches::Batcher<Batch>,
}

impl Writes {
    /// Starts the task, writing along `route`; `max_request_bytes` is etcd's
    /// request limit. Must be called within a tokio runtime.
    pub(super) fn start(
        route: Arc<Route>,
        leader: Arc<Leader>,
        max_request_bytes: usize,
    ) -> Writes {
        let max_bytes = max_request_bytes.saturating_sub(FRAMING);
        let batcher = batches::Batcher::start(route, leader, move || Batch {
            max_bytes,
            ..Batch::default()
        });
        Writes { batcher }
    }

    /// Puts `record` at etcd key `key` if the key is still at `revision`.
    /// `Err`: etcd did not confirm (it may have committed).
    pub(super) async fn compare_and_put(
        &self,
        key: Vec<u8>,
        revision: i64,
        record: Vec<u8>,
    ) -> Result<Outcome, String> {
        let (answer, answered) = oneshot::channel();
        self.batcher
            .submit(Wanted {
                key,
                revision,
                record,
                answer,
            })
            .await
            .map_err(|()| "the node is shutting down".to_owned())?;
        answered.await.map_err(|_| batches::NO_ANSWER.to_owned())?
    }
}

/// Writes going to etcd together.
#[derive(Default)]
struct Batch {
    /// The bound of the request's bytes.
    max_bytes: usize,
    writes: Vec<Wanted>,
    keys: HashSet<Vec<u8>>,
    bytes: usize,
}

impl batches::Batch for Batch {
    type Item = Wanted;
    const KIND: &'static str = "write";

    /// A key not in the batch yet (one write per key), within the bounds.
    fn fits(&self, wanted: &Wanted) -> bool {
        !self.keys.contains(&wanted.key)
            && self.writes.len() < MAX_KEYS
            && self.bytes + wanted.bytes() <= self.max_bytes
    }

    fn add(&mut self, wanted: Wanted) {
        self.bytes += wanted.bytes();
        self.keys.insert(wanted.key.clone());
        self.writes.push(wanted);
    }

    /// Commits the batch, and again the writes whose compare held while
    /// another one's did not, until every write is answered.
    async fn send(self, kv: KvClient, leader: Arc<Leader>) -> bool {
        let mut batch = self;
        loop {
            match batch.commit(kv.clone(), &leader).await {
                Ok(Some(again)) => batch = again,
                Ok(None) => return true,
                Err(()) => return false,
            }
        }
    }
}

impl Batch {
    /// Commits the batch and answers its writes; gives back the writes to
    /// send again (their compare held, another one's did not). `Err`: etcd
    /// did not answer (each write was told).
    async fn commit(self, mut kv: KvClient, leader: &Leader) -> Result<Option<Batch>, ()> {
        crate::metrics::cluster_write_batch(self.writes.len());
        let compares: Vec<Compare> = self
            .writes
            .iter()
            .map(|w| Compare::mod_revision(w.key.clone(), CompareOp::Equal, w.revision))
            .collect();
        let puts: Vec<TxnOp> = self
            .writes
            .iter()
            .map(|w| TxnOp::put(w.key.clone(), w.record.clone(), None))
            .collect();
        let gets: Vec<TxnOp> = self
            .writes
            .iter()
            .map(|w| TxnOp::get(w.key.clone(), None))
            .collect();
        let txn = Txn::new().when(compares).and_then(puts).or_else(gets);
        let response = match kv.txn(txn).await {
            Ok(response) => response,
            Err(e) => {
                let e = e.to_string();
                for write in self.writes {
                    let _ = write.answer.send(Err(e.clone()));
                }
                return Err(());
            }
        };
        leader.observe(response.header());
        let revision = response.header().map_or(0, |h| h.revision());
        if response.succeeded() {
            for write in self.writes {
                let _ = write.answer.send(Ok(Outcome::Committed { revision }));
            }
            return Ok(None);
        }
        let current: Vec<Option<KeyValue>> = response
            .op_responses()
            .into_iter()
            .filter_map(|op| match op {
                TxnOpResponse::Get(mut get) => Some(get.take_kvs().into_iter().next()),
                _ => None,
            })
            .collect();
        if current.len() != self.writes.len() {
            let e = format!(
                "etcd answered {} reads of {} keys",
                current.len(),
                self.writes.len()
            );
            for write in self.writes {
                let _ = write.answer.send(Err(e.clone()));
            }
            return Err(());
        }
        let held = |write: &Wanted, kv: &Option<KeyValue>| {
            kv.as_ref().map_or(0, KeyValue::mod_revision) == write.revision
        };
        // Had every compare held (it cannot), each write would plan again.
        let any_moved = self.writes.iter().zip(&current).any(|(w, kv)| !held(w, kv));
        let mut again = Batch {
            max_bytes: self.max_bytes,
            ..Batch::default()
        };
        for (write, kv) in self.writes.into_iter().zip(current) {
            if any_moved && held(&write, &kv) {
                again.add(write);
            } else {
                let _ = write.answer.send(Ok(Outcome::Changed { kv, revision }));
            }
        }
        Ok((!again.writes.is_empty()).then_some(again))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wanted(key: &str, record: usize) -> Wanted {
        let (answer, _) = oneshot::channel();
        Wanted {
            key: key.as_bytes().to_vec(),
            revision: 0,
            record: vec![0; record],
            answer,
        }
    }

    #[test]
    fn a_batch_takes_one_write_per_key_within_its_bounds() {
        let mut batch = Batch {
            max_bytes: usize::MAX,
            ..Batch::default()
        };
        batch.add(wanted("a", 10));
        assert!(!batch.fits(&wanted("a", 10)), "a key twice");
        assert!(batch.fits(&wanted("b", 10)));
        let size = wanted("b", 10).bytes();
        batch.max_bytes = batch.bytes + size - 1;
        assert!(!batch.fits(&wanted("b", 10)), "bytes");
        batch.max_bytes = batch.bytes + size;
        assert!(batch.fits(&wanted("b", 10)));
        batch.max_bytes = usize::MAX;
        for n in 1..MAX_KEYS {
            batch.add(wanted(&format!("k{n}"), 1));
        }
        assert!(!batch.fits(&wanted("z", 1)), "past MAX_KEYS");
    }
}
