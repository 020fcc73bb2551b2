//! One etcd watch over every key of the store: what any node changes
//! reaches this node's KEYNOTIFY watchers, in etcd's revision order, once.
//!
//! At start the node reads every record (building the [`Index`] of what
//! expires) and watches from the revision after that read. After a broken
//! stream it watches again from the revision after the last event it
//! handled, so nothing is missed or repeated. If etcd compacted past that
//! revision (the watch fell too far behind), the changes in between are
//! lost to this node's watchers; it logs that, reads every record again
//! and goes on from there.
//!
//! A record gives SET (with its value and version), a tombstone DELETE
//! (with the deleted entry's version); removing a tombstone notifies
//! nobody.

use std::collections::{BTreeSet, HashMap};
use std::sync::Weak;
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, WatchOptions, WatchStream};
use statestore::Event;

use super::record::Record;
use super::{Cluster, NodeClock};

/// A change made on some node, for this node's watchers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The key.
    pub key: Vec<u8>,
    /// SET with the value, or DELETE.
    pub event: Event,
    /// The version, as its node wrote it.
    pub version: statestore::hlc::Stamp,
}

/// What the reaper has to do and when: for each key, the time it expires
/// (a record with PX) or its tombstone may go, and the revision that must
/// still be the key's for that to hold.
#[derive(Default)]
pub struct Index {
    due: BTreeSet<(u64, Vec<u8>)>,
    by_key: HashMap<Vec<u8>, Tracked>,
}

/// One key the reaper will visit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tracked {
    /// When.
    pub at: u64,
    /// The key's mod revision when it was indexed.
    pub revision: i64,
    /// A tombstone (to remove) rather than a record (to expire).
    pub tombstone: bool,
}

impl Index {
    fn forget(&mut self, key: &[u8]) {
        if let Some(old) = self.by_key.remove(key) {
            self.due.remove(&(old.at, key.to_vec()));
        }
    }

    /// Indexes `record` of `key` at `revision` (or forgets the key).
    fn record(&mut self, key: &[u8], record: &Record, revision: i64, tombstone_ttl_ms: u64) {
        self.forget(key);
        let at = if record.tombstone {
            Some(record.version.wall_ms.saturating_add(tombstone_ttl_ms))
        } else {
            record.expires_at
        };
        if let Some(at) = at {
            self.due.insert((at, key.to_vec()));
            self.by_key.insert(
                key.to_vec(),
                Tracked {
                    at,
                    revision,
                    tombstone: record.tombstone,
                },
            );
        }
    }

    /// Up to `max` keys due by `now`.
    pub fn due(&self, now: u64, max: usize) -> Vec<(Vec<u8>, Tracked)> {
        self.due
            .iter()
            .take_while(|(at, _)| *at <= now)
            .take(max)
            .filter_map(|(_, key)| self.by_key.get(key).map(|t| (key.clone(), *t)))
            .collect()
    }

    /// Keys tracked.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }
}

/// Keys and bytes of keys and values of the live (not deleted) records,
/// kept up to date from each change and the record it replaced.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Keyspace {
    keys: i64,
    bytes: i64,
}

impl Keyspace {
    /// The size of `value`, a stored record of `key`, if it is live.
    fn live(key: &[u8], value: &[u8]) -> Option<i64> {
        let record = Record::decode(value).ok()?;
        (!record.tombstone).then(|| (key.len() + record.value.len()) as i64)
    }

    /// `key` went from `before` to `after` (stored records; `None`:
    /// absent).
    fn change(&mut self, key: &[u8], before: Option<&[u8]>, after: Option<&[u8]>) {
        if let Some(size) = before.and_then(|v| Keyspace::live(key, v)) {
            self.keys -= 1;
            self.bytes -= size;
        }
        if let Some(size) = after.and_then(|v| Keyspace::live(key, v)) {
            self.keys += 1;
            self.bytes += size;
        }
    }

    /// Keys and bytes (never below 0).
    pub fn get(&self) -> (usize, u64) {
        (self.keys.max(0) as usize, self.bytes.max(0) as u64)
    }
}

