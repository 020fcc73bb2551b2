//! The node's cache of etcd's records: the last record known of each
//! key, which writes plan against (their transaction compares its
//! revision) and cached GETs answer from.

use std::collections::HashMap;

use super::kv::Read;

/// The last record known of each key, with the etcd revision it was
/// learned at (a delete's revision for a key known absent): the watch, the
/// node's reads and its writes feed it, and only something later replaces
/// what it holds.
///
/// Bounded by `[clustering] cache_bytes`: past it, records are dropped
/// (whichever come first in the table) until a tenth is free. A key not
/// kept is planned as absent (its transaction then finds the record and
/// plans again: one more round trip) and read from etcd by a cached GET.
/// Nothing learned at a revision below the latest one dropped is taken in
/// for a key not kept: it might be older than what was dropped.
pub(super) struct Cache {
    keys: HashMap<Vec<u8>, (Read, i64)>,
    /// What the records kept take, as [`Cache::size`] counts.
    bytes: usize,
    limit: usize,
    /// The latest revision learned of a record dropped.
    floor: i64,
}

impl Cache {
    pub(super) fn new(limit: usize) -> Cache {
        Cache {
            keys: HashMap::new(),
            bytes: 0,
            limit,
            floor: 0,
        }
    }

    /// The memory a kept record takes, roughly: its key (twice: the table
    /// and the record's owner), value, node name and bookkeeping.
    fn size(key: &[u8], read: &Read) -> usize {
        let record = read
            .record
            .as_ref()
            .map_or(0, |r| r.value.len() + r.node.len());
        key.len() + record + 128
    }

    /// The key's record as kept, with the revision it was learned at.
    pub(super) fn get(&self, key: &[u8]) -> Option<&(Read, i64)> {
        self.keys.get(key)
    }

    /// `read` is the key's as of etcd revision `learned`.
    pub(super) fn remember(&mut self, key: &[u8], read: Read, learned: i64) {
        match self.keys.get_mut(key) {
            Some((_, at)) if *at >= learned => {}
            Some(kept) => {
                self.bytes -= Cache::size(key, &kept.0);
                self.bytes += Cache::size(key, &read);
                *kept = (read, learned);
            }
            None if learned < self.floor => {}
            None => {
                self.bytes += Cache::size(key, &read);
                self.keys.insert(key.to_vec(), (read, learned));
            }
        }
        if self.bytes > self.limit {
            self.shrink();
        }
    }

    /// The key is gone from etcd at `learned` (a tombstone removed).
    pub(super) fn forget(&mut self, key: &[u8], learned: i64) {
        if self.keys.get(key).is_some_and(|(_, at)| *at >= learned) {
            return;
        }
        if let Some((read, _)) = self.keys.remove(key) {
            self.bytes -= Cache::size(key, &read);
        }
    }

    /// Drops records until a tenth of the limit is free.
    fn shrink(&mut self) {
        let target = self.limit - self.limit / 10;
        let mut freed = 0;
        let mut drop = Vec::new();
        for (key, (read, at)) in &self.keys {
            if self.bytes - freed <= target {
                break;
            }
            freed += Cache::size(key, read);
            self.floor = self.floor.max(*at);
            drop.push(key.clone());
        }
        for key in drop {
            self.keys.remove(&key);
        }
        self.bytes -= freed;
        tracing::debug!(
            kept = self.keys.len(),
            bytes = self.bytes,
            "clustering: record cache full (clustering.cache_bytes): records dropped"
        );
    }

    /// How many records are kept, and their bytes.
    pub(super) fn usage(&self) -> (usize, usize) {
        (self.keys.len(), self.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::record::Record;
    use statestore::hlc::Version;

    fn read(value: usize, revision: i64) -> Read {
        Read {
            record: Some(Record {
                tombstone: false,
                after_expiry: false,
                version: Version::default(),
                node: "n".into(),
                expires_at: None,
                fencing_token: None,
                request: 0,
                value: vec![b'v'; value],
            }),
            revision,
        }
    }

    #[test]
    fn the_cache_keeps_to_its_bound() {
        let mut cache = Cache::new(100_000);
        for n in 0..1_000i64 {
            cache.remember(format!("k{n}").as_bytes(), read(1_000, n + 1), n + 1);
            let (_, bytes) = cache.usage();
            assert!(bytes <= 100_000, "{bytes} bytes after {n} records");
        }
        let (records, bytes) = cache.usage();
        assert!(records > 50, "{records} records kept");
        let counted: usize = cache.keys.iter().map(|(k, (r, _))| Cache::size(k, r)).sum();
        assert_eq!(counted, bytes, "the count matches what is kept");
    }

    #[test]
    fn nothing_older_than_a_dropped_record_comes_back() {
        let mut cache = Cache::new(10_000);
        for n in 0..100i64 {
            cache.remember(format!("k{n}").as_bytes(), read(500, 10 + n), 10 + n);
        }
        let floor = cache.floor;
        assert!(floor > 10, "records were dropped");
        let dropped = (0..100)
            .map(|n| format!("k{n}"))
            .find(|k| cache.get(k.as_bytes()).is_none())
            .expect("a key was dropped");
        // A watch event older than what was dropped is not taken in...
        cache.remember(dropped.as_bytes(), read(1, floor - 1), floor - 1);
        assert!(cache.get(dropped.as_bytes()).is_none());
        // ...a later one is, and a kept key's later record replaces it.
        cache.remember(dropped.as_bytes(), read(1, floor + 1), floor + 1);
        assert_eq!(
            cache.get(dropped.as_bytes()).map(|(_, at)| *at),
            Some(floor + 1)
        );
        cache.remember(dropped.as_bytes(), read(2, floor), floor);
        assert_eq!(
            cache.get(dropped.as_bytes()).map(|(_, at)| *at),
            Some(floor + 1)
        );
        cache.forget(dropped.as_bytes(), floor + 2);
        assert!(cache.get(dropped.as_bytes()).is_none());
    }
}
