//! The writer thread: group commit, fsync, and the durable position.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use fjall::PersistMode;
use statestore::persist::Write;
use tokio::sync::watch;

use super::kick::Kick;
use super::{Batch, CLOCK_MARK, Engine, Job, Position, Put};
use crate::config::Mode;

/// How long the writer sleeps when nothing wakes it: a safety net only
/// (every queued job is followed by a wake-up, see [`Kick`]).
const IDLE: Duration = Duration::from_secs(1);

/// At most this many changes in one group commit.
const MAX_BATCH: usize = 100_000;

/// A disk that takes its time: the `stall_disk` fault (see
/// [`crate::fault_control`]). Until it ends the writer writes nothing, so
/// every change waiting for the disk stays unacknowledged, as on a stalled
/// or saturated disk.
#[derive(Default)]
pub(super) struct Stall {
    until: parking_lot::Mutex<Option<Instant>>,
}

impl Stall {
    /// Stalls for `period` from now (zero: no more).
    pub fn set(&self, period: Duration) {
        *self.until.lock() = (!period.is_zero()).then(|| Instant::now() + period);
    }

    /// Waits while stalled, looking again every few milliseconds (a stall
    /// may be ended early).
    fn wait(&self) {
        loop {
            let left = match *self.until.lock() {
                Some(until) => until.saturating_duration_since(Instant::now()),
                None => return,
            };
            if left.is_zero() {
                return;
            }
            std::thread::sleep(left.min(Duration::from_millis(5)));
        }
    }
}

/// The storage engine, closed and opened again when it fails: fjall
/// poisons a database after any failed journal write or fsync (and after a
/// failed flush of a memtable in the background), and refuses every write
/// after that, even once the disk has room again. Closing it and opening
/// the directory again reads back what its journal holds, as after a crash
/// (a torn last batch, never acknowledged, is cut off), and it writes again.
struct Disk {
    dir: std::path::PathBuf,
    engine: Option<Engine>,
    /// The recoverable sequence number after the last write that succeeded (and was
    /// synced as the mode asks): what the directory must hold when opened
    /// again, or acknowledged writes would be gone.
    written: u64,
    /// Whether the last attempt failed (shared with `/readyz`).
    refusing: Arc<AtomicBool>,
}

impl Disk {
    /// The engine, opened again first if a failure closed it.
    fn engine(&mut self) -> Result<&Engine, String> {
        if self.engine.is_none() {
            let engine = super::open_engine(&self.dir).map_err(|e| e.to_string())?;
            let found = engine.recoverable_seqno();
            if found < self.written {
                lost_acknowledged(&self.dir, self.written, found);
            }
            tracing::warn!(
                dir = %self.dir.display(),
                "opened the data directory again after a failed write; retrying the writes"
            );
            self.engine = Some(engine);
        }
        Ok(self.engine.as_ref().expect("opened above"))
    }

    /// The last attempt failed: the engine is closed (fjall has poisoned
    /// it; it is opened again before the next try).
    fn failed(&mut self, what: &str, error: &dyn std::fmt::Display) {
        tracing::error!(error = %error, "{what}; retrying (writes stay unacknowledged)");
        if !self.refusing.swap(true, Ordering::AcqRel) {
            crate::metrics::disk_refusing_writes(true);
        }
        // Dropping the database waits for fjall's worker threads.
        self.engine = None;
    }

    /// The last attempt succeeded.
    fn written(&mut self) {
        if let Some(engine) = &self.engine {
            self.written = engine.recoverable_seqno();
        }
        if self.refusing.swap(false, Ordering::AcqRel) {
            crate::metrics::disk_refusing_writes(false);
            tracing::warn!(
                dir = %self.dir.display(),
                "the data directory takes writes again"
            );
        }
    }
}

