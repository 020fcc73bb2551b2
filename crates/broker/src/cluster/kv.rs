//! Serving the state store's commands against etcd.
//!
//! A GET reads the key's record with a linearizable read (with
//! `[clustering] cached_reads`, it answers from the node's [`Cache`](super::cache::Cache) when
//! that keeps the key: not linearizable). A write (SET,
//! DEL, VDEL) plans (`statestore::plan`: the answers and errors are the
//! single node's) against the record this node last knew of the key (its
//! [`Cache`](super::cache::Cache), fed by the watch, its reads and its writes) and commits with
//! one transaction: `If mod_revision(key) == m Then Put(record) Else
//! Get(key)`: one round trip when the record was current. When another
//! node changed the key first, the transaction returns the current record
//! and the write plans again against it. A write that would change nothing
//! or be refused (`:-1`, `:0`, a fencing error) is only as current as its
//! record, so from the cache it is read again linearizably and planned
//! again before it is answered. Reads and writes waiting at the same time
//! go to etcd together ([`super::reads`], [`super::writes`]).
//!
//! **Answers etcd cannot confirm.** A transaction that times out may still
//! commit. Every record carries the id of the request that wrote it, and
//! every attempt compares on the revision it read, so at most one attempt
//! of a request commits; the next read tells which: the request's own
//! record (answered as done), the same revision (nothing committed: try
//! again), or another writer's record after an attempt in doubt, which
//! gets **no answer**: the client times out, as it would if the network had
//! lost the answer. A wrong answer is never sent.
//!
//! **Requests sent again** (MQTT DUP: the client's node died, or its
//! connection broke, before the answer) read the key's record: their own
//! write is answered as done. When the record is another request's, the
//! key's earlier records are read back from etcd's history, newest first,
//! down to the first older than the request itself (its `__ts`), as long
//! as etcd has not compacted them: a write of the request found there
//! (another client wrote the key after it) is answered as done too.
//!
//! SCAN reads pages of records rather than one key: [`super::scan`].

use etcd_client::{GetOptions, Txn, TxnOp};
use statestore::db::Entry;
use statestore::hlc::{Hlc, Version};
use statestore::plan::{Change, Planner, Stamp};
use statestore::resp3::Frame;
use statestore::store::Keyed;
use statestore::{Error, Quota};

use super::Cluster;
use super::record::Record;
use super::writes::Outcome;

/// A node's hybrid logical clock (kept in its `statestore::Store`).
pub trait NodeClock: Send + Sync {
    /// Takes in a version another node handed out.
    fn observe(&self, seen: Version);
    /// Hands out a new version.
    fn mint(&self, now_ms: u64, received: Option<&Hlc>) -> Version;
    /// The clock's reading: for answers that show no version.
    fn clock_now(&self, now_ms: u64) -> Version;
    /// The wall clock, milliseconds since the Unix epoch.
    fn wall_ms(&self) -> u64;
}

/// An answer to send.
#[derive(Debug)]
pub struct Answer {
    /// The RESP3 answer.
    pub frame: Frame,
    /// `__ts`.
    pub version: statestore::hlc::Stamp,
    /// The error answered, if any (for logs and metrics).
    pub error: Option<Error>,
}

/// Why a request gets no answer.
#[derive(Debug, thiserror::Error)]
pub enum Unanswered {
    /// etcd did not answer (no quorum, or unreachable).
    #[error("etcd did not answer: {0}")]
    Unreachable(String),
    /// A write whose outcome etcd could not confirm, and the key changed
    /// since: whether it committed cannot be told.
    #[error("a write etcd could not confirm, and the key changed since")]
    InDoubt,
    /// Other nodes kept changing the key.
    #[error("the key kept changing ({0} attempts)")]
    Contended(usize),
}

/// Conflicts with other nodes' writes retried before giving up.
const ATTEMPTS: usize = 32;

