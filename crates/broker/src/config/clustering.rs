//! `[clustering]`, checked and resolved: what a node of a cluster on
//! etcd needs to know (see `crate::cluster`).

use std::time::Duration;

use super::sections::ClusteringSection;
use super::{ConfigError, invalid};

/// `[clustering]`, resolved: present when `etcd_endpoints` is not empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusteringSettings {
    /// This node's name; the node id of its versions.
    pub node_id: String,
    /// etcd's client URLs.
    pub etcd_endpoints: Vec<String>,
    /// The prefix of every key in etcd, ending in `/`.
    pub etcd_prefix: String,
    /// How long one etcd request may take.
    pub request_timeout: Duration,
    /// How long a deleted key's last version is kept.
    pub tombstone_ttl: Duration,
    /// etcd's largest request, bytes.
    pub max_request_bytes: usize,
    /// `cached_reads`: a GET answers from the records the watch delivered
    /// when the node has the key's (not linearizable).
    pub cached_reads: bool,
    /// `cache_bytes`: how much of the records the node keeps in memory.
    pub cache_bytes: usize,
    /// `requests_to_leader`: keys' reads and writes go to etcd's leader
    /// when the node knows it (see `cluster::route`).
    pub requests_to_leader: bool,
    /// `lease_ttl_ms`: the membership lease's TTL (whole seconds).
    pub lease_ttl: Duration,
    /// `peer_address`: where the other nodes' links reach this node
    /// (`None`: the first plain TCP listener's address).
    pub peer_address: Option<String>,
    /// `forward_queue`: publishes waiting for one link, at most.
    pub forward_queue: usize,
    /// `session_reap_interval_s`: how often ownerless session records are
    /// looked for.
    pub session_reap_interval: Duration,
    /// `keep_queued_in_etcd`: QoS 1 and 2 messages queued for persistent
    /// sessions are kept in etcd too (see `cluster::queue`).
    pub keep_queued_in_etcd: bool,
    /// `recent_publishes_bytes`: memory for the publishes kept a few
    /// seconds for the sessions of a node that dies (see
    /// `cluster::recent`; 0: none kept).
    pub recent_publishes_bytes: usize,
}

impl ClusteringSettings {
    /// Checks and resolves `[clustering]`; `None`: a single node.
    pub(super) fn resolve(
        section: ClusteringSection,
        max_clock_skew_ms: u64,
    ) -> Result<Option<ClusteringSettings>, ConfigError> {
        let endpoints: Vec<String> = section
            .etcd_endpoints
            .iter()
            .map(|e| e.trim().to_owned())
            .filter(|e| !e.is_empty())
            .collect();
        let node_id = section.node_id.trim().to_owned();
        if endpoints.is_empty() {
            if !node_id.is_empty() {
                return Err(invalid(
                    "clustering.node_id is set but clustering.etcd_endpoints is empty: give etcd's client URLs (--etcd-endpoints http://HOST:2379,...), or remove node_id for a single node",
                ));
            }
            return Ok(None);
        }
        for endpoint in &endpoints {
            let valid = endpoint
                .strip_prefix("http://")
                .or_else(|| endpoint.strip_prefix("https://"))
                .is_some_and(|rest| !rest.is_empty() && !rest.contains('/'));
            if !valid {
                return Err(invalid(format!(
                    "clustering.etcd_endpoints: `{endpoint}` is not an etcd client URL like http://127.0.0.1:2379"
                )));
            }
        }
        // ':' and '/' separate fields of versions and etcd keys; a line
        // break separates the entries of a session's owner record (a node
        // id with one passed for a marker, and a session that moved there
        // lost its queued messages).
        if node_id.is_empty()
            || node_id.contains(':')
            || node_id.contains('/')
            || node_id.chars().any(char::is_control)
        {
            return Err(invalid(
                "clustering.node_id must be set (unique per node, without ':', '/' or control characters such as line breaks) when clustering.etcd_endpoints is: --cluster-node-id NAME",
            ));
        }
        let mut prefix = section.etcd_prefix.trim().to_owned();
        if prefix.is_empty() {
            return Err(invalid("clustering.etcd_prefix must not be empty"));
        }
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        if section.etcd_request_timeout_ms == 0 {
            return Err(invalid(
                "clustering.etcd_request_timeout_ms must be at least 1",
            ));
        }
        let min_ttl = max_clock_skew_ms / 1000 + 10;
        if section.tombstone_ttl_s < min_ttl {
            return Err(invalid(format!(
                "clustering.tombstone_ttl_s must be at least statestore.max_clock_skew_ms / 1000 + 10 = {min_ttl}"
            )));
        }
        if section.lease_ttl_ms < 1000 || !section.lease_ttl_ms.is_multiple_of(1000) {
            return Err(invalid(
                "clustering.lease_ttl_ms must be whole seconds (etcd's leases count seconds), at least 1000",
            ));
        }
        if section.etcd_max_request_bytes < 4096 {
            return Err(invalid(
                "clustering.etcd_max_request_bytes must be at least 4096 (etcd's --max-request-bytes)",
            ));
        }
        let peer_address = section.peer_address.trim().to_owned();
        if !peer_address.is_empty()
            && peer_address
                .rsplit_once(':')
                .is_none_or(|(host, port)| host.is_empty() || port.parse::<u16>().is_err())
        {
            return Err(invalid(format!(
                "clustering.peer_address: `{peer_address}` is not host:port (where the other nodes reach this node's plain MQTT listener)"
            )));
        }
        if section.forward_queue == 0 {
            return Err(invalid("clustering.forward_queue must be at least 1"));
        }
        if section.session_reap_interval_s == 0 {
            return Err(invalid(
                "clustering.session_reap_interval_s must be at least 1 (seconds)",
            ));
        }
        Ok(Some(ClusteringSettings {
            peer_address: (!peer_address.is_empty()).then_some(peer_address),
            forward_queue: section.forward_queue,
            session_reap_interval: Duration::from_secs(section.session_reap_interval_s),
            keep_queued_in_etcd: section.keep_queued_in_etcd,
            recent_publishes_bytes: section.recent_publishes_bytes,
            node_id,
            etcd_endpoints: endpoints,
            etcd_prefix: prefix,
            request_timeout: Duration::from_millis(section.etcd_request_timeout_ms),
            tombstone_ttl: Duration::from_secs(section.tombstone_ttl_s),
            max_request_bytes: section.etcd_max_request_bytes,
            cached_reads: section.cached_reads,
            cache_bytes: section.cache_bytes,
            requests_to_leader: section.requests_to_leader,
            lease_ttl: Duration::from_millis(section.lease_ttl_ms),
        }))
    }
}
