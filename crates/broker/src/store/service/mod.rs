//! The state store service: the store inside the broker.
//!
//! Connection tasks hand it requests directly (no network hop, and no trip
//! through the router, so a request can never be lost between router and
//! store). It runs them against the [`statestore::Store`] and delivers the
//! response to the caller's Response Topic and notifications to watchers, at
//! QoS 1: straight to the connection that is their only recipient (see
//! [`crate::sessions`]), and otherwise into the router through the service's
//! own in-process link, to travel like any other message: to whoever
//! subscribes, at the subscriber's QoS, kept for persistent sessions.
//!
//! How answers travel is the publisher's business ([`crate::publisher`]);
//! what they carry is the binding's ([`super::binding`]). With persistence,
//! answers wait for the disk (`durable.rs`); the expiry timer is
//! `expiry.rs`; where an answer goes and who asked is `reply.rs`;
//! delivering answers and notifications is `publish.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use parking_lot::Mutex;
use statestore::persist::{Observed, Write};
use statestore::{Caller, Outcome, Request, Store};

mod durable;
mod expiry;
mod publish;
mod reply;

pub(super) use reply::Reply;
use reply::{settle, verb_of};

use super::binding::ReplyTo;
use super::pending::Pending;
use crate::activity::Activity;
use crate::clock::now_ms;
use crate::persistence::{Batch, Loaded, Persistence, Position};
use crate::publisher::Publisher;
use crate::sessions::Answer;
use durable::Waiters;
use expiry::Alarm;

/// The state store, served in process.
pub struct StateStoreService {
    store: Mutex<Store>,
    /// The changes not on disk yet, by key: what an answer waits for.
    /// Locked only with `store` locked, so always in that order.
    pending: Mutex<Pending>,
    publisher: Arc<Publisher>,
    /// The expiry task's alarm, shared with the task (which holds no
    /// reference to the service while it sleeps, and ends when the service
    /// is dropped: see [`Alarm`]).
    expiry: Arc<Alarm>,
    persistence: Option<Arc<Persistence>>,
    /// The live list of requests and notifications (web view).
    activity: Arc<Activity>,
    /// Added to the wall clock the store reads (a fault for tests, see
    /// [`crate::faults`]), milliseconds.
    clock_offset_ms: AtomicI64,
    /// Answers and notifications waiting for the disk, with the batch each
    /// waits for; the durable task publishes them as the disk catches up.
    waiting: Mutex<Waiters>,
    /// On a cluster node: the keys are in etcd (see `clustered.rs`).
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    clustered: Option<super::ClusterPart>,
    /// The durable position whose answers the durable task has published.
    /// Set on the runtime, so the connections waiting on it are woken
    /// without a trip through the operating system (the writer thread's
    /// own position would wake each from outside).
    published: tokio::sync::watch::Sender<Position>,
}

impl StateStoreService {
    /// Starts the service, answering through `publisher`; with
    /// `persistence`, the store starts from what was on disk.
    pub fn start(
        config: statestore::Config,
        persistence: Option<(Arc<Persistence>, Loaded)>,
        publisher: Arc<Publisher>,
        activity: Arc<Activity>,
    ) -> Arc<StateStoreService> {
        Self::build(config, persistence, publisher, activity, None)
    }

    /// Starts the service of a cluster node: its keys are in etcd, and a
    /// data directory keeps only the MQTT side.
    #[cfg(feature = "cluster")]
    pub(crate) async fn start_clustered(
        config: statestore::Config,
        persistence: Option<(Arc<Persistence>, Loaded)>,
        publisher: Arc<Publisher>,
        activity: Arc<Activity>,
        cluster: Arc<crate::cluster::Cluster>,
    ) -> Result<Arc<StateStoreService>, String> {
        let persistence = persistence.map(|(persistence, mut loaded)| {
            let left = std::mem::take(&mut loaded.records).len();
            if left > 0 {
                tracing::warn!(
                    keys = left,
                    "clustering: the data directory holds state store keys of a single-node run; they are not served (the cluster's keys are in etcd) and stay on disk"
                );
            }
            (persistence, loaded)
        });
        let clustered = super::clustered::Clustered::new(cluster);
        let service = Self::build(config, persistence, publisher, activity, Some(clustered));
        super::clustered::Clustered::start(&service).await?;
        Ok(service)
    }

