//! The broker's state in numbers, sampled on demand: the gauges of
//! `/metrics` ([`set_gauges`]) and the `$SYS` topics
//! ([`crate::sys`]) read the same [`Snapshot`].
//!
//! Sampling walks the session mirror once (a read lock) and reads a few
//! counters; nothing is counted on the hot path for it.

use std::time::Duration;

use metrics::{counter, gauge};

use crate::metrics::{
    BYTES_SENT, DROPPED, FILTER_LOG_BYTES, FILTER_LOGS, KEPT_SESSIONS, PUBLISHES_REFUSED,
    QUEUED_DELIVERIES, QUEUED_DELIVERY_BYTES, QUEUED_WAITING, RETAINED, SESSIONS,
    STORE_ANSWERS_WAITING, STORE_BYTES, STORE_EXPIRED, STORE_KEYS, STORE_WATCHES, SUBSCRIPTIONS,
    Totals, UPTIME,
};
use crate::sessions::Census;
use crate::shared::Shared;

/// The numbers at one moment.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Since the broker started.
    pub uptime: Duration,
    /// Clients, connections, subscriptions, queued deliveries.
    pub census: Census,
    /// Sessions the router keeps beyond their connection.
    pub kept_sessions: usize,
    /// Retained messages the router holds.
    pub retained: usize,
    /// Message logs the router holds (one per subscription filter in use).
    pub filter_logs: usize,
    /// Topic and payload bytes in them.
    pub filter_log_bytes: u64,
    /// Messages pushed out of a filter's log before a subscriber read
    /// them (once per subscriber), since the start.
    pub filter_log_dropped: u64,
    /// Publishes refused for a kept session's full log, since the start.
    pub publishes_refused: u64,
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
        kept_sessions: shared.router.kept_sessions(),
        retained: shared.router.retained_messages(),
        filter_logs: shared.router.filter_logs().logs(),
        filter_log_bytes: shared.router.filter_logs().bytes(),
        filter_log_dropped: shared.router.filter_logs().dropped(),
        publishes_refused: shared.router.filter_logs().refused(),
        queued_waiting: shared.durable.as_ref().map_or(0, |d| d.waiting_total()),
        keys,
        key_bytes,
        watches,
        answers_waiting: shared.store.answers_waiting(),
        totals: crate::metrics::totals(),
    }
}

/// Values sampled from the broker's state, set as gauges just before
/// `/metrics` is rendered.
pub fn set_gauges(now: &Snapshot) {
    gauge!(SESSIONS).set(now.census.clients as f64);
    gauge!(KEPT_SESSIONS).set(now.kept_sessions as f64);
    gauge!(SUBSCRIPTIONS).set(now.census.subscriptions as f64);
    gauge!(RETAINED).set(now.retained as f64);
    gauge!(FILTER_LOGS).set(now.filter_logs as f64);
    gauge!(FILTER_LOG_BYTES).set(now.filter_log_bytes as f64);
    gauge!(QUEUED_DELIVERIES).set(now.census.queued_messages as f64);
    gauge!(QUEUED_DELIVERY_BYTES).set(now.census.queued_bytes as f64);
    gauge!(QUEUED_WAITING).set(now.queued_waiting as f64);
    gauge!(STORE_KEYS).set(now.keys as f64);
    gauge!(STORE_BYTES).set(now.key_bytes as f64);
    gauge!(STORE_WATCHES).set(now.watches as f64);
    gauge!(STORE_ANSWERS_WAITING).set(now.answers_waiting as f64);
    gauge!(UPTIME).set(now.uptime.as_secs_f64());
    // Counted in atomics on the hot path, handed over here.
    counter!(BYTES_SENT).absolute(now.totals.bytes_sent);
    counter!(STORE_EXPIRED).absolute(now.totals.keys_expired);
    // Counted by the router (one broker per process outside tests).
    counter!(DROPPED, "reason" => "filter_log_evicted").absolute(now.filter_log_dropped);
    counter!(PUBLISHES_REFUSED).absolute(now.publishes_refused);
}
