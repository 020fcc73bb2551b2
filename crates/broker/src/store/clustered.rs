//! The state store service when the keys are kept in etcd
//! ([`crate::cluster`]): the requests' path on a cluster node.
//!
//! Checks, KEYNOTIFY, PING and INFO are served at once by the node's own
//! `statestore::Store` (which holds the node's watchers and clock, and no
//! keys). Key commands and SCAN go to etcd from a task: requests on one
//! key run one after another in the order they arrived on this node (one
//! queue per key with work), SCANs each on their own. Changes made on any
//! node come back through the cluster's watch and are published to this
//! node's watchers like the single node's notifications.
//!
//! The request's PUBLISH is acknowledged when it is handed over; its
//! answer follows when etcd confirms. A request etcd cannot confirm gets no
//! answer (see [`crate::cluster::kv`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use statestore::command::{Command, Dialect};
use statestore::hlc::{Hlc, Version};
use statestore::store::Prepared;
use statestore::{Caller, KeyAccess, Request};

use super::binding::ReplyTo;
use super::service::{Reply, StateStoreService};
use crate::cluster::registrations::{self, Recorder, Registered};
use crate::cluster::{Change, Cluster, NodeClock, Unanswered, record};

/// Requests handed to etcd and not answered yet, on this node: beyond it a
/// request is answered `-ERR the quota has been exceeded` at once.
const MAX_QUEUED: usize = 16_384;

/// A cluster node's side of the service.
pub(crate) struct Clustered {
    cluster: Arc<Cluster>,
    /// Per key with work: the requests waiting behind the running one.
    queues: Mutex<HashMap<Vec<u8>, VecDeque<Job>>>,
    /// Requests handed over and not answered.
    queued: std::sync::atomic::AtomicUsize,
    /// Wakes the task that records this node's KEYNOTIFY registrations in
    /// etcd (see `cluster::registrations`).
    recorder: Arc<Recorder>,
}

/// A request's parts, owned, for the task that serves it.
struct Job {
    payload: Vec<u8>,
    dialect: Dialect,
    timestamp: Option<Hlc>,
    fencing_token: Option<Hlc>,
    persist: bool,
    request: u64,
    /// Sent again by the client (see [`ReplyTo::resent`]).
    resent: bool,
    reply: Reply<'static>,
    access: Option<Arc<dyn KeyAccess + Send + Sync>>,
}

impl Clustered {
    pub(crate) fn new(cluster: Arc<Cluster>) -> Clustered {
        Clustered {
            cluster,
            queues: Mutex::new(HashMap::new()),
            queued: std::sync::atomic::AtomicUsize::new(0),
            recorder: Arc::new(Recorder::default()),
        }
    }

    /// Some KEYNOTIFY registration was made or ended on this node.
    pub(crate) fn registrations_changed(&self) {
        self.recorder.wake();
    }

    /// Whether etcd answers (for `/readyz`).
    pub(crate) fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    pub(crate) fn is_ready(&self) -> bool {
        self.cluster.is_ready()
    }

    /// Starts the cluster's tasks, with this service's clock and watchers.
    pub(crate) async fn start(service: &Arc<StateStoreService>) -> Result<(), String> {
        let Some(clustered) = service.clustered() else {
            return Ok(());
        };
        let (changes, mut received) = tokio::sync::mpsc::unbounded_channel::<Change>();
        let clock: Arc<dyn NodeClock> = Arc::new(ServiceClock(Arc::downgrade(service)));
        clustered.cluster.start(clock, changes).await?;
        // The node's store reports the cluster's keys and bytes (INFO, the
        // gauges, $SYS), as of each change the watch delivers.
        let keyspace = |service: &StateStoreService, cluster: &Cluster| {
            let now = cluster.keyspace();
            service.with_store(|store| store.set_keyspace(Some(now)));
        };
        keyspace(service, &clustered.cluster);
        // The node's registrations, recorded in etcd for every node's key
        // pages.
        service.with_store(|store| store.keep_watch_changes(registrations::MAX_CHANGES));
        clustered.cluster.record_registrations(
            Arc::new(ServiceRegistrations(Arc::downgrade(service))),
            &clustered.recorder,
        );
        let weak = Arc::downgrade(service);
        let cluster = Arc::clone(&clustered.cluster);
        tokio::spawn(async move {
            while let Some(change) = received.recv().await {
                let Some(service) = weak.upgrade() else {
                    return;
                };
                keyspace(&service, &cluster);
                service.notify_elsewhere(change);
            }
        });
        Ok(())
    }
}

/// The node's KEYNOTIFY registrations, for the task that records them.
struct ServiceRegistrations(Weak<StateStoreService>);

