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
use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

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
/// Messages not delivered to a client because a bound or limit was
/// reached, by `reason`.
pub const DROPPED: &str = "statebroker_dropped_messages_total";
/// QoS 1/2 messages saved for persistent sessions (one per session).
pub const QUEUED_SAVED: &str = "statebroker_queued_messages_saved_total";
/// State store requests, by `command` and `outcome` (`ok`, `error`).
pub const STORE_REQUESTS: &str = "statebroker_statestore_requests_total";
/// From a state store request's arrival to its answer being handed on
/// (after the disk when it must wait for it).
pub const STORE_REQUEST_SECONDS: &str = "statebroker_statestore_request_duration_seconds";
/// Changes written in one group commit.
pub const PERSISTENCE_BATCH: &str = "statebroker_persistence_batch_writes";
/// How long one group commit's write and sync took.
pub const PERSISTENCE_SYNC_SECONDS: &str = "statebroker_persistence_commit_duration_seconds";

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
}

impl DropReason {
    fn label(self) -> &'static str {
        match self {
            DropReason::TooLarge => "too_large_for_client",
            DropReason::QueueFull => "client_queue_full",
            DropReason::NoWatcher => "watcher_not_subscribed",
        }
    }
}

/// Installs the process-wide recorder (once) and returns its handle.
pub fn install() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let handle = match PrometheusBuilder::new().install_recorder() {
                Ok(handle) => handle,
                Err(e) => {
                    // Another recorder is installed: ours still renders
                    // (empty), the broker runs on.
                    tracing::warn!(error = %e, "metrics recorder not installed");
                    PrometheusBuilder::new().build_recorder().handle()
                }
            };
            describe();
            handle
        })
        .clone()
}

fn describe() {
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

/// A client connected.
pub fn connection_opened() {
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
    counter!(MESSAGES_RECEIVED, "qos" => qos_label(qos)).increment(1);
    counter!(BYTES_RECEIVED).increment(payload as u64);
}

/// A PUBLISH went to a client.
pub fn sent(qos: u8) {
    counter!(MESSAGES_SENT, "qos" => qos_label(qos)).increment(1);
}

/// `n` messages were not delivered, for `reason`.
pub fn dropped(reason: DropReason, n: u64) {
    counter!(DROPPED, "reason" => reason.label()).increment(n);
}

/// `n` copies of a message were saved for persistent sessions.
pub fn queued_saved(n: usize) {
    counter!(QUEUED_SAVED).increment(n as u64);
}

/// A state store request was answered.
pub fn store_request(command: &'static str, ok: bool, took: Duration) {
    let outcome = if ok { "ok" } else { "error" };
    counter!(STORE_REQUESTS, "command" => command, "outcome" => outcome).increment(1);
    histogram!(STORE_REQUEST_SECONDS).record(took.as_secs_f64());
}

/// A group commit of `writes` changes took `took`.
pub fn commit(writes: usize, took: Duration) {
    histogram!(PERSISTENCE_BATCH).record(writes as f64);
    histogram!(PERSISTENCE_SYNC_SECONDS).record(took.as_secs_f64());
}
