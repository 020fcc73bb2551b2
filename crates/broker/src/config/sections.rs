//! What each section of the configuration file may hold: statebroker's own
//! sections (`[broker]`, `[statestore]`, `[persistence]`), which top-level
//! sections exist, and which of rumqttd's are refused.

use serde::Deserialize;

/// Top-level keys a configuration may have.
pub(super) const KNOWN_SECTIONS: &[&str] = &[
    "id",
    "router",
    "v4",
    "v5",
    "ws",
    "cluster",
    "console",
    "bridge",
    "prometheus",
    "metrics",
    "broker",
    "statestore",
    "persistence",
    "http",
    "log",
    "faults",
    "clustering",
];

/// Sections of rumqttd's format that statebroker does not implement: a
/// configuration with one is refused at start rather than silently ignored.
pub(super) const UNSUPPORTED: &[(&str, &str)] = &[
    ("bridge", "bridges are not supported by statebroker"),
    (
        "cluster",
        "rumqttd's [cluster] is not supported; statebroker's clustering is configured in [clustering]",
    ),
    (
        "console",
        "rumqttd's console is not supported by statebroker; remove the section",
    ),
    (
        "metrics",
        "rumqttd's metrics section is not used: statebroker serves Prometheus metrics at /metrics of [http] listen",
    ),
    (
        "prometheus",
        "rumqttd's prometheus section is not used: statebroker serves Prometheus metrics at /metrics of [http] listen",
    ),
];

/// statebroker's own sections.
#[derive(Deserialize)]
pub(super) struct Sections {
    pub broker: BrokerSection,
    pub statestore: StoreSection,
    pub persistence: PersistenceSection,
    pub http: HttpSection,
    pub log: LogSection,
    #[serde(default)]
    pub faults: crate::faults::FaultsSection,
    pub clustering: ClusteringSection,
}

/// `[clustering]`
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ClusteringSection {
    /// This node's name, and the node id of the versions it hands out.
    pub node_id: String,
    /// etcd's client URLs; empty: a single node.
    pub etcd_endpoints: Vec<String>,
    /// The prefix of every key statebroker writes in etcd.
    pub etcd_prefix: String,
    /// How long one etcd request may take, milliseconds.
    pub etcd_request_timeout_ms: u64,
    /// How long a deleted key's last version is kept, seconds.
    pub tombstone_ttl_s: u64,
    /// etcd's largest request, bytes.
    pub etcd_max_request_bytes: usize,
    /// GETs answered from the node's watch-fed records (not linearizable).
    pub cached_reads: bool,
    /// Memory for the node's copy of the records, bytes.
    pub cache_bytes: usize,
    /// Keys' reads and writes go to etcd's leader when the node knows it.
    pub requests_to_leader: bool,
    /// The membership lease's TTL, milliseconds (etcd counts whole
    /// seconds).
    pub lease_ttl_ms: u64,
    /// Where the other nodes' links reach this node (`host:port`); empty:
    /// the first plain TCP listener's.
    pub peer_address: String,
    /// Publishes waiting for one link to another node, at most.
    pub forward_queue: usize,
    /// How often ownerless session records are looked for, seconds.
    pub session_reap_interval_s: u64,
    /// QoS 1 messages queued for persistent sessions are kept in etcd too.
    pub keep_queued_in_etcd: bool,
    /// Memory for the publishes a node keeps a few seconds for the
    /// sessions of a node that dies, bytes (0: none kept).
    pub recent_publishes_bytes: usize,
}

/// `[log]`
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LogSection {
    /// A `tracing` filter (`info`, `debug`, `info,broker=debug`); the
    /// RUST_LOG environment variable wins over it. Reloaded on SIGHUP.
    pub level: String,
    /// `text` or `json` (one JSON object per line).
    pub format: String,
}

/// `[http]`
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HttpSection {
    /// Address of the HTTP endpoint; empty: none.
    pub listen: String,
    /// The web view offers set and delete forms.
    #[serde(default)]
    pub allow_edit: bool,
    /// Host names the web view answers under besides `localhost` and IP
    /// literals (DNS rebinding: see `web/hosts.rs`).
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
    /// On a non-loopback address, the web view's reads (its page, keys,
    /// clients, events: GET) answer without a password.
    #[serde(default)]
    pub allow_anonymous: bool,
    /// HTTP connections open at once; more are closed at accept.
    pub max_connections: usize,
    /// A request's headers must arrive within this, milliseconds.
    pub header_timeout_ms: u64,
    /// A connection with no byte either way this long is closed,
    /// milliseconds.
    pub idle_timeout_ms: u64,
}

