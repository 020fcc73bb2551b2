//! The broker's state in numbers, sampled on demand: the gauges of
//! `/metrics` ([`crate::metrics::set_gauges`]) and the `$SYS` topics
//! ([`crate::sys`]) read the same [`Snapshot`].
//!
//! Sampling walks the session mirror once (a read lock) and reads a few
//! counters; nothing is counted on the hot path for it.

use std::time::Duration;

use crate::metrics::Totals;
use crate::sessions::Census;
use crate::shared::Shared;

/// The numbers at one moment.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Since the broker started.
    pub uptime: Duration,
    /// Clients, connections, subscriptions, queued deliveries.
    pub census: Census,
    /// Retained messages the router holds.
    pub retained: usize,
    /// Saved QoS 1/2 copies persistent sessions wait for.
    pub queued_waiting: usize,
    /// State store keys.
    pub keys: usize,
    /// Bytes of state store keys and values.
    pub key_bytes: u64,
    /// KEYNOTIFY registrations.
    pub watches: usize,
    /// State store answers waiting for the disk.
    pub answers_waiting: usize,
    /// Running totals (process-wide).
    pub totals: Totals,
}

/// Samples the broker behind `shared`.
pub(crate) fn sample(shared: &Shared) -> Snapshot {
    let (keys, key_bytes, watches) = shared
        .store
        .with_store(|store| (store.len(), store.bytes(), store.watch_count()));
    Snapshot {
        uptime: shared.started.elapsed(),
        census: shared.sessions.census(),
        retained: shared.router.retained_messages(),
        queued_waiting: shared.durable.as_ref().map_or(0, |d| d.waiting_total()),
        keys,
        key_bytes,
        watches,
        answers_waiting: shared.store.answers_waiting(),
        totals: crate::metrics::totals(),
    }
}
