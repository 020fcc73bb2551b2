//! Which node a client id's connection and session are on: one node at a
//! time.
//!
//! A cluster node that accepts a CONNECT records itself as the owner of
//! the client id in etcd, `<etcd_prefix>C/<client id>` = `<node id>\n<its
//! connection number>\nids <its packet id block>` (see
//! [`crate::sessions::PacketIdBlock`]; `\nat <revision> <ms>` for a
//! CONNECT that read the session in etcd, see below; and `\nclean` for a
//! clean start, `\nqueue` when the session's queued messages came from
//! etcd: the node that had it hands nothing over then), under its
//! membership lease (so the record goes with the node: killed, cut off or
//! paused past its lease). Every node
//! watches these records; a node whose client connected later to another
//! node (a record with a greater revision than its own claim) ends that
//! connection with DISCONNECT 0x8E "session taken over", as MQTT asks of
//! a single server (3.1.4-3), and discards the session it kept for it.
//!
//! Which CONNECT is the later one is etcd's order: a CONNECT with Clean
//! Start 0 reads the client's owner and session records (see
//! [`super::sessions`]) before it is accepted, and comes at that read's
//! revision (two read at the same revision, nothing written between,
//! come in the order of their nodes' wall clocks); one with Clean Start 1
//! reads nothing and comes at its claim's own revision. Its claim goes to
//! etcd after it is accepted, in the background, and may be late (etcd
//! slow, the node suspended): a claim is put only if the owner record did
//! not change since its CONNECT's read; if it did, by another node's
//! claim of a later CONNECT, this one's connection ends (0x8E) instead,
//! and by an earlier CONNECT's claim that etcd took late, it is put over
//! it.
//!
//! The owner also keeps the client's persistent session in etcd (see
//! [`super::sessions`]): each change the router journals is written to
//! `<etcd_prefix>S/<client id>` in a transaction that compares the owner
//! record with this node's claim, so a node that lost the client can no
//! longer write it. A claim outlives its connection while the session is
//! kept; the record goes when the session ends, the session's record with
//! it. Putting a claim is [`claims`]'; what a claim taken by another node
//! ends, [`taken`]'; writing the session and will records, [`records`]'.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp};
use parking_lot::Mutex;
use router::RouterHandle;
use tokio::sync::Notify;

use super::{Cluster, Membership, Peers};

mod adoption;
mod claims;
mod leaving;
mod owner_record;
mod records;
mod sweep;
mod taken;
use crate::sessions::{PacketIdBlock, Sessions};
use crate::will::WillRegistry;
pub use adoption::Offers;
use claims::{Claim, claim_of};
pub use owner_record::{offered, owner_ids, owner_of};
use owner_record::{owner_record, started_clean, wants_handover};
use records::write_records;
pub use records::{SessionValue, with_block};

/// A session record waiting to be written, numbered so that a newer one
/// is not taken for it.
struct Pending {
    number: u64,
    /// `None`: the session ended, its record goes.
    value: Option<Vec<u8>>,
}

#[derive(Default)]
struct State {
    /// One per connection of this node's (not links) and per session kept
    /// after one: bounded by them.
    claims: HashMap<String, Claim>,
    /// Session records to write, by client id (bounded as the claims).
    records: HashMap<String, Pending>,
    /// Will records this node put and has not seen removed, by client id:
    /// the revision of the claim that put each (bounded as the claims).
    wills: HashMap<String, i64>,
    /// Client ids whose next claim says their session's queued messages
    /// came from etcd (at most [`TOOK_QUEUE_MAX`]).
    took_queue: HashSet<String>,
    numbers: u64,
}

/// Resumed sessions waiting for their claim, at most (a CONNECT that ends
/// between the two leaves one; past it, they are forgotten).
const TOOK_QUEUE_MAX: usize = 10_000;

/// The client ids this node owns, and the watch that ends them when
/// another node takes one over.
pub struct Ownership {
    cluster: Arc<Cluster>,
    membership: Arc<Membership>,
    sessions: Arc<Sessions>,
    /// The wills of this node's connections, told when another node takes
    /// a client over.
    wills: Arc<WillRegistry>,
    router: RouterHandle,
    peers: Arc<Peers>,
    /// The node's queue in etcd (see [`Ownership::attach`]).
    queue: std::sync::OnceLock<std::sync::Weak<super::Queue>>,
    /// `<etcd_prefix>C/`.
    prefix: Vec<u8>,
    /// `<etcd_prefix>S/`.
    sessions_prefix: Vec<u8>,
    /// `<etcd_prefix>W/`.
    wills_prefix: Vec<u8>,
    state: Mutex<State>,
    /// Session records are waiting.
    wake: Arc<Notify>,
    /// A fault (`[faults] claim_delay_ms`): each claim waits this long
    /// before it goes to etcd.
    claim_delay: Option<Duration>,
    /// Sessions moving away, waited for when the node stops (see
    /// [`leaving`]).
    leaving: Arc<leaving::Leaving>,
    /// Adopted sessions so far (numbers their claims, see [`ADOPTED`]).
    adoptions: std::sync::atomic::AtomicU64,
    /// Sessions stopping nodes offer (see [`Ownership::offer_kept`]), for
    /// `super::orphans` to adopt.
    offers: Arc<Offers>,
}

