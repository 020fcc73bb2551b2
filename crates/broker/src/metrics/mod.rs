//! What the broker counts, under Prometheus names (served at `/metrics` by
//! [`crate::http`]).
//!
//! Every metric is declared here, with its name, unit and labels, so an
//! operator finds them in one place; the rest of the broker calls the
//! functions below. They go through the `metrics` crate's facade (a no-op
//! until a recorder is installed) to `metrics-exporter-prometheus`, which
//! renders the text format: a well-kept pair, chosen over hand-written
//! counters for its histogram summaries and its exposition format.
//!
//! The recorder is process-wide: several brokers in one process (tests)
//! share the counters.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use metrics::{
    Counter, Histogram, counter, describe_counter, describe_gauge, describe_histogram, gauge,
    histogram,
};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

mod cluster;
#[cfg(feature = "cluster")]
pub use cluster::*;
mod traffic;

/// Connections open now.
pub const CONNECTIONS: &str = "statebroker_connections";
/// Connections accepted (CONNACK success).
pub const CONNECTIONS_ACCEPTED: &str = "statebroker_connections_accepted_total";
/// CONNECTs refused, by `reason`.
pub const CONNECTIONS_REFUSED: &str = "statebroker_connections_refused_total";
/// Connections ended, by `reason`.
pub const CONNECTIONS_CLOSED: &str = "statebroker_connections_closed_total";
/// PUBLISH packets received from clients, by `qos`.
pub const MESSAGES_RECEIVED: &str = "statebroker_messages_received_total";
/// Payload bytes received in PUBLISH packets.
pub const BYTES_RECEIVED: &str = "statebroker_received_payload_bytes_total";
/// PUBLISH packets sent to clients, by `qos`.
pub const MESSAGES_SENT: &str = "statebroker_messages_sent_total";
/// Bytes of the PUBLISH packets sent to clients.
pub const BYTES_SENT: &str = "statebroker_sent_publish_bytes_total";
/// Clients known: connected, or with a session kept (gauge).
pub const SESSIONS: &str = "statebroker_sessions";
/// Sessions kept beyond their connection: persistent clients connected
/// now, and sessions waiting for their client (gauge); bounded by
/// `[broker] max_kept_sessions`.
pub const KEPT_SESSIONS: &str = "statebroker_kept_sessions";
/// Subscriptions of connected clients and kept sessions (gauge).
pub const SUBSCRIPTIONS: &str = "statebroker_subscriptions";
/// Retained messages held (gauge).
pub const RETAINED: &str = "statebroker_retained_messages";
/// The router's message logs: one per subscription filter in use (gauge).
pub const FILTER_LOGS: &str = "statebroker_filter_logs";
/// Topic and payload bytes held in the router's message logs (gauge).
pub const FILTER_LOG_BYTES: &str = "statebroker_filter_log_bytes";
/// Subscriptions refused, by `reason` (`quota_exceeded`: the client held
/// `[router] max_subscriptions_per_client` already).
pub const SUBSCRIPTIONS_REFUSED: &str = "statebroker_subscriptions_refused_total";
/// The broker's own deliveries (state store answers, notifications)
/// queued or unacknowledged, all connections together (gauge).
pub const QUEUED_DELIVERIES: &str = "statebroker_queued_deliveries";
/// The same in bytes of topic and payload (gauge).
pub const QUEUED_DELIVERY_BYTES: &str = "statebroker_queued_delivery_bytes";
/// Saved copies of QoS 1/2 messages persistent sessions still wait for
/// (gauge).
pub const QUEUED_WAITING: &str = "statebroker_queued_messages_waiting";
/// Keys in the state store (gauge).
pub const STORE_KEYS: &str = "statebroker_statestore_keys";
/// Bytes of keys and values in the state store (gauge).
pub const STORE_BYTES: &str = "statebroker_statestore_bytes";
/// KEYNOTIFY registrations (gauge).
pub const STORE_WATCHES: &str = "statebroker_statestore_watches";
/// State store answers waiting for the disk (gauge).
pub const STORE_ANSWERS_WAITING: &str = "statebroker_statestore_answers_waiting";
/// Keys removed because their expiry passed.
pub const STORE_EXPIRED: &str = "statebroker_statestore_expired_keys_total";
/// Seconds since the broker started (gauge).
pub const UPTIME: &str = "statebroker_uptime_seconds";
/// Messages not delivered to a client because a bound or limit was
/// reached, by `reason`.
pub const DROPPED: &str = "statebroker_dropped_messages_total";
/// Publishes refused (MQTT 5: PUBACK / PUBREC 0x97) because they would have
/// pushed out of a filter's log what a kept session has not had (`[broker]
/// queue_full = "refuse"`).
pub const PUBLISHES_REFUSED: &str = "statebroker_publishes_refused_total";
/// QoS 1/2 messages saved for persistent sessions (one per session).
pub const QUEUED_SAVED: &str = "statebroker_queued_messages_saved_total";
/// State store requests, by `command` and `outcome` (`ok`, `error`).
pub const STORE_REQUESTS: &str = "statebroker_statestore_requests_total";
/// From a state store request's arrival to its answer being handed on
/// (after the disk when it must wait for it).
pub const STORE_REQUEST_SECONDS: &str = "statebroker_statestore_request_duration_seconds";
/// 1 while the data directory refuses writes (the persistence writer's
/// last attempt failed and it retries: persisted writes wait), else 0
/// (gauge).
pub const DISK_REFUSING_WRITES: &str = "statebroker_disk_refusing_writes";
/// Changes written in one group commit.
pub const PERSISTENCE_BATCH: &str = "statebroker_persistence_batch_writes";
/// How long one group commit's write and sync took.
pub const PERSISTENCE_SYNC_SECONDS: &str = "statebroker_persistence_commit_duration_seconds";