/// The data directory, opened again, lacks writes that were acknowledged
/// (its journal lost what the operating system had been handed: only
/// possible in `interval` mode, after a failed fsync). Going on would
/// serve answers the disk does not back; the broker stops at once, with
/// the reason, and a supervisor's restart finds the directory as it is.
fn lost_acknowledged(dir: &std::path::Path, expected: u64, found: u64) -> ! {
    tracing::error!(
        dir = %dir.display(),
        expected,
        found,
        "the data directory, opened again after a failed write, lacks acknowledged writes \
         (fjall sequence number {found}, {expected} written): stopping (exit code {LOST_EXIT_CODE})"
    );
    std::process::exit(LOST_EXIT_CODE)
}

/// The exit code of [`lost_acknowledged`] (`EX_IOERR`).
pub(super) const LOST_EXIT_CODE: i32 = 74;

#[allow(clippy::too_many_arguments)]
pub(super) fn write_loop(
    engine: Engine,
    jobs: mpsc::Receiver<Job>,
    durable: watch::Sender<Position>,
    mode: Mode,
    kick: Arc<Kick>,
    stall: Arc<Stall>,
    stopping: Arc<AtomicBool>,
    refusing: Arc<AtomicBool>,
) {
    let mut disk = Disk {
        dir: engine.dir.clone(),
        written: engine.recoverable_seqno(),
        engine: Some(engine),
        refusing,
    };
    let mut last_sync = Instant::now();
    let mut unsynced = false;
    let mut more = false;
    loop {
        if !more {
            kick.wait(match mode {
                Mode::Interval(every) if unsynced => every.saturating_sub(last_sync.elapsed()),
                _ => IDLE,
            });
        }
        stall.wait();
        // Group commit: everything queued now goes into one batch.
        let mut batch = Vec::new();
        let mut puts = Vec::new();
        let mut stop = false;
        let mut seq = 0;
        more = false;
        loop {
            match jobs.try_recv() {
                Ok(Job::Writes(s, writes)) => {
                    seq = s;
                    batch.extend(writes);
                }
                Ok(Job::Puts(s, added)) => {
                    seq = s;
                    puts.extend(added);
                }
                Ok(Job::Stop) | Err(mpsc::TryRecvError::Disconnected) => {
                    stop = true;
                    break;
                }
                Err(mpsc::TryRecvError::Empty) => break,
            }
            if batch.len() + puts.len() >= MAX_BATCH {
                more = true;
                break;
            }
        }
        let changes = batch.len() + puts.len();
        let started = Instant::now();
        if changes > 0 {
            // Out of the process, into the OS, in `interval` mode: a crash
            // of the broker loses nothing; a power loss what the OS has
            // not written.
            let persist = match mode {
                Mode::Fsync => PersistMode::SyncAll,
                Mode::Interval(_) => PersistMode::Buffer,
            };
            if !commit(&mut disk, &batch, &puts, persist, &stopping) {
                return gave_up(changes);
            }
            unsynced = matches!(mode, Mode::Interval(_));
        }
        // The interval's fsync, when due: after a batch, or on waking idle.
        if let Mode::Interval(every) = mode
            && unsynced
            && last_sync.elapsed() >= every
        {
            if !sync(&mut disk, &stopping) {
                return gave_up(0);
            }
            unsynced = false;
            last_sync = Instant::now();
        }
        if changes > 0 {
            crate::metrics::commit(changes, started.elapsed());
        }
        if let Some(batch) = Batch::new(seq) {
            durable.send_replace(Position::after(Some(batch)));
        }
        if stop {
            break;
        }
    }
    if !sync(&mut disk, &stopping) {
        return gave_up(0);
    }
    // What the next start must find again (see check.rs).
    if let Some(engine) = &disk.engine
        && let Err(e) = super::check::write_mark(&engine.dir, engine.recoverable_seqno())
    {
        tracing::warn!(error = %e, dir = %engine.dir.display(), "cannot leave the clean-shutdown mark: the next start cannot check for a lost journal");
    }
    tracing::debug!("persistence writer stopped");
}

