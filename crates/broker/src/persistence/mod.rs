//! Durability: persisted keys, retained messages and persistent sessions in
//! an embedded storage engine, group commit, and the promise every answer
//! waits for.
//!
//! One fjall database, five keyspaces: `keys` (the state store's persisted
//! keys), `meta` (the clock mark, the count of starts), `retained` (retained messages by topic),
//! `sessions` (persistent sessions by client id) and `queued` (messages for
//! persistent sessions, by client id and number). The state store and
//! the MQTT side ([`crate::durable`]) submit to the same writer, so one
//! group commit and one fsync carry both.
//!
//! Here: opening, reading back, submitting and the durable position; the
//! writer thread is in `writer.rs`, when it wakes in `kick.rs`, the
//! journal's corrupt-tail repair in `repair.rs`.
//!
//! # The promise
//!
//! In `fsync` mode a SET, DEL or VDEL of a persisted key is acknowledged only
//! after it is on disk: the writer thread gathers every change waiting at
//! that moment into one atomic batch, appends it to fjall's journal, fsyncs,
//! and only then do the responses go out. No response or notification of
//! any kind is published before the changes it could have observed are
//! durable, so nobody sees a value that a crash could take back; answers
//! that could not have observed them do not wait (`store/pending.rs`). In
//! `interval` mode each batch is handed to the operating system at once
//! (written to the journal file, not fsynced) and fsynced every
//! `interval_ms`: a crash of the broker process loses nothing, a power loss
//! or kernel crash loses at most the last `interval_ms` of acknowledged
//! writes. After a crash, fjall replays its journal on open and cuts a torn
//! tail (an incomplete last batch) off: a batch is all or nothing. fjall
//! documents the same for a *corrupt* last batch, but fjall 3 refuses to
//! open when a complete last batch fails its checksum; the broker then does
//! what the documentation says (`discard_corrupt_tail`): it keeps a
//! copy of the journal, cuts that one batch, and opens. Corruption before
//! the tail is not a crash artifact: the broker refuses to start and says
//! so. Every repair is logged; the broker logs what it restored. Keys that
//! expired while the broker was down are gone, and no notification is sent
//! for them.
//!
//! What waits for the disk is bounded: a connection is read only until 256
//! of its answers wait (`connection/hold.rs`), retained messages and
//! session changes as `connection/gate.rs` says.
//!
//! # Why fjall
//!
//! The store lives in memory; the disk only has to keep persisted keys. An
//! LSM engine with a journal fits that shape: each group commit is one
//! sequential append and one fsync, old versions are compacted away in the
//! background, and its journal recovery is documented and tested for torn
//! and corrupt tails. redb, the other candidate, rewrites B-tree pages on
//! every commit, and its documentation warns that a plain open of an
//! altered file may panic unless the whole file is checked on open.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fjall::{Database, Keyspace, KeyspaceCreateOptions};
use parking_lot::Mutex;
use statestore::persist::{Record, Write};
use tokio::sync::watch;

use crate::config::PersistenceSettings;

mod batch;
mod check;
mod kick;
mod repair;
mod writer;

pub use batch::{Batch, Position};

const CLOCK_MARK: &[u8] = b"clock_mark";
/// How many times the broker has started on this directory (u64 BE).
const STARTS: &[u8] = b"starts";

/// How much of each keyspace fjall keeps in memory before it writes it
/// out as a table (its memtable). fjall's default is 64 MiB per keyspace,
/// and a memtable keeps every version written, not just the latest: 10,000
/// keys SET 360,000 times took the broker from 32 to 78 MB resident, for
/// data the state store already holds in memory. With 4 MiB the same run
/// stays at 32 MB and SETs are as fast (alternating runs, 64 connections,
/// fsync mode: 195,500 vs 200,900 in 5 s, within the runs' spread).
/// fjall stores this with each keyspace when it is created: a data
/// directory created by an older broker keeps 64 MiB.
const MEMTABLE_BYTES: u64 = 4 << 20;

