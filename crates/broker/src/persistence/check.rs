//! What a start checks before it trusts the data directory: that the
//! journal is still there, that nothing the last clean shutdown held has
//! gone missing, and whether a crash left a torn last batch.
//!
//! A lost journal does not stop the storage engine: fjall opens a
//! directory whose journal was deleted as a new, empty database (the
//! keyspaces themselves are registered through the journal), and one whose
//! journal was zeroed with what its tables hold. The broker would then
//! serve with the data silently gone. So:
//!
//! - a directory that fjall has used (its `version` file) but that holds no
//!   journal file is refused;
//! - a clean shutdown leaves a mark, [`MARK`], with fjall's sequence
//!   number after its last write; a start that finds the mark but opens the
//!   database at a lower sequence number is refused (writes that were on
//!   disk are gone). The mark is removed once a start has checked it, so it
//!   speaks only of the shutdown just before;
//! - without the mark (the last run ended in a crash) the newest journal is
//!   read for a torn last batch, which fjall cuts off and logs only at
//!   debug level: the broker says so at WARN.
//!
//! `--accept-data-loss` starts anyway, with what the engine can read, and
//! says at WARN what was accepted.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use super::repair;

/// The clean-shutdown mark: `seqno <fjall sequence number>`.
pub(super) const MARK: &str = "statebroker-clean-shutdown";

/// Data the directory should hold and does not.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Loss {
    /// fjall's files are there, its journal is not.
    JournalMissing,
    /// The clean shutdown left the database at `expected`; it opened at
    /// `found`.
    Behind { expected: u64, found: u64 },
}

impl Loss {
    pub(super) fn describe(&self, dir: &Path) -> String {
        match self {
            Loss::JournalMissing => "it has been used (fjall's `version` file is there) but holds no journal file (*.jnl): \
                 every change not yet written to a table is lost, and the storage engine would start empty"
                .to_owned(),
            Loss::Behind { expected, found } => format!(
                "its last clean shutdown left the storage engine at sequence number {expected}, \
                 and it opens at {found}: the journal ({}) was damaged or replaced since",
                dir.join("*.jnl").display()
            ),
        }
    }
}

/// What to do about a loss: refuse (the error text), or go on with a WARN.
pub(super) fn judge(dir: &Path, loss: Loss, accept: bool) -> Result<(), String> {
    let what = loss.describe(dir);
    if accept {
        tracing::warn!(
            data_dir = %dir.display(),
            "starting with data lost, as --accept-data-loss asks: {what}"
        );
        Ok(())
    } else {
        Err(format!(
            "{what}. Restore the data directory from a backup, or start once with \
             --accept-data-loss to go on with what the storage engine can still read"
        ))
    }
}

/// Before opening: a directory fjall has used whose journal is gone.
pub(super) fn journal_missing(dir: &Path) -> std::io::Result<Option<Loss>> {
    if !dir.join("version").exists() {
        return Ok(None);
    }
    Ok(journals(dir)?.is_empty().then_some(Loss::JournalMissing))
}

/// The journal files, oldest first.
pub(super) fn journals(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut journals: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jnl"))
        .filter_map(|p| {
            let n = p.file_stem()?.to_str()?.parse::<u64>().ok()?;
            Some((n, p))
        })
        .collect();
    journals.sort();
    Ok(journals.into_iter().map(|(_, p)| p).collect())
}

/// The sequence number the last clean shutdown left, if it left a mark.
pub(super) fn read_mark(dir: &Path) -> std::io::Result<Option<u64>> {
    match std::fs::read_to_string(dir.join(MARK)) {
        Ok(text) => Ok(text
            .trim()
            .strip_prefix("seqno ")
            .and_then(|n| n.parse().ok())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// After a start has checked the mark: it no longer describes the data.
pub(super) fn remove_mark(dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(dir.join(MARK)) {
        Ok(()) => sync_dir(dir),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// At a clean shutdown, after the last fsync: the sequence number a start
/// must find again.
pub(super) fn write_mark(dir: &Path, seqno: u64) -> std::io::Result<()> {
    let temporary = dir.join(format!("{MARK}.tmp"));
    let mut file = std::fs::File::create(&temporary)?;
    writeln!(file, "seqno {seqno}")?;
    file.sync_all()?;
    std::fs::rename(&temporary, dir.join(MARK))?;
    sync_dir(dir)
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// After a crash: whether the newest journal ends in a batch that never
/// fully reached the disk (fjall cuts it off on open). Logs at WARN.
pub(super) fn warn_of_a_torn_tail(dir: &Path) {
    let Ok(Some(journal)) = journals(dir).map(|mut j| j.pop()) else {
        return;
    };
    let Ok(bytes) = std::fs::read(&journal) else {
        return;
    };
    if let Some(torn) = repair::torn_tail(&bytes) {
        tracing::warn!(
            journal = %journal.display(),
            offset = torn.start,
            bytes = torn.len(),
            "the journal ends in a batch that was not completely written (the last run ended during a write): \
             the storage engine discards it; those writes had not been acknowledged"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mark_round_trips_and_goes() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_mark(dir.path()).unwrap(), None);
        write_mark(dir.path(), 4711).unwrap();
        assert_eq!(read_mark(dir.path()).unwrap(), Some(4711));
        remove_mark(dir.path()).unwrap();
        assert_eq!(read_mark(dir.path()).unwrap(), None);
        remove_mark(dir.path()).unwrap();
    }

    #[test]
    fn a_used_directory_without_a_journal_is_a_loss() {
        let dir = tempfile::tempdir().unwrap();
        // Never used: nothing to lose.
        assert_eq!(journal_missing(dir.path()).unwrap(), None);
        std::fs::write(dir.path().join("version"), b"FJL\x03").unwrap();
        assert_eq!(
            journal_missing(dir.path()).unwrap(),
            Some(Loss::JournalMissing)
        );
        std::fs::write(dir.path().join("0.jnl"), b"").unwrap();
        assert_eq!(journal_missing(dir.path()).unwrap(), None);
    }

    #[test]
    fn a_loss_is_refused_unless_accepted() {
        let dir = Path::new("/data");
        let loss = || Loss::Behind {
            expected: 10,
            found: 3,
        };
        let refused = judge(dir, loss(), false).unwrap_err();
        assert!(refused.contains("sequence number 10"), "{refused}");
        assert!(refused.contains("--accept-data-loss"), "{refused}");
        assert!(judge(dir, loss(), true).is_ok());
    }
}
