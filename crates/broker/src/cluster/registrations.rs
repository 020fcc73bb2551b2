//! KEYNOTIFY registrations recorded in etcd, so that every node's key
//! pages show a key's watchers wherever they registered.
//!
//! Registrations stay with their connection's node: its own
//! `statestore::Store` holds them and its watch tells them of changes.
//! This module only records them, one empty etcd key each,
//! `<etcd_prefix>KN/<key in hex>/<node id>/<client id in hex>`, under the
//! node's membership lease (they go with the node). A page reads its
//! keys' records by prefix, many keys a transaction
//! ([`Cluster::watchers_of`]).
//!
//! The store keeps the registrations made and ended
//! (`Store::keep_watch_changes`, at most [`MAX_CHANGES`]); a task takes
//! them when the service says some were made ([`Recorder::wake`]) and
//! writes them, coalesced per client and key, [`BATCH_OPS`] a
//! transaction. Under a new lease (the node registered again), after a
//! failed write, or when more changes waited than the store keeps, it
//! records them all again from the store: this node's records in etcd are
//! read, those of ended registrations deleted and the others put.
//!
//! Pages trail a registration by the task's write (an etcd round trip);
//! a node killed leaves its records until its lease ends.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Weak};
use std::time::Duration;

use etcd_client::{GetOptions, PutOptions, Txn, TxnOp};
use statestore::notify::WatchChange;
use tokio::sync::{Notify, watch};

use super::Cluster;
use super::kv::prefix_end;

/// Operations per transaction, within etcd's default `--max-txn-ops`.
const BATCH_OPS: usize = 64;

/// Changes the store keeps for the task, and the task holds unwritten, at
/// most: past it the task records everything again.
pub const MAX_CHANGES: usize = 65_536;

/// Watchers of one key read for a page, at most (what a key watched by
/// many clients costs a page).
const MAX_PER_KEY: i64 = 1_000;

/// How long a failed write waits before the task tries again, at first
/// (then twice as long each time, up to [`RETRY_MAX`]; a new lease ends
/// the wait).
const RETRY: Duration = Duration::from_millis(250);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// One registration: client id and key.
type Registration = (Arc<str>, Box<[u8]>);

/// Where the task takes the registrations from: the node's store.
pub trait Registered: Send + Sync {
    /// The changes since the last call; `None` if more were made than
    /// the store keeps (then [`Registered::all`] is what there is).
    fn changes(&self) -> Option<Vec<WatchChange>>;
    /// Every registration, the changes kept until now dropped (one step,
    /// so that the changes after it are those made since).
    fn all(&self) -> Vec<Registration>;
}

/// Wakes the task that records this node's registrations.
#[derive(Default)]
pub struct Recorder {
    wake: Notify,
}

impl Recorder {
    /// Some registration was made or ended.
    pub fn wake(&self) {
        self.wake.notify_one();
    }
}

impl Cluster {
    /// `<etcd_prefix>KN/`.
    fn registrations_prefix(&self) -> Vec<u8> {
        format!("{}KN/", self.settings.etcd_prefix).into_bytes()
    }

    /// The record of `client`'s registration for `key` on this node.
    fn registration_key(&self, client: &str, key: &[u8]) -> Vec<u8> {
        [
            self.registrations_prefix().as_slice(),
            hex::encode(key).as_bytes(),
            b"/",
            self.node_id().as_bytes(),
            b"/",
            hex::encode(client.as_bytes()).as_bytes(),
        ]
        .concat()
    }

    /// Starts recording this node's registrations, from `source`, woken by
    /// `recorder`; the task ends with the cluster.
    pub fn record_registrations(
        self: &Arc<Self>,
        source: Arc<dyn Registered>,
        recorder: &Arc<Recorder>,
    ) {
        tokio::spawn(record(
            Arc::downgrade(self),
            source,
            Arc::downgrade(recorder),
            self.lease.subscribe(),
            self.stop.subscribe(),
        ));
    }