    fn build(
        config: statestore::Config,
        persistence: Option<(Arc<Persistence>, Loaded)>,
        publisher: Arc<Publisher>,
        activity: Arc<Activity>,
        clustered: Option<super::ClusterPart>,
    ) -> Arc<StateStoreService> {
        let (store, persistence, mark) = match persistence {
            None => (Store::new(config), None, 0),
            Some((persistence, loaded)) => {
                let started = std::time::Instant::now();
                let (store, restored) =
                    Store::restore(config, loaded.records, loaded.clock_mark, now_ms());
                tracing::info!(
                    keys = restored.keys,
                    expired_while_down = restored.expired.len(),
                    unreadable = loaded.corrupt,
                    read_ms = loaded.elapsed.as_millis() as u64,
                    restore_ms = started.elapsed().as_millis() as u64,
                    "restored persisted keys"
                );
                if !restored.expired.is_empty() {
                    let deletes = restored.expired.into_iter().map(Write::Delete).collect();
                    persistence.submit(deletes, |_, _| {});
                }
                (store, Some(persistence), loaded.clock_mark.unwrap_or(0))
            }
        };
        let service = Arc::new(StateStoreService {
            store: Mutex::new(store),
            pending: Mutex::new(Pending::new(mark)),
            publisher,
            expiry: Arc::new(Alarm::new()),
            persistence,
            activity,
            clock_offset_ms: AtomicI64::new(0),
            waiting: Mutex::new(Waiters::default()),
            clustered,
            published: tokio::sync::watch::Sender::new(Position::default()),
        });
        tokio::spawn(expiry::expiry_task(
            Arc::downgrade(&service),
            Arc::clone(&service.expiry),
        ));
        if let Some(persistence) = &service.persistence {
            tokio::spawn(durable::durable_task(
                Arc::downgrade(&service),
                persistence.durable(),
            ));
        }
        service
    }

    /// Serves one request from `caller` and publishes the answer to
    /// `reply_to` (`None`: no answer, a fault), once what it could have
    /// observed is durable. Returns the batch the answer waits for, if it
    /// was not published now.
    ///
    /// `access` is the caller's key rules, kept by a cluster node's SCAN
    /// until etcd answers (`request.access` is the same rules, borrowed).
    pub fn serve(
        self: &Arc<Self>,
        request: &Request<'_>,
        caller: Caller<'_>,
        reply_to: Option<ReplyTo>,
        access: Option<Arc<dyn statestore::KeyAccess + Send + Sync>>,
    ) -> Option<Batch> {
        #[cfg(feature = "cluster")]
        if let Some(clustered) = &self.clustered {
            self.serve_clustered(clustered, request, caller, reply_to, access);
            return None;
        }
        let _ = access;
        self.run(request, caller, reply_to, |reply, outcome, wait| {
            self.publish_when_durable(Some(reply), outcome, wait, None)
        })
    }

    /// [`Self::serve`] in the requester's own connection task: an answer
    /// that goes out at once, on the connection's answer route, is put in
    /// `here` for that task to write, rather than sent through the
    /// connection's mailbox back to itself (a `Box`, the channel, and a
    /// wake-up check each way).
    pub fn serve_here(
        self: &Arc<Self>,
        request: &Request<'_>,
        caller: Caller<'_>,
        reply_to: ReplyTo,
        access: Option<Arc<dyn statestore::KeyAccess + Send + Sync>>,
        here: &mut Option<Answer>,
    ) -> Option<Batch> {
        #[cfg(feature = "cluster")]
        if self.clustered.is_some() {
            return self.serve(request, caller, Some(reply_to), access);
        }
        let _ = access;
        self.run(request, caller, Some(reply_to), |reply, outcome, wait| {
            self.publish_when_durable(Some(reply), outcome, wait, Some(here))
        })
    }

    /// Changes the service still tracks as possibly not on disk (see
    /// `pending.rs`): bounded by what waits for the disk.
    pub fn changes_tracked(&self) -> usize {
        self.pending.lock().entries()
    }

    /// Writes nothing to disk for `period` (zero: ends a stall): the
    /// `stall_disk` fault. `false`: there is no data directory.
    pub fn stall_disk(&self, period: std::time::Duration) -> bool {
        match &self.persistence {
            Some(persistence) => {
                persistence.stall(period);
                true
            }
            None => false,
        }
    }

