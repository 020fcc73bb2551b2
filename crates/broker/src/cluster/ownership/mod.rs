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
//! it. Writing the session and will records is [`records`]'.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Weak};
use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse,
};
use parking_lot::Mutex;
use router::RouterHandle;
use tokio::sync::Notify;

use super::watch::{Ended, follow_prefix};
use super::{Cluster, Membership, Peers};

mod adoption;
mod leaving;
mod owner_record;
mod records;
mod sweep;
use crate::sessions::{PacketIdBlock, Resumed, Sessions};
use crate::will::WillRegistry;
pub use adoption::Offers;
pub use owner_record::{offered, owner_ids, owner_of};
use owner_record::{owner_read, owner_record, started_clean, wants_handover};
use records::write_records;
pub use records::{SessionValue, with_block};

/// This node's claim on a client id.
#[derive(Debug, Clone, Copy)]
struct Claim {
    connection: u64,
    /// The revision of the claim's record (0: the put is on its way).
    revision: i64,
    /// The greatest revision of another node's claim seen meanwhile,
    /// and whether that claim's CONNECT started clean.
    superseded: (i64, bool),
    /// The connection started clean: the claim removes the session record
    /// another node left.
    clean_start: bool,
    /// The connection ended.
    ended: bool,
    /// The session outlives the connection (kept by the router).
    kept: bool,
    /// The packet ids its router deliveries take.
    ids: PacketIdBlock,
    /// The session's queued messages came from etcd (see
    /// [`Ownership::took_queue`]).
    took_queue: bool,
    /// The node's lease losses when the connection was accepted (see
    /// [`crate::standing`]): a claim made before a loss is not recorded
    /// after it.
    epoch: u64,
    /// The etcd revision its CONNECT read the session at (Clean Start 0;
    /// 0: not read) and the wall clock's ms then: where the CONNECT comes,
    /// kept in the record (see the module's documentation).
    read: (i64, u64),
    /// The record is put only if the owner record's revision is at most
    /// this one (`read`, or the revision of a record found put over it
    /// that this claim comes after).
    put_over: i64,
    /// A session no node held, adopted without a connection (see
    /// [`Ownership::adopt`]): its record comes before any CONNECT's, and
    /// leaves the will record alone.
    adopted: bool,
}