/// 1, labelled with the version and whether clustering was built in.
pub const BUILD_INFO: &str = "statebroker_build_info";
/// HTTP connections open now (gauge).
pub const HTTP_CONNECTIONS: &str = "statebroker_http_connections";
/// HTTP connections closed at accept: `[http] max_connections` were open.
pub const HTTP_CONNECTIONS_REFUSED: &str = "statebroker_http_connections_refused_total";
/// HTTP connections the endpoint closed for a timeout, by `reason`
/// (`header_timeout`, `idle_timeout`).
pub const HTTP_CONNECTIONS_TIMED_OUT: &str = "statebroker_http_connections_timed_out_total";
/// Requests to the web view refused before being looked at, by `reason`
/// (`host`: a `Host` not served; `origin`: a change from another site).
pub const HTTP_REQUESTS_REFUSED: &str = "statebroker_http_requests_refused_total";

/// Faults injected on demand (see `crate::faults`), by `kind`.
pub const FAULTS_INJECTED: &str = "statebroker_faults_injected_total";

/// Why a message was not delivered.
#[derive(Debug, Clone, Copy)]
pub enum DropReason {
    /// Larger than the client's Maximum Packet Size (MQTT 5 3.1.2.11.4).
    TooLarge,
    /// The client's queue of the broker's own deliveries was full.
    QueueFull,
    /// A KEYNOTIFY notification whose watcher was not connected or not
    /// subscribed.
    NoWatcher,
    /// Its Message Expiry Interval passed while it waited for the client's
    /// Receive Maximum (MQTT 5 3.3.2.3.3).
    Expired,
}

impl DropReason {
    fn label(self) -> &'static str {
        match self {
            DropReason::TooLarge => "too_large_for_client",
            DropReason::QueueFull => "client_queue_full",
            DropReason::NoWatcher => "watcher_not_subscribed",
            DropReason::Expired => "expired_waiting_for_client",
        }
    }
}

/// Durations as Prometheus histograms (which add up across instances, a
/// summary's quantiles do not): buckets from 50 µs to 10 s.
const SECONDS_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
];
/// Changes per group commit.
const BATCH_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0,
];

fn builder() -> PrometheusBuilder {
    use metrics_exporter_prometheus::Matcher;
    let with = |b: PrometheusBuilder, name: &str, buckets: &[f64]| {
        b.set_buckets_for_metric(Matcher::Full(name.to_owned()), buckets)
            .expect("buckets are not empty")
    };
    let b = with(
        PrometheusBuilder::new(),
        STORE_REQUEST_SECONDS,
        SECONDS_BUCKETS,
    );
    let b = with(b, PERSISTENCE_SYNC_SECONDS, SECONDS_BUCKETS);
    let b = with(b, cluster::CLUSTER_ETCD_SECONDS, SECONDS_BUCKETS);
    with(b, PERSISTENCE_BATCH, BATCH_BUCKETS)
}