impl Registered for ServiceRegistrations {
    fn changes(&self) -> Option<Vec<statestore::notify::WatchChange>> {
        match self.0.upgrade() {
            Some(service) => service.with_store(|store| store.take_watch_changes()),
            None => Some(Vec::new()),
        }
    }

    fn all(&self) -> Vec<(Arc<str>, Box<[u8]>)> {
        self.0.upgrade().map_or_else(Vec::new, |service| {
            service.with_store(|store| {
                let _ = store.take_watch_changes();
                store.all_watches()
            })
        })
    }
}

/// The service's clock, for the cluster's tasks (which must not keep the
/// service alive).
struct ServiceClock(Weak<StateStoreService>);

impl NodeClock for ServiceClock {
    fn observe(&self, seen: Version) {
        if let Some(service) = self.0.upgrade() {
            service.with_store(|store| store.observe(seen));
        }
    }

    fn mint(&self, now_ms: u64, received: Option<&Hlc>) -> Version {
        match self.0.upgrade() {
            Some(service) => service.with_store(|store| store.mint(now_ms, received)),
            None => Version::default(),
        }
    }

    fn clock_now(&self, now_ms: u64) -> Version {
        match self.0.upgrade() {
            Some(service) => service.with_store(|store| store.clock_now(now_ms)),
            None => Version::default(),
        }
    }

    fn wall_ms(&self) -> u64 {
        self.0
            .upgrade()
            .map_or_else(crate::clock::now_ms, |s| s.wall_ms())
    }
}

impl StateStoreService {
    /// Serves a request on a cluster node: at once when the node's own
    /// store can, else through etcd from a task.
    pub(super) fn serve_clustered(
        self: &Arc<Self>,
        clustered: &Clustered,
        request: &Request<'_>,
        caller: Caller<'_>,
        reply_to: Option<ReplyTo>,
        access: Option<Arc<dyn KeyAccess + Send + Sync>>,
    ) {
        let now = self.wall_ms();
        let (prepared, registered) = self.with_store(|store| {
            let prepared = store.prepare(request, caller, now);
            (prepared, store.watch_changes_waiting())
        });
        if registered {
            clustered.registrations_changed();
        }
        let (key, command) = match prepared {
            Prepared::Done(outcome) => {
                let reply = self.reply(request, caller, reply_to, &outcome);
                self.publish_answer(reply, outcome);
                return;
            }
            Prepared::Key(keyed) => (Some(keyed.command.key().to_vec()), keyed.command.name()),
            Prepared::Scan(_) => (None, "SCAN"),
        };
        let reply = self.reply_pending(request, caller, reply_to, command);
        if clustered.queued.load(std::sync::atomic::Ordering::Relaxed) >= MAX_QUEUED {
            crate::metrics::cluster_refused("queue_full");
            tracing::warn!(
                client_id = caller.client_id,
                queued = MAX_QUEUED,
                "state store request refused: too many requests wait for etcd on this node"
            );
            self.answer(
                reply,
                statestore::Error::QuotaExceeded.frame(),
                Default::default(),
                Some(statestore::Error::QuotaExceeded),
            );
            return;
        }
        clustered
            .queued
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let correlation = reply
            .to
            .as_ref()
            .and_then(|to| to.correlation.as_deref())
            .unwrap_or_default();
        let job = Job {
            payload: request.payload.to_vec(),
            dialect: request.dialect,
            timestamp: request.timestamp.and_then(|t| t.parse().ok()),
            fencing_token: request.fencing_token.and_then(|t| t.parse().ok()),
            persist: request.persist,
            request: record::request_id(caller.client_id, correlation),
            resent: reply.to.as_ref().is_some_and(|to| to.resent),
            reply: reply.detach(),
            access,
        };
        let Some(key) = key else {
            tokio::spawn(run_scan(Arc::clone(self), job));
            return;
        };
        let mut queues = clustered.queues.lock();
        match queues.get_mut(&key) {
            Some(waiting) => waiting.push_back(job),
            None => {
                queues.insert(key.clone(), VecDeque::new());
                tokio::spawn(run_key(Arc::clone(self), key, job));
            }
        }
    }

