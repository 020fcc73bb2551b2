//! Whether this node may serve MQTT clients now: a single node always; a
//! cluster node while it holds its membership lease in etcd (see
//! `cluster::membership`), so that a node cut off from etcd, or paused past
//! its lease, stops serving before another may take its clients over.
//!
//! The answer is read from the clock, not from the task that renews the
//! lease: a node that wakes from a pause refuses a CONNECT at once, before
//! that task has run.

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
}

impl Standing {
    /// A single node's: always serving.
    pub fn always() -> Standing {
        Standing {
            base: Instant::now(),
            until_ms: AtomicU64::new(ALWAYS),
            losses: watch::Sender::new(0),
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
}
