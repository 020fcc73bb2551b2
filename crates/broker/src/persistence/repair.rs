//! Journal repair: a corrupt last batch is cut off, as fjall documents.

use std::path::Path;

use fjall::Database;

use super::open_database;

/// A complete last journal batch failed its checksum (a torn sector after a
/// power loss can do that). fjall documents that a corrupt last batch is
/// discarded on recovery (`RecoveryMode::TolerateCorruptTail`), but fjall 3
/// stops with an error instead; this does what the documentation says:
/// copy the newest journal aside, blank its last complete batch, and open
/// again. If the engine still refuses, the corruption is not in the tail:
/// the original journal is put back and the error stands.
pub(super) fn discard_corrupt_tail(dir: &Path) -> std::io::Result<Database> {
    let mut journals = super::check::journals(dir)?;
    let refuse = |why: String| {
        std::io::Error::other(format!(
            "journal recovery failed (checksum mismatch): {why}"
        ))
    };
    let journal = journals
        .pop()
        .ok_or_else(|| refuse("no journal file".into()))?;
    let mut bytes = std::fs::read(&journal)?;
    let Some((start, end)) = last_complete_batch(&bytes) else {
        return Err(refuse(format!(
            "no complete batch in {}",
            journal.display()
        )));
    };
    let backup = journal.with_extension(format!("jnl.corrupt-{}", crate::clock::now_ms()));
    std::fs::copy(&journal, &backup)?;
    bytes[start..end].fill(0);
    std::fs::write(&journal, &bytes)?;
    match open_database(dir) {
        Ok(db) => {
            tracing::error!(
                journal = %journal.display(),
                offset = start,
                bytes = end - start,
                copy = %backup.display(),
                "the journal's last batch was corrupt (checksum mismatch): discarded it, as the storage engine documents for a corrupt tail; the writes in it are lost"
            );
            Ok(db)
        }
        Err(e) => {
            std::fs::copy(&backup, &journal)?;
            let _ = std::fs::remove_file(&backup);
            Err(refuse(format!(
                "the corruption is not in the last batch ({e}); the data directory needs a manual look"
            )))
        }
    }
}

/// Offsets of the last complete batch in a fjall 3 journal (see [`scan`]).
fn last_complete_batch(bytes: &[u8]) -> Option<(usize, usize)> {
    scan(bytes).last
}

/// A tail of the journal past its last complete entry that is not zero: a
/// batch that was being written when the process ended (fjall cuts it off
/// on open).
pub(super) fn torn_tail(bytes: &[u8]) -> Option<std::ops::Range<usize>> {
    let from = scan(bytes).clean_end;
    let to = bytes.iter().rposition(|&b| b != 0)? + 1;
    (to > from).then_some(from..to)
}

/// What a pass over a journal finds.
struct Scan {
    /// The last complete batch.
    last: Option<(usize, usize)>,
    /// Where the last complete entry outside a batch ends (after a batch's
    /// End or a Clear).
    clean_end: usize,
}

