//! A cluster node's metrics (see `crate::cluster`): declared with the
//! others' shape, described with them at install.

#[cfg(feature = "cluster")]
use metrics::{Counter, counter, gauge, histogram};
use metrics::{describe_counter, describe_gauge, describe_histogram};

/// Clustering: state store requests refused for etcd's limits, by reason.
pub const CLUSTER_REFUSED: &str = "statebroker_cluster_requests_refused_total";
/// Clustering: writes that found the key changed by another node first,
/// and were planned again.
pub const CLUSTER_CONFLICTS: &str = "statebroker_cluster_write_conflicts_total";
/// Clustering: state store requests left unanswered, by reason
/// (`unreachable`: etcd did not answer; `in_doubt`: a write etcd could
/// not confirm; `contended`: the key kept changing).
pub const CLUSTER_UNANSWERED: &str = "statebroker_cluster_requests_unanswered_total";
/// Clustering: linearizable reads of keys (GETs, and writes whose record
/// had to be read again), and the etcd requests that served them (reads
/// waiting together go as one request: see `cluster/reads.rs`).
pub const CLUSTER_READS: &str = "statebroker_cluster_reads_total";
/// Clustering: see [`CLUSTER_READS`].
pub const CLUSTER_READ_REQUESTS: &str = "statebroker_cluster_read_requests_total";
/// Clustering: transactions of clients' writes (SET, DEL, VDEL; not the
/// reaper's), and the etcd requests that carried them (writes waiting together go as one: see `cluster/writes.rs`).
pub const CLUSTER_WRITES: &str = "statebroker_cluster_writes_total";
/// Clustering: see [`CLUSTER_WRITES`].
pub const CLUSTER_WRITE_REQUESTS: &str = "statebroker_cluster_write_requests_total";
/// Clustering: times this node saw etcd elect a new leader.
pub const CLUSTER_ETCD_LEADER_CHANGES: &str = "statebroker_cluster_etcd_leader_changes_total";
/// Clustering: batches of etcd requests given up, by reason
/// (`leader_changed`: etcd elected a new leader while they were out;
/// `overtaken`: a batch sent later was answered first); their requests
/// try again (see `cluster/batches.rs`).
pub const CLUSTER_GIVEN_UP: &str = "statebroker_cluster_etcd_requests_given_up_total";
/// Clustering: time from sending a batch of reads (`kind="read"`) or
/// writes (`kind="write"`) to etcd until its answer, for the batches etcd
/// answered: what etcd takes of a request's time on the node
/// ([`super::STORE_REQUEST_SECONDS`]); the rest is the node's own.
pub const CLUSTER_ETCD_SECONDS: &str = "statebroker_cluster_etcd_request_duration_seconds";
/// Clustering: records kept in the node's cache, and their bytes.
pub const CLUSTER_CACHE_RECORDS: &str = "statebroker_cluster_cache_records";
/// Clustering: see [`CLUSTER_CACHE_RECORDS`].
pub const CLUSTER_CACHE_BYTES: &str = "statebroker_cluster_cache_bytes";
/// Clustering: nodes registered in etcd, as this node last read them.
pub const CLUSTER_MEMBERS: &str = "statebroker_cluster_members";
/// Clustering: links to other nodes connected now (publishes forwarded).
pub const CLUSTER_PEER_LINKS: &str = "statebroker_cluster_peer_links";
/// Clustering: publishes handed to the link to another node, by `peer`.
pub const CLUSTER_FORWARDED: &str = "statebroker_cluster_forwarded_total";
/// Clustering: publishes not forwarded to a node, its link's queue full,
/// by `peer`.
pub const CLUSTER_FORWARD_DROPPED: &str = "statebroker_cluster_forward_dropped_total";
/// Clustering: sessions this node gave up to another node (their queued
/// messages handed over), and the messages it handed over.
pub const CLUSTER_SESSIONS_HANDED_OVER: &str = "statebroker_cluster_sessions_handed_over_total";
pub const CLUSTER_MESSAGES_HANDED_OVER: &str = "statebroker_cluster_messages_handed_over_total";
/// Clustering: (shared subscription, node with members) pairs this node
/// knows: where its clients' publishes to groups go.
pub const CLUSTER_SHARED_GROUP_NODES: &str = "statebroker_cluster_shared_group_nodes";
/// Clustering: forwarded publishes whose publisher was acknowledged
/// without a node's acknowledgement (not given within 5 s).
pub const CLUSTER_UNCONFIRMED: &str = "statebroker_cluster_unconfirmed_total";
/// Clustering: times the node's membership lease was not renewed in time
/// and its clients waited for etcd to confirm it (see `standing.rs`).
pub const CLUSTER_SUSPENSIONS: &str = "statebroker_cluster_suspensions_total";
/// Clustering: times the node lost its membership lease and sent its
/// clients to other nodes (DISCONNECT 0x9C).
pub const CLUSTER_LEASE_LOSSES: &str = "statebroker_cluster_lease_losses_total";
/// Clustering: wills of clients whose node died, published by this node.
pub const CLUSTER_DEAD_NODE_WILLS: &str = "statebroker_cluster_dead_node_wills_total";
/// Clustering: sessions no node held (their node gone, their client away)
/// adopted by this node.
pub const CLUSTER_SESSIONS_ADOPTED: &str = "statebroker_cluster_sessions_adopted_total";
/// Clustering: messages another node handed over for a session that moved
/// here which this node's router had given the session already (not
/// delivered twice).
pub const CLUSTER_HANDOVER_DUPLICATES: &str =
    "statebroker_cluster_handover_duplicates_dropped_total";