    /// Runs a request of one of the broker's own tools (the web view's
    /// edit forms) through etcd, as [`StateStoreService::serve_clustered`]
    /// runs a client's, and returns its RESP3 answer (there is no reply
    /// to publish; watchers hear of the change through the watch, as of
    /// any node's).
    pub(super) async fn execute_clustered(
        self: &Arc<Self>,
        clustered: &Clustered,
        request: &Request<'_>,
        caller: Caller<'_>,
    ) -> Vec<u8> {
        let now = self.wall_ms();
        let keyed = match self.with_store(|store| store.prepare(request, caller, now)) {
            Prepared::Done(outcome) => {
                let payload = outcome.payload.clone();
                let reply = self.reply(request, caller, None, &outcome);
                self.publish_answer(reply, outcome);
                return payload;
            }
            Prepared::Key(keyed) => keyed,
            // The edit forms send SET and DEL.
            Prepared::Scan(_) => return b"-ERR SCAN is not an edit\r\n".to_vec(),
        };
        let reply = self.reply_pending(request, caller, None, keyed.command.name());
        // Each edit is a request of its own: nothing sends one again.
        let id = record::request_id(caller.client_id, &crate::clock::now_nanos().to_be_bytes());
        match commit(self, clustered, &keyed, (id, false)).await {
            Ok(answer) => {
                let mut payload = Vec::new();
                answer.frame.encode(&mut payload);
                self.answer(reply, answer.frame, answer.version, answer.error);
                payload
            }
            Err(why) => {
                unanswered(&reply, &why);
                format!("-ERR etcd did not answer: {why}\r\n").into_bytes()
            }
        }
    }

    /// Publishes the notifications of a change made on any node.
    fn notify_elsewhere(&self, change: Change) {
        let notice = self
            .with_store(|store| store.changed_elsewhere(&change.key, change.event, change.version));
        if let Some(notice) = notice {
            self.publish_notices(vec![notice]);
        }
    }
}

/// Serves the requests on one key in their order, until none waits.
async fn run_key(service: Arc<StateStoreService>, key: Vec<u8>, mut job: Job) {
    let Some(clustered) = service.clustered() else {
        return;
    };
    loop {
        serve_key(&service, clustered, job).await;
        let next = {
            let mut queues = clustered.queues.lock();
            match queues.get_mut(&key).and_then(VecDeque::pop_front) {
                Some(next) => Some(next),
                None => {
                    queues.remove(&key);
                    None
                }
            }
        };
        match next {
            Some(next) => job = next,
            None => return,
        }
    }
}

/// Serves `keyed` through etcd, with the service's clock and quotas;
/// `request`: its identity, and whether it was sent again.
async fn commit(
    service: &Arc<StateStoreService>,
    clustered: &Clustered,
    keyed: &statestore::store::Keyed<'_>,
    request: (u64, bool),
) -> Result<crate::cluster::kv::Answer, Unanswered> {
    let clock = ServiceClock(Arc::downgrade(service));
    let quota = service.with_store(|store| store.config().quota.clone());
    clustered
        .cluster
        .serve_key(keyed, request, &quota, &clock)
        .await
}

async fn serve_key(service: &Arc<StateStoreService>, clustered: &Clustered, job: Job) {
    let served = async {
        let args = statestore::resp3::parse_request(&job.payload).ok()?;
        let command = Command::parse(&args, job.dialect).ok()?;
        let command = statestore::command::KeyCommand::of(command)?;
        let keyed = statestore::store::Keyed {
            command,
            timestamp: job.timestamp.clone(),
            fencing_token: job.fencing_token.clone(),
            persist: job.persist,
        };
        Some(commit(service, clustered, &keyed, (job.request, job.resent)).await)
    }
    .await;
    clustered
        .queued
        .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    match served {
        Some(Ok(answer)) => service.answer(job.reply, answer.frame, answer.version, answer.error),
        Some(Err(why)) => unanswered(&job.reply, &why),
        // It parsed before it was queued.
        None => unanswered(&job.reply, &Unanswered::Contended(0)),
    }
}

async fn run_scan(service: Arc<StateStoreService>, job: Job) {
    let Some(clustered) = service.clustered() else {
        return;
    };
    let served = async {
        let args = statestore::resp3::parse_request(&job.payload).ok()?;
        let Command::Scan(scan) = Command::parse(&args, job.dialect).ok()? else {
            return None;
        };
        let page_size = service.with_store(|store| store.config().scan_page_size);
        let access = job.access.as_deref().map(|a| a as &(dyn KeyAccess + Sync));
        Some(
            clustered
                .cluster
                .scan(&scan, access, page_size, service.wall_ms())
                .await,
        )
    }
    .await;
    clustered
        .queued
        .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    match served {
        Some(Ok(Ok(frame))) => service.answer(job.reply, frame, Default::default(), None),
        Some(Ok(Err(error))) => {
            service.answer(job.reply, error.frame(), Default::default(), Some(error))
        }
        Some(Err(why)) => unanswered(&job.reply, &why),
        None => unanswered(&job.reply, &Unanswered::Contended(0)),
    }
}

fn unanswered(reply: &Reply<'_>, why: &Unanswered) {
    let reason = match why {
        Unanswered::Unreachable(_) => "unreachable",
        Unanswered::InDoubt => "in_doubt",
        Unanswered::Contended(_) => "contended",
    };
    crate::metrics::cluster_unanswered(reason);
    tracing::warn!(
        client_id = %reply.requester,
        command = reply.command,
        %why,
        "state store request not answered"
    );
}
