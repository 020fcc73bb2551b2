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

use etcd_client::{GetOptions, Txn, TxnOp};
use statestore::command::STEPS_PER_PAGE;
use statestore::command::Scan;
use statestore::db::Entry;
use statestore::glob::{Pattern, StepBudget};
use statestore::hlc::{Hlc, Version};
use statestore::plan::{Change, Planner, Stamp};
use statestore::resp3::Frame;
use statestore::store::Keyed;
use statestore::{Error, KeyAccess, Quota};

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

    /// A page of SCAN over the keys in etcd, in key order; the token
    /// (`k` and the last key looked at) resumes after that key.
    pub async fn scan(
        &self,
        scan: &Scan<'_>,
        access: Option<&(dyn KeyAccess + Sync)>,
        page_size: usize,
        now: u64,
    ) -> Result<Result<Frame, Error>, Unanswered> {
        let mut from = self.keys_prefix.clone();
        if let Some(token) = scan.token {
            let Some(last) = token.strip_prefix(b"k") else {
                return Ok(Err(Error::Syntax));
            };
            from.extend_from_slice(last);
            from.push(0);
        }
        let end = prefix_end(&self.keys_prefix);
        let pattern = Pattern::new(scan.pattern);
        let page_size = page_size.max(1);
        let budget = page_size.saturating_mul(16);
        let mut keys = Vec::new();
        let mut looked = 0usize;
        // Glob steps spent (see `statestore::command::STEPS_PER_PAGE`): a
        // page ends before the key that would pass the budget, except at
        // its first key, so every page moves on.
        let mut steps = StepBudget::new(STEPS_PER_PAGE);
        let mut last_looked: Option<Vec<u8>> = None;
        // The page reads etcd in chunks of records an answer can hold, all
        // at the first chunk's revision: one snapshot.
        let mut revision = None;
        loop {
            let chunk = (budget - looked).min(super::reads::MAX_KEYS);
            let mut options = GetOptions::new()
                .with_range(end.clone())
                .with_limit(chunk as i64);
            if let Some(revision) = revision {
                options = options.with_revision(revision);
            }
            let response = self
                .kv
                .clone()
                .get(from.clone(), Some(options))
                .await
                .map_err(|e| Unanswered::Unreachable(e.to_string()))?;
            revision = revision.or(response.header().map(|h| h.revision()));
            let mut last = None;
            let mut full = false;
            for kv in response.kvs() {
                let key = &kv.key()[self.keys_prefix.len()..];
                if !steps.take(pattern.cost(key.len()), looked == 0) {
                    // Resumed at this key, after the one before it.
                    let mut token = b"k".to_vec();
                    token.extend_from_slice(last_looked.as_deref().unwrap_or_default());
                    return Ok(Ok(page(keys, Some(token))));
                }
                looked += 1;
                last = Some(key.to_vec());
                last_looked.clone_from(&last);
                let live = Record::decode(kv.value())
                    .ok()
                    .is_some_and(|r| r.entry(key, now).is_some());
                if live && pattern.matches(key) && access.is_none_or(|a| a.may_read(key)) {
                    keys.push(Frame::Bulk(key.to_vec()));
                    if keys.len() >= page_size {
                        full = true;
                        break;
                    }
                }
            }
            let Some(last) = last else {
                return Ok(Ok(page(keys, None)));
            };
            let rest_seen = !full && !response.more();
            if rest_seen {
                return Ok(Ok(page(keys, None)));
            }
            if full || looked >= budget {
                let mut token = b"k".to_vec();
                token.extend_from_slice(&last);
                return Ok(Ok(page(keys, Some(token))));
            }
            from = self.key(&last);
            from.push(0);
        }
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

fn page(keys: Vec<Frame>, token: Option<Vec<u8>>) -> Frame {
    let mut parts = vec![Frame::Array(keys)];
    if let Some(token) = token {
        parts.push(Frame::Bulk(token));
    }
    Frame::Array(parts)
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
pub(super) mod etcd_tests {
    use std::sync::Arc;
    use std::time::Duration;

    use parking_lot::Mutex;
    use statestore::command::{Command, Dialect, KeyCommand};
    use statestore::hlc::HybridClock;

    use super::*;
    use crate::config::ClusteringSettings;

    struct Clock(Mutex<HybridClock>);

    impl NodeClock for Clock {
        fn observe(&self, seen: Version) {
            self.0.lock().observe(seen);
        }
        fn mint(&self, now_ms: u64, received: Option<&Hlc>) -> Version {
            self.0.lock().next(now_ms, received)
        }
        fn clock_now(&self, now_ms: u64) -> Version {
            self.0.lock().now(now_ms)
        }
        fn wall_ms(&self) -> u64 {
            crate::clock::now_ms()
        }
    }

    /// A cluster node `id` on etcd `endpoint` (its tasks not started).
    pub(in crate::cluster) async fn node(id: &str, endpoint: &str) -> Arc<Cluster> {
        node_with(id, endpoint, 1_572_864).await
    }

    /// [`node`] with etcd's request limit `max_request_bytes`.
    async fn node_with(id: &str, endpoint: &str, max_request_bytes: usize) -> Arc<Cluster> {
        Cluster::connect(ClusteringSettings {
            node_id: id.into(),
            etcd_endpoints: vec![endpoint.into()],
            etcd_prefix: "/kv-test/".into(),
            request_timeout: Duration::from_secs(5),
            tombstone_ttl: Duration::from_secs(70),
            max_request_bytes,
            cached_reads: false,
            cache_bytes: 1 << 20,
            requests_to_leader: true,
            lease_ttl: Duration::from_secs(5),
            peer_address: None,
            forward_queue: 100,
            session_reap_interval: Duration::from_secs(60),
            keep_queued_in_etcd: true,
            recent_publishes_bytes: 0,
        })
        .await
        .expect("etcd answers")
    }

    /// Serves `args` on `node` as request `request`; the answer's RESP3
    /// and version.
    async fn serve(node: &Cluster, args: &[&[u8]], request: u64) -> (String, String) {
        serve_sent(node, args, (request, false), &client_now()).await
    }

    /// The client's timestamp (`__ts`) now.
    fn client_now() -> String {
        format!("{}:0:client", crate::clock::now_ms())
    }

    /// [`serve`] of a request `(id, resent)` the client sent at `sent`.
    async fn serve_sent(
        node: &Cluster,
        args: &[&[u8]],
        request: (u64, bool),
        sent: &str,
    ) -> (String, String) {
        let command = Command::parse(args, Dialect::V1).unwrap();
        let keyed = Keyed {
            command: KeyCommand::of(command).unwrap(),
            timestamp: sent.parse().ok(),
            fencing_token: None,
            persist: false,
        };
        let clock = Clock(Mutex::new(HybridClock::starting_after(Version::default())));
        let answer = node
            .serve_key(&keyed, request, &Quota::default(), &clock)
            .await
            .expect("answered");
        let mut resp = Vec::new();
        answer.frame.encode(&mut resp);
        (
            String::from_utf8_lossy(&resp).into_owned(),
            answer.version.into(),
        )
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_committed_elsewhere_first_is_not_committed_again() {
        let etcd = statebroker_cluster_harness::EtcdCluster::start(1).expect("etcd starts");
        let endpoint = etcd.endpoint(0);
        let (a, b) = (node("a", &endpoint).await, node("b", &endpoint).await);
        // Node a writes the key: its cache has that record.
        assert_eq!(serve(&a, &[b"SET", b"k", b"v0"], 1).await.0, "+OK\r\n");
        // Request 7 reaches node b first (sent again by its client) and
        // commits there.
        let (answer, version) = serve(&b, &[b"SET", b"k", b"v1"], 7).await;
        assert_eq!(answer, "+OK\r\n");
        let revision = |etcd: &statebroker_cluster_harness::EtcdCluster| {
            let out = etcd
                .etcdctl()
                .args(["get", "/kv-test/K/k", "-w", "json"])
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            text.split("\"mod_revision\":")
                .nth(1)
                .and_then(|r| r.split([',', '}']).next())
                .and_then(|r| r.parse::<i64>().ok())
                .unwrap_or_else(|| panic!("no mod_revision in {text}"))
        };
        let committed = revision(&etcd);
        // Node a still runs its first copy, planned on its older record:
        // its transaction fails, finds request 7's record, and answers
        // with that write instead of committing again.
        let (again, again_version) = serve(&a, &[b"SET", b"k", b"v1"], 7).await;
        assert_eq!(again, "+OK\r\n");
        assert_eq!(
            again_version, version,
            "the answer of the write that was made"
        );
        assert_eq!(revision(&etcd), committed, "not written again");
        // Another request on the same key is written, as ever.
        serve(&a, &[b"SET", b"k", b"v2"], 8).await;
        assert!(revision(&etcd) > committed);
    }

    /// A request sent again (its node died after etcd's commit, before
    /// the answer) after another client wrote the key: its write is in
    /// the key's history, and it is answered as done, not run again.
    /// Before, the key's last record only was looked at, and the request
    /// wrote its value over the other client's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_sent_again_finds_its_write_in_the_keys_history() {
        let etcd = statebroker_cluster_harness::EtcdCluster::start(1).expect("etcd starts");
        let endpoint = etcd.endpoint(0);
        let (a, b) = (node("a", &endpoint).await, node("b", &endpoint).await);
        let value = |node: Arc<Cluster>| async move { serve(&node, &[b"GET", b"k"], 99).await.0 };
        let sent = client_now();
        let (answer, version) = serve_sent(&a, &[b"SET", b"k", b"v1"], (7, false), &sent).await;
        assert_eq!(answer, "+OK\r\n");
        serve(&b, &[b"SET", b"k", b"other"], 8).await;
        serve(&b, &[b"SET", b"k", b"another"], 9).await;
        let again = serve_sent(&b, &[b"SET", b"k", b"v1"], (7, true), &sent).await;
        assert_eq!(
            again,
            ("+OK\r\n".to_owned(), version),
            "the first write's answer"
        );
        assert_eq!(
            value(Arc::clone(&b)).await,
            "$7\r\nanother\r\n",
            "not run again"
        );
        // A DEL sent again, after another SET: its tombstone is in the
        // history.
        let sent = client_now();
        assert_eq!(
            serve_sent(&a, &[b"DEL", b"k"], (10, false), &sent).await.0,
            ":1\r\n"
        );
        serve(&b, &[b"SET", b"k", b"back"], 11).await;
        let again = serve_sent(&b, &[b"DEL", b"k"], (10, true), &sent).await;
        assert_eq!(again.0, ":1\r\n");
        assert_eq!(
            value(Arc::clone(&b)).await,
            "$4\r\nback\r\n",
            "not deleted again"
        );
        // A request sent again that never ran runs: the key's history
        // holds no write of it.
        let sent = client_now();
        let (answer, _) = serve_sent(&b, &[b"SET", b"k", b"new"], (12, true), &sent).await;
        assert_eq!(answer, "+OK\r\n");
        assert_eq!(value(b).await, "$3\r\nnew\r\n");
    }

    /// With the quotas raised past etcd's request limit (the harness's
    /// members take 2 MiB, and the node is told so), a SET whose write
    /// would pass it gets `-ERR the quota has been exceeded`, and the
    /// largest one that fits commits. Before, the node counted the key
    /// twice and 512 bytes: a 60 KB key's SET of 1,950,000 bytes passed
    /// that, etcd refused the request, and the refusal read as an outcome
    /// not known: no answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_set_past_etcds_request_limit_is_refused_and_the_largest_that_fits_commits() {
        const LIMIT: usize = 2_097_152;
        let etcd = statebroker_cluster_harness::EtcdCluster::start(1).expect("etcd starts");
        let a = node_with("a", &etcd.endpoint(0), LIMIT).await;
        let quota = Quota {
            max_value_size: 4 << 20,
            max_bytes: 64 << 20,
            ..Quota::default()
        };
        let key = vec![b'k'; 60_000];
        let set = |value: usize| {
            let (a, key, quota) = (Arc::clone(&a), key.clone(), quota.clone());
            async move {
                let value = vec![b'v'; value];
                let args: [&[u8]; 3] = [b"SET", &key, &value];
                let keyed = Keyed {
                    command: KeyCommand::of(Command::parse(&args, Dialect::V1).unwrap()).unwrap(),
                    timestamp: client_now().parse().ok(),
                    fencing_token: None,
                    persist: false,
                };
                let clock = Clock(Mutex::new(HybridClock::starting_after(Version::default())));
                let answer = tokio::time::timeout(
                    Duration::from_secs(30),
                    a.serve_key(&keyed, (fastrand::u64(..), false), &quota, &clock),
                )
                .await
                .expect("an answer within 30 s")
                .expect("answered");
                let mut resp = Vec::new();
                answer.frame.encode(&mut resp);
                String::from_utf8_lossy(&resp).into_owned()
            }
        };
        const REFUSED: &str = "-ERR the quota has been exceeded\r\n";
        assert_eq!(set(1_950_000).await, REFUSED);
        // The largest value the node's count lets through, and one more.
        let fits = |value| {
            let record = Record::encoded_len(1, 0, value);
            super::super::writes::fits_a_request("/kv-test/K/".len() + key.len(), record, LIMIT)
        };
        let largest = (1_000_000..LIMIT).rev().find(|&v| fits(v)).unwrap();
        assert_eq!(set(largest + 1).await, REFUSED);
        assert_eq!(
            set(largest).await,
            "+OK\r\n",
            "etcd takes what the node counts as fitting"
        );
    }
}
