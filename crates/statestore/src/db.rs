//! The key/value data: entries, their versions, fencing tokens and expiry.
//!
//! [`Db`] owns expiry: every key with a `PX` sits in an index ordered by
//! expiry time, and [`Db::expire_due`] pops exactly the keys that are due, so
//! the cost of expiring is proportional to what expires, never to the size
//! of the store. The [`crate::Store`] calls it before it serves each request
//! and from the broker's expiry timer, so an expired key is never seen.
//!
//! # Layout
//!
//! Keys live in a slab (`Vec<Option<Entry>>`) and a hash table maps a key to
//! its slot (a `u32`). A slot is 80 bytes; when key and value together fit
//! in 48 bytes they live inside it (as Redis embeds short strings), larger
//! ones in one heap block. So a small key costs 80 bytes of slot and about
//! ten bytes of hash table, and nothing else. Slots of deleted keys are
//! reused by later inserts; a key keeps its slot for as long as it exists,
//! which is what makes SCAN's slot-order cursor sound (see [`Db::scan`]).

use std::collections::BTreeSet;
use std::hash::BuildHasher;

use hashbrown::{DefaultHashBuilder, HashTable};

use crate::glob::{Pattern, StepBudget};
use crate::hlc::{Hlc, Version};

/// Key and value bytes this long or shorter are stored inside the slot.
pub const INLINE: usize = 48;

/// The key's bytes followed by the value's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Data {
    Inline { len: u8, bytes: [u8; INLINE] },
    Heap(Box<[u8]>),
}

impl Data {
    fn new(key: &[u8], value: &[u8]) -> Data {
        let len = key.len() + value.len();
        if len <= INLINE {
            let mut bytes = [0; INLINE];
            bytes[..key.len()].copy_from_slice(key);
            bytes[key.len()..len].copy_from_slice(value);
            Data::Inline {
                len: len as u8,
                bytes,
            }
        } else {
            let mut data = Vec::with_capacity(len);
            data.extend_from_slice(key);
            data.extend_from_slice(value);
            Data::Heap(data.into_boxed_slice())
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Data::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Data::Heap(bytes) => bytes,
        }
    }
}

/// One key with its value and metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    data: Data,
    key_len: u32,
    counter: u32,
    wall_ms: u64,
    extras: Option<Box<Extras>>,
}

/// What only some keys have; boxed so that plain keys pay 8 bytes for it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Extras {
    /// Absolute expiry time, milliseconds since the Unix epoch.
    pub expires_at: Option<u64>,
    /// The fencing token protecting the key.
    pub fencing_token: Option<Hlc>,
    /// Whether the key is kept on disk.
    pub persisted: bool,
}

impl Extras {
    fn is_empty(&self) -> bool {
        self.expires_at.is_none() && self.fencing_token.is_none() && !self.persisted
    }
}

impl Entry {
    /// A new entry. Panics only if the key is longer than 4 GiB, which the
    /// broker's packet size limit rules out long before.
    pub fn new(key: &[u8], value: &[u8], version: Version, extras: Extras) -> Entry {
        Entry {
            data: Data::new(key, value),
            key_len: u32::try_from(key.len()).expect("key longer than 4 GiB"),
            counter: version.counter,
            wall_ms: version.wall_ms,
            extras: (!extras.is_empty()).then(|| Box::new(extras)),
        }
    }

    /// The key.
    pub fn key(&self) -> &[u8] {
        &self.data.bytes()[..self.key_len as usize]
    }

    /// The value.
    pub fn value(&self) -> &[u8] {
        &self.data.bytes()[self.key_len as usize..]
    }

    /// The version of the SET that wrote this entry.
    pub fn version(&self) -> Version {
        Version {
            wall_ms: self.wall_ms,
            counter: self.counter,
        }
    }

    /// When the key expires, if it does.
    pub fn expires_at(&self) -> Option<u64> {
        self.extras.as_ref().and_then(|e| e.expires_at)
    }

    /// The fencing token protecting the key, if any.
    pub fn fencing_token(&self) -> Option<&Hlc> {
        self.extras.as_ref().and_then(|e| e.fencing_token.as_ref())
    }

    /// Whether the key is kept on disk.
    pub fn persisted(&self) -> bool {
        self.extras.as_ref().is_some_and(|e| e.persisted)
    }

    /// Bytes counted against the store's byte quota.
    pub fn size(&self) -> u64 {
        self.data.bytes().len() as u64
    }
}