impl Claim {
    /// `connection`'s claim, not recorded yet, on a session `resumed` as
    /// its CONNECT read it (see [`Ownership::claim`]).
    fn new(connection: u64, resumed: &Resumed, took_queue: bool, epoch: u64) -> Claim {
        Claim {
            connection,
            revision: 0,
            superseded: (0, false),
            clean_start: false,
            ended: false,
            kept: false,
            ids: resumed.ids,
            took_queue,
            epoch,
            read: resumed.read,
            put_over: resumed.read.0,
            adopted: false,
        }
    }
}

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
        tokio::spawn(watch(
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

    /// Records this node as `client_id`'s owner for `connection`, in the
    /// background (the connection does not wait for etcd: one that cannot
    /// answer is tried again while the connection lasts and the node
    /// serves). A later CONNECT of the client on another node ends
    /// `connection` (0x8E), whichever claim etcd takes first (see the
    /// module's documentation).
    /// `clean_start`: the claim also removes the session record another
    /// node left (the session ended with this CONNECT); `resumed`: the
    /// packet ids the session's router deliveries take here, kept in the
    /// owner and session records, and where its CONNECT read the session
    /// (which CONNECT is the later one); `will`: the connection's will record
    /// (see [`super::wills`]), put with the claim (none: an older one
    /// goes); `epoch`: the node's lease losses when the connection was
    /// accepted.
    pub fn claim(
        self: &Arc<Self>,
        client_id: &str,
        connection: u64,
        clean_start: bool,
        resumed: Resumed,
        will: Option<Vec<u8>>,
        epoch: u64,
    ) {
        let mut state = self.state.lock();
        let took_queue = state.took_queue.remove(client_id) && !clean_start;
        state.claims.insert(
            client_id.to_owned(),
            Claim {
                clean_start,
                ..Claim::new(connection, &resumed, took_queue, epoch)
            },
        );
        drop(state);
        self.keep_recording(client_id, connection, will, self.claim_delay);
    }

    /// Puts `connection`'s claim on `client_id` (with its `will` record)
    /// in the background, tried again while it may still be put (see
    /// [`Ownership::record`]), after `delay` (a fault).
    fn keep_recording(
        self: &Arc<Self>,
        client_id: &str,
        connection: u64,
        will: Option<Vec<u8>>,
        delay: Option<Duration>,
    ) {
        let ownership = Arc::clone(self);
        let client_id = client_id.to_owned();
        tokio::spawn(async move {
            if let Some(delay) = delay {
                tracing::info!(
                    client_id,
                    fault = "claim_delay",
                    delay_ms = delay.as_millis() as u64,
                    "fault injected: the client's ownership claim waits before it goes to etcd"
                );
                tokio::time::sleep(delay).await;
            }
            let mut said = false;
            let mut again = 0;
            loop {
                match ownership
                    .record(&client_id, connection, will.as_deref())
                    .await
                {
                    Ok(()) | Err(NotRecorded::Done) => return,
                    Err(NotRecorded::Again) if again < 8 => again += 1,
                    Err(NotRecorded::Again) => {
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                    Err(NotRecorded::Later(e)) => {
                        if !std::mem::replace(&mut said, true) {
                            tracing::warn!(
                                client_id,
                                error = e,
                                "clustering: cannot record the client's ownership in etcd yet: trying again"
                            );
                        }
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                }
            }
        });
    }

    /// `client_id`'s session, resumed here, took its queued messages from
    /// etcd (see [`super::queue`]): its next claim says so (`\nqueue`), so
    /// that the node it was on, paused past its lease or cut off from this
    /// one, does not hand the same messages over when it comes back.
    /// `took`: whether it did (`false` forgets an earlier resumption's
    /// that no claim followed).
    pub fn took_queue(&self, client_id: &str, took: bool) {
        let mut state = self.state.lock();
        if !took {
            state.took_queue.remove(client_id);
            return;
        }
        if state.took_queue.len() >= TOOK_QUEUE_MAX {
            state.took_queue.clear();
        }
        state.took_queue.insert(client_id.to_owned());
    }

    /// Puts the record of `connection`'s claim (and, for a clean start,
    /// removes the session record), if no other claim came after its
    /// CONNECT read the session (see [`Ownership::claim`]).
    async fn record(
        self: &Arc<Self>,
        client_id: &str,
        connection: u64,
        will: Option<&[u8]>,
    ) -> Result<(), NotRecorded> {
        let standing = self.membership.standing();
        let Some((clean_start, ids, took_queue, read, put_over, adopted)) =
            claim_of(&mut self.state.lock().claims, client_id, connection)
                .filter(|c| c.epoch == standing.epoch())
                .map(|c| {
                    let Claim {
                        clean_start,
                        ids,
                        took_queue,
                        read,
                        put_over,
                        adopted,
                        ..
                    } = *c;
                    (clean_start, ids, took_queue, read, put_over, adopted)
                })
        else {
            return Err(NotRecorded::Done);
        };
        // Suspended: the connection waits for etcd to confirm the lease,
        // and goes on if it does; so does its claim.
        if !standing.serving() {
            return Err(NotRecorded::Later(
                "etcd has not confirmed this node's membership lease".to_owned(),
            ));
        }
        // Why the node that had the session hands nothing over, if so.
        let mark = match (clean_start, took_queue) {
            (true, _) => "\nclean",
            (false, true) => "\nqueue",
            (false, false) => "",
        };
        let at = match read {
            // Before every CONNECT's (see `Ownership::adopt`).
            _ if adopted => Some((0, 0)),
            (0, _) => None,
            read => Some(read),
        };
        let value = owner_record(self.cluster.node_id(), connection, ids, at, mark);
        let lease = self.membership.lease();
        let options = PutOptions::new().with_lease(lease).with_prev_key();
        let mut ops = vec![TxnOp::put(self.key(client_id), value, Some(options))];
        if !adopted {
            ops.push(match will {
                Some(will) => TxnOp::put(
                    self.will_key(client_id),
                    super::wills::with_lease(lease, will),
                    None,
                ),
                None => TxnOp::delete(self.will_key(client_id), None),
            });
        }
        if clean_start {
            ops.push(TxnOp::delete(self.session_key(client_id), None));
            ops.push(self.delete_queue(client_id));
        }
        let key = self.key(client_id);
        let txn = match put_over {
            0 => Txn::new().and_then(ops),
            // No claim recorded since the CONNECT read the session (or
            // since the earlier CONNECT's that this one is put over).
            put_over => Txn::new()
                .when([Compare::mod_revision(
                    key.clone(),
                    CompareOp::Less,
                    put_over + 1,
                )])
                .and_then(ops)
                .or_else([TxnOp::get(key, None)]),
        };
        let mut client = self.cluster.client.clone();
        let response = tokio::time::timeout(self.cluster.settings.request_timeout, client.txn(txn))
            .await
            .map_err(|_| NotRecorded::Later("etcd did not answer in time".to_owned()))?
            .map_err(|e| NotRecorded::Later(e.to_string()))?;
        if !response.succeeded() {
            return Err(self.claimed_since_read(client_id, connection, &response));
        }
        let revision = response.header().map_or(0, |h| h.revision());
        let mut state = self.state.lock();
        if will.is_some() {
            state.wills.insert(client_id.to_owned(), revision);
        }
        let Some(claim) = claim_of(&mut state.claims, client_id, connection) else {
            // The connection ended meanwhile: its records go too.
            drop(state);
            self.delete(client_id, revision);
            self.forget_will(client_id, revision);
            return Err(NotRecorded::Done);
        };
        claim.revision = revision;
        if claim.ended && !claim.adopted {
            // Its will is with this node's will module.
            self.forget_will(client_id, revision);
        }
        if claim.superseded.0 > revision {
            // Another node's CONNECT came after this one's.
            let claim = *claim;
            drop(state);
            self.lost(client_id, claim, None, claim.superseded.1);
            return Err(NotRecorded::Done);
        }
        drop(state);
        self.wake.notify_one();
        let previous = response.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Put(put) => put
                .prev_key()
                .and_then(|kv| owner_of(kv.value()).map(str::to_owned)),
            _ => None,
        });
        if let Some(node) = previous.filter(|node| node != self.cluster.node_id()) {
            tracing::info!(
                client_id,
                previous_node = node,
                "clustering: the client was connected to another node: that connection ends (0x8E)"
            );
        }
        Ok(())
    }

    /// `connection`'s claim found the owner record put after its CONNECT
    /// read the session (`response`: the transaction that did not put
    /// it, with the record). This node's own record (an earlier
    /// connection's claim that etcd took late, or this claim's, whose
    /// answer was lost), or an earlier CONNECT's (read before this one's,
    /// see the module's documentation): put over it. A later CONNECT's,
    /// on another node: this connection ends (0x8E), as if that node's
    /// claim had come after its record.
    fn claimed_since_read(
        &self,
        client_id: &str,
        connection: u64,
        response: &etcd_client::TxnResponse,
    ) -> NotRecorded {
        let found = response.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(get) => get
                .kvs()
                .first()
                .map(|kv| (kv.mod_revision(), kv.value().to_vec())),
            _ => None,
        });
        let mut state = self.state.lock();
        let Some(claim) = claim_of(&mut state.claims, client_id, connection) else {
            return NotRecorded::Done;
        };
        // Where the record's CONNECT comes: at its read, or at its claim.
        let (node_id, read) = (self.cluster.node_id(), claim.read);
        let earlier = |revision: i64, value: &[u8]| {
            owner_of(value) == Some(node_id) || owner_read(value).unwrap_or((revision, 0)) < read
        };
        match found {
            Some((revision, value)) if earlier(revision, &value) => {
                claim.put_over = revision;
                NotRecorded::Again
            }
            found => {
                let claim = *claim;
                drop(state);
                let to = found.as_ref().and_then(|(_, value)| owner_of(value));
                tracing::info!(
                    client_id,
                    to,
                    "clustering: the client connected to another node while this CONNECT waited for etcd: this connection ends (0x8E session taken over)"
                );
                let clean = found
                    .as_ref()
                    .is_some_and(|(_, value)| started_clean(value));
                self.lost(client_id, claim, None, clean);
                NotRecorded::Done
            }
        }
    }

    /// Another node (`to`, if known) took `client_id` from `claim` with a
    /// CONNECT that started `clean` or not: its connection ends (0x8E),
    /// its will is judged as a takeover's (see
    /// [`WillRegistry::taken_elsewhere`]), and the session kept here goes,
    /// its queued messages handed to `to` (see [`super::handover`]).
    fn lost(&self, client_id: &str, claim: Claim, to: Option<&str>, clean: bool) {
        self.wills.taken_elsewhere(client_id, clean);
        let to = to.filter(|_| claim.kept || !claim.ended);
        let counted = {
            let mut state = self.state.lock();
            // Counted before the claim goes (see `leaving`).
            let counted = to.map(|_| self.leaving.handing_over());
            if state
                .claims
                .get(client_id)
                .is_some_and(|c| c.connection == claim.connection)
            {
                self.remove_claim(&mut state, client_id);
            }
            state.records.remove(client_id);
            // The other node's claim replaced the will record.
            state.wills.remove(client_id);
            counted
        };
        if !claim.ended && self.sessions.take_over(client_id, claim.connection) {
            tracing::info!(
                client_id,
                "clustering: the client connected to another node: connection ended (0x8E session taken over)"
            );
        }
        let router = self.router.clone();
        let client_id = client_id.to_owned();
        if let Some(to) = to.map(str::to_owned) {
            let peers = Arc::clone(&self.peers);
            let sessions = Arc::clone(&self.sessions);
            let queue = self.queue.get().and_then(std::sync::Weak::upgrade);
            tokio::spawn(async move {
                let node = super::handover::From {
                    router: &router,
                    sessions: &sessions,
                    peers: &peers,
                    queue: queue.as_deref(),
                };
                super::handover::hand_over(node, &client_id, &to, claim.ids).await;
                drop(counted);
            });
            return;
        }
        tokio::spawn(async move {
            if let Ok(true) = router.replace_session(&client_id, None).await {
                tracing::debug!(
                    client_id,
                    "clustering: the session kept here is discarded: another node has it"
                );
            }
        });
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

    /// Another node recorded itself as `client_id`'s owner at `revision`:
    /// this node's connection of it ends and its session is discarded, if
    /// it claimed before.
    fn taken(&self, client_id: &str, revision: i64, to: Option<&str>, clean: bool) {
        let mut state = self.state.lock();
        let Some(claim) = state.claims.get_mut(client_id) else {
            return;
        };
        if claim.revision == 0 {
            claim.superseded = claim.superseded.max((revision, clean));
            return;
        }
        if claim.revision < revision {
            let claim = *claim;
            drop(state);
            self.lost(client_id, claim, to, clean);
        }
    }
}