    /// Runs a request for one of the broker's own tools (the web view's
    /// edit forms) as a client's request runs: notifications, persistence,
    /// metrics and the live list included. Returns the RESP3 answer once
    /// the change is durable.
    pub async fn execute(self: &Arc<Self>, request: &Request<'_>, caller: Caller<'_>) -> Vec<u8> {
        #[cfg(feature = "cluster")]
        if let Some(clustered) = &self.clustered {
            return self.execute_clustered(clustered, request, caller).await;
        }
        let (mut reply, mut outcome, wait) = self.run(request, caller, None, |r, o, w| {
            (r.take_detached(), take_outcome(o), w)
        });
        if let (Some(persistence), Some(batch)) = (&self.persistence, wait) {
            persistence.wait_durable(batch).await;
        }
        let payload = outcome.payload.clone();
        self.publish_outcome(Some(&mut reply), &mut outcome, None);
        payload
    }

    /// Executes a request and hands `then` where its answer goes, the
    /// outcome, and the batch the answer must wait for (handed on rather
    /// than returned: a tuple returned and taken apart was copied, ~350
    /// bytes, twice more a request; lent rather than moved: moved into
    /// `then`, the two were copied once more, ~60 instructions).
    fn run<'c, R>(
        &self,
        request: &Request<'_>,
        caller: Caller<'c>,
        reply_to: Option<ReplyTo>,
        then: impl FnOnce(&mut Reply<'c>, &mut Outcome, Option<Batch>) -> R,
    ) -> R {
        let started = crate::clock::Ticks::now();
        let machine_ms = now_ms();
        // (The lock ends with `drop`, not with a block: the outcome moved
        // out of a block as a tuple was copied twice more a request.)
        let mut store = self.store.lock();
        let mut outcome = store.execute(request, caller, self.now_from(machine_ms));
        self.rearm_expiry(store.next_expiry());
        let writes = std::mem::take(&mut outcome.writes);
        let wait = self.persist(&store, writes, &outcome.observed, request.payload);
        drop(store);
        let mut reply = self.reply_pending_at(
            request,
            caller,
            reply_to,
            outcome.command.unwrap_or_else(|| verb_of(request.payload)),
            (started, machine_ms),
        );
        settle(&mut reply, outcome.error);
        if let Some(error) = outcome.error {
            tracing::debug!(client_id = caller.client_id, owner = caller.owner, command = outcome.command, %error, "request refused");
        }
        let answered = then(&mut reply, &mut outcome, wait);
        // What is left of them is empty but for a moment's errors: dropped
        // without the drop glue's calls (~60 instructions a request).
        let Outcome {
            payload,
            notices,
            writes,
            ..
        } = outcome;
        drop_vec(payload);
        drop_vec(notices);
        drop_vec(writes);
        let Reply { to, shown, .. } = reply;
        drop_none(to);
        drop_none(shown);
        answered
    }

    /// Whether a request's acknowledgement waits for its outcome (a
    /// cluster node: see [`super::tickets`]).
    pub fn acknowledges_on_outcome(&self) -> bool {
        self.clustered.is_some()
    }

    /// The cluster side, on a cluster node.
    #[cfg(feature = "cluster")]
    pub(super) fn clustered(&self) -> Option<&super::clustered::Clustered> {
        self.clustered.as_ref()
    }

    /// A cluster node's cluster, where its keys are.
    #[cfg(feature = "cluster")]
    pub fn cluster(&self) -> Option<&Arc<crate::cluster::Cluster>> {
        self.clustered
            .as_ref()
            .map(super::clustered::Clustered::cluster)
    }

    /// Whether the state store can serve: on a cluster node, whether etcd
    /// answers.
    pub fn is_ready(&self) -> bool {
        #[cfg(feature = "cluster")]
        if let Some(clustered) = &self.clustered {
            return clustered.is_ready();
        }
        true
    }

    /// Whether the data directory refuses writes now (persisted writes
    /// wait until it takes them again): `/readyz` says so.
    pub fn disk_refuses_writes(&self) -> bool {
        self.persistence
            .as_ref()
            .is_some_and(|persistence| persistence.refuses_writes())
    }

