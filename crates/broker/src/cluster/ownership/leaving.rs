//! A node that stops normally (SIGTERM) lets the other nodes take its
//! clients' sessions before it goes.
//!
//! Its clients are sent away first ("server shutting down") and come back
//! on other nodes; the links between the nodes stay up meanwhile, so the
//! node they come to finds this one alive and linked, claims each client
//! and has its queued messages handed over (see [`super::super::handover`])
//! rather than reading them from etcd, where the last ones are not yet
//! (they are written [`super::super::queue::LINGER`] after they were
//! queued). [`Ownership::wait_moved`] waits until the sessions of the
//! clients connected when the node began to stop are no longer kept here
//! and no handover is under way, or until a deadline: a session whose
//! client does not come back in time stays, as do those whose clients
//! were away already (not waited for), their messages written to etcd
//! before the node exits (`Queue::flush`).

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;
use tokio::time::Instant;

use super::Ownership;

/// Sessions moving away from this node.
#[derive(Default)]
pub(super) struct Leaving {
    /// A claim went, or a handover ended.
    settled: Notify,
    /// Handovers under way.
    handovers: AtomicUsize,
}

/// A handover under way, counted until it is dropped. Taken under the
/// ownership's lock, with the removal of the claim it hands over: the
/// count of claims and handovers never passes through 0 between them.
pub(super) struct HandingOver(Arc<Leaving>);

impl Leaving {
    pub(super) fn handing_over(self: &Arc<Self>) -> HandingOver {
        self.handovers.fetch_add(1, Ordering::AcqRel);
        HandingOver(Arc::clone(self))
    }

    pub(super) fn claim_gone(&self) {
        self.settled.notify_waiters();
    }
}

impl Drop for HandingOver {
    fn drop(&mut self) {
        self.0.handovers.fetch_sub(1, Ordering::AcqRel);
        self.0.settled.notify_waiters();
    }
}

impl Ownership {
    /// The clients connected here now (before the node sends them away).
    pub fn connected_clients(&self) -> HashSet<String> {
        self.state
            .lock()
            .claims
            .iter()
            .filter(|(_, claim)| !claim.ended)
            .map(|(client, _)| client.clone())
            .collect()
    }

    /// How many sessions this node keeps (or clients it has).
    pub fn kept_sessions(&self) -> usize {
        self.state.lock().claims.len()
    }

    /// Waits until this node keeps the session of none of `clients` (those
    /// connected when it began to stop: their clients come back elsewhere
    /// at once; a session whose client was away already is not waited
    /// for) and hands none over, or until `deadline`; returns how many of
    /// them it still keeps.
    pub async fn wait_moved(&self, clients: &HashSet<String>, deadline: Instant) -> usize {
        loop {
            let settled = self.leaving.settled.notified();
            tokio::pin!(settled);
            settled.as_mut().enable();
            let kept = {
                let state = self.state.lock();
                clients
                    .iter()
                    .filter(|c| state.claims.contains_key(*c))
                    .count()
            };
            if kept == 0 && self.leaving.handovers.load(Ordering::Acquire) == 0 {
                return 0;
            }
            tokio::select! {
                () = settled => {}
                () = tokio::time::sleep_until(deadline) => return kept,
            }
        }
    }
}