/// Installs the process-wide recorder (once) and returns its handle.
pub fn install() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let handle = match builder().install_recorder() {
                Ok(handle) => handle,
                Err(e) => {
                    // Another recorder is installed: ours still renders
                    // (empty), the broker runs on.
                    tracing::warn!(error = %e, "metrics recorder not installed");
                    builder().build_recorder().handle()
                }
            };
            describe();
            // Present from the start, at 0: an alert on
            // `statebroker_connections == 0` or a rate() of the first
            // connections needs the series before the first client.
            gauge!(CONNECTIONS).set(0.0);
            counter!(CONNECTIONS_ACCEPTED).absolute(0);
            let _ = HOT.set(Hot::register());
            gauge!(
                BUILD_INFO,
                "version" => env!("CARGO_PKG_VERSION"),
                "cluster" => if cfg!(feature = "cluster") { "true" } else { "false" },
            )
            .set(1.0);
            handle
        })
        .clone()
}

/// The handles of the metrics every message and request updates,
/// registered once the recorder is installed. A `counter!` call builds its
/// key (labels in a fresh `Vec`), hashes it and looks it up in the
/// registry every time: four lookups per state store request, 2% of the
/// broker's CPU at 64 busy connections. Without the recorder (the HTTP
/// endpoint off: nothing could read them) these are not recorded at all:
/// building the keys for the no-op recorder cost 1,500 instructions per
/// request, 6% of it. The counters are set from the threads' own counts
/// when `/metrics` is read ([`publish_traffic`]); the histogram is
/// recorded into at each request.
struct Hot {
    received: [Counter; 3],
    bytes_received: Counter,
    sent: [Counter; 3],
    /// `[ok, error]` counters of each verb, in [`Command::NAMES`] order.
    ///
    /// [`Command::NAMES`]: statestore::command::Command::NAMES
    requests: [[Counter; 2]; traffic::VERBS],
    request_seconds: Histogram,
}

static HOT: OnceLock<Hot> = OnceLock::new();

impl Hot {
    fn register() -> Hot {
        let by_qos = |name: &'static str| [0, 1, 2].map(|q| counter!(name, "qos" => qos_label(q)));
        let requests = statestore::command::Command::NAMES.map(|command| {
            let outcome =
                |o: &'static str| counter!(STORE_REQUESTS, "command" => command, "outcome" => o);
            [outcome("ok"), outcome("error")]
        });
        Hot {
            received: by_qos(MESSAGES_RECEIVED),
            bytes_received: counter!(BYTES_RECEIVED),
            sent: by_qos(MESSAGES_SENT),
            requests,
            request_seconds: histogram!(STORE_REQUEST_SECONDS),
        }
    }
}