/// The key/value data.
#[derive(Default)]
pub struct Db {
    slots: Vec<Option<Entry>>,
    free: Vec<u32>,
    index: HashTable<u32>,
    hasher: DefaultHashBuilder,
    /// (expires_at, slot) of every key with an expiry.
    expiries: BTreeSet<(u64, u32)>,
    bytes: u64,
}

impl Db {
    /// An empty store.
    pub fn new() -> Db {
        Db::default()
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether there are no keys.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Sum of the lengths of all keys and values.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    fn slot_of(&self, key: &[u8]) -> Option<u32> {
        let hash = self.hasher.hash_one(key);
        let slots = &self.slots;
        self.index
            .find(hash, |&slot| entry_at(slots, slot).key() == key)
            .copied()
    }

    /// The entry for `key`.
    pub fn get(&self, key: &[u8]) -> Option<&Entry> {
        self.slot_of(key).map(|slot| entry_at(&self.slots, slot))
    }

    /// Writes `entry`, replacing and returning the old entry of its key. A
    /// replaced key keeps its slot.
    pub fn insert(&mut self, entry: Entry) -> Option<Entry> {
        let expires_at = entry.expires_at();
        let size = entry.size();
        let (slot, old) = match self.slot_of(entry.key()) {
            Some(slot) => {
                let old = self.slots[slot as usize].replace(entry);
                (slot, old)
            }
            None => {
                let hash = self.hasher.hash_one(entry.key());
                let slot = match self.free.pop() {
                    Some(slot) => {
                        self.slots[slot as usize] = Some(entry);
                        slot
                    }
                    None => {
                        let slot =
                            u32::try_from(self.slots.len()).expect("more than 4 billion keys");
                        self.slots.push(Some(entry));
                        slot
                    }
                };
                let (slots, hasher) = (&self.slots, &self.hasher);
                self.index
                    .insert_unique(hash, slot, |&s| hasher.hash_one(entry_at(slots, s).key()));
                (slot, None)
            }
        };
        if let Some(old) = &old {
            self.bytes -= old.size();
            if let Some(at) = old.expires_at() {
                self.expiries.remove(&(at, slot));
            }
        }
        self.bytes += size;
        if let Some(at) = expires_at {
            self.expiries.insert((at, slot));
        }
        old
    }

    /// Removes and returns the entry for `key`.
    pub fn remove(&mut self, key: &[u8]) -> Option<Entry> {
        let hash = self.hasher.hash_one(key);
        let slots = &self.slots;
        let slot = self
            .index
            .find_entry(hash, |&slot| entry_at(slots, slot).key() == key)
            .ok()?
            .remove()
            .0;
        Some(self.vacate(slot))
    }

    fn vacate(&mut self, slot: u32) -> Entry {
        let entry = self.slots[slot as usize]
            .take()
            .expect("indexed slot is occupied");
        if let Some(at) = entry.expires_at() {
            self.expiries.remove(&(at, slot));
        }
        self.bytes -= entry.size();
        self.free.push(slot);
        entry
    }

    /// Removes and returns every entry whose expiry is at or before `now_ms`.
    pub fn expire_due(&mut self, now_ms: u64) -> Vec<Entry> {
        let mut expired = Vec::new();
        while let Some(&(at, slot)) = self.expiries.first() {
            if at > now_ms {
                break;
            }
            let hash = self.hasher.hash_one(entry_at(&self.slots, slot).key());
            let found = self.index.find_entry(hash, |&s| s == slot);
            found.expect("expiring key is indexed").remove();
            expired.push(self.vacate(slot));
        }
        expired
    }

    /// The earliest expiry time in the store.
    pub fn next_expiry(&self) -> Option<u64> {
        self.expiries.first().map(|&(at, _)| at)
    }

    /// Collects the keys matching `pattern` from slot `start` on, stopping
    /// after `max_keys` keys or `max_slots` visited slots, whichever comes
    /// first, or before a key whose [`Pattern::cost`] would take the page's
    /// matching over `max_steps` (but never before the first slot, so that
    /// every page moves on), or before a matching key that would take the
    /// keys' bytes over `max_key_bytes` (but never before the first key). Returns the keys and the slot to resume from,
    /// or `None` when the end of the slab was reached.
    ///
    /// A key that exists for the whole scan never moves, so it is returned
    /// exactly once; a deleted key is not returned after its deletion; keys
    /// added during a scan may or may not be.
    pub fn scan(
        &self,
        start: usize,
        max_keys: usize,
        max_slots: usize,
        max_steps: u64,
        max_key_bytes: usize,
        pattern: &Pattern,
    ) -> (Vec<Vec<u8>>, Option<usize>) {
        let everything = pattern.matches_everything();
        let mut keys = Vec::new();
        let mut key_bytes = 0usize;
        let mut steps = StepBudget::new(max_steps);
        let mut slot = start;
        let end = start.saturating_add(max_slots.max(1)).min(self.slots.len());
        while slot < end && keys.len() < max_keys.max(1) {
            if let Some(entry) = &self.slots[slot] {
                let key = entry.key();
                if !everything && !steps.take(pattern.cost(key.len()), slot == start) {
                    break;
                }
                if everything || pattern.matches(key) {
                    key_bytes = key_bytes.saturating_add(key.len());
                    if key_bytes > max_key_bytes && !keys.is_empty() {
                        break;
                    }
                    keys.push(key.to_vec());
                }
            }
            slot += 1;
        }
        let resume = (slot < self.slots.len()).then_some(slot);
        (keys, resume)
    }

    /// Every entry, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = &Entry> {
        self.slots.iter().flatten()
    }
}