    /// Writes and syncs what is queued and closes the storage engine,
    /// with a last clock mark just above the last version handed out: no
    /// version comes after it, and the next start's clock need not start
    /// a lease ahead (as after a crash).
    pub fn close(&self) {
        if let Some(persistence) = &self.persistence {
            let store = self.store.lock();
            if store.config().clock_lease_ms.is_some() {
                let mark = store.last_version().wall_ms.saturating_add(1);
                persistence.submit(vec![Write::ClockMark(mark)], |_, _| {});
            }
            drop(store);
            persistence.close();
        }
    }

    /// A connection of `client_id` was accepted: the KEYNOTIFY
    /// registrations of its earlier connections (one it takes over) end
    /// now.
    pub fn connection_opened(&self, client_id: &str, connection: u64) {
        let dropped = self.store.lock().connection_opened(client_id, connection);
        if dropped > 0 {
            self.registrations_changed();
            tracing::debug!(
                client_id,
                connection,
                dropped,
                "KEYNOTIFY registrations of the client's earlier connection removed"
            );
        }
    }

    /// Drops the KEYNOTIFY registrations of a connection that ended.
    pub fn connection_closed(&self, client_id: &str, connection: u64) {
        let dropped = self.store.lock().connection_closed(client_id, connection);
        if dropped > 0 {
            self.registrations_changed();
            tracing::debug!(
                client_id,
                connection,
                dropped,
                "KEYNOTIFY registrations removed"
            );
        }
    }

    /// KEYNOTIFY registrations ended: a cluster node records that in etcd.
    fn registrations_changed(&self) {
        #[cfg(feature = "cluster")]
        if let Some(clustered) = &self.clustered {
            clustered.registrations_changed();
        }
    }

    /// The wall clock the store reads: the machine's, plus the offset.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(super) fn wall_ms(&self) -> u64 {
        self.now()
    }

    /// The wall clock the store reads: the machine's, plus the offset.
    fn now(&self) -> u64 {
        self.now_from(now_ms())
    }

    /// The store's wall clock when the machine's reads `machine_ms`.
    fn now_from(&self, machine_ms: u64) -> u64 {
        machine_ms.saturating_add_signed(self.clock_offset_ms.load(Ordering::Relaxed))
    }

    /// Moves the store's clock by `offset_ms` from the machine's (a fault:
    /// see [`crate::faults`]; `0` puts it back). Versions never go back: a
    /// clock moved back leaves the HLC where it was until time catches up.
    pub fn set_clock_offset(&self, offset_ms: i64) {
        self.clock_offset_ms.store(offset_ms, Ordering::Relaxed);
        // Expiries are due by the new clock.
        self.expiry.ring();
    }

    /// The store's clock offset, milliseconds.
    pub fn clock_offset(&self) -> i64 {
        self.clock_offset_ms.load(Ordering::Relaxed)
    }

    /// Runs `f` on the store (for tests and tools).
    pub fn with_store<R>(&self, f: impl FnOnce(&mut Store) -> R) -> R {
        f(&mut self.store.lock())
    }
}

/// Drops `v`, an empty one without calling its drop glue: the glue of a
/// `Vec` of records is a function of its own, ~17 instructions to find
/// nothing to free, and a request's outcome has two to three empty ones.
#[inline(always)]
fn drop_vec<T>(v: Vec<T>) {
    if v.capacity() == 0 {
        // Nothing was allocated: nothing to leak.
        std::mem::forget(v);
    } else {
        drop(v);
    }
}

/// Drops `o`, without a call to its drop glue when it is `None`.
fn drop_none<T>(o: Option<T>) {
    if o.is_none() {
        std::mem::forget(o);
    } else {
        drop(o);
    }
}

/// A lent outcome taken whole (for what outlives the request), an empty
/// one left.
fn take_outcome(outcome: &mut Outcome) -> Outcome {
    std::mem::replace(outcome, notices_only(Vec::new()))
}

/// An outcome that only notifies (keys expired: no request, no answer).
fn notices_only(notices: Vec<statestore::Notice>) -> Outcome {
    Outcome {
        payload: Vec::new(),
        timestamp: Default::default(),
        notices,
        writes: Vec::new(),
        observed: Observed::Nothing,
        command: None,
        error: None,
    }
}