/// A data directory that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("cannot open the data directory {dir}: {message}")]
pub struct OpenError {
    dir: PathBuf,
    message: String,
}

/// The keyspaces of the MQTT side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    /// Retained messages, by topic.
    Retained,
    /// Persistent sessions, by client id.
    Sessions,
    /// Messages for persistent sessions, by client id and number.
    Queued,
}

/// A write of the MQTT side: `value: None` deletes `key`.
#[derive(Debug, Clone)]
pub struct Put {
    /// Which keyspace.
    pub space: Space,
    /// The key (a topic, a client id).
    pub key: Vec<u8>,
    /// The value, or `None` to delete.
    pub value: Option<Vec<u8>>,
}

/// A key and its value, as stored.
pub type Pair = (Vec<u8>, Vec<u8>);

/// What was on disk at start.
pub struct Loaded {
    /// Retained messages, as stored (decoded by [`crate::durable`]).
    pub retained: Vec<Pair>,
    /// Persistent sessions, as stored.
    pub sessions: Vec<Pair>,
    /// Messages for persistent sessions, as stored.
    pub queued: Vec<Pair>,
    /// The persisted keys (decodable ones; others are logged and skipped).
    pub records: Vec<Record>,
    /// The last clock mark.
    pub clock_mark: Option<u64>,
    /// This start's number on the directory: 1 for a new one (on disk
    /// before anything is served).
    pub starts: u64,
    /// Records that could not be decoded.
    pub corrupt: usize,
    /// Time taken to open and read everything.
    pub elapsed: Duration,
}

enum Job {
    Writes(u64, Vec<Write>),
    Puts(u64, Vec<Put>),
    Stop,
}

/// The persistence writer and the durable position responses wait for.
pub struct Persistence {
    jobs: Mutex<mpsc::Sender<Job>>,
    /// Sequence number of the last submitted batch of writes.
    submitted: AtomicU64,
    /// The last durable batch.
    durable: watch::Receiver<Position>,
    writer: Mutex<Option<JoinHandle<()>>>,
    /// Wakes the writer once per round of the runtime.
    kick: Arc<kick::Kick>,
    /// The `stall_disk` fault.
    stall: Arc<writer::Stall>,
    /// Set by [`Persistence::close`]: a writer retrying against a disk that
    /// refuses writes gives up.
    stopping: Arc<AtomicBool>,
    /// Whether the writer's last attempt to write or sync failed: the disk
    /// refuses writes (full, read-only, failing) and persisted writes wait.
    refusing: Arc<AtomicBool>,
}

struct Engine {
    /// The data directory.
    dir: PathBuf,
    db: Database,
    keys: Keyspace,
    meta: Keyspace,
    retained: Keyspace,
    sessions: Keyspace,
    queued: Keyspace,
}

impl Engine {
    /// The sequence number fjall recovers this database at: one past the
    /// highest of its keyspaces' (what a restart's `db.seqno()` is).
    /// `db.seqno()` itself also counts fjall's own writes to its meta
    /// keyspace (registering keyspaces), which a restart does not: a new
    /// directory stopped before its first write would otherwise leave a
    /// clean-shutdown mark its next start could never reach.
    fn recoverable_seqno(&self) -> u64 {
        use fjall::AbstractTree as _;
        [
            &self.keys,
            &self.meta,
            &self.retained,
            &self.sessions,
            &self.queued,
        ]
        .iter()
        .filter_map(|space| space.tree.get_highest_seqno())
        .map(|seqno| seqno + 1)
        .max()
        .unwrap_or(0)
    }

    fn space(&self, space: Space) -> &Keyspace {
        match space {
            Space::Retained => &self.retained,
            Space::Sessions => &self.sessions,
            Space::Queued => &self.queued,
        }
    }
}

fn open_database(dir: &Path) -> fjall::Result<Database> {
    Database::builder(dir)
        // We persist explicitly (group commit); no fsync per write.
        .manual_journal_persist(true)
        .open()
}