    /// The client ids watching each of `keys` on the other nodes, as
    /// recorded in etcd (this node's own are in its store): each key's
    /// records read with a prefix, [`BATCH_OPS`] keys a transaction, at
    /// most [`MAX_PER_KEY`] a key. `Err`: etcd did not answer.
    pub async fn watchers_of(
        &self,
        keys: &[Vec<u8>],
    ) -> Result<HashMap<Vec<u8>, Vec<String>>, String> {
        let prefix = self.registrations_prefix();
        let mut watchers: HashMap<Vec<u8>, Vec<String>> = HashMap::new();
        let mut client = self.client.clone();
        for chunk in keys.chunks(BATCH_OPS) {
            let reads: Vec<TxnOp> = chunk
                .iter()
                .map(|key| {
                    let of_key = [prefix.as_slice(), hex::encode(key).as_bytes(), b"/"].concat();
                    let options = GetOptions::new()
                        .with_prefix()
                        .with_keys_only()
                        .with_limit(MAX_PER_KEY);
                    TxnOp::get(of_key, Some(options))
                })
                .collect();
            let read = client.txn(Txn::new().and_then(reads));
            let response = tokio::time::timeout(self.settings.request_timeout, read)
                .await
                .map_err(|_| "etcd did not answer in time".to_owned())?
                .map_err(|e| e.to_string())?;
            for op in response.op_responses() {
                let etcd_client::TxnOpResponse::Get(get) = op else {
                    continue;
                };
                for kv in get.kvs() {
                    if let Some((key, node, client)) = parse(&kv.key()[prefix.len()..])
                        && node != self.node_id()
                    {
                        watchers.entry(key).or_default().push(client);
                    }
                }
            }
        }
        Ok(watchers)
    }

    /// This node's records in etcd: client id and key.
    async fn recorded_here(&self) -> Result<HashSet<(String, Vec<u8>)>, String> {
        let prefix = self.registrations_prefix();
        let end = prefix_end(&prefix);
        let mut from = prefix.clone();
        let mut here = HashSet::new();
        loop {
            let options = GetOptions::new()
                .with_range(end.clone())
                .with_keys_only()
                .with_limit(1000);
            let mut client = self.client.clone();
            let read = client.get(from.clone(), Some(options));
            let response = tokio::time::timeout(self.settings.request_timeout, read)
                .await
                .map_err(|_| "etcd did not answer in time".to_owned())?
                .map_err(|e| e.to_string())?;
            for kv in response.kvs() {
                if let Some((key, node, client)) = parse(&kv.key()[prefix.len()..])
                    && node == self.node_id()
                {
                    here.insert((client, key));
                }
            }
            match response.kvs().last() {
                Some(last) if response.more() => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => return Ok(here),
            }
        }
    }
}

/// A record's key (past the prefix): the key, the node id and the client
/// id.
fn parse(record: &[u8]) -> Option<(Vec<u8>, &str, String)> {
    let record = std::str::from_utf8(record).ok()?;
    let (key, rest) = record.split_once('/')?;
    let (node, client) = rest.rsplit_once('/')?;
    let client = String::from_utf8(hex::decode(client).ok()?).ok()?;
    Some((hex::decode(key).ok()?, node, client))
}

/// What the task has to write.
#[derive(Default)]
struct Unwritten {
    /// Per registration: made (`true`) or ended, the last change.
    changes: HashMap<Registration, bool>,
    /// Everything is to be recorded again.
    all: bool,
}

impl Unwritten {
    fn take(&mut self, source: &dyn Registered) {
        if self.all {
            return;
        }
        match source.changes() {
            Some(changes) if self.changes.len() + changes.len() <= MAX_CHANGES => {
                for change in changes {
                    let (registration, made) = match change {
                        WatchChange::Made { client, key } => ((client, key), true),
                        WatchChange::Ended { client, key } => ((client, key), false),
                    };
                    self.changes.insert(registration, made);
                }
            }
            _ => self.all = true,
        }
    }
}

