//! Several statebroker nodes sharing one state store kept in **etcd**.
//!
//! etcd is the only engine: each state store key is one etcd key under
//! `<etcd_prefix>K/` ([`record`]); each command is one etcd transaction
//! that compares the key's mod revision with the one the command was
//! planned against (the `statestore::plan` seam) and plans again when
//! another node got there first. There is no consensus code here.
//!
//! - [`kv`]: serving a key command and SCAN against etcd; [`reads`] and
//!   [`writes`]: its linearizable reads and its transactions, those
//!   waiting together sent as one ([`batches`]); [`leader`]: etcd's
//!   leader term, for giving up requests stuck at a member after a leader
//!   change.
//! - [`watch`]: one etcd watch over every key, resumed by revision: the
//!   changes any node makes, for this node's KEYNOTIFY watchers, and the
//!   index of what expires.
//! - [`reaper`]: the node elected (etcd election) to delete expired keys
//!   and old tombstones.
//! - [`membership`]: the node's registration under a lease; it serves MQTT
//!   clients only while it holds the lease.
//! - [`ownership`]: which node a client id is connected to; a CONNECT on
//!   another node ends the older connection (0x8E).
//! - [`sessions`]: persistent sessions kept in etcd, resumed on any node;
//!   [`handover`]: the messages a session had queued go with it;
//!   [`orphans`]: those whose node is gone, adopted by a live node until
//!   their client comes back.
//! - [`wills`]: the wills of clients whose node died, published by
//!   another.
//! - [`retained`]: retained messages kept in etcd for nodes that start
//!   later.
//! - [`Node`]: the membership, the links, client ownership and retained
//!   messages of a node, started together and owned in one place.
//! - [`peers`]: links to the other nodes, which carry this node's clients'
//!   publishes to every node's subscribers (a publish is acknowledged once
//!   the nodes have it: `confirmations`); [`shares`]: which node a shared
//!   subscription gets each message on.
//! - readiness: a linearizable read every second; `/readyz` is 503 while it
//!   fails (no etcd quorum).
//!
//! Registrations (KEYNOTIFY) stay with the node of their connection, in
//! its own `statestore::Store`, which also holds the node's hybrid logical
//! clock; [`registrations`] records them in etcd for every node's key
//! pages.

mod awaited;
mod backlog;
mod batches;
pub mod browse;
mod cache;
mod confirmations;
mod endpoints;
mod handover;
pub mod kv;
mod leader;
pub mod membership;
mod node;
pub mod origins;
mod orphans;
pub mod ownership;
pub mod peers;
mod queue;
mod reads;
mod reaper;
mod recent;
pub mod record;
pub mod registrations;
pub mod retained;
mod route;
mod scan;
pub mod sessions;
pub mod shares;
mod stamps;
pub mod watch;
pub mod wills;
mod writes;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions};
use parking_lot::Mutex;

use crate::config::ClusteringSettings;
pub use awaited::Awaited;
pub use kv::{NodeClock, Unanswered};
pub use membership::Membership;
pub use node::Node;
pub use ownership::Ownership;
pub use peers::Peers;
pub use queue::Queue;
pub use retained::Retained;
pub use sessions::SessionJournal;
pub use shares::Shares;
pub use watch::Change;

/// A node's connection to the cluster.
pub struct Cluster {
    settings: ClusteringSettings,
    client: Client,
    /// `<etcd_prefix>K/`: where the store's keys are.
    keys_prefix: Vec<u8>,
    /// The last linearizable read succeeded.
    ready: AtomicBool,
    /// What expires and which tombstones to drop, as the watch saw them.
    index: Mutex<watch::Index>,
    /// Dropped with the cluster: its tasks end.
    stop: tokio::sync::watch::Sender<()>,
    /// A deliberately wrong mode, for the checker's test only.
    broken: kv::Broken,
    /// etcd's leader term as last seen (see [`leader`]).
    leader: Arc<leader::Leader>,
    /// For the keys' records: answers of up to [`reads::MAX_KEYS`] records
    /// are decoded.
    kv: etcd_client::KvClient,
    /// Linearizable reads of keys, batched (see [`reads`]).
    reads: reads::Reads,
    /// Writes of keys' records, batched (see [`writes`]).
    writes: writes::Writes,
    /// The last record known of each key (see [`cache::Cache`]).
    cache: Mutex<cache::Cache>,
    /// With `stale-reads`: the first record this node saw of each key.
    seen: Mutex<std::collections::HashMap<Vec<u8>, kv::Read>>,
    /// Keys and bytes of keys and values in etcd, as the watch delivered
    /// them (see [`watch::Keyspace`]).
    keyspace: Mutex<watch::Keyspace>,
    /// The membership lease this node is registered under (0: none yet);
    /// only [`membership`] writes it. What the node records in etcd for as
    /// long as it serves goes under it.
    lease: tokio::sync::watch::Sender<i64>,
    /// Wakes [`endpoints::follow`] to ask the members now (a request
    /// failed: one may have gone down since the last round).
    recheck: Arc<tokio::sync::Notify>,
}