/// What went wrong opening `dir`, in words a person can act on: who the
/// process runs as when it may not write there, a file where the
/// directory should be.
fn io_message(dir: &Path, e: &std::io::Error) -> String {
    use std::io::ErrorKind;
    let shown = dir.display();
    match e.kind() {
        _ if dir.exists() && !dir.is_dir() => format!(
            "{shown} is a file, not a directory: remove it, or give another path \
             (--data-dir DIR or [persistence] data_dir)"
        ),
        ErrorKind::PermissionDenied => {
            let uid =
                running_uid().map_or_else(String::new, |uid| format!(" (running as uid {uid})"));
            let owner =
                running_uid().map_or_else(|| "the broker's user".to_owned(), |uid| uid.to_string());
            format!(
                "permission denied{uid}; make it writable by that user (e.g. `chown -R {owner} {shown}`; \
                 in a container whose volume or bind mount belongs to root: chown it to the image's \
                 user, or run the container as the directory's owner, compose's `user:`), or give \
                 another path (--data-dir DIR)"
            )
        }
        ErrorKind::NotADirectory => {
            format!("a part of the path {shown} is a file, not a directory ({e})")
        }
        ErrorKind::ReadOnlyFilesystem => format!(
            "it is on a read-only file system ({e}): give a writable path (--data-dir DIR), \
             or --in-memory"
        ),
        _ => e.to_string(),
    }
}

/// [`io_message`] for the storage engine's errors.
fn fjall_message(dir: &Path, e: &fjall::Error) -> String {
    match e {
        fjall::Error::Io(io) | fjall::Error::Storage(fjall::LsmError::Io(io)) => {
            io_message(dir, io)
        }
        fjall::Error::Locked => format!(
            "it is in use by another process (another statebroker with this data directory \
             still running?): stop it, or give another path (--data-dir DIR) ({e})"
        ),
        other => other.to_string(),
    }
}

/// The user id the process runs as (Unix), for error messages.
fn running_uid() -> Option<u32> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt as _;
        std::fs::metadata("/proc/self").ok().map(|m| m.uid())
    }
    #[cfg(not(unix))]
    None
}

fn open_engine(dir: &Path) -> Result<Engine, OpenError> {
    let error = |message: String| OpenError {
        dir: dir.to_owned(),
        message,
    };
    std::fs::create_dir_all(dir).map_err(|e| error(io_message(dir, &e)))?;
    let db = match open_database(dir) {
        Err(fjall::Error::JournalRecovery(fjall::JournalRecoveryError::ChecksumMismatch)) => {
            repair::discard_corrupt_tail(dir).map_err(|e| error(e.to_string()))?
        }
        other => other.map_err(|e| error(fjall_message(dir, &e)))?,
    };
    let keyspace = |name: &str| {
        db.keyspace(name, || {
            KeyspaceCreateOptions::default().max_memtable_size(MEMTABLE_BYTES)
        })
        .map_err(|e| error(fjall_message(dir, &e)))
    };
    let (keys, meta, retained) = (keyspace("keys")?, keyspace("meta")?, keyspace("retained")?);
    let (sessions, queued) = (keyspace("sessions")?, keyspace("queued")?);
    Ok(Engine {
        dir: dir.to_owned(),
        db,
        keys,
        meta,
        retained,
        sessions,
        queued,
    })
}

/// Counts this start in the `meta` keyspace, on disk (fsync) before it
/// returns; returns its number.
fn count_start(engine: &Engine) -> fjall::Result<u64> {
    let before = engine
        .meta
        .get(STARTS)?
        .and_then(|v| <[u8; 8]>::try_from(&v[..]).ok())
        .map_or(0, u64::from_be_bytes);
    let starts = before.saturating_add(1);
    engine.meta.insert(STARTS, starts.to_be_bytes())?;
    engine.db.persist(fjall::PersistMode::SyncAll)?;
    Ok(starts)
}