fn describe() {
    cluster::describe();
    describe_counter!(
        FAULTS_INJECTED,
        "Faults injected on demand ([faults] enabled), by kind"
    );
    describe_gauge!(
        BUILD_INFO,
        "1, labelled with the version and whether clustering (`cluster`) was built in"
    );
    describe_gauge!(HTTP_CONNECTIONS, "HTTP connections open now");
    describe_counter!(
        HTTP_CONNECTIONS_REFUSED,
        "HTTP connections closed at accept: [http] max_connections were open"
    );
    describe_counter!(
        HTTP_CONNECTIONS_TIMED_OUT,
        "HTTP connections closed for a timeout, by reason"
    );
    describe_counter!(
        HTTP_REQUESTS_REFUSED,
        "Web view requests refused for their Host or Origin, by reason"
    );
    describe_gauge!(CONNECTIONS, "Client connections open now");
    describe_counter!(CONNECTIONS_ACCEPTED, "Client connections accepted");
    describe_counter!(CONNECTIONS_REFUSED, "CONNECTs refused, by reason");
    describe_counter!(CONNECTIONS_CLOSED, "Client connections ended, by reason");
    describe_counter!(
        MESSAGES_RECEIVED,
        "PUBLISH packets received from clients, by QoS"
    );
    describe_counter!(BYTES_RECEIVED, "Payload bytes of PUBLISH packets received");
    describe_counter!(MESSAGES_SENT, "PUBLISH packets sent to clients, by QoS");
    describe_counter!(BYTES_SENT, "Bytes of PUBLISH packets sent to clients");
    describe_gauge!(SESSIONS, "Clients connected or with a session kept");
    describe_gauge!(
        KEPT_SESSIONS,
        "Sessions kept beyond their connection, connected or not ([broker] max_kept_sessions)"
    );
    describe_gauge!(SUBSCRIPTIONS, "Subscriptions of clients and kept sessions");
    describe_gauge!(RETAINED, "Retained messages held");
    describe_gauge!(
        FILTER_LOGS,
        "Message logs the router holds, one per subscription filter in use"
    );
    describe_gauge!(
        FILTER_LOG_BYTES,
        metrics::Unit::Bytes,
        "Topic and payload bytes held in the router's message logs"
    );
    describe_counter!(SUBSCRIPTIONS_REFUSED, "Subscriptions refused, by reason");
    describe_gauge!(
        QUEUED_DELIVERIES,
        "State store answers and notifications queued or unacknowledged"
    );
    describe_gauge!(
        QUEUED_DELIVERY_BYTES,
        metrics::Unit::Bytes,
        "Topic and payload bytes of the queued deliveries"
    );
    describe_gauge!(
        QUEUED_WAITING,
        "Saved QoS 1/2 messages persistent sessions wait for"
    );
    describe_gauge!(STORE_KEYS, "Keys in the state store");
    describe_gauge!(
        STORE_BYTES,
        metrics::Unit::Bytes,
        "Bytes of keys and values in the state store"
    );
    describe_gauge!(STORE_WATCHES, "KEYNOTIFY registrations");
    describe_gauge!(
        STORE_ANSWERS_WAITING,
        "State store answers waiting for their changes to be on disk"
    );
    describe_gauge!(
        DISK_REFUSING_WRITES,
        "1 while the data directory refuses writes (persisted writes wait), else 0"
    );
    describe_counter!(
        PUBLISHES_REFUSED,
        "Publishes refused because a kept session's queue (its filter's log) was full"
    );
    describe_counter!(STORE_EXPIRED, "Keys removed because their expiry passed");
    describe_gauge!(UPTIME, metrics::Unit::Seconds, "Seconds since the start");
    describe_counter!(
        DROPPED,
        "Messages not delivered because a bound was reached, by reason"
    );
    describe_counter!(
        QUEUED_SAVED,
        "QoS 1/2 messages saved for persistent sessions"
    );
    describe_counter!(
        STORE_REQUESTS,
        "State store requests, by command and outcome"
    );
    describe_histogram!(
        STORE_REQUEST_SECONDS,
        metrics::Unit::Seconds,
        "State store request arrival to answer"
    );
    describe_histogram!(PERSISTENCE_BATCH, "Changes per group commit");
    describe_histogram!(
        PERSISTENCE_SYNC_SECONDS,
        metrics::Unit::Seconds,
        "Write and sync time of one group commit"
    );
}

fn qos_label(qos: u8) -> &'static str {
    match qos {
        0 => "0",
        1 => "1",
        _ => "2",
    }
}

/// Running totals `$SYS` reports (the Prometheus recorder cannot be read
/// back). Process-wide, like the recorder.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    /// PUBLISH packets received.
    pub messages_received: u64,
    /// Their payload bytes.
    pub bytes_received: u64,
    /// PUBLISH packets sent.
    pub messages_sent: u64,
    /// Their bytes.
    pub bytes_sent: u64,
    /// Connections accepted.
    pub connections_accepted: u64,
    /// Keys expired.
    pub keys_expired: u64,
}

static ACCEPTED_N: AtomicU64 = AtomicU64::new(0);
static EXPIRED_N: AtomicU64 = AtomicU64::new(0);

/// Sets the Prometheus counters of PUBLISH traffic and state store
/// requests to what the threads counted (before `/metrics` renders them).
pub fn publish_traffic() {
    let Some(hot) = HOT.get() else { return };
    let sum = traffic::sum();
    for q in 0..3 {
        hot.received[q].absolute(sum.received[q]);
        hot.sent[q].absolute(sum.sent[q]);
    }
    hot.bytes_received.absolute(sum.bytes_received);
    for (counters, counts) in hot.requests.iter().zip(&sum.requests) {
        counters[0].absolute(counts[0]);
        counters[1].absolute(counts[1]);
    }
}

/// The running totals now.
pub fn totals() -> Totals {
    let traffic = traffic::sum();
    Totals {
        messages_received: traffic.received.iter().sum(),
        bytes_received: traffic.bytes_received,
        messages_sent: traffic.sent.iter().sum(),
        bytes_sent: traffic.bytes_sent,
        connections_accepted: ACCEPTED_N.load(Relaxed),
        keys_expired: EXPIRED_N.load(Relaxed),
    }
}

