//! The expiry timer: a task that sleeps until the store's next expiry,
//! expires what is due and publishes the DELETE notifications; and the
//! `expire_key` fault, which expires one key now.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use statestore::persist::Observed;
use tokio::sync::Notify;

use super::{StateStoreService, notices_only};

impl StateStoreService {
    /// Removes `key` now as if it had expired (a fault: see
    /// [`crate::faults`]): its watchers get DELETE. `false`: no such key.
    pub fn expire_key(self: &Arc<Self>, key: &[u8]) -> bool {
        let (fx, wait) = {
            let mut store = self.store.lock();
            let Some(mut fx) = store.expire_key(key) else {
                return false;
            };
            crate::metrics::expired(1);
            let wait = self.persist(&store, std::mem::take(&mut fx.writes), &Observed::All, &[]);
            (fx, wait)
        };
        self.publish_when_durable(None, &mut notices_only(fx.notices), wait, None);
        true
    }

    /// Wakes the expiry task if `next` (the store's next expiry) comes
    /// before what it sleeps until.
    pub(super) fn rearm_expiry(&self, next: Option<u64>) {
        let next = next.unwrap_or(u64::MAX);
        if next < self.expiry.armed.load(Ordering::Relaxed) {
            self.expiry.changed.notify_one();
        }
    }

    /// Expires what is due and publishes the notifications; returns the next expiry.
    fn expire_now(self: &Arc<Self>) -> Option<u64> {
        let (fx, next, wait) = {
            let mut store = self.store.lock();
            let before = store.len();
            let mut fx = store.expire(self.now());
            crate::metrics::expired(before.saturating_sub(store.len()));
            let wait = self.persist(&store, std::mem::take(&mut fx.writes), &Observed::All, &[]);
            (fx, store.next_expiry(), wait)
        };
        if !fx.notices.is_empty() {
            self.publish_when_durable(None, &mut notices_only(fx.notices), wait, None);
        }
        next
    }
}

/// What the expiry task sleeps on: woken early when an earlier expiry
/// appears, and for good when the service is dropped.
pub(super) struct Alarm {
    changed: Notify,
    /// The expiry time the task sleeps until (u64::MAX: none).
    armed: AtomicU64,
    /// Closed when the service (its only sender) is dropped.
    dropped: tokio::sync::watch::Sender<()>,
}

impl Drop for StateStoreService {
    fn drop(&mut self) {
        // The expiry task ends (the alarm outlives the service: the task
        // holds it).
        self.expiry.dropped.send_replace(());
    }
}

/// Sleeps until the next expiry, expires, repeats; woken early by
/// [`StateStoreService::rearm_expiry`]. It holds the service only while it
/// expires keys, and ends when the service is dropped.
pub(super) async fn expiry_task(service: std::sync::Weak<StateStoreService>, alarm: Arc<Alarm>) {
    let mut dropped = alarm.dropped.subscribe();
    let mut next: Option<u64> = None;
    loop {
        alarm
            .armed
            .store(next.unwrap_or(u64::MAX), Ordering::Relaxed);
        let until = match (next, service.upgrade()) {
            (_, None) => return,
            (None, Some(_)) => None,
            (Some(at), Some(svc)) => Some(Duration::from_millis(at.saturating_sub(svc.now()))),
        };
        let sleep = async {
            match until {
                Some(wait) => tokio::time::sleep(wait).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = alarm.changed.notified() => {}
            () = sleep => {}
            _ = dropped.changed() => return,
        }
        let Some(svc) = service.upgrade() else { return };
        next = svc.expire_now();
    }
}

impl Alarm {
    /// An alarm set for no expiry.
    pub(super) fn new() -> Alarm {
        Alarm {
            changed: Notify::new(),
            armed: AtomicU64::new(u64::MAX),
            dropped: tokio::sync::watch::Sender::new(()),
        }
    }

    /// Wakes the task to look again (the clock moved).
    pub(super) fn ring(&self) {
        self.changed.notify_one();
    }
}
