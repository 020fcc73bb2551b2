//! Durability: persisted keys, retained messages and persistent sessions in
//! an embedded storage engine, group commit, and the promise every answer
//! waits for.
//!
//! One fjall database, five keyspaces: `keys` (the state store's persisted
//! keys), `meta` (the clock mark), `retained` (retained messages by topic),
//! `sessions` (persistent sessions by client id) and `queued` (messages for
//! persistent sessions, by client id and number). The state store and
//! the MQTT side ([`crate::durable`]) submit to the same writer, so one
//! group commit and one fsync carry both.
//!
//! # The promise
//!
//! In `fsync` mode a SET, DEL or VDEL of a persisted key is acknowledged only
//! after it is on disk: the writer thread gathers every change waiting at
//! that moment into one atomic batch, appends it to fjall's journal, fsyncs,
//! and only then do the responses go out. No response or notification of
//! any kind is published before the changes it could have observed are
//! durable, so nobody sees a value that a crash could take back. In
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
//! so. Every repair is logged; the broker logs what it restored. Keys that expired while the
//! broker was down are gone, and no notification is sent for them.
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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode};
use parking_lot::Mutex;
use statestore::persist::{Record, Write};
use tokio::sync::watch;

use crate::config::{Mode, PersistenceSettings};

const CLOCK_MARK: &[u8] = b"clock_mark";

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
    /// Sequence number of the last durable batch.
    durable: watch::Receiver<u64>,
    writer: Mutex<Option<JoinHandle<()>>>,
}

struct Engine {
    db: Database,
    keys: Keyspace,
    meta: Keyspace,
    retained: Keyspace,
    sessions: Keyspace,
    queued: Keyspace,
}