impl Ownership {
    /// Starts watching the owners' records; the watch ends when the
    /// returned value is dropped. `claim_delay`: a fault (see
    /// `[faults] claim_delay_ms`).
    pub async fn start(
        cluster: Arc<Cluster>,
        membership: Arc<Membership>,
        sessions: Arc<Sessions>,
        wills: Arc<WillRegistry>,
        router: RouterHandle,
        peers: Arc<Peers>,
        claim_delay: Option<Duration>,
    ) -> Result<Arc<Ownership>, String> {
        let prefix = format!("{}C/", cluster.settings.etcd_prefix).into_bytes();
        let mut client = cluster.client.clone();
        let now = tokio::time::timeout(
            cluster.settings.request_timeout,
            client.get(
                prefix.clone(),
                Some(GetOptions::new().with_prefix().with_count_only()),
            ),
        )
        .await
        .map_err(|_| "etcd did not answer in time".to_owned())?
        .map_err(|e| e.to_string())?;
        let from = now.header().map_or(0, |h| h.revision()) + 1;
        sweep::drop_copies_owned_elsewhere(&cluster, &router, &prefix, from - 1).await?;
        let cluster_prefix = cluster.settings.etcd_prefix.clone();
        let sessions_prefix = format!("{cluster_prefix}S/").into_bytes();
        let ownership = Arc::new(Ownership {
            cluster,
            membership,
            sessions,
            wills,
            router,
            peers,
            queue: std::sync::OnceLock::new(),
            prefix,
            sessions_prefix,
            wills_prefix: format!("{}W/", cluster_prefix).into_bytes(),
            state: Mutex::new(State::default()),
            wake: Arc::new(Notify::new()),
            claim_delay,
            leaving: Arc::default(),
            adoptions: std::sync::atomic::AtomicU64::new(0),
            offers: Arc::default(),
        });
        tokio::spawn(taken::watch(
            Arc::downgrade(&ownership),
            from,
            ownership.cluster.stop.subscribe(),
        ));
        tokio::spawn(write_records(
            Arc::downgrade(&ownership),
            Arc::clone(&ownership.wake),
            ownership.cluster.stop.subscribe(),
        ));
        Ok(ownership)
    }

    /// `client_id`'s owner record.
    pub fn key(&self, client_id: &str) -> Vec<u8> {
        [self.prefix.as_slice(), client_id.as_bytes()].concat()
    }

    /// This node's id.
    pub fn node_id(&self) -> &str {
        self.cluster.node_id()
    }

    /// The packet ids of this node's claim on `client_id`, if it has one.
    pub fn ids_of(&self, client_id: &str) -> Option<PacketIdBlock> {
        self.state.lock().claims.get(client_id).map(|c| c.ids)
    }

    /// Whether this node's claim on `client_id` is the owner record put at
    /// `revision`.
    pub fn holds(&self, client_id: &str, revision: i64) -> bool {
        let state = self.state.lock();
        state
            .claims
            .get(client_id)
            .is_some_and(|c| c.revision > 0 && c.revision == revision)
    }

    /// Handovers take QoS 2 messages out of `queue` before they go (see
    /// [`super::handover`]).
    pub fn attach(&self, queue: &Arc<super::Queue>) {
        let _ = self.queue.set(Arc::downgrade(queue));
    }

    /// Removes `client_id`'s claim from `state`, telling a stop that waits
    /// for claims to go (see [`leaving`]).
    fn remove_claim(&self, state: &mut State, client_id: &str) {
        if state.claims.remove(client_id).is_some() {
            self.leaving.claim_gone();
        }
    }

    /// Deletes `client_id`'s record if it is still the one put at
    /// `revision`.
    fn delete(&self, client_id: &str, revision: i64) {
        self.delete_if(self.key(client_id), revision);
    }

    /// Deletes `key` in the background if its mod revision is `revision`.
    fn delete_if(&self, key: Vec<u8>, revision: i64) {
        let mut client = self.cluster.client.clone();
        let timeout = self.cluster.settings.request_timeout;
        tokio::spawn(async move {
            let txn = client.txn(delete_at(key, revision));
            let _ = tokio::time::timeout(timeout, txn).await;
        });
    }

    /// `connection` of `client_id` ended; `kept`: its session outlives it
    /// (the claim stays while the router keeps the session). Otherwise the
    /// owner record goes, if it is still this connection's, once no
    /// session record is waiting.
    pub fn release(self: &Arc<Self>, client_id: &str, connection: u64, kept: bool) {
        let mut state = self.state.lock();
        let writing = state.records.contains_key(client_id);
        let Some(claim) = claim_of(&mut state.claims, client_id, connection) else {
            return;
        };
        claim.ended = true;
        claim.kept = kept;
        let revision = claim.revision;
        if revision > 0 {
            self.forget_will(client_id, revision);
        }
        if kept || writing {
            return;
        }
        self.remove_claim(&mut state, client_id);
        drop(state);
        if revision > 0 {
            self.delete(client_id, revision);
        }
    }
}

/// A transaction that deletes `key` if its mod revision is `revision`.
fn delete_at(key: Vec<u8>, revision: i64) -> Txn {
    Txn::new()
        .when([Compare::mod_revision(
            key.clone(),
            CompareOp::Equal,
            revision,
        )])
        .and_then([TxnOp::delete(key, None)])
}