/// Clustering: publishes a dead node had not had, given to one of its
/// sessions taken here from this node's log of recent publishes.
pub const CLUSTER_REPLAYED: &str = "statebroker_cluster_dead_node_missed_given_total";
/// Clustering: origins whose word on how far a dead node had their
/// publishes did not come in time when one of its sessions was taken here.
pub const CLUSTER_REPLAY_UNKNOWN: &str = "statebroker_cluster_dead_node_missed_unknown_total";

/// The cluster metrics' descriptions (with [`super::install`]'s).
pub(super) fn describe() {
    describe_counter!(
        CLUSTER_REFUSED,
        "Clustering: state store requests refused for etcd's limits, by reason"
    );
    describe_counter!(
        CLUSTER_READS,
        "Clustering: linearizable reads of keys from etcd"
    );
    describe_counter!(
        CLUSTER_READ_REQUESTS,
        "Clustering: etcd requests that served the linearizable reads (reads waiting together go as one)"
    );
    describe_counter!(
        CLUSTER_WRITES,
        "Clustering: write transactions of keys' records sent to etcd (a batch sent again counts again)"
    );
    describe_counter!(
        CLUSTER_ETCD_LEADER_CHANGES,
        "Clustering: times this node saw etcd elect a new leader"
    );
    describe_histogram!(
        CLUSTER_ETCD_SECONDS,
        metrics::Unit::Seconds,
        "Clustering: etcd requests (batches of reads or writes) sent to answered, by kind"
    );
    describe_counter!(
        CLUSTER_GIVEN_UP,
        "Clustering: batches of etcd requests given up, by reason (etcd's leader changed, or a later batch was answered first); their requests try again"
    );
    describe_counter!(
        CLUSTER_WRITE_REQUESTS,
        "Clustering: etcd requests that carried the write transactions (writes waiting together go as one)"
    );
    describe_counter!(
        CLUSTER_CONFLICTS,
        "Clustering: writes planned again because another node changed the key first"
    );
    describe_counter!(
        CLUSTER_UNANSWERED,
        "Clustering: state store requests left unanswered, by reason"
    );
    describe_gauge!(
        CLUSTER_CACHE_RECORDS,
        "Clustering: records of keys kept in this node's cache"
    );
    describe_gauge!(
        CLUSTER_CACHE_BYTES,
        "Clustering: bytes of the records kept in this node's cache ([clustering] cache_bytes)"
    );
    describe_gauge!(
        CLUSTER_MEMBERS,
        "Clustering: nodes registered in etcd (this one included), as this node last read them"
    );
    describe_gauge!(
        CLUSTER_PEER_LINKS,
        "Clustering: links to the other nodes connected now (each carries this node's clients' publishes)"
    );
    describe_counter!(
        CLUSTER_FORWARDED,
        "Clustering: client publishes handed to the link to another node, by peer"
    );
    describe_counter!(
        CLUSTER_SESSIONS_HANDED_OVER,
        "Clustering: sessions this node gave up to the node their client connected to (queued messages handed over)"
    );
    describe_counter!(
        CLUSTER_MESSAGES_HANDED_OVER,
        "Clustering: messages queued here for a session that moved, sent to its new node"
    );
    describe_gauge!(
        CLUSTER_SHARED_GROUP_NODES,
        "Clustering: (shared subscription, node with members) pairs this node knows from etcd"
    );
    describe_counter!(
        CLUSTER_UNCONFIRMED,
        "Clustering: forwarded publishes acknowledged to their publisher without a node's acknowledgement (none within 5 s)"
    );
    describe_counter!(
        CLUSTER_SUSPENSIONS,
        "Clustering: times the membership lease was not renewed in time and clients waited for etcd to confirm it"
    );
    describe_counter!(
        CLUSTER_LEASE_LOSSES,
        "Clustering: times the membership lease was lost and clients were sent to other nodes (DISCONNECT 0x9C)"
    );
    describe_counter!(
        CLUSTER_SESSIONS_ADOPTED,
        "Clustering: persistent sessions no node held (their node gone, their client away) adopted by this node"
    );
    describe_counter!(
        CLUSTER_HANDOVER_DUPLICATES,
        "Clustering: messages handed over for a session that moved here which this node had given it already (dropped, not delivered twice)"
    );
    describe_counter!(
        CLUSTER_REPLAYED,
        "Clustering: publishes a dead node had not had, given to one of its sessions taken here (from this node's log of recent publishes)"
    );
    describe_counter!(
        CLUSTER_REPLAY_UNKNOWN,
        "Clustering: nodes that did not say in time how far a dead node had their publishes when one of its sessions was taken here (what they published meanwhile not given)"
    );
    describe_counter!(
        CLUSTER_DEAD_NODE_WILLS,
        "Clustering: wills of clients whose node died (or lost its lease), published by this node"
    );
    describe_counter!(
        CLUSTER_FORWARD_DROPPED,
        "Clustering: client publishes not forwarded to a node because its link's queue was full, by peer"
    );
}

