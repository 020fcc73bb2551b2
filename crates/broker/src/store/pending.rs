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
//! - and always the newest clock mark (see [`statestore::persist`]): any
//!   answer carries a version or a clock reading, and none may be above a
//!   mark that is not on disk.
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
use std::hash::{BuildHasher, RandomState};

use statestore::persist::{Observed, Write};

/// Changes not known to be durable, by key.
#[derive(Default)]
pub(super) struct Pending {
    /// Hash of a key -> the newest batch that changes it.
    by_key: HashMap<u64, u64>,
    /// (batch, hash of a key) in the order submitted, to forget what the
    /// disk has.
    order: VecDeque<(u64, u64)>,
    /// The newest batch with a clock mark.
    mark: u64,
    hasher: RandomState,
}

impl Pending {
    /// Notes that batch `seq` holds `writes` (batches are numbered in the
    /// order submitted).
    pub fn wrote(&mut self, seq: u64, writes: &[Write]) {
        for write in writes {
            let key = match write {
                Write::Put(record) => &record.key,
                Write::Delete(key) => key,
                Write::ClockMark(_) => {
                    self.mark = seq;
                    continue;
                }
            };
            let hash = self.hasher.hash_one(key.as_slice());
            self.by_key.insert(hash, seq);
            self.order.push_back((seq, hash));
        }
    }

    /// The batch an answer that made no writes must wait for, given what
    /// it shows of the request `payload`, the last batch `submitted` and
    /// the `published` position (everything up to it is on disk and its
    /// answers are out: forgotten here).
    pub fn wait_for(
        &mut self,
        observed: &Observed,
        payload: &[u8],
        submitted: u64,
        published: u64,
    ) -> u64 {
        self.forget(published);
        let shown = match observed {
            Observed::Nothing => 0,
            Observed::All => submitted,
            Observed::Key(range) => match payload.get(range.clone()) {
                Some(key) if !self.by_key.is_empty() => {
                    let hash = self.hasher.hash_one(key);
                    self.by_key.get(&hash).copied().unwrap_or(0)
                }
                Some(_) => 0,
                None => submitted,
            },
        };
        shown.max(self.mark)
    }

    /// Drops every batch up to `published`.
    fn forget(&mut self, published: u64) {
        while let Some(&(seq, hash)) = self.order.front() {
            if seq > published {
                break;
            }
            self.order.pop_front();
            if self.by_key.get(&hash) == Some(&seq) {
                self.by_key.remove(&hash);
            }
        }
    }

    /// Keys with changes not known to be durable (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_key.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use statestore::hlc::Version;
    use statestore::persist::Record;

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
        p.wrote(1, &[put("a")]);
        p.wrote(2, &[put("b")]);
        p.wrote(3, &[put("a"), Write::Delete(b"c".to_vec())]);
        let wait = |p: &mut Pending, key: &str, durable: u64| {
            let (payload, observed) = get(key);
            p.wait_for(&observed, &payload, 3, durable)
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
        p.wrote(4, &[put("a")]);
        assert_eq!(p.wait_for(&Observed::All, b"", 9, 0), 9);
        assert_eq!(p.wait_for(&Observed::Nothing, b"", 9, 0), 0);
        // A key that is not where the store said: as if it showed all.
        assert_eq!(p.wait_for(&Observed::Key(5..50), b"short", 9, 0), 9);
    }

    #[test]
    fn every_answer_waits_for_the_newest_clock_mark() {
        let mut p = Pending::default();
        p.wrote(5, &[put("a"), Write::ClockMark(1_000)]);
        let (payload, observed) = get("other");
        assert_eq!(p.wait_for(&observed, &payload, 7, 0), 5);
        assert_eq!(p.wait_for(&Observed::Nothing, b"", 7, 0), 5);
        // Once durable, waiting for it is no wait at all.
        assert_eq!(p.wait_for(&Observed::Nothing, b"", 7, 5), 5);
    }
}
