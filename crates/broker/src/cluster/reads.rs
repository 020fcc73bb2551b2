//! Linearizable reads of keys' records, batched.
//!
//! Every GET (and every write whose record must be read again) needs a
//! linearizable read from etcd. Sent one by one, 64 concurrent GETs are 64
//! etcd requests, each with its own gRPC call and read index; on a machine
//! that etcd and the node share, that work is what bounds them. Here the
//! reads that arrive while others are on their way wait, and go together as
//! one read-only etcd transaction (one `Range` per distinct key; a single
//! key goes as a plain `Range`). etcd serves a read-only transaction
//! linearizably (a read index, as for a `Range`), at one point between its
//! sending and its answer: every read in the batch was asked for before it
//! was sent and is answered after, so each one's linearization point lies
//! inside its own call. The answers are what a read of each key alone
//! could have returned.
//!
//! One task owns the queue ([`batches::run`]); it ends when the [`Reads`]
//! handle (the cluster) is dropped. A read at low load goes out at once,
//! and at high load the reads that come while a batch is out make the next
//! one (etcd's own read index works the same way). A batch holds at most [`MAX_KEYS`] keys and
//! half etcd's request limit in key bytes; its answer can take up to
//! [`MAX_KEYS`] records of etcd's request limit each, which the cluster's
//! key-value client is allowed to decode ([`decoding_limit`]).

use std::collections::HashMap;
use std::sync::Arc;

use etcd_client::{KeyValue, KvClient, Txn, TxnOp, TxnOpResponse};
use tokio::sync::oneshot;

use super::batches;
use super::leader::Leader;
use super::route::Route;

/// Keys in one batch (etcd's `--max-txn-ops` is 128 by default).
pub(super) const MAX_KEYS: usize = 64;

/// What a read found: the key's etcd key-value (none: absent) and the
/// revision etcd answered at.
pub(super) struct Fetched {
    pub(super) kv: Option<KeyValue>,
    pub(super) revision: i64,
}

/// A read waiting for its batch.
struct Wanted {
    /// The etcd key.
    key: Vec<u8>,
    answer: oneshot::Sender<Result<Fetched, String>>,
}

/// The handle: reads go to etcd through it.
pub(super) struct Reads {
    batcher: batches::Batcher<Batch>,
}

impl Reads {
    /// Starts the task, reading along `route` (whose clients decode
    /// answers up to [`decoding_limit`]); `max_request_bytes` is etcd's request limit.
    /// Must be called within a tokio runtime.
    pub(super) fn start(route: Arc<Route>, leader: Arc<Leader>, max_request_bytes: usize) -> Reads {
        let max_key_bytes = max_request_bytes / 2;
        let batcher = batches::Batcher::start(route, leader, move || Batch {
            max_key_bytes,
            ..Batch::default()
        });
        Reads { batcher }
    }

    /// A linearizable read of etcd key `key`.
    pub(super) async fn read(&self, key: Vec<u8>) -> Result<Fetched, String> {
        let (answer, answered) = oneshot::channel();
        self.batcher
            .submit(Wanted { key, answer })
            .await
            .map_err(|()| "the node is shutting down".to_owned())?;
        answered.await.map_err(|_| batches::NO_ANSWER.to_owned())?
    }
}

/// The largest answer of etcd's to decode: [`MAX_KEYS`] records, each
/// under etcd's request limit `max_request_bytes` (gRPC's default, 4 MiB,
/// is seven records of 600 KB).
pub(super) fn decoding_limit(max_request_bytes: usize) -> usize {
    MAX_KEYS
        .saturating_mul(max_request_bytes)
        .saturating_add(1 << 20)
}

/// Reads going to etcd together: the distinct keys, and who waits for each.
#[derive(Default)]
struct Batch {
    /// The bound of the keys' bytes together.
    max_key_bytes: usize,
    keys: Vec<Vec<u8>>,
    /// The key's place in `keys`.
    places: HashMap<Vec<u8>, usize>,
    key_bytes: usize,
    waiting: Vec<(usize, oneshot::Sender<Result<Fetched, String>>)>,
}

impl batches::Batch for Batch {
    type Item = Wanted;
    const KIND: &'static str = "read";

    /// A key already in the batch always joins.
    fn fits(&self, wanted: &Wanted) -> bool {
        self.places.contains_key(&wanted.key)
            || (self.keys.len() < MAX_KEYS
                && self.key_bytes + wanted.key.len() <= self.max_key_bytes)
    }