impl Engine {
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

fn open_engine(dir: &Path) -> Result<Engine, OpenError> {
    let error = |e: &dyn std::fmt::Display| OpenError {
        dir: dir.to_owned(),
        message: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(|e| error(&e))?;
    let db = match open_database(dir) {
        Err(fjall::Error::JournalRecovery(fjall::JournalRecoveryError::ChecksumMismatch)) => {
            discard_corrupt_tail(dir).map_err(|e| error(&e))?
        }
        other => other.map_err(|e| error(&e))?,
    };
    let keyspace = |name: &str| {
        db.keyspace(name, KeyspaceCreateOptions::default)
            .map_err(|e| error(&e))
    };
    let (keys, meta, retained) = (keyspace("keys")?, keyspace("meta")?, keyspace("retained")?);
    let (sessions, queued) = (keyspace("sessions")?, keyspace("queued")?);
    Ok(Engine {
        db,
        keys,
        meta,
        retained,
        sessions,
        queued,
    })
}

impl Persistence {
    /// Opens (or creates) the data directory, recovering after a crash, and
    /// reads back what it holds.
    pub fn open(settings: &PersistenceSettings) -> Result<(Persistence, Loaded), OpenError> {
        let started = Instant::now();
        let dir = &settings.data_dir;
        let engine = open_engine(dir)?;
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
            corrupt,
            elapsed: started.elapsed(),
        };
        let (tx, rx) = mpsc::channel();
        let (durable_tx, durable_rx) = watch::channel(0);
        let mode = settings.mode;
        let writer = std::thread::Builder::new()
            .name("persistence".into())
            .spawn(move || write_loop(engine, rx, durable_tx, mode))
            .map_err(|e| OpenError {
                dir: dir.clone(),
                message: e.to_string(),
            })?;
        let persistence = Persistence {
            jobs: Mutex::new(tx),
            submitted: AtomicU64::new(0),
            durable: durable_rx,
            writer: Mutex::new(Some(writer)),
        };
        Ok((persistence, loaded))
    }

    /// Queues `writes`; call in the order the store made them (under the
    /// store's lock). Returns the batch's sequence number.
    pub fn submit(&self, writes: Vec<Write>) -> u64 {
        self.send(|seq| Job::Writes(seq, writes))
    }

    /// Queues writes of the MQTT side. Returns the batch's sequence number.
    pub fn put(&self, puts: Vec<Put>) -> u64 {
        self.send(|seq| Job::Puts(seq, puts))
    }

    /// Numbers a job and queues it, both under the lock: the writer sees
    /// sequence numbers in order, so "durable up to n" holds for all below.
    fn send(&self, job: impl FnOnce(u64) -> Job) -> u64 {
        let jobs = self.jobs.lock();
        let seq = self.submitted.fetch_add(1, Ordering::AcqRel) + 1;
        if jobs.send(job(seq)).is_err() {
            tracing::error!("persistence writer is gone: a write will never be acknowledged");
        }
        seq
    }

    /// The sequence number of the last submitted batch.
    pub fn submitted(&self) -> u64 {
        self.submitted.load(Ordering::Acquire)
    }

    /// Whether batch `seq` (and all before it) is durable.
    pub fn is_durable(&self, seq: u64) -> bool {
        *self.durable.borrow() >= seq
    }

    /// The durable position, to wait on its changes.
    pub fn durable(&self) -> watch::Receiver<u64> {
        self.durable.clone()
    }

    /// Waits until batch `seq` (and all before it) is durable.
    pub async fn wait_durable(&self, seq: u64) {
        let mut durable = self.durable.clone();
        let _ = durable.wait_for(|d| *d >= seq).await;
    }

    /// Writes and syncs everything queued, then stops the writer and closes
    /// the engine. Idempotent.
    pub fn close(&self) {
        let _ = self.jobs.lock().send(Job::Stop);
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

fn write_loop(engine: Engine, jobs: mpsc::Receiver<Job>, durable: watch::Sender<u64>, mode: Mode) {
    let mut last_sync = Instant::now();
    let mut unsynced = false;
    loop {
        let first = match mode {
            Mode::Fsync => jobs.recv().ok(),
            Mode::Interval(every) => {
                match jobs.recv_timeout(every.saturating_sub(last_sync.elapsed())) {
                    Ok(job) => Some(job),
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        if unsynced {
                            sync(&engine.db, PersistMode::SyncAll);
                            unsynced = false;
                        }
                        last_sync = Instant::now();
                        continue;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => None,
                }
            }
        };
        let Some(first) = first else { break };
        // Group commit: everything waiting now goes into one batch.
        let mut batch = Vec::new();
        let mut puts = Vec::new();
        let mut stop = false;
        let mut seq = 0;
        for job in std::iter::once(first).chain(std::iter::from_fn(|| jobs.try_recv().ok())) {
            match job {
                Job::Writes(s, writes) => {
                    seq = s;
                    batch.extend(writes);
                }
                Job::Puts(s, more) => {
                    seq = s;
                    puts.extend(more);
                }
                Job::Stop => {
                    stop = true;
                    break;
                }
            }
            if batch.len() + puts.len() >= 100_000 {
                break;
            }
        }
        if !batch.is_empty() || !puts.is_empty() {
            let started = Instant::now();
            commit(&engine, &batch, &puts);
            match mode {
                Mode::Fsync => sync(&engine.db, PersistMode::SyncAll),
                Mode::Interval(every) => {
                    // Out of the process, into the OS: a crash of the broker
                    // loses nothing; a power loss what the OS has not written.
                    sync(&engine.db, PersistMode::Buffer);
                    unsynced = true;
                    if last_sync.elapsed() >= every {
                        sync(&engine.db, PersistMode::SyncAll);
                        unsynced = false;
                        last_sync = Instant::now();
                    }
                }
            }
            crate::metrics::commit(batch.len() + puts.len(), started.elapsed());
        }
        if seq > 0 {
            durable.send_replace(seq);
        }
        if stop {
            break;
        }
    }
    sync(&engine.db, PersistMode::SyncAll);
    tracing::debug!("persistence writer stopped");
}

/// Writes one batch atomically, retrying until the disk takes it: until
/// then, the writes it holds are not acknowledged.
fn commit(engine: &Engine, writes: &[Write], puts: &[Put]) {
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
            Ok(()) => return,
            Err(e) => {
                tracing::error!(error = %e, "cannot write to the data directory; retrying (writes stay unacknowledged)");
                std::thread::sleep(delay);
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// A complete last journal batch failed its checksum (a torn sector after a
/// power loss can do that). fjall documents that a corrupt last batch is
/// discarded on recovery (`RecoveryMode::TolerateCorruptTail`), but fjall 3
/// stops with an error instead; this does what the documentation says:
/// copy the newest journal aside, blank its last complete batch, and open
/// again. If the engine still refuses, the corruption is not in the tail:
/// the original journal is put back and the error stands.
fn discard_corrupt_tail(dir: &Path) -> std::io::Result<Database> {
    let mut journals: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jnl"))
        .collect();
    journals.sort_by_key(|p| {
        p.file_stem()
            .and_then(|s| s.to_str())
            .and_then(|s| s.parse::<u64>().ok())
    });
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

/// Offsets of the last complete batch in a fjall 3 journal: entries are
/// Start `[1][u32 items][u64 seqno]`, Item `[2][type][compression][u64
/// keyspace][u16 key len][u32 value len][u32 stored len][key][value]`, End
/// `[3][u64 checksum]FJL\x03`, Clear `[4][u64 keyspace]`; the file is
/// zero-filled past the data.
fn last_complete_batch(bytes: &[u8]) -> Option<(usize, usize)> {
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
    let (mut pos, mut open, mut last) = (0usize, None, None);
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
    }
    last
}

fn sync(db: &Database, mode: PersistMode) {
    let mut delay = Duration::from_millis(10);
    while let Err(e) = db.persist(mode) {
        tracing::error!(error = %e, "cannot fsync persisted keys; retrying (writes stay unacknowledged)");
        std::thread::sleep(delay);
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