/// `[persistence]`
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PersistenceSection {
    /// Data directory; empty for memory only.
    pub data_dir: String,
    /// `fsync` or `interval`.
    pub mode: String,
    /// fsync period in `interval` mode.
    pub interval_ms: u64,
    /// Keys persisted by configuration.
    pub keys: Vec<String>,
}

/// `[broker]`
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct BrokerSection {
    /// Upper bound on client keep-alive, seconds; 0 for none.
    pub max_keep_alive_secs: u16,
    /// Upper bound on a session's expiry after its connection, seconds
    /// (MQTT 5 Session Expiry Interval; 3.1.1 persistent sessions); 0 for
    /// none.
    pub max_session_expiry_secs: u32,
    /// Sessions kept beyond their connection, all clients together; a
    /// connection that would keep one more for a new client id is refused
    /// (CONNACK 0x97, 3.1.1: 0x03). 0 for no limit.
    pub max_kept_sessions: usize,
    /// Retained messages held, all topics together; a retained publish on
    /// a new topic beyond it is refused (0x97). 0 for no limit.
    pub max_retained_messages: usize,
    /// Bytes of topics and payloads of the retained messages; a retained
    /// publish that would pass it is refused (0x97). 0 for no limit.
    pub max_retained_bytes: usize,
    /// Bytes of one client's QoS 2 publishes held until their PUBREL; a
    /// QoS 2 publish beyond it gets PUBREC 0x97. 0 for no limit.
    pub max_unreleased_qos2_bytes: usize,
    /// The same for all clients together. 0 for no limit.
    pub max_unreleased_qos2_bytes_total: usize,
    /// Topic aliases a client may use towards the broker.
    pub topic_alias_max: u16,
    /// Serve the 2023 request topic.
    pub legacy_2023_topic: bool,
    /// Deliveries from the broker (state store answers and notifications)
    /// one connection may hold unacknowledged or waiting, in messages.
    pub max_queued_messages: usize,
    /// The same bound in bytes (topic and payload).
    pub max_queued_bytes: usize,
    /// A publish that would push out of a filter's log what a kept session
    /// has not had: the oldest go, or the publish is refused.
    pub queue_full: router::QueueFull,
    /// A session may choose `refuse` for itself (CONNECT User Property
    /// `queue_full`) where `queue_full` drops the oldest; `drop_oldest`
    /// it may always choose.
    pub allow_session_refuse: bool,
    /// Seconds between two publications of the `$SYS` topics; 0: none.
    pub sys_interval: u64,
    /// mosquitto_passwd file of users; empty: none. Reloaded on SIGHUP.
    pub password_file: String,
    /// Authorization policy (YAML or JSON); empty: everything allowed.
    /// Reloaded on SIGHUP.
    pub authorization: String,
}

/// `[statestore]`
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct StoreSection {
    /// Node id of versions.
    pub node_id: String,
    /// Allowed clock skew of `__ts` / `__ft`, milliseconds.
    pub max_clock_skew_ms: u64,
    /// Keys per SCAN page.
    pub scan_page_size: usize,
    /// KEYNOTIFY registrations per client.
    pub max_watches_per_client: usize,
    /// Bytes of key names one client's registrations may hold.
    pub max_watch_bytes_per_client: usize,
    /// KEYNOTIFY registrations per user: the verified username, or the
    /// address of an anonymous client (all its connections and client ids).
    pub max_watches_per_user: usize,
    /// Bytes of key names one user's registrations may hold.
    pub max_watch_bytes_per_user: usize,
    /// KEYNOTIFY registrations of all clients.
    pub max_watches: usize,
    /// Bytes of key names of all registrations.
    pub max_watch_bytes: usize,
    /// `[statestore.quota]`
    pub quota: QuotaSection,
}

/// `[statestore.quota]`
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct QuotaSection {
    /// Number of keys.
    pub max_keys: u64,
    /// Bytes of keys and values.
    pub max_bytes: u64,
    /// Bytes of one key.
    pub max_key_size: usize,
    /// Bytes of one value.
    pub max_value_size: usize,
}