/// Reads every record into the index, taking in their versions; returns
/// the revision read at.
pub(super) async fn load(cluster: &Cluster, clock: &dyn NodeClock) -> Result<i64, String> {
    let mut client = cluster.client.clone();
    let end = super::kv::prefix_end(&cluster.keys_prefix);
    let ttl = ttl_ms(cluster);
    let mut from = cluster.keys_prefix.clone();
    let mut revision = 0;
    let mut index = Index::default();
    let mut keyspace = Keyspace::default();
    loop {
        let mut options = GetOptions::new().with_range(end.clone()).with_limit(1000);
        if revision > 0 {
            options = options.with_revision(revision);
        }
        let response = client
            .get(from.clone(), Some(options))
            .await
            .map_err(|e| e.to_string())?;
        if revision == 0 {
            revision = response.header().map_or(0, |h| h.revision());
        }
        for kv in response.kvs() {
            let key = &kv.key()[cluster.keys_prefix.len()..];
            keyspace.change(key, None, Some(kv.value()));
            if let Ok(record) = Record::decode(kv.value()) {
                clock.observe(record.version);
                index.record(key, &record, kv.mod_revision(), ttl);
                let read = super::kv::Read {
                    record: Some(record),
                    revision: kv.mod_revision(),
                };
                cluster.cache.lock().remember(key, read, revision);
            }
        }
        match response.kvs().last() {
            Some(kv) if response.more() => {
                from = kv.key().to_vec();
                from.push(0);
            }
            _ => break,
        }
    }
    tracing::info!(
        revision,
        tracked = index.len(),
        "clustering: read the state store's records"
    );
    *cluster.index.lock() = index;
    *cluster.keyspace.lock() = keyspace;
    Ok(revision)
}

fn ttl_ms(cluster: &Cluster) -> u64 {
    u64::try_from(cluster.settings.tombstone_ttl.as_millis()).unwrap_or(u64::MAX)
}

/// The largest watch answer the keys' watch decodes: one revision's
/// events, each with the record it replaced. A transaction of writes
/// that go together (at most [`super::reads::MAX_KEYS`] keys, under
/// etcd's request limit) or of DELs of that many large records can carry
/// up to that many previous records; gRPC's default, 4 MiB, ended the
/// watch at every such answer, for good (ten DELs of 1 MB values stopped
/// KEYNOTIFY on every node, silently).
pub(super) fn keys_watch_limit(max_request_bytes: usize) -> usize {
    super::reads::decoding_limit(max_request_bytes).saturating_mul(2)
}

/// gRPC's default decoding limit: enough for the other watches' small
/// records.
pub(super) const SMALL_WATCH_LIMIT: usize = 4 << 20;

/// Opens a watch of `prefix` with `options`, its answers decoded up to
/// `limit` bytes, trying again every 250 ms until etcd takes it; `None`
/// once `stop` fires.
pub(super) async fn open(
    client: &mut Client,
    prefix: &[u8],
    options: WatchOptions,
    limit: usize,
    stop: &mut tokio::sync::watch::Receiver<()>,
) -> Option<WatchStream> {
    let mut watches = client.watch_client().max_decoding_message_size(limit);
    loop {
        let opened = tokio::select! {
            s = watches.watch(prefix.to_vec(), Some(options.clone())) => s,
            _ = stop.changed() => return None,
        };
        match opened {
            Ok(stream) => return Some(stream),
            Err(e) => {
                tracing::debug!(error = %e, "clustering: cannot watch etcd; trying again");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(250)) => {}
                    _ = stop.changed() => return None,
                }
            }
        }
    }
}

/// How one watch of a prefix ([`follow_prefix`]) ended.
pub(super) enum Ended {
    /// `stop` fired, or the handler wanted no more.
    Stopped,
    /// The stream broke: watch again from this revision.
    Broken(i64),
    /// etcd compacted past the revision asked for: changes up to this
    /// revision are lost to the watch.
    Compacted(i64),
}