/// [`open_engine`] after the checks of `check.rs`: a lost journal, or
/// less than the last clean shutdown left, is refused unless `accept`.
fn open_checked(dir: &Path, accept: bool) -> Result<Engine, OpenError> {
    let error = |message: String| OpenError {
        dir: dir.to_owned(),
        message,
    };
    let io = |e: std::io::Error| error(io_message(dir, &e));
    std::fs::create_dir_all(dir).map_err(io)?;
    if let Some(loss) = check::journal_missing(dir).map_err(io)? {
        check::judge(dir, loss, accept).map_err(error)?;
    }
    let mark = check::read_mark(dir).map_err(io)?;
    if mark.is_none() {
        check::warn_of_a_torn_tail(dir);
    }
    let engine = open_engine(dir)?;
    if let Some(expected) = mark {
        let found = engine.recoverable_seqno();
        if found < expected {
            check::judge(dir, check::Loss::Behind { expected, found }, accept).map_err(error)?;
        }
    }
    check::remove_mark(dir).map_err(io)?;
    Ok(engine)
}

impl Persistence {
    /// Opens (or creates) the data directory, recovering after a crash, and
    /// reads back what it holds.
    pub fn open(settings: &PersistenceSettings) -> Result<(Persistence, Loaded), OpenError> {
        let started = Instant::now();
        let dir = &settings.data_dir;
        let engine = open_checked(dir, settings.accept_data_loss)?;
        let read_error = |e: fjall::Error| OpenError {
            dir: dir.clone(),
            message: e.to_string(),
        };
        let clock_mark = engine
            .meta
            .get(CLOCK_MARK)
            .map_err(read_error)?
            .and_then(|v| <[u8; 8]>::try_from(&v[..]).ok())
            .map(u64::from_be_bytes);
        let starts = count_start(&engine).map_err(read_error)?;
        let mut records = Vec::new();
        let mut corrupt = 0;
        for item in engine.keys.iter() {
            let (key, value) = item.into_inner().map_err(read_error)?;
            match Record::decode(&key, &value) {
                Ok(record) => records.push(record),
                Err(_) => {
                    corrupt += 1;
                    tracing::error!(
                        key = hex::encode_upper(&key),
                        "skipping a persisted key that cannot be decoded"
                    );
                }
            }
        }
        let read_all = |space: &Keyspace| -> Result<Vec<Pair>, OpenError> {
            let mut all = Vec::new();
            for item in space.iter() {
                let (key, value) = item.into_inner().map_err(read_error)?;
                all.push((key.to_vec(), value.to_vec()));
            }
            Ok(all)
        };
        let loaded = Loaded {
            retained: read_all(&engine.retained)?,
            sessions: read_all(&engine.sessions)?,
            queued: read_all(&engine.queued)?,
            records,
            clock_mark,
            starts,
            corrupt,
            elapsed: started.elapsed(),
        };
        let (tx, rx) = mpsc::channel();
        let (durable_tx, durable_rx) = watch::channel(Position::default());
        let mode = settings.mode;
        let kick = kick::Kick::new();
        let writer_kick = Arc::clone(&kick);
        let stall = Arc::new(writer::Stall::default());
        let writer_stall = Arc::clone(&stall);
        let stopping = Arc::new(AtomicBool::new(false));
        let writer_stopping = Arc::clone(&stopping);
        let refusing = Arc::new(AtomicBool::new(false));
        crate::metrics::disk_refusing_writes(false);
        let writer_refusing = Arc::clone(&refusing);
        let writer = std::thread::Builder::new()
            .name("persistence".into())
            .spawn(move || {
                writer::write_loop(
                    engine,
                    rx,
                    durable_tx,
                    mode,
                    writer_kick,
                    writer_stall,
                    writer_stopping,
                    writer_refusing,
                )
            })
            .map_err(|e| OpenError {
                dir: dir.clone(),
                message: e.to_string(),
            })?;
        kick.set_writer(writer.thread().clone());
        let persistence = Persistence {
            jobs: Mutex::new(tx),
            submitted: AtomicU64::new(0),
            durable: durable_rx,
            writer: Mutex::new(Some(writer)),
            kick,
            stall,
            stopping,
            refusing,
        };
        Ok((persistence, loaded))
    }

