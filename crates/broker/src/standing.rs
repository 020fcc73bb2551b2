//! Whether this node may serve MQTT clients now: a single node always; a
//! cluster node while it holds its membership lease in etcd (see
//! `cluster::membership`), so that a node cut off from etcd, or paused past
//! its lease, stops serving before another may take its clients over.
//!
//! The answer is read from the clock, not from the task that renews the
//! lease: a node that wakes from a pause refuses a CONNECT at once, before
//! that task has run.
//!
//! Past the deadline the node is *suspended*, not yet gone: its
//! connections wait ([`Standing::resumed`]), reading and writing nothing,
//! while the renewing task asks etcd about the same lease. A renewal that
//! etcd confirms (the lease never ran out: etcd extends every lease across
//! a leader election) lets them go on; a lease etcd no longer has, or no
//! answer for two TTLs, is a loss ([`Standing::lost`]): the connections
//! end with DISCONNECT 0x9C. An etcd leader election thus pauses a node's
//! clients instead of sending them all to other nodes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use tokio::sync::watch;

/// Always serving, as far as the standing knows.
const ALWAYS: u64 = u64::MAX;

/// See the module's documentation.
#[derive(Debug)]
pub struct Standing {
    base: Instant,
    /// Milliseconds after `base` until which the node serves ([`ALWAYS`]:
    /// a single node; 0: not serving).
    until_ms: AtomicU64,
    /// How many times the lease was lost: each loss must end the
    /// connections, even when the node registered again before anyone
    /// looked.
    losses: watch::Sender<u64>,
    /// Moves with each renewal (what suspended connections wait for).
    renewals: watch::Sender<u64>,
}

impl Standing {
    /// A single node's: always serving.
    pub fn always() -> Standing {
        Standing {
            base: Instant::now(),
            until_ms: AtomicU64::new(ALWAYS),
            losses: watch::Sender::new(0),
            renewals: watch::Sender::new(0),
        }
    }

    /// A cluster node's: serving until `until`.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub fn until(until: Instant) -> Standing {
        let standing = Standing::always();
        standing.serve_until(until);
        standing
    }

    /// Whether the node serves now.
    pub fn serving(&self) -> bool {
        let until = self.until_ms.load(Ordering::Acquire);
        until == ALWAYS || self.millis(Instant::now()) < until
    }

    /// The lease was renewed: serve until `until`.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub fn serve_until(&self, until: Instant) {
        self.until_ms.store(self.millis(until), Ordering::Release);
        self.renewals.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// How long ago the deadline passed without a renewal (`None`: serving,
    /// or stopped by a loss).
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub fn overdue(&self) -> Option<std::time::Duration> {
        let until = self.until_ms.load(Ordering::Acquire);
        let now = self.millis(Instant::now());
        (until != ALWAYS && until != 0 && now >= until)
            .then(|| std::time::Duration::from_millis(now - until))
    }

    /// Waits until the node serves again (`Ok`), or until it has stopped
    /// for good more often than the `epoch` a connection was accepted in
    /// (`Err`: the connection must end).
    pub async fn resumed(&self, epoch: u64) -> Result<(), ()> {
        let mut renewals = self.renewals.subscribe();
        let mut losses = self.losses.subscribe();
        loop {
            if *losses.borrow_and_update() > epoch {
                return Err(());
            }
            if self.serving() {
                return Ok(());
            }
            tokio::select! {
                changed = renewals.changed() => changed.map_err(|_| ())?,
                changed = losses.changed() => changed.map_err(|_| ())?,
            }
        }
    }

    /// Waits until the node serves (at once if it does).
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub async fn serves(&self) {
        let mut renewals = self.renewals.subscribe();
        while !self.serving() {
            if renewals.changed().await.is_err() {
                return;
            }
        }
    }

    /// The lease is lost: serve no more, and say so (once per loss).
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub fn lost(&self) {
        if self.until_ms.swap(0, Ordering::AcqRel) != 0 {
            self.losses.send_modify(|losses| *losses += 1);
        }
    }

    /// The number of times the lease was lost, as the renewing task found
    /// out: it changes with each loss.
    /// How many times the node stopped serving so far (see
    /// [`crate::sessions::Sessions::send_all_away`]).
    pub fn epoch(&self) -> u64 {
        *self.losses.borrow()
    }

    pub fn losses(&self) -> watch::Receiver<u64> {
        self.losses.subscribe()
    }

    fn millis(&self, at: Instant) -> u64 {
        // Never ALWAYS, never 0 for a time after the base.
        (at.saturating_duration_since(self.base).as_millis() as u64).clamp(1, ALWAYS - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn serving_follows_the_clock_and_the_lease() {
        assert!(Standing::always().serving());
        let standing = Standing::until(Instant::now() + Duration::from_secs(60));
        let mut losses = standing.losses();
        assert!(standing.serving());
        // Past the deadline: not serving, before anyone says it is lost.
        standing.serve_until(Instant::now() - Duration::from_millis(1));
        assert!(!standing.serving());
        assert!(!losses.has_changed().unwrap(), "the clock, not the task");
        standing.lost();
        standing.lost();
        assert!(!standing.serving());
        // Back before anyone looked: the loss is still told, once.
        standing.serve_until(Instant::now() + Duration::from_secs(60));
        assert!(standing.serving());
        assert!(losses.has_changed().unwrap());
        assert_eq!(*losses.borrow_and_update(), 1);
        standing.lost();
        assert_eq!(*losses.borrow_and_update(), 2);
    }

    #[tokio::test]
    async fn a_suspended_connection_goes_on_after_a_renewal_and_ends_after_a_loss() {
        let past = || Instant::now() - Duration::from_millis(5);
        let standing = std::sync::Arc::new(Standing::until(past()));
        assert!(standing.overdue().is_some(), "suspended");
        let waiting = {
            let standing = std::sync::Arc::clone(&standing);
            tokio::spawn(async move { standing.resumed(0).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "waits while suspended");
        standing.serve_until(Instant::now() + Duration::from_secs(60));
        assert_eq!(waiting.await.unwrap(), Ok(()));
        assert_eq!(standing.overdue(), None);

        standing.serve_until(past());
        let waiting = {
            let standing = std::sync::Arc::clone(&standing);
            tokio::spawn(async move { standing.resumed(0).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        standing.lost();
        assert_eq!(waiting.await.unwrap(), Err(()));
        assert_eq!(standing.overdue(), None, "lost, not suspended");
        // Serving again: a connection from before the loss still ends, one
        // accepted after it goes on.
        standing.serve_until(Instant::now() + Duration::from_secs(60));
        assert_eq!(standing.resumed(0).await, Err(()));
        assert_eq!(standing.resumed(1).await, Ok(()));
    }
}
