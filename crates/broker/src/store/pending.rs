//! What an answer waits for: the persistence batches holding changes it
//! could show that are not on disk yet.
//!
//! A persisted change is answered once it is durable, and no answer may
//! show what a crash could take back. That does not make every answer wait
//! for every change: the store says what each answer can show
//! ([`Observed`]), and this keeps, for each key with changes not yet on
//! disk, the newest batch that changes it. An answer then waits for
//!
//! - its own writes, if it made any (their batch comes after everything
//!   submitted before, so it covers the rest too);
//! - else the newest batch changing the key it shows, for GET, SET, DEL,
//!   VDEL and KEYNOTIFY; everything submitted so far for SCAN and INFO;
//! - and the newest clock mark (see [`statestore::persist`]) while the
//!   store has handed out a version at or above the last mark on disk: an
//!   answer may show that version, and none may be seen above a mark that
//!   is not on disk. (Marks are raised half a lease early, so normally
//!   every version is below the mark on disk and nobody waits for the
//!   next; after a fresh start, or a client's timestamp ahead of the
//!   clock, everything waits for one mark.)
//!
//! So a GET of a key nobody changed since the last fsync, or a SET of a key
//! that is not persisted, is answered at once while persisted SETs of other
//! keys wait for the disk, and during a stalled disk only what depends on
//! the stalled changes waits.
//!
//! Keys are kept as 64-bit hashes: two keys with the same hash only make
//! an answer wait longer than it had to, never shorter. Entries are
//! forgotten once their batch is durable, so the map holds at most the
//! changes waiting for the disk, which the connections' bound on waiting
//! answers limits (`connection/hold.rs`).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};

use hashbrown::DefaultHashBuilder;

use statestore::persist::{Observed, Write};

use crate::persistence::{Batch, Position};

/// Changes not known to be durable, by key.
#[derive(Default)]
pub(super) struct Pending {
    /// Hash of a key -> the newest batch that changes it.
    by_key: HashMap<u64, Batch, BuildHasherDefault<Prehashed>>,
    /// (batch, hash of a key) in the order submitted, to forget what the
    /// disk has.
    order: VecDeque<(Batch, u64)>,
    /// Clock marks not known to be durable: (batch, mark), in order.
    marks: VecDeque<(Batch, u64)>,
    /// The last clock mark on disk (ms): versions below it need no wait.
    durable_mark: u64,
    /// The keys' hasher: foldhash, seeded at random, as the store's own
    /// table hashes the same keys (`statestore::db`); SipHash cost ~175
    /// instructions a persisted write. A collision found on purpose would
    /// only make answers wait longer.
    hasher: DefaultHashBuilder,
}

/// The keys of `Pending::by_key` are hashes already (seeded ones, from
/// `Pending::hasher`): the map uses them as they are rather than hash them a
/// second time (SipHash did, three rounds per persisted write: about 270
/// instructions, 1% of the write's, by callgrind).
#[derive(Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }

    fn write_u64(&mut self, hash: u64) {
        self.0 = hash;
    }
}

impl Pending {
    /// Nothing pending; `durable_mark`: the clock mark on disk at start.
    pub fn new(durable_mark: u64) -> Pending {
        Pending {
            durable_mark,
            ..Pending::default()
        }
    }

    /// Notes that `batch` holds `writes` (batches are numbered in the
    /// order submitted).
    pub fn wrote(&mut self, batch: Batch, writes: &[Write]) {
        for write in writes {
            let key = match write {
                Write::Put(record) => &record.key,
                Write::Delete(key) => key,
                Write::ClockMark(mark) => {
                    self.marks.push_back((batch, *mark));
                    continue;
                }
            };
            let hash = self.hasher.hash_one(key.as_slice());
            self.by_key.insert(hash, batch);
            self.order.push_back((batch, hash));
        }
    }

    /// The batch an answer that made no writes must wait for, given what
    /// it shows of the request `payload`, the last batch `submitted` and
    /// the wall time (ms) of the highest version the store has handed out.
    /// Call [`Pending::forget`] first.
    pub fn wait_for(
        &mut self,
        observed: &Observed,
        payload: &[u8],
        submitted: Option<Batch>,
        last_version_ms: u64,
    ) -> Option<Batch> {
        let shown = match observed {
            Observed::Nothing => None,
            Observed::All => submitted,
            Observed::Key(range) => match payload.get(range.clone()) {
                Some(key) if !self.by_key.is_empty() => {
                    let hash = self.hasher.hash_one(key);
                    self.by_key.get(&hash).copied()
                }
                Some(_) => None,
                None => submitted,
            },
        };
        let mark = match self.marks.back() {
            Some(&(batch, _)) if last_version_ms >= self.durable_mark => Some(batch),
            _ => None,
        };
        shown.max(mark)
    }

    /// Drops every batch `published` covers (on disk, and its answers
    /// out). Called before each request's writes are noted or its wait is
    /// asked, so what is kept never outgrows what waits for the disk.
    pub fn forget(&mut self, published: Position) {
        while let Some(&(batch, mark)) = self.marks.front() {
            if !published.covers(batch) {
                break;
            }
            self.marks.pop_front();
            self.durable_mark = mark;
        }
        while let Some(&(batch, hash)) = self.order.front() {
            if !published.covers(batch) {
                break;
            }
            self.order.pop_front();
            if self.by_key.get(&hash) == Some(&batch) {
                self.by_key.remove(&hash);
            }
        }
    }