/// Watches every key under `prefix` from revision `from` until the stream
/// breaks, handing each event to `on_event` in revision order (`false`:
/// no more).
pub(super) async fn follow_prefix(
    client: &mut Client,
    prefix: &[u8],
    from: i64,
    stop: &mut tokio::sync::watch::Receiver<()>,
    mut on_event: impl FnMut(&etcd_client::Event) -> bool,
) -> Ended {
    let options = WatchOptions::new().with_prefix().with_start_revision(from);
    let Some(mut stream) = open(client, prefix, options, SMALL_WATCH_LIMIT, stop).await else {
        return Ended::Stopped;
    };
    let mut next = from;
    loop {
        let message = tokio::select! {
            m = stream.message() => m,
            _ = stop.changed() => return Ended::Stopped,
        };
        let Ok(Some(response)) = message else {
            return Ended::Broken(next);
        };
        if response.canceled() {
            return match response.compact_revision() {
                0 => Ended::Broken(next),
                compacted => Ended::Compacted(compacted),
            };
        }
        for event in response.events() {
            if let Some(kv) = event.kv() {
                next = next.max(kv.mod_revision() + 1);
            }
            if !on_event(event) {
                return Ended::Stopped;
            }
        }
    }
}

/// Watches every key from revision `from`, sending each change to
/// `changes`; ends when the cluster is dropped or nobody takes changes.
pub(super) async fn run(
    cluster: Weak<Cluster>,
    mut client: Client,
    mut from: i64,
    clock: std::sync::Arc<dyn NodeClock>,
    changes: tokio::sync::mpsc::UnboundedSender<Change>,
    mut stop: tokio::sync::watch::Receiver<()>,
) {
    let Some(c) = cluster.upgrade() else { return };
    let prefix = c.keys_prefix.clone();
    let ttl = ttl_ms(&c);
    let limit = keys_watch_limit(c.settings.max_request_bytes);
    drop(c);
    loop {
        // With each change the record it replaced, for the keyspace's count.
        let options = WatchOptions::new()
            .with_prefix()
            .with_prev_key()
            .with_start_revision(from);
        let Some(mut stream) = open(&mut client, &prefix, options, limit, &mut stop).await else {
            return;
        };
        loop {
            let message = tokio::select! {
                m = stream.message() => m,
                _ = stop.changed() => return,
            };
            let response = match message {
                Ok(Some(response)) => response,
                Ok(None) => break,
                Err(e) => {
                    // Watched again from the next revision; an error that
                    // comes back every time (an answer it cannot decode)
                    // says so each time rather than stop notifications
                    // unseen.
                    tracing::warn!(
                        from,
                        error = %e,
                        "clustering: the keys' watch broke; watching again from where it was"
                    );
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(250)) => {}
                        _ = stop.changed() => return,
                    }
                    break;
                }
            };
            if response.canceled() {
                let compacted = response.compact_revision();
                if compacted > 0 {
                    tracing::warn!(
                        from,
                        compacted,
                        "clustering: the watch fell behind etcd's compaction; changes in between are not notified on this node"
                    );
                    let Some(c) = cluster.upgrade() else { return };
                    match load(&c, clock.as_ref()).await {
                        Ok(revision) => from = revision + 1,
                        Err(_) => from = compacted,
                    }
                }
                break;
            }
            let Some(c) = cluster.upgrade() else { return };
            for event in response.events() {
                let Some(kv) = event.kv() else { continue };
                from = from.max(kv.mod_revision() + 1);
                let Some(key) = kv.key().get(prefix.len()..) else {
                    continue;
                };
                let before = event.prev_kv().map(|p| p.value());
                let after = (event.event_type() == EventType::Put).then(|| kv.value());
                c.keyspace.lock().change(key, before, after);
                match event.event_type() {
                    EventType::Put => {
                        let Ok(record) = Record::decode(kv.value()) else {
                            continue;
                        };
                        clock.observe(record.version);
                        c.index.lock().record(key, &record, kv.mod_revision(), ttl);
                        let read = super::kv::Read {
                            record: Some(record.clone()),
                            revision: kv.mod_revision(),
                        };
                        c.cache.lock().remember(key, read, kv.mod_revision());
                        if let Some(expired) = expired_before(&record, event.prev_kv()) {
                            let change = Change {
                                key: key.to_vec(),
                                event: Event::Delete,
                                version: expired.version_text(),
                            };
                            if changes.send(change).is_err() {
                                return;
                            }
                        }
                        let event = if record.tombstone {
                            Event::Delete
                        } else {
                            Event::Set(record.value.clone())
                        };
                        let change = Change {
                            key: key.to_vec(),
                            event,
                            version: record.version_text(),
                        };
                        if changes.send(change).is_err() {
                            return;
                        }
                    }
                    EventType::Delete => {
                        c.index.lock().forget(key);
                        c.cache.lock().forget(key, kv.mod_revision());
                    }
                }
            }
        }
    }
}