#[cfg(feature = "cluster")]
/// Clustering: a request refused for etcd's limits.
pub fn cluster_refused(reason: &'static str) {
    counter!(CLUSTER_REFUSED, "reason" => reason).increment(1);
}

#[cfg(feature = "cluster")]
/// Clustering: one etcd request sent for `reads` linearizable reads.
pub fn cluster_read_batch(reads: usize) {
    counter!(CLUSTER_READ_REQUESTS).increment(1);
    counter!(CLUSTER_READS).increment(reads as u64);
}

#[cfg(feature = "cluster")]
/// Clustering: one etcd request sent for `writes` writes.
pub fn cluster_write_batch(writes: usize) {
    counter!(CLUSTER_WRITE_REQUESTS).increment(1);
    counter!(CLUSTER_WRITES).increment(writes as u64);
}

#[cfg(feature = "cluster")]
/// Clustering: etcd answered a batch of `kind` (`read`, `write`) in `took`.
pub fn cluster_etcd_answered(kind: &'static str, took: std::time::Duration) {
    histogram!(CLUSTER_ETCD_SECONDS, "kind" => kind).record(took.as_secs_f64());
}

#[cfg(feature = "cluster")]
/// Clustering: etcd elected a new leader (as this node saw).
pub fn cluster_etcd_leader_changed() {
    counter!(CLUSTER_ETCD_LEADER_CHANGES).increment(1);
}

#[cfg(feature = "cluster")]
/// Clustering: a batch of etcd requests given up, for `reason`.
pub fn cluster_requests_given_up(reason: &'static str) {
    counter!(CLUSTER_GIVEN_UP, "reason" => reason).increment(1);
}

#[cfg(feature = "cluster")]
/// Clustering: a write planned again after another node's.
pub fn cluster_conflict() {
    counter!(CLUSTER_CONFLICTS).increment(1);
}