    /// Keys with changes not known to be durable (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Entries kept, keys and marks.
    pub fn entries(&self) -> usize {
        self.order.len() + self.marks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use statestore::hlc::Version;
    use statestore::persist::Record;

    fn b(n: u64) -> Batch {
        Batch::new(n).unwrap()
    }

    fn at(n: u64) -> Position {
        Position::after(Batch::new(n))
    }

    fn put(key: &str) -> Write {
        Write::Put(Record {
            key: key.as_bytes().to_vec(),
            value: b"v".to_vec(),
            version: Version {
                wall_ms: 1,
                counter: 0,
            },
            fencing_token: None,
            expires_at: None,
        })
    }

    /// `GET key` as a payload, and what it shows.
    fn get(key: &str) -> (Vec<u8>, Observed) {
        let payload = statestore::resp3::encode_request(&["GET", key]);
        let start = payload.len() - key.len() - 2;
        (payload, Observed::Key(start..start + key.len()))
    }

    #[test]
    fn an_answer_waits_for_the_newest_change_to_its_key_only() {
        let mut p = Pending::default();
        p.wrote(b(1), &[put("a")]);
        p.wrote(b(2), &[put("b")]);
        p.wrote(b(3), &[put("a"), Write::Delete(b"c".to_vec())]);
        let wait = |p: &mut Pending, key: &str, published: u64| {
            let (payload, observed) = get(key);
            p.forget(at(published));
            p.wait_for(&observed, &payload, Some(b(3)), 0)
                .map_or(0, Batch::number)
        };
        assert_eq!(wait(&mut p, "a", 0), 3);
        assert_eq!(wait(&mut p, "b", 0), 2);
        assert_eq!(wait(&mut p, "c", 0), 3, "a delete counts");
        assert_eq!(wait(&mut p, "d", 0), 0, "unchanged: at once");
        // Batch 2 is on disk: b is forgotten, a still waits for 3.
        assert_eq!(wait(&mut p, "b", 2), 0);
        assert_eq!(wait(&mut p, "a", 2), 3);
        assert_eq!(p.len(), 2);
        assert_eq!(wait(&mut p, "a", 3), 0);
        assert_eq!(p.len(), 0, "everything durable is forgotten");
        assert!(p.order.is_empty());
    }

    #[test]
    fn scan_and_info_wait_for_everything_and_ping_for_nothing() {
        let mut p = Pending::default();
        p.wrote(b(4), &[put("a")]);
        assert_eq!(p.wait_for(&Observed::All, b"", Some(b(9)), 0), Some(b(9)));
        assert_eq!(p.wait_for(&Observed::Nothing, b"", Some(b(9)), 0), None);
        // A key that is not where the store said: as if it showed all.
        assert_eq!(
            p.wait_for(&Observed::Key(5..50), b"short", Some(b(9)), 0),
            Some(b(9))
        );
    }

    #[test]
    fn a_version_at_or_above_the_mark_on_disk_waits_for_the_next_mark() {
        // The mark on disk is 1,000 ms; batch 5 raises it to 2,000.
        let mut p = Pending::new(1_000);
        p.wrote(b(5), &[put("a"), Write::ClockMark(2_000)]);
        let (payload, observed) = get("other");
        // Every version handed out is below 1,000: nothing to wait for.
        assert_eq!(p.wait_for(&observed, &payload, Some(b(7)), 999), None);
        // One at 1,000 or above may be shown: wait for the new mark.
        assert_eq!(
            p.wait_for(&observed, &payload, Some(b(7)), 1_000),
            Some(b(5))
        );
        assert_eq!(
            p.wait_for(&Observed::Nothing, b"", Some(b(7)), 1_500),
            Some(b(5))
        );
        // Once batch 5 is published, 2,000 is the mark on disk.
        p.forget(at(5));
        assert_eq!(p.wait_for(&Observed::Nothing, b"", Some(b(7)), 1_500), None);
        assert_eq!(p.durable_mark, 2_000);
        // A fresh start has no mark on disk: the first one is waited for.
        let mut fresh = Pending::new(0);
        fresh.wrote(b(1), &[Write::ClockMark(11_000)]);
        assert_eq!(
            fresh.wait_for(&Observed::Nothing, b"", Some(b(1)), 1_000),
            Some(b(1))
        );
    }

    /// Requests that only write (persisted SETs, nobody reading) keep
    /// what is kept bounded too: each forgets what was published.
    #[test]
    fn writes_alone_keep_only_what_is_not_published() {
        let mut p = Pending::new(0);
        for seq in 1..=10_000u64 {
            p.forget(at(seq.saturating_sub(3)));
            p.wrote(b(seq), &[put(&format!("k{seq}")), Write::ClockMark(seq)]);
        }
        assert_eq!(
            p.entries(),
            2 * 3,
            "batches 9,998..10,000, a key and a mark each"
        );
        assert_eq!(p.len(), 3);
    }
}
