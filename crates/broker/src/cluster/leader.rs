//! etcd's leader term, as this node last saw it: a batch of requests out
//! since an older term is given up once a newer term appears.
//!
//! When etcd's leader dies or is paused, a request already at a member
//! waits there: a follower keeps a proposal or a read index meant for the
//! old leader until the request times out (`etcd_request_timeout_ms`, 2 s
//! by default), even when a new leader was elected meanwhile. So a leader
//! kill stalled requests for the election *plus* up to a whole timeout
//! (the long fault run: 4.46 s without any answer after a kill, the new
//! leader elected about 2 s before the answers came again).
//!
//! Each batch ([`super::batches`]) notes the term it was sent in; one out
//! longer than `STUCK_AFTER` also waits for a newer term, and is given up
//! when one appears: its reads are read again, its writes found out as in
//! doubt (see [`super::kv`]), both from the new leader. While such a
//! batch is out, the node asks etcd's members for their status every
//! [`PROBE_EVERY`] (a member answers alone, without a quorum: its leader
//! and term); the answers of the node's requests carry the term too.
//!
//! A newer term without a failure (a leader handing over, a spurious
//! election on a loaded machine) only costs the batches out at that moment
//! a second attempt.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::{Notify, watch};

/// How often the members are asked while a batch is out too long.
pub(super) const PROBE_EVERY: Duration = Duration::from_millis(100);

/// How long one status request may take (a paused member never answers).
const PROBE_TIMEOUT: Duration = Duration::from_millis(300);

/// The greatest term seen, and how many batches are out too long.
pub(super) struct Leader {
    term: watch::Sender<u64>,
    stuck: AtomicUsize,
    wake: Notify,
}

impl Leader {
    pub(super) fn new() -> Arc<Leader> {
        Arc::new(Leader {
            term: watch::Sender::new(0),
            stuck: AtomicUsize::new(0),
            wake: Notify::new(),
        })
    }

    /// Takes in the term of an etcd answer.
    pub(super) fn observe(&self, header: Option<&etcd_client::ResponseHeader>) {
        if let Some(header) = header {
            self.observe_term(header.raft_term());
        }
    }

    fn observe_term(&self, term: u64) {
        self.term.send_if_modified(|seen| {
            let newer = term > *seen;
            if newer {
                if *seen > 0 {
                    tracing::info!(term, "clustering: etcd has a new leader");
                    crate::metrics::cluster_etcd_leader_changed();
                }
                *seen = term;
            }
            newer
        });
    }

    /// The greatest term seen.
    pub(super) fn term(&self) -> u64 {
        *self.term.borrow()
    }

    /// Returns once a term greater than `term` has been seen.
    pub(super) async fn newer_than(&self, term: u64) {
        let mut seen = self.term.subscribe();
        let _ = seen.wait_for(|&t| t > term).await;
    }

    /// A batch is out too long: the members are asked for their status
    /// until the returned guard is dropped.
    pub(super) fn stuck(self: &Arc<Self>) -> Stuck {
        if self.stuck.fetch_add(1, Ordering::AcqRel) == 0 {
            self.wake.notify_one();
        }
        Stuck(Arc::clone(self))
    }
}

/// See [`Leader::stuck`].
pub(super) struct Stuck(Arc<Leader>);

impl Drop for Stuck {
    fn drop(&mut self) {
        self.0.stuck.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Asks etcd's members for their status while a batch is out too long;
/// ends with `leader` or when `stop` fires.
pub(super) async fn probe(
    leader: Weak<Leader>,
    mut client: etcd_client::MaintenanceClient,
    mut stop: watch::Receiver<()>,
) {
    loop {
        let Some(l) = leader.upgrade() else { return };
        if l.stuck.load(Ordering::Acquire) == 0 {
            // (Ends with the cluster's `stop`, which outlives nothing here.)
            tokio::select! {
                () = l.wake.notified() => {}
                _ = stop.changed() => return,
            }
            continue;
        }
        // A member without a leader (an election under way) says 0.
        if let Ok(Ok(status)) = tokio::time::timeout(PROBE_TIMEOUT, client.status()).await
            && status.leader() != 0
        {
            l.observe_term(status.raft_term());
        }
        drop(l);
        tokio::select! {
            () = tokio::time::sleep(PROBE_EVERY) => {}
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_newer_term_wakes_what_waits_and_an_older_one_does_not() {
        let leader = Leader::new();
        leader.observe_term(5);
        let waiting = tokio::spawn({
            let leader = Arc::clone(&leader);
            async move { leader.newer_than(5).await }
        });
        leader.observe_term(4);
        leader.observe_term(5);
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "no newer term yet");
        leader.observe_term(6);
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("woken by term 6")
            .unwrap();
        assert_eq!(leader.term(), 6);
    }

    #[test]
    fn stuck_batches_are_counted_until_dropped() {
        let leader = Leader::new();
        let a = leader.stuck();
        let b = leader.stuck();
        assert_eq!(leader.stuck.load(Ordering::Acquire), 2);
        drop(a);
        drop(b);
        assert_eq!(leader.stuck.load(Ordering::Acquire), 0);
    }
}