/// A client connected.
pub fn connection_opened() {
    ACCEPTED_N.fetch_add(1, Relaxed);
    counter!(CONNECTIONS_ACCEPTED).increment(1);
    gauge!(CONNECTIONS).increment(1.0);
}

/// A client's connection ended, for `reason`.
pub fn connection_closed(reason: &'static str) {
    counter!(CONNECTIONS_CLOSED, "reason" => reason).increment(1);
    gauge!(CONNECTIONS).decrement(1.0);
}

/// A CONNECT was refused, for `reason`.
pub fn connection_refused(reason: &'static str) {
    counter!(CONNECTIONS_REFUSED, "reason" => reason).increment(1);
}

/// A client's PUBLISH arrived.
pub fn received(qos: u8, payload: usize) {
    traffic::here().received(qos, payload as u64);
}

/// A PUBLISH packet of `bytes` went to a client.
pub fn sent(qos: u8, bytes: usize) {
    traffic::here().sent(qos, bytes as u64);
}

/// `n` keys expired.
pub fn expired(n: usize) {
    if n > 0 {
        EXPIRED_N.fetch_add(n as u64, Relaxed);
    }
}

/// `n` messages were not delivered, for `reason`.
pub fn dropped(reason: DropReason, n: u64) {
    counter!(DROPPED, "reason" => reason.label()).increment(n);
}

/// `n` subscriptions were refused, for `reason`.
pub fn subscriptions_refused(reason: &'static str, n: u64) {
    counter!(SUBSCRIPTIONS_REFUSED, "reason" => reason).increment(n);
}

/// `n` copies of a message were saved for persistent sessions.
pub fn queued_saved(n: usize) {
    counter!(QUEUED_SAVED).increment(n as u64);
}

/// A state store request was answered.
pub fn store_request(command: &'static str, ok: bool, took: Duration) {
    let Some(hot) = HOT.get() else { return };
    let names = statestore::command::Command::NAMES;
    match names.iter().position(|verb| *verb == command) {
        Some(verb) => traffic::here().request(verb, ok),
        // A name outside the known commands ("unknown"): rare.
        None => {
            let outcome = if ok { "ok" } else { "error" };
            counter!(STORE_REQUESTS, "command" => command, "outcome" => outcome).increment(1);
        }
    }
    hot.request_seconds.record(took.as_secs_f64());
}

/// The data directory refuses writes (`true`) or takes them again.
pub fn disk_refusing_writes(refusing: bool) {
    gauge!(DISK_REFUSING_WRITES).set(if refusing { 1.0 } else { 0.0 });
}

/// A group commit of `writes` changes took `took`.
pub fn commit(writes: usize, took: Duration) {
    histogram!(PERSISTENCE_BATCH).record(writes as f64);
    histogram!(PERSISTENCE_SYNC_SECONDS).record(took.as_secs_f64());
}

/// A fault of `kind` was injected.
pub fn fault_injected(kind: &'static str) {
    counter!(FAULTS_INJECTED, "kind" => kind).increment(1);
}

/// An HTTP connection was accepted.
pub fn http_connection_opened() {
    gauge!(HTTP_CONNECTIONS).increment(1.0);
}

/// An HTTP connection ended; `timed_out`: the endpoint closed it, for
/// that reason.
pub fn http_connection_closed(timed_out: Option<&'static str>) {
    gauge!(HTTP_CONNECTIONS).decrement(1.0);
    if let Some(reason) = timed_out {
        counter!(HTTP_CONNECTIONS_TIMED_OUT, "reason" => reason).increment(1);
    }
}

/// An HTTP connection was closed at accept (the endpoint was full).
pub fn http_connection_refused() {
    counter!(HTTP_CONNECTIONS_REFUSED).increment(1);
}

/// A web view request was refused for `reason` (`host`, `origin`).
pub fn http_request_refused(reason: &'static str) {
    counter!(HTTP_REQUESTS_REFUSED, "reason" => reason).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The process-wide totals see what this thread counted.
    #[test]
    fn totals_include_this_threads_traffic() {
        let before = totals();
        received(1, 11);
        sent(1, 13);
        let after = totals();
        assert!(after.messages_received > before.messages_received);
        assert!(after.bytes_received >= before.bytes_received + 11);
        assert!(after.messages_sent > before.messages_sent);
        assert!(after.bytes_sent >= before.bytes_sent + 13);
    }
}