/// The record a write replaced after its expiry had come and before the
/// reaper replaced it (a DELETE its watchers have not had yet), if
/// `record` is such a write and etcd still had the one before it.
fn expired_before(record: &Record, before: Option<&etcd_client::KeyValue>) -> Option<Record> {
    if record.tombstone || !record.after_expiry {
        return None;
    }
    Record::decode(before?.value())
        .ok()
        .filter(|before| !before.tombstone)
}

#[cfg(test)]
mod tests {
    use super::*;
    use statestore::hlc::Version;

    fn record(tombstone: bool, wall_ms: u64, expires_at: Option<u64>) -> Record {
        Record {
            tombstone,
            after_expiry: false,
            version: Version {
                wall_ms,
                counter: 0,
            },
            node: "n".into(),
            expires_at,
            fencing_token: None,
            request: 0,
            value: Vec::new(),
        }
    }

    #[test]
    fn the_keyspace_counts_live_records_from_each_change() {
        let live = |value: &[u8]| {
            Record {
                value: value.to_vec(),
                ..record(false, 1, None)
            }
            .encode()
        };
        let tombstone = record(true, 2, None).encode();
        let mut keyspace = Keyspace::default();
        keyspace.change(b"k", None, Some(&live(b"four")));
        keyspace.change(b"j", None, Some(&live(b"")));
        assert_eq!(keyspace.get(), (2, 5 + 1));
        // Replaced: the same key, another size.
        keyspace.change(b"k", Some(&live(b"four")), Some(&live(b"sixsix")));
        assert_eq!(keyspace.get(), (2, 7 + 1));
        // Deleted (a tombstone), then the tombstone removed: counted once.
        keyspace.change(b"k", Some(&live(b"sixsix")), Some(&tombstone));
        keyspace.change(b"k", Some(&tombstone), None);
        assert_eq!(keyspace.get(), (1, 1));
        // A change without the record it replaced (compacted) never goes
        // below zero.
        keyspace.change(b"j", Some(&live(b"")), None);
        keyspace.change(b"j", Some(&live(b"")), None);
        assert_eq!(keyspace.get(), (0, 0));
    }

    #[test]
    fn the_index_holds_expiries_and_tombstones_until_replaced() {
        let mut index = Index::default();
        index.record(b"a", &record(false, 10, Some(500)), 7, 1000);
        index.record(b"b", &record(true, 20, None), 8, 1000);
        index.record(b"c", &record(false, 30, None), 9, 1000);
        assert_eq!(index.len(), 2);
        assert!(index.due(499, 10).is_empty());
        let due = index.due(1020, 10);
        assert_eq!(due.len(), 2);
        assert_eq!((due[0].0.as_slice(), due[0].1.revision), (&b"a"[..], 7));
        assert!(due[1].1.tombstone);
        // A new record without PX replaces the expiry.
        index.record(b"a", &record(false, 40, None), 11, 1000);
        assert_eq!(index.due(u64::MAX, 10).len(), 1);
        index.forget(b"b");
        assert_eq!(index.len(), 0);
    }
}
