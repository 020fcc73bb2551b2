//! The writer thread: group commit, fsync, and the durable position.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use fjall::{Database, PersistMode};
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

pub(super) fn write_loop(
    engine: Engine,
    jobs: mpsc::Receiver<Job>,
    durable: watch::Sender<Position>,
    mode: Mode,
    kick: Arc<Kick>,
    stall: Arc<Stall>,
    stopping: Arc<AtomicBool>,
) {
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
            let written = commit(&engine, &batch, &puts, &stopping)
                && match mode {
                    Mode::Fsync => sync(&engine.db, PersistMode::SyncAll, &stopping),
                    // Out of the process, into the OS: a crash of the broker
                    // loses nothing; a power loss what the OS has not written.
                    Mode::Interval(_) => {
                        unsynced = true;
                        sync(&engine.db, PersistMode::Buffer, &stopping)
                    }
                };
            if !written {
                return gave_up(changes);
            }
        }
        // The interval's fsync, when due: after a batch, or on waking idle.
        if let Mode::Interval(every) = mode
            && unsynced
            && last_sync.elapsed() >= every
        {
            if !sync(&engine.db, PersistMode::SyncAll, &stopping) {
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
    if !sync(&engine.db, PersistMode::SyncAll, &stopping) {
        return gave_up(0);
    }
    // What the next start must find again (see check.rs).
    if let Err(e) = super::check::write_mark(&engine.dir, engine.recoverable_seqno()) {
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

/// Writes one batch atomically, retrying until the disk takes it: until
/// then, the writes it holds are not acknowledged. `false`: the broker
/// began stopping while the disk still refused it (given up).
fn commit(engine: &Engine, writes: &[Write], puts: &[Put], stopping: &AtomicBool) -> bool {
    let mut delay = Duration::from_millis(10);
    loop {
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
        match batch.commit() {
            Ok(()) => return true,
            Err(e) => {
                tracing::error!(error = %e, "cannot write to the data directory; retrying (writes stay unacknowledged)");
                if !back_off(&mut delay, stopping) {
                    return false;
                }
            }
        }
    }
}

/// Persists the journal as `mode` says, retrying like [`commit`].
fn sync(db: &Database, mode: PersistMode, stopping: &AtomicBool) -> bool {
    let mut delay = Duration::from_millis(10);
    while let Err(e) = db.persist(mode) {
        tracing::error!(error = %e, "cannot fsync persisted keys; retrying (writes stay unacknowledged)");
        if !back_off(&mut delay, stopping) {
            return false;
        }
    }
    true
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