impl Cluster {
    /// Connects to etcd and checks that a quorum answers (a linearizable
    /// read), within a few request timeouts.
    pub async fn connect(settings: ClusteringSettings) -> Result<Arc<Cluster>, String> {
        let endpoints = settings.etcd_endpoints.join(",");
        let timeout = settings.request_timeout;
        let options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(timeout)
            .with_keep_alive(Duration::from_secs(2), timeout);
        let deadline = timeout.saturating_mul(3).max(Duration::from_secs(5));
        let keys_prefix = format!("{}K/", settings.etcd_prefix).into_bytes();
        let leader = leader::Leader::new();
        // The members that answer now: requests go to those only (see
        // `endpoints.rs`).
        let in_use = endpoints::answering(&settings.etcd_endpoints, &options, timeout).await;
        let connect = async {
            let mut client = Client::connect(&in_use, Some(options.clone()))
                .await
                .map_err(|e| e.to_string())?;
            let read = client
                .get(
                    keys_prefix.clone(),
                    Some(GetOptions::new().with_prefix().with_count_only()),
                )
                .await
                .map_err(|e| e.to_string())?;
            leader.observe(read.header());
            Ok::<_, String>(client)
        };
        let client = match tokio::time::timeout(deadline, connect).await {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => return Err(format!("cannot reach etcd at {endpoints}: {e}")),
            Err(_) => {
                return Err(format!(
                    "cannot reach etcd at {endpoints}: no quorum answered within {} ms",
                    deadline.as_millis()
                ));
            }
        };
        tracing::info!(
            node_id = settings.node_id,
            etcd = endpoints,
            prefix = settings.etcd_prefix,
            "clustering: the state store is kept in etcd"
        );
        let broken = kv::Broken::from_env();
        if broken != kv::Broken::No {
            tracing::error!(
                mode = ?broken,
                "clustering: STATEBROKER_CLUSTER_BROKEN is set: this node answers WRONGLY on purpose (a test of the history checker)"
            );
        }
        let decoding_limit = reads::decoding_limit(settings.max_request_bytes);
        let kv = client.kv_client().max_decoding_message_size(decoding_limit);
        let route = Arc::new(route::Route::new(
            kv.clone(),
            settings.requests_to_leader,
            decoding_limit,
        ));
        let reads = reads::Reads::start(
            Arc::clone(&route),
            Arc::clone(&leader),
            settings.max_request_bytes,
        );
        let writes = writes::Writes::start(
            Arc::clone(&route),
            Arc::clone(&leader),
            settings.max_request_bytes,
        );
        let following = endpoints::Following {
            client: client.clone(),
            endpoints: settings.etcd_endpoints.clone(),
            in_use,
            options,
            timeout,
            route,
            leader: Arc::clone(&leader),
        };
        let recheck = Arc::new(tokio::sync::Notify::new());
        let cluster = Arc::new(Cluster {
            leader,
            broken,
            kv,
            reads,
            writes,
            seen: Mutex::new(std::collections::HashMap::new()),
            cache: Mutex::new(cache::Cache::new(settings.cache_bytes)),
            settings,
            client,
            keys_prefix,
            ready: AtomicBool::new(true),
            index: Mutex::new(watch::Index::default()),
            keyspace: Mutex::new(watch::Keyspace::default()),
            stop: tokio::sync::watch::Sender::new(()),
            lease: tokio::sync::watch::Sender::new(0),
            recheck: Arc::clone(&recheck),
        });
        tokio::spawn(endpoints::follow(
            following,
            recheck,
            cluster.stop.subscribe(),
        ));
        Ok(cluster)
    }