/// Records the registrations `source` reports under the node's lease, as
/// they change and again under each new lease; ends with the cluster.
async fn record(
    cluster: Weak<Cluster>,
    source: Arc<dyn Registered>,
    recorder: Weak<Recorder>,
    mut lease: watch::Receiver<i64>,
    mut stop: watch::Receiver<()>,
) {
    let mut unwritten = Unwritten::default();
    let mut written_lease = 0;
    let mut retry = RETRY;
    loop {
        let now = *lease.borrow_and_update();
        if now != 0 {
            if now != written_lease {
                // Records under an earlier lease went (or go) with it.
                unwritten.all = true;
            }
            unwritten.take(source.as_ref());
            let Some(c) = cluster.upgrade() else { return };
            let written = if unwritten.all {
                record_all(&c, source.as_ref(), now).await
            } else {
                let changes = std::mem::take(&mut unwritten.changes);
                write(&c, &changes, now).await
            };
            match written {
                Ok(()) => {
                    unwritten.all = false;
                    written_lease = now;
                    retry = RETRY;
                }
                Err(e) => {
                    tracing::debug!(
                        error = e,
                        "clustering: cannot record the KEYNOTIFY registrations"
                    );
                    // Some batches may have gone: all again, from the store
                    // (after a while: recording all reads every node's).
                    unwritten.all = true;
                    drop(c);
                    tokio::select! {
                        () = tokio::time::sleep(retry) => {}
                        changed = lease.changed() => if changed.is_err() { return },
                        _ = stop.changed() => return,
                    }
                    retry = (retry * 2).min(RETRY_MAX);
                    continue;
                }
            }
        }
        let Some(r) = recorder.upgrade() else { return };
        tokio::select! {
            () = r.wake.notified() => {}
            changed = lease.changed() => if changed.is_err() { return },
            _ = stop.changed() => return,
        }
    }
}

/// Records every registration of `source` under `lease`, and deletes this
/// node's records of the others.
async fn record_all(cluster: &Cluster, source: &dyn Registered, lease: i64) -> Result<(), String> {
    let recorded = cluster.recorded_here().await?;
    let mut changes: HashMap<Registration, bool> = source
        .all()
        .into_iter()
        .map(|registration| (registration, true))
        .collect();
    for (client, key) in recorded {
        let registration: Registration = (client.into(), key.into());
        changes.entry(registration).or_insert(false);
    }
    write(cluster, &changes, lease).await
}

/// Puts the records of registrations made (under `lease`) and deletes
/// those of registrations ended.
async fn write(
    cluster: &Cluster,
    changes: &HashMap<Registration, bool>,
    lease: i64,
) -> Result<(), String> {
    let ops: Vec<TxnOp> = changes
        .iter()
        .map(|((client, key), made)| {
            let record = cluster.registration_key(client, key);
            if *made {
                TxnOp::put(
                    record,
                    Vec::new(),
                    Some(PutOptions::new().with_lease(lease)),
                )
            } else {
                TxnOp::delete(record, None)
            }
        })
        .collect();
    let mut client = cluster.client.clone();
    for batch in ops.chunks(BATCH_OPS) {
        let txn = Txn::new().and_then(batch.to_vec());
        tokio::time::timeout(cluster.settings.request_timeout, client.txn(txn))
            .await
            .map_err(|_| "etcd did not answer in time".to_owned())?
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_names_key_node_and_client() {
        let record = format!(
            "{}/sb/1/{}",
            hex::encode(b"k/\xff"),
            hex::encode("client/a")
        );
        assert_eq!(
            parse(record.as_bytes()),
            Some((b"k/\xff".to_vec(), "sb/1", "client/a".to_owned()))
        );
        assert_eq!(parse(b"zz/sb1/61"), None);
        assert_eq!(parse(b"61/sb1"), None);
    }

    struct Log(parking_lot::Mutex<Option<Vec<WatchChange>>>);

    impl Registered for Log {
        fn changes(&self) -> Option<Vec<WatchChange>> {
            self.0.lock().take()
        }
        fn all(&self) -> Vec<Registration> {
            Vec::new()
        }
    }

    #[test]
    fn changes_coalesce_and_too_many_mean_all_again() {
        let made = |k: &[u8]| WatchChange::Made {
            client: "c".into(),
            key: k.into(),
        };
        let ended = |k: &[u8]| WatchChange::Ended {
            client: "c".into(),
            key: k.into(),
        };
        let mut unwritten = Unwritten::default();
        let log = Log(parking_lot::Mutex::new(Some(vec![
            made(b"a"),
            made(b"b"),
            ended(b"a"),
        ])));
        unwritten.take(&log);
        let registration = |k: &[u8]| (Arc::<str>::from("c"), Box::<[u8]>::from(k));
        assert_eq!(unwritten.changes.get(&registration(b"a")), Some(&false));
        assert_eq!(unwritten.changes.get(&registration(b"b")), Some(&true));
        assert!(!unwritten.all);
        // The store kept no list: more were made than it keeps.
        unwritten.take(&log);
        assert!(unwritten.all);
    }
}