/// Reads a fjall 3 journal: entries are Start `[1][u32 items][u64 seqno]`,
/// Item `[2][type][compression][u64 keyspace][u16 key len][u32 value
/// len][u32 stored len][key][value]`, End `[3][u64 checksum]FJL\x03`, Clear
/// `[4][u64 keyspace]`; the file is zero-filled past the data.
fn scan(bytes: &[u8]) -> Scan {
    let u16_at = |at: usize| {
        bytes
            .get(at..at + 2)
            .map(|b| usize::from(u16::from_le_bytes([b[0], b[1]])))
    };
    let u32_at = |at: usize| {
        bytes
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    let (mut pos, mut open, mut last, mut clean_end) = (0usize, None, None, 0usize);
    while let Some(&tag) = bytes.get(pos) {
        let next = match tag {
            1 => {
                open = Some(pos);
                pos + 13
            }
            2 => match (u16_at(pos + 11), u32_at(pos + 17)) {
                (Some(key), Some(stored)) => pos + 21 + key + stored,
                _ => break,
            },
            3 => {
                let end = pos + 13;
                if bytes.get(pos + 9..end) != Some(b"FJL\x03".as_slice()) {
                    break;
                }
                if let Some(start) = open.take() {
                    last = Some((start, end));
                }
                end
            }
            4 => pos + 9,
            _ => break,
        };
        if next > bytes.len() {
            break;
        }
        pos = next;
        if open.is_none() {
            clean_end = pos;
        }
    }
    Scan { last, clean_end }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persistence::open_engine;
    use fjall::PersistMode;

    #[test]
    fn finds_the_last_complete_batch() {
        let start = |n: u8| [vec![1], vec![n, 0, 0, 0], vec![9; 8]].concat();
        let item = |key: &[u8], value: &[u8]| {
            let mut b = vec![2, 0, 0];
            b.extend(0u64.to_le_bytes());
            b.extend((key.len() as u16).to_le_bytes());
            b.extend((value.len() as u32).to_le_bytes());
            b.extend((value.len() as u32).to_le_bytes());
            b.extend(key);
            b.extend(value);
            b
        };
        let end = [vec![3], vec![7; 8], b"FJL\x03".to_vec()].concat();
        let one = [start(1), item(b"k", b"v"), end.clone()].concat();
        let two = [start(1), item(b"key2", b"value2"), end.clone()].concat();
        let mut journal = [one.clone(), two.clone(), vec![0; 64]].concat();
        assert_eq!(
            last_complete_batch(&journal),
            Some((one.len(), one.len() + two.len()))
        );
        // A torn third batch does not count.
        journal.truncate(one.len() + two.len());
        journal.extend(start(2));
        journal.extend(&item(b"x", b"y")[..5]);
        assert_eq!(
            last_complete_batch(&journal),
            Some((one.len(), one.len() + two.len()))
        );
        assert_eq!(last_complete_batch(&[0; 32]), None);
        assert_eq!(last_complete_batch(&[]), None);
        // Torn: what follows the second batch, up to its last byte that is
        // not zero.
        let last = journal.iter().rposition(|&b| b != 0).unwrap() + 1;
        assert!(last > one.len() + two.len());
        assert_eq!(torn_tail(&journal), Some(one.len() + two.len()..last));
        let whole = [one.clone(), two.clone(), vec![0; 64]].concat();
        assert_eq!(torn_tail(&whole), None);
        assert_eq!(torn_tail(&[0; 32]), None);
        // Garbage never panics.
        for len in 0..one.len() {
            let _ = last_complete_batch(&one[..len]);
        }
    }

    /// The journal layout `last_complete_batch` reads is fjall's private
    /// format: this writes real batches with the pinned fjall and finds the
    /// last one, so a fjall release that changes the layout fails here.
    #[test]
    fn reads_a_real_fjall_journal() {
        let dir = tempfile::tempdir().unwrap();
        let engine = open_engine(dir.path()).unwrap();
        for (key, value) in [(&b"first"[..], &b"1"[..]), (b"second-key", b"value two")] {
            let mut batch = engine.db.batch();
            batch.insert(&engine.keys, key, value);
            batch.commit().unwrap();
        }
        engine.db.persist(PersistMode::SyncAll).unwrap();
        let journal = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "jnl"))
            .expect("a journal file");
        let bytes = std::fs::read(&journal).unwrap();
        let (start, end) = last_complete_batch(&bytes).expect("a complete batch");
        let last = &bytes[start..end];
        let contains = |needle: &[u8]| last.windows(needle.len()).any(|w| w == needle);
        assert!(contains(b"second-key") && contains(b"value two"));
        assert!(!contains(b"first"), "only the last batch");
        assert!(last.ends_with(b"FJL\x03"));
    }
}