    /// Queues `writes`; call in the order the store made them (under the
    /// store's lock). `numbered` learns the batch before the writer can
    /// make it durable. Returns the batch.
    pub fn submit(&self, writes: Vec<Write>, numbered: impl FnOnce(Batch, &[Write])) -> Batch {
        self.send(|batch| {
            numbered(batch, &writes);
            Job::Writes(batch.number(), writes)
        })
    }

    /// Queues writes of the MQTT side. Returns the batch.
    pub fn put(&self, puts: Vec<Put>) -> Batch {
        self.send(|batch| Job::Puts(batch.number(), puts))
    }

    /// Numbers a job and queues it, both under the lock: the writer sees
    /// batches in order, so "durable up to n" holds for all below.
    fn send(&self, job: impl FnOnce(Batch) -> Job) -> Batch {
        let batch = {
            let jobs = self.jobs.lock();
            let batch = Batch::after(self.submitted.fetch_add(1, Ordering::AcqRel));
            if jobs.send(job(batch)).is_err() {
                tracing::error!("persistence writer is gone: a write will never be acknowledged");
            }
            batch
        };
        self.kick.request();
        batch
    }

    /// The last submitted batch, if any.
    pub fn submitted(&self) -> Option<Batch> {
        Batch::new(self.submitted.load(Ordering::Acquire))
    }

    /// Whether `batch` (and all before it) is durable.
    pub fn is_durable(&self, batch: Batch) -> bool {
        self.durable.borrow().covers(batch)
    }

    /// The durable position, to wait on its changes.
    pub fn durable(&self) -> watch::Receiver<Position> {
        self.durable.clone()
    }

    /// Waits until `batch` (and all before it) is durable.
    pub async fn wait_durable(&self, batch: Batch) {
        let mut durable = self.durable.clone();
        let _ = durable.wait_for(|d| d.covers(batch)).await;
    }

    /// Whether the data directory refuses writes now: the writer's last
    /// attempt failed, and it retries (for `/readyz`).
    pub fn refuses_writes(&self) -> bool {
        self.refusing.load(Ordering::Acquire)
    }

    /// Writes nothing for `period` (zero: ends a stall): the `stall_disk`
    /// fault.
    pub fn stall(&self, period: Duration) {
        self.stall.set(period);
    }

    /// Writes and syncs everything queued, then stops the writer and closes
    /// the engine (ending a stall). Idempotent.
    pub fn close(&self) {
        self.stall.set(Duration::ZERO);
        self.stopping.store(true, Ordering::Release);
        let _ = self.jobs.lock().send(Job::Stop);
        self.kick.now();
        if let Some(writer) = self.writer.lock().take() {
            let _ = writer.join();
        }
    }
}

impl Drop for Persistence {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// More than [`MEMTABLE_BYTES`] written to a keyspace is written out
    /// as a table rather than kept in memory (with fjall's default, 64 MiB,
    /// all of it would stay in the memtable).
    #[test]
    fn a_keyspace_keeps_at_most_its_memtable_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        let engine = open_engine(dir.path()).unwrap();
        assert_eq!(engine.keys.table_count(), 0);
        let value = vec![7u8; 1024];
        for round in 0..6u32 {
            let mut batch = engine.db.batch();
            for i in 0..1024u32 {
                let key = format!("key-{round}-{i}");
                batch.insert(&engine.keys, key.as_bytes(), value.as_slice());
            }
            batch.commit().unwrap();
        }
        // The flush runs on fjall's worker thread.
        let deadline = Instant::now() + Duration::from_secs(10);
        while engine.keys.table_count() == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            engine.keys.table_count() >= 1,
            "6 MiB written, nothing flushed"
        );
        // Everything is still there.
        assert_eq!(engine.keys.len().unwrap(), 6 * 1024);
    }
}