    /// This node's name.
    pub fn node_id(&self) -> &str {
        &self.settings.node_id
    }

    /// Keys and bytes of keys and values in the store, all nodes' (as the
    /// watch has delivered them: a write another node made moments ago may
    /// not be counted yet; an expired key counts until it is reaped).
    pub fn keyspace(&self) -> (usize, u64) {
        self.keyspace.lock().get()
    }

    /// Whether the last linearizable read reached a quorum.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Starts the node's tasks: the readiness probe, the watch (changes go
    /// to `changes`, versions into `clock`) and the reaper. They end when
    /// the cluster is dropped.
    pub async fn start(
        self: &Arc<Self>,
        clock: Arc<dyn NodeClock>,
        changes: tokio::sync::mpsc::UnboundedSender<Change>,
    ) -> Result<(), String> {
        let revision = watch::load(self, clock.as_ref())
            .await
            .map_err(|e| format!("cannot read the state store's keys from etcd: {e}"))?;
        tokio::spawn(readiness(Arc::downgrade(self), self.stop.subscribe()));
        tokio::spawn(leader::probe(
            Arc::downgrade(&self.leader),
            self.client.maintenance_client(),
            self.stop.subscribe(),
        ));
        tokio::spawn(watch::run(
            Arc::downgrade(self),
            self.client.clone(),
            revision + 1,
            clock,
            changes,
            self.stop.subscribe(),
        ));
        tokio::spawn(reaper::run(Arc::downgrade(self), self.stop.subscribe()));
        Ok(())
    }

    /// A request to etcd failed: the members are asked now rather than at
    /// the next round, so one that went down leaves the channel before the
    /// request is tried again.
    fn request_failed(&self) {
        self.recheck.notify_one();
    }

    fn key(&self, key: &[u8]) -> Vec<u8> {
        let mut full = Vec::with_capacity(self.keys_prefix.len() + key.len());
        full.extend_from_slice(&self.keys_prefix);
        full.extend_from_slice(key);
        full
    }
}

/// A linearizable read every second: `/readyz` follows it. A read that
/// fails at once is tried again as the store's own reads are (up to
/// [`kv::READ_ATTEMPTS`] tries, the members asked again between them): a
/// member that just went down fails the read sent to it, and the node
/// stays ready while a quorum answers. A read that times out makes the
/// node unready at once.
async fn readiness(cluster: std::sync::Weak<Cluster>, mut stop: tokio::sync::watch::Receiver<()>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let Some(c) = cluster.upgrade() else { return };
        let (records, bytes) = c.cache.lock().usage();
        crate::metrics::cluster_cache(records, bytes);
        let mut ok = false;
        for attempt in 1..=kv::READ_ATTEMPTS {
            let mut client = c.client.clone();
            let read = client.get(
                c.keys_prefix.clone(),
                Some(GetOptions::new().with_prefix().with_count_only()),
            );
            match tokio::time::timeout(c.settings.request_timeout, read).await {
                Ok(Ok(read)) => {
                    c.leader.observe(read.header());
                    ok = true;
                    break;
                }
                Ok(Err(_)) if attempt < kv::READ_ATTEMPTS => {
                    c.request_failed();
                    kv::back_off(attempt).await;
                }
                // No answer within the timeout (no quorum, or a member that
                // hangs): not ready now rather than a few timeouts later.
                _ => {
                    c.request_failed();
                    break;
                }
            }
        }
        let was = c.ready.swap(ok, Ordering::AcqRel);
        if was != ok {
            if ok {
                tracing::info!("clustering: etcd answers again: ready");
            } else {
                tracing::warn!(
                    etcd = c.settings.etcd_endpoints.join(","),
                    "clustering: etcd does not answer (no quorum?): not ready; state store requests wait or go unanswered"
                );
            }
        }
    }
}