/// The broker is stopping and the disk still refuses writes: what was not
/// written was never acknowledged; say so and end (no clean-shutdown
/// mark: the next start checks the journal as after a crash).
fn gave_up(changes: usize) {
    tracing::error!(
        changes,
        "stopping while the data directory refuses writes: the changes not on disk were never acknowledged and are not kept"
    );
}

/// Writes one batch atomically and persists the journal as `persist`
/// says, retrying (on the engine opened again) until the disk takes it:
/// until then, the writes it holds are not acknowledged. `false`: the
/// broker began stopping while the disk still refused it (given up).
fn commit(
    disk: &mut Disk,
    writes: &[Write],
    puts: &[Put],
    persist: PersistMode,
    stopping: &AtomicBool,
) -> bool {
    retry(disk, stopping, |disk| attempt(disk, writes, puts, persist))
}

/// Runs `once` until it succeeds (the disk then says it writes again) or
/// the writer stops (`false`), saying each failure and backing off.
fn retry(
    disk: &mut Disk,
    stopping: &AtomicBool,
    mut once: impl FnMut(&mut Disk) -> Result<(), (&'static str, String)>,
) -> bool {
    let mut delay = Duration::from_millis(10);
    loop {
        match once(disk) {
            Ok(()) => {
                disk.written();
                return true;
            }
            Err((what, e)) => disk.failed(what, &e),
        }
        if !back_off(&mut delay, stopping) {
            return false;
        }
    }
}

/// One try of [`commit`]: the whole batch again (a batch that failed on an
/// engine since closed may or may not be in its journal; writing it twice
/// puts the same values twice).
fn attempt(
    disk: &mut Disk,
    writes: &[Write],
    puts: &[Put],
    persist: PersistMode,
) -> Result<(), (&'static str, String)> {
    let engine = disk
        .engine()
        .map_err(|e| ("cannot open the data directory again", e))?;
    let mut batch = engine.db.batch();
    for write in writes {
        match write {
            Write::Put(record) => {
                batch.insert(&engine.keys, record.key.as_slice(), record.encode_value())
            }
            Write::Delete(key) => batch.remove(&engine.keys, key.as_slice()),
            Write::ClockMark(mark) => {
                batch.insert(&engine.meta, CLOCK_MARK, mark.to_be_bytes().to_vec())
            }
        }
    }
    for put in puts {
        let space = engine.space(put.space);
        match &put.value {
            Some(value) => batch.insert(space, put.key.as_slice(), value.as_slice()),
            None => batch.remove(space, put.key.as_slice()),
        }
    }
    let failed = |what| move |e: fjall::Error| (what, e.to_string());
    batch
        .commit()
        .map_err(failed("cannot write to the data directory"))?;
    engine
        .db
        .persist(persist)
        .map_err(failed("cannot fsync persisted keys"))
}

/// Fsyncs the journal, retrying like [`commit`]. An engine opened again
/// has just read its journal back from the files; it is fsynced too.
fn sync(disk: &mut Disk, stopping: &AtomicBool) -> bool {
    retry(disk, stopping, |disk| {
        disk.engine()
            .map_err(|e| ("cannot open the data directory again", e))
            .and_then(|engine| {
                engine
                    .db
                    .persist(PersistMode::SyncAll)
                    .map_err(|e| ("cannot fsync persisted keys", e.to_string()))
            })
    })
}

/// Waits `delay` before the next try (doubling it up to 5 s), looking
/// every 10 ms whether the broker is stopping. `false`: it is.
fn back_off(delay: &mut Duration, stopping: &AtomicBool) -> bool {
    let until = Instant::now() + *delay;
    *delay = (*delay * 2).min(Duration::from_secs(5));
    while Instant::now() < until {
        if stopping.load(Ordering::Acquire) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    !stopping.load(Ordering::Acquire)
}