/// A key's earlier records a request sent again looks through for its own
/// write, at most (see `Cluster::written_before`).
const HISTORY: usize = 64;

/// Tries of a linearizable read that fails before the request goes
/// unanswered.
pub(super) const READ_ATTEMPTS: usize = 3;

/// The pause after failed try `attempt` of a read.
pub(super) async fn back_off(attempt: usize) {
    tokio::time::sleep(std::time::Duration::from_millis(100 * attempt as u64)).await;
}

/// The cluster's quotas: the sizes of one key and one value, the store's
/// keys and bytes across nodes (as the watch counted them: writes made on
/// several nodes at once may pass `max_keys` or `max_bytes` by what they
/// add together), and etcd's request limit.
struct Sizes<'a> {
    quota: &'a Quota,
    /// etcd's request limit.
    max_request_bytes: usize,
    /// What a record's etcd key adds to the store's key.
    key_prefix: usize,
    /// The node id a record carries.
    node: usize,
    /// The text of the request's fencing token (0: none).
    token: usize,
    /// Keys and bytes in the store now (see [`Cluster::keyspace`]).
    keyspace: (usize, u64),
}

impl Planner for Sizes<'_> {
    fn check_quota(&self, key: &[u8], value: &[u8], existing: Option<&Entry>) -> Result<(), Error> {
        if key.len() > self.quota.max_key_size || value.len() > self.quota.max_value_size {
            return Err(Error::QuotaExceeded);
        }
        let (keys, bytes) = self.keyspace;
        if existing.is_none() && keys as u64 >= self.quota.max_keys {
            return Err(Error::QuotaExceeded);
        }
        let freed = existing.map_or(0, Entry::size);
        let needed = (key.len() + value.len()) as u64;
        if bytes.saturating_sub(freed) + needed > self.quota.max_bytes {
            return Err(Error::QuotaExceeded);
        }
        // The write as the batcher counts it (the etcd key three times,
        // the record with its node id and fencing token, the framing), in
        // a request of its own: etcd refuses a longer one, and a refusal
        // would read as an outcome not known (no answer).
        let token = self.token.max(
            existing
                .and_then(Entry::fencing_token)
                .map_or(0, |t| t.to_string().len()),
        );
        let record = Record::encoded_len(self.node, token, value.len());
        let etcd_key = self.key_prefix + key.len();
        if !super::writes::fits_a_request(etcd_key, record, self.max_request_bytes) {
            crate::metrics::cluster_refused("value_over_etcd_limit");
            tracing::info!(
                key_bytes = key.len(),
                value_bytes = value.len(),
                limit = self.max_request_bytes,
                "SET refused: the record would pass etcd's request limit (clustering.etcd_max_request_bytes)"
            );
            return Err(Error::QuotaExceeded);
        }
        Ok(())
    }

    fn persists_by_policy(&self, _: &[u8]) -> bool {
        false
    }
}

/// Deliberately wrong behaviour, for the history checker's own test only
/// (it must flag it): the environment variable `STATEBROKER_CLUSTER_BROKEN`
/// of a node's process, `lost-update` or `stale-reads`. Logged at ERROR.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Broken {
    /// Correct.
    #[default]
    No,
    /// Writes do not compare the revision they planned against (and wait
    /// 20 ms after their read, so that races are common).
    LostUpdate,
    /// GET answers from the first record this node saw of the key.
    StaleReads,
}

impl Broken {
    /// Reads `STATEBROKER_CLUSTER_BROKEN`.
    pub fn from_env() -> Broken {
        match std::env::var("STATEBROKER_CLUSTER_BROKEN").as_deref() {
            Ok("lost-update") => Broken::LostUpdate,
            Ok("stale-reads") => Broken::StaleReads,
            _ => Broken::No,
        }
    }
}

/// A key's record as read, with its etcd mod revision (0: no record).
#[derive(Clone)]
pub(super) struct Read {
    pub(super) record: Option<Record>,
    pub(super) revision: i64,
}