    fn add(&mut self, wanted: Wanted) {
        let place = match self.places.get(&wanted.key) {
            Some(&place) => place,
            None => {
                let place = self.keys.len();
                self.key_bytes += wanted.key.len();
                self.places.insert(wanted.key.clone(), place);
                self.keys.push(wanted.key);
                place
            }
        };
        self.waiting.push((place, wanted.answer));
    }

    /// Reads every key in one etcd request and answers each waiting read.
    async fn send(self, mut kv: KvClient, leader: Arc<Leader>) -> bool {
        crate::metrics::cluster_read_batch(self.waiting.len());
        let found: Result<(Vec<Option<KeyValue>>, i64), String> = if self.keys.len() == 1 {
            kv.get(self.keys[0].clone(), None)
                .await
                .map(|mut response| {
                    leader.observe(response.header());
                    let revision = response.header().map_or(0, |h| h.revision());
                    (vec![response.take_kvs().into_iter().next()], revision)
                })
                .map_err(|e| e.to_string())
        } else {
            let ops = self.keys.iter().map(|key| TxnOp::get(key.clone(), None));
            let txn = Txn::new().and_then(ops.collect::<Vec<_>>());
            kv.txn(txn)
                .await
                .map_err(|e| e.to_string())
                .and_then(|response| {
                    leader.observe(response.header());
                    let revision = response.header().map_or(0, |h| h.revision());
                    let kvs: Vec<Option<KeyValue>> = response
                        .op_responses()
                        .into_iter()
                        .map(|op| match op {
                            TxnOpResponse::Get(mut get) => Ok(get.take_kvs().into_iter().next()),
                            _ => Err("etcd answered a read with something else".to_owned()),
                        })
                        .collect::<Result<_, _>>()?;
                    if kvs.len() != self.keys.len() {
                        return Err(format!(
                            "etcd answered {} reads of {}",
                            kvs.len(),
                            self.keys.len()
                        ));
                    }
                    Ok((kvs, revision))
                })
        };
        match found {
            Ok((kvs, revision)) => {
                for (place, answer) in self.waiting {
                    let _ = answer.send(Ok(Fetched {
                        kv: kvs[place].clone(),
                        revision,
                    }));
                }
                true
            }
            Err(e) => {
                for (_, answer) in self.waiting {
                    let _ = answer.send(Err(e.clone()));
                }
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::batches::Batch as _;
    use super::*;

    fn wanted(key: &str) -> (Wanted, oneshot::Receiver<Result<Fetched, String>>) {
        let (answer, answered) = oneshot::channel();
        (
            Wanted {
                key: key.as_bytes().to_vec(),
                answer,
            },
            answered,
        )
    }

    #[test]
    fn a_batch_reads_each_key_once_and_answers_everyone() {
        let mut batch = Batch {
            max_key_bytes: 1000,
            ..Batch::default()
        };
        let mut receivers = Vec::new();
        for key in ["a", "b", "a", "c", "b"] {
            let (w, r) = wanted(key);
            assert!(batch.fits(&w));
            batch.add(w);
            receivers.push(r);
        }
        assert_eq!(batch.keys, [b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);
        let places: Vec<usize> = batch.waiting.iter().map(|(p, _)| *p).collect();
        assert_eq!(places, [0, 1, 0, 2, 1]);
        assert_eq!(batch.key_bytes, 3);
    }

    #[test]
    fn a_batch_keeps_to_its_keys_and_bytes() {
        let mut batch = Batch {
            max_key_bytes: usize::MAX,
            ..Batch::default()
        };
        for n in 0..MAX_KEYS {
            let (w, _) = wanted(&format!("k{n:03}"));
            assert!(batch.fits(&w));
            batch.add(w);
        }
        let (more, _) = wanted("another");
        assert!(!batch.fits(&more), "past MAX_KEYS");
        let (again, _) = wanted("k000");
        assert!(batch.fits(&again), "a key already in");

        let mut small = Batch {
            max_key_bytes: 20,
            ..Batch::default()
        };
        let (w, _) = wanted("0123456789");
        small.add(w);
        let (w, _) = wanted("abcdefghij");
        assert!(small.fits(&w));
        small.max_key_bytes = 19;
        assert!(!small.fits(&w), "past the key bytes");
    }
}