#[cfg(feature = "cluster")]
/// Clustering: the nodes registered now.
pub fn cluster_members(members: usize) {
    gauge!(CLUSTER_MEMBERS).set(members as f64);
}

#[cfg(feature = "cluster")]
/// Clustering: forwarded publishes no longer waited for (see
/// [`CLUSTER_UNCONFIRMED`]).
pub fn cluster_unconfirmed(publishes: usize) {
    counter!(CLUSTER_UNCONFIRMED).increment(publishes as u64);
}

#[cfg(feature = "cluster")]
/// Clustering: the node's clients wait for etcd to confirm its lease.
pub fn cluster_suspended() {
    counter!(CLUSTER_SUSPENSIONS).increment(1);
}

#[cfg(feature = "cluster")]
/// Clustering: the node lost its lease.
pub fn cluster_lease_lost() {
    counter!(CLUSTER_LEASE_LOSSES).increment(1);
}

#[cfg(feature = "cluster")]
/// Clustering: the (shared subscription, node) pairs known now.
pub fn cluster_shared_group_nodes(pairs: usize) {
    gauge!(CLUSTER_SHARED_GROUP_NODES).set(pairs as f64);
}

#[cfg(feature = "cluster")]
/// Clustering: a link to another node came up (`true`) or went down
/// (each link says so from its own task: increments, not a value set,
/// so two links changing at once cannot leave a stale count).
pub fn cluster_peer_link(up: bool) {
    let gauge = gauge!(CLUSTER_PEER_LINKS);
    if up {
        gauge.increment(1.0);
    } else {
        gauge.decrement(1.0);
    }
}

#[cfg(feature = "cluster")]
/// Clustering: the counters of publishes forwarded to `peer` and of those
/// dropped for it (taken once per link: no lookup per publish).
pub fn cluster_forward_counters(peer: &str) -> (Counter, Counter) {
    (
        counter!(CLUSTER_FORWARDED, "peer" => peer.to_owned()),
        counter!(CLUSTER_FORWARD_DROPPED, "peer" => peer.to_owned()),
    )
}

#[cfg(feature = "cluster")]
/// Clustering: what the node's record cache holds now.
pub fn cluster_cache(records: usize, bytes: usize) {
    gauge!(CLUSTER_CACHE_RECORDS).set(records as f64);
    gauge!(CLUSTER_CACHE_BYTES).set(bytes as f64);
}

#[cfg(feature = "cluster")]
/// Clustering: this node gave a session up to another node, handing over
/// `messages`.
pub fn session_handed_over(messages: usize) {
    counter!(CLUSTER_SESSIONS_HANDED_OVER).increment(1);
    counter!(CLUSTER_MESSAGES_HANDED_OVER).increment(messages as u64);
}

#[cfg(feature = "cluster")]
/// Clustering: this node adopted a session no node held.
pub fn session_adopted() {
    counter!(CLUSTER_SESSIONS_ADOPTED).increment(1);
}

#[cfg(feature = "cluster")]
/// Clustering: publishes a dead node had not had, given to its session.
pub fn cluster_replayed(count: usize) {
    counter!(CLUSTER_REPLAYED).increment(count as u64);
}

#[cfg(feature = "cluster")]
/// Clustering: origins silent when a dead node's session was taken.
pub fn cluster_replay_unknown(count: usize) {
    counter!(CLUSTER_REPLAY_UNKNOWN).increment(count as u64);
}

#[cfg(feature = "cluster")]
/// Clustering: a handed-over message this node had given its session.
pub fn handed_over_had() {
    counter!(CLUSTER_HANDOVER_DUPLICATES).increment(1);
}

#[cfg(feature = "cluster")]
/// Clustering: this node published the will of a client whose node died.
pub fn dead_node_will_published() {
    counter!(CLUSTER_DEAD_NODE_WILLS).increment(1);
}

#[cfg(feature = "cluster")]
/// Clustering: a request left unanswered.
pub fn cluster_unanswered(reason: &'static str) {
    counter!(CLUSTER_UNANSWERED, "reason" => reason).increment(1);
}