/// Why [`Ownership::record`] did not put a claim's record.
enum NotRecorded {
    /// Try again in a while: etcd did not take it, or the node waits for
    /// etcd to confirm its lease.
    Later(String),
    /// Try again now: the owner record was this node's own, put after the
    /// CONNECT's read (see [`Ownership::claimed_since_read`]).
    Again,
    /// No more to do: the claim is gone, lost to another node's, or made
    /// before the node lost its lease (its connection was sent away, and
    /// a record put under the next lease would take the client from the
    /// node it went to).
    Done,
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

/// `client_id`'s claim, if it is `connection`'s (a newer connection of
/// this node's replaces it).
fn claim_of<'a>(
    claims: &'a mut HashMap<String, Claim>,
    client_id: &str,
    connection: u64,
) -> Option<&'a mut Claim> {
    claims
        .get_mut(client_id)
        .filter(|c| c.connection == connection)
}

/// Watches the owners' records from revision `from`, resumed after the
/// last event when the stream breaks; ends with the ownership or the
/// cluster.
async fn watch(
    ownership: Weak<Ownership>,
    mut from: i64,
    mut stop: tokio::sync::watch::Receiver<()>,
) {
    loop {
        let Some(o) = ownership.upgrade() else { return };
        let (mut client, prefix, node) = (
            o.cluster.client.clone(),
            o.prefix.clone(),
            o.cluster.node_id().to_owned(),
        );
        drop(o);
        let ended = follow_prefix(&mut client, &prefix, from, &mut stop, |event| {
            let Some(o) = ownership.upgrade() else {
                return false;
            };
            let Some(kv) = event.kv() else { return true };
            if event.event_type() != EventType::Put {
                return true;
            }
            let Some(owner_node) = owner_of(kv.value()) else {
                return true;
            };
            if owner_node == node {
                return true;
            }
            let Ok(client_id) = std::str::from_utf8(&kv.key()[prefix.len()..]) else {
                return true;
            };
            if offered(kv.value()) {
                o.offers.push(client_id, owner_node);
            }
            // A clean start ended the session, or the other node took its
            // messages from etcd: nothing to hand over.
            let to = wants_handover(kv.value()).then_some(owner_node);
            o.taken(client_id, kv.mod_revision(), to, started_clean(kv.value()));
            true
        });
        from = match ended.await {
            Ended::Stopped => return,
            Ended::Broken(next) => next,
            Ended::Compacted(compacted) => {
                // Takeovers in between are not seen here; the other node
                // owns those clients all the same.
                tracing::warn!(
                    from,
                    "clustering: the owners' watch fell behind etcd's compaction"
                );
                compacted
            }
        };
    }
}