impl Cluster {
    /// Serves a key command (SET, GET, DEL, VDEL) of request `request`
    /// (see [`super::record::request_id`]); `resent`: the client sent it
    /// again (MQTT DUP, as after a reconnection to this node): if the
    /// key's record is this request's write, its answer is that write's.
    pub async fn serve_key(
        &self,
        keyed: &Keyed<'_>,
        (request, resent): (u64, bool),
        quota: &Quota,
        clock: &dyn NodeClock,
    ) -> Result<Answer, Unanswered> {
        let key = keyed.command.key();
        let sizes = Sizes {
            quota,
            max_request_bytes: self.settings.max_request_bytes,
            key_prefix: self.keys_prefix.len(),
            node: self.node_id().len(),
            token: keyed
                .fencing_token
                .as_ref()
                .map_or(0, |t| t.to_string().len()),
            keyspace: self.keyspace(),
        };
        // The revision compared by an attempt whose outcome is unknown.
        let mut in_doubt: Option<i64> = None;
        // A write plans first against the record the watch last delivered
        // (one round trip when it is current: the transaction compares its
        // revision); a transaction that finds another revision returns the
        // current record, the next plan's.
        // With `cached_reads`, a GET answers from that record too.
        let writes = keyed.command.writes();
        // A resent request reads the current record: was it its own write?
        let mut cached =
            (writes || self.settings.cached_reads) && self.broken == Broken::No && !resent;
        let mut found: Option<Read> = None;
        let mut look_back = resent && writes;
        for _ in 0..ATTEMPTS {
            let mut from_cache = std::mem::take(&mut cached);
            let kept = if from_cache { self.cached(key) } else { None };
            let read = match (found.take(), self.broken) {
                (Some(read), _) => read,
                (None, _) if from_cache => match kept {
                    Some(read) => read,
                    // A write plans a key not kept as absent: its
                    // transaction brings the record if there is one.
                    None if writes => Read {
                        record: None,
                        revision: 0,
                    },
                    None => {
                        from_cache = false;
                        self.read(key).await?
                    }
                },
                (None, Broken::StaleReads) if !keyed.command.writes() => {
                    let seen = self.seen.lock().get(key).cloned();
                    match seen {
                        Some(read) => read,
                        None => self.read(key).await?,
                    }
                }
                (None, _) => self.read(key).await?,
            };
            if self.broken == Broken::StaleReads {
                self.seen
                    .lock()
                    .entry(key.to_vec())
                    .or_insert_with(|| read.clone());
            }
            if let Some(record) = &read.record {
                clock.observe(record.version);
                if (in_doubt.is_some() || resent) && writes && record.request == request {
                    return Ok(done_earlier(record));
                }
            }
            // Sent again, and the key's last write is another's: an
            // earlier one may be this request's (its node died after
            // etcd's commit, and another client wrote the key since).
            if std::mem::take(&mut look_back)
                && let Some(record) = self
                    .written_before(key, read.revision, request, keyed.timestamp.as_ref())
                    .await
            {
                return Ok(done_earlier(&record));
            }
            if in_doubt.is_some_and(|m| m != read.revision) {
                return Err(Unanswered::InDoubt);
            }
            let now = clock.wall_ms();
            let entry = read.record.as_ref().and_then(|r| r.entry(key, now));
            let plan = match keyed
                .command
                .plan(entry.as_ref(), &keyed.context(now), &sizes)
            {
                Ok(plan) => plan,
                // A refusal must be confirmed by a linearizable read.
                Err(_) if from_cache && writes => continue,
                Err(error) => {
                    return Ok(Answer {
                        frame: error.frame(),
                        version: clock.clock_now(now).format(self.node_id()),
                        error: Some(error),
                    });
                }
            };
            let Some(change) = plan.change else {
                // An answer that changes nothing (`:-1`, `:0`) is only as
                // current as its read: from the cache, read and plan again
                // (a GET with `cached_reads` answers as it is).
                if from_cache && writes {
                    continue;
                }
                let version = match (plan.stamp, &read.record) {
                    (Stamp::Of(_), Some(record)) => record.version_text(),
                    _ => clock.clock_now(now).format(self.node_id()),
                };
                return Ok(Answer {
                    frame: plan.frame,
                    version,
                    error: None,
                });
            };
            let (record, answer_version) = match change {
                Change::Put { value, extras, .. } => {
                    let version = clock.mint(now, keyed.timestamp.as_ref());
                    let record = Record {
                        tombstone: false,
                        after_expiry: read.record.as_ref().is_some_and(|r| r.expired(now)),
                        version,
                        node: self.node_id().to_owned(),
                        expires_at: extras.expires_at,
                        fencing_token: extras.fencing_token,
                        request,
                        value: value.to_vec(),
                    };
                    let text = record.version_text();
                    (record, text)
                }
                Change::Delete => {
                    // The tombstone keeps the deleted entry's version: the
                    // next SET on any node gets a greater one.
                    let Some(old) = &read.record else {
                        return Err(Unanswered::Contended(0));
                    };
                    let record = Record {
                        tombstone: true,
                        after_expiry: false,
                        version: old.version,
                        node: old.node.clone(),
                        expires_at: None,
                        fencing_token: None,
                        request,
                        value: Vec::new(),
                    };
                    let text = record.version_text();
                    (record, text)
                }
            };
            match self.compare_and_put(key, read.revision, &record).await {
                Ok(Committed::Yes) => {
                    return Ok(Answer {
                        frame: plan.frame,
                        version: answer_version,
                        error: None,
                    });
                }
                Ok(Committed::No(current)) => {
                    // The key moved since the plan. If by this very request
                    // (sent again by its client on another node, which ran
                    // it first), it is done: not run twice.
                    if let Some(record) = current.record.as_ref().filter(|r| r.request == request) {
                        return Ok(done_earlier(record));
                    }
                    crate::metrics::cluster_conflict();
                    found = Some(current);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "clustering: a write's outcome is unknown; reading again");
                    self.request_failed();
                    in_doubt = Some(read.revision);
                }
            }
        }
        Err(Unanswered::Contended(ATTEMPTS))
    }

    /// A linearizable read of `key`'s record (with the reads waiting at the
    /// same time: [`super::reads`]). A read changes nothing, so
    /// one that fails is tried again (up to [`READ_ATTEMPTS`] times): after
    /// etcd members come back, the client's first request may go to one
    /// whose connection is not up yet.
    async fn read(&self, key: &[u8]) -> Result<Read, Unanswered> {
        let mut attempt = 0;
        let fetched = loop {
            attempt += 1;
            match self.reads.read(self.key(key)).await {
                Ok(fetched) => break fetched,
                Err(e) if attempt >= READ_ATTEMPTS => return Err(Unanswered::Unreachable(e)),
                Err(e) => {
                    tracing::debug!(error = %e, attempt, "clustering: a read failed; reading again");
                    self.request_failed();
                    back_off(attempt).await;
                }
            }
        };
        let read = read_of(key, fetched.kv.as_ref());
        self.remember(key, read.clone(), fetched.revision);
        Ok(read)
    }

    /// The record request `request` wrote to `key` before the key's
    /// record of revision `revision`, if it is in etcd's history (not
    /// compacted): the key's earlier records, newest first, read at past
    /// revisions, at most [`HISTORY`] of them, and none older than the
    /// request's timestamp `sent` (its write's version is later: every
    /// write after it, and every tombstone of one, has a later version
    /// still). One etcd read per record; only for requests sent again.
    async fn written_before(
        &self,
        key: &[u8],
        mut revision: i64,
        request: u64,
        sent: Option<&Hlc>,
    ) -> Option<Record> {
        for _ in 0..HISTORY {
            if revision <= 1 {
                return None;
            }
            let options = GetOptions::new().with_revision(revision - 1);
            let response = match self.kv.clone().get(self.key(key), Some(options)).await {
                Ok(response) => response,
                Err(e) => {
                    // Compacted, or etcd unreachable: the request runs as
                    // if its earlier write was not found.
                    tracing::debug!(error = %e, "clustering: a key's history cannot be read");
                    return None;
                }
            };
            let kv = response.kvs().first()?;
            let record = Record::decode(kv.value()).ok()?;
            if record.request == request {
                return Some(record);
            }
            let version = (record.version.wall_ms, u64::from(record.version.counter));
            if sent.is_some_and(|t| version <= (t.wall_ms, t.counter)) {
                return None;
            }
            revision = kv.mod_revision();
        }
        None
    }

    /// Puts `record` if the key is still at `revision` (with the writes
    /// waiting at the same time: [`super::writes`]); otherwise returns the
    /// key's current record (read in the same transaction). `Err`: unknown.
    async fn compare_and_put(
        &self,
        key: &[u8],
        revision: i64,
        record: &Record,
    ) -> Result<Committed, String> {
        let outcome = if self.broken == Broken::LostUpdate {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            let txn = Txn::new().and_then([TxnOp::put(self.key(key), record.encode(), None)]);
            let response = self.kv.clone().txn(txn).await.map_err(|e| e.to_string())?;
            Outcome::Committed {
                revision: response.header().map_or(0, |h| h.revision()),
            }
        } else {
            self.writes
                .compare_and_put(self.key(key), revision, record.encode())
                .await?
        };
        match outcome {
            Outcome::Committed { revision: learned } => {
                let read = Read {
                    record: Some(record.clone()),
                    revision: learned,
                };
                self.remember(key, read, learned);
                Ok(Committed::Yes)
            }
            Outcome::Changed {
                kv,
                revision: learned,
            } => {
                let current = read_of(key, kv.as_ref());
                self.remember(key, current.clone(), learned);
                Ok(Committed::No(current))
            }
        }
    }

    /// The key's record as the watch (or this node's last read or write)
    /// left it; `None` if the cache does not keep the key.
    fn cached(&self, key: &[u8]) -> Option<Read> {
        self.cache.lock().get(key).map(|(read, _)| read.clone())
    }

    /// Records what etcd holds for `key` as of revision `learned`, unless
    /// something later is known.
    fn remember(&self, key: &[u8], read: Read, learned: i64) {
        if self.broken == Broken::No {
            self.cache.lock().remember(key, read, learned);
        }
    }
}

/// What a transaction did.
enum Committed {
    /// It put the record.
    Yes,
    /// The key had changed: its current record.
    No(Read),
}

/// A key's record as read from an etcd key-value (none: absent).
fn read_of(key: &[u8], kv: Option<&etcd_client::KeyValue>) -> Read {
    let Some(kv) = kv else {
        return Read {
            record: None,
            revision: 0,
        };
    };
    let record = match Record::decode(kv.value()) {
        Ok(record) => Some(record),
        Err(e) => {
            tracing::warn!(key = %String::from_utf8_lossy(key), "clustering: {e}; it reads as absent");
            None
        }
    };
    Read {
        record,
        revision: kv.mod_revision(),
    }
}

/// The answer of a request whose write committed in an attempt that got
/// no confirmation: found again by its id in `record`.
fn done_earlier(record: &Record) -> Answer {
    let frame = if record.tombstone {
        Frame::Integer(1)
    } else {
        Frame::Simple("OK")
    };
    Answer {
        frame,
        version: record.version_text(),
        error: None,
    }
}

/// The first key after every key that starts with `prefix`.
pub(super) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// Against a real etcd member (`etcd` on PATH): two nodes' halves.
#[cfg(test)]
pub(super) mod etcd_tests;