fn entry_at(slots: &[Option<Entry>], slot: u32) -> &Entry {
    slots[slot as usize]
        .as_ref()
        .expect("indexed slot is occupied")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(ms: u64) -> Version {
        Version {
            wall_ms: ms,
            counter: 0,
        }
    }

    fn expiring(at: u64) -> Extras {
        Extras {
            expires_at: Some(at),
            ..Extras::default()
        }
    }

    #[test]
    fn entry_is_compact() {
        assert_eq!(std::mem::size_of::<Option<Entry>>(), 80);
    }

    #[test]
    fn inline_and_heap_data() {
        for (key, value) in [
            (&b"k"[..], &b""[..]),
            (&[1; 16], &[2; 32]),
            (&[1; 16], &[2; 33]),
            (&[3; 100], &[4; 1000]),
        ] {
            let e = Entry::new(key, value, v(1), Extras::default());
            assert_eq!((e.key(), e.value()), (key, value));
            assert_eq!(e.size(), (key.len() + value.len()) as u64);
            assert_eq!(
                matches!(e.data, Data::Inline { .. }),
                key.len() + value.len() <= INLINE
            );
        }
    }

    #[test]
    fn insert_get_replace_remove() {
        let mut db = Db::new();
        assert!(
            db.insert(Entry::new(b"k", b"v1", v(1), Extras::default()))
                .is_none()
        );
        assert_eq!(db.get(b"k").unwrap().value(), b"v1");
        assert_eq!(db.bytes(), 3);
        let old = db
            .insert(Entry::new(b"k", b"v22", v(2), Extras::default()))
            .unwrap();
        assert_eq!(old.value(), b"v1");
        assert_eq!((db.len(), db.bytes()), (1, 4));
        assert_eq!(db.remove(b"k").unwrap().version(), v(2));
        assert!(db.get(b"k").is_none());
        assert!(db.remove(b"k").is_none());
        assert_eq!((db.len(), db.bytes()), (0, 0));
    }

    #[test]
    fn slots_are_reused_and_keys_keep_theirs() {
        let mut db = Db::new();
        for k in [b"a", b"b", b"c"] {
            db.insert(Entry::new(k, b"", v(1), Extras::default()));
        }
        db.remove(b"b");
        db.insert(Entry::new(b"a", b"new", v(2), Extras::default()));
        db.insert(Entry::new(b"d", b"", v(3), Extras::default()));
        let keys: Vec<&[u8]> = db.iter().map(Entry::key).collect();
        assert_eq!(keys, vec![&b"a"[..], b"d", b"c"]);
    }

    #[test]
    fn expiry_pops_only_what_is_due() {
        let mut db = Db::new();
        db.insert(Entry::new(b"late", b"", v(1), expiring(300)));
        db.insert(Entry::new(b"early", b"", v(1), expiring(100)));
        db.insert(Entry::new(b"never", b"", v(1), Extras::default()));
        assert_eq!(db.next_expiry(), Some(100));
        assert!(db.expire_due(99).is_empty());
        let due = db.expire_due(100);
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].key(), b"early");
        // Renewing moves the expiry; clearing it removes it from the index.
        db.insert(Entry::new(b"late", b"", v(2), expiring(500)));
        assert!(db.expire_due(400).is_empty());
        db.insert(Entry::new(b"late", b"", v(3), Extras::default()));
        assert_eq!(db.next_expiry(), None);
        assert!(db.expire_due(u64::MAX).is_empty());
        assert_eq!(db.len(), 2);
    }

    #[test]
    fn scan_pages_through_slots() {
        let mut db = Db::new();
        for i in 0..10u8 {
            db.insert(Entry::new(&[b'k', b'0' + i], b"", v(1), Extras::default()));
        }
        let all = Pattern::new(b"*");
        let (page, next) = db.scan(0, 4, 100, u64::MAX, usize::MAX, &all);
        assert_eq!((page.len(), next), (4, Some(4)));
        db.remove(b"k5");
        // At most 4 slots visited: k4, (hole), k6, k7.
        let (page, next) = db.scan(4, 10, 4, u64::MAX, usize::MAX, &all);
        assert_eq!(page, vec![b"k4".to_vec(), b"k6".to_vec(), b"k7".to_vec()]);
        let (page, next2) = db.scan(
            next.unwrap(),
            4,
            100,
            u64::MAX,
            usize::MAX,
            &Pattern::new(b"k9"),
        );
        assert_eq!((page, next2), (vec![b"k9".to_vec()], None));
        assert_eq!(
            db.scan(100, 4, 4, u64::MAX, usize::MAX, &all),
            (vec![], None)
        );
    }

    #[test]
    fn a_scan_ends_before_the_key_that_passes_its_bytes() {
        let mut db = Db::new();
        for i in 0..6u8 {
            db.insert(Entry::new(&[b'k', b'0' + i], b"", v(1), Extras::default()));
        }
        let all = Pattern::new(b"*");
        // Two-byte keys, five bytes a page: two keys, resumed at the third.
        let (page, next) = db.scan(0, 10, 100, u64::MAX, 5, &all);
        assert_eq!((page.len(), next), (2, Some(2)));
        // The first key always goes, however long.
        let (page, next) = db.scan(2, 10, 100, u64::MAX, 1, &all);
        assert_eq!((page, next), (vec![b"k2".to_vec()], Some(3)));
    }

    #[test]
    fn a_costly_pattern_ends_pages_early_and_misses_nothing() {
        let mut db = Db::new();
        // 1000-byte keys of `a`; every third one has a `b` after 900 `a`.
        let mut matching = Vec::new();
        for i in 0..40u32 {
            let mut key = vec![b'a'; 1000];
            key[..4].copy_from_slice(&i.to_be_bytes());
            if i % 3 == 0 {
                key[950] = b'b';
                matching.push(key.clone());
            }
            db.insert(Entry::new(&key, b"", v(1), Extras::default()));
        }
        let pattern = Pattern::new(format!("*{}b*", "a".repeat(100)).as_bytes());
        // 2 words for each byte, the tables once: 2000 steps a key or more.
        assert_eq!(pattern.cost(1000), 2000 + 2 * 256 * 2 + 101);
        // Without a step budget, one page looks at all 40 slots.
        let (keys, next) = db.scan(0, 100, 1600, u64::MAX, usize::MAX, &pattern);
        assert_eq!((keys, next), (matching.clone(), None));
        // With 10,000 steps, a page looks at four or five slots.
        let pattern = Pattern::new(format!("*{}b*", "a".repeat(100)).as_bytes());
        let (mut found, mut start, mut pages) = (Vec::new(), Some(0), 0);
        while let Some(from) = start {
            let (keys, next) = db.scan(from, 100, 1600, 10_000, usize::MAX, &pattern);
            if let Some(next) = next {
                assert!((from + 4..=from + 5).contains(&next), "{from} -> {next}");
            }
            found.extend(keys);
            start = next;
            pages += 1;
        }
        assert_eq!(pages, 9);
        assert_eq!(found, matching, "every matching key, once, in slot order");
    }

    #[test]
    fn every_page_looks_at_one_slot_at_least() {
        let mut db = Db::new();
        for i in 0..5u8 {
            db.insert(Entry::new(&[b'k', i, b'b'], b"", v(1), Extras::default()));
        }
        db.remove(&[b'k', 2, b'b']);
        let pattern = Pattern::new(b"*b");
        let mut keys = Vec::new();
        let mut start = Some(0);
        // No budget at all: one key a page (the hole at slot 2 costs nothing).
        for expected in [Some(1), Some(3), Some(4), None] {
            let (page, next) = db.scan(start.unwrap(), 10, 10, 0, usize::MAX, &pattern);
            assert_eq!((page.len(), next), (1, expected));
            keys.extend(page);
            start = next;
        }
        assert_eq!(keys.len(), 4);
    }
}
