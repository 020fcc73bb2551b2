//! Persistent sessions kept in etcd: a client finds its session on
//! whichever node it connects to next.
//!
//! `<etcd_prefix>S/<client id>` = the node that wrote it, the packet ids
//! the session's router deliveries take there, and the session as the
//! data directory keeps it (see `durable`: Session Expiry Interval, when
//! its connection ended, its subscriptions; the format:
//! [`super::ownership::SessionValue`]). The node that
//! owns the client writes it at each change the router journals (CONNECT,
//! SUBSCRIBE, UNSUBSCRIBE, the connection's end) and removes it when the
//! session ends, each time in a transaction that compares the owner record
//! with its claim ([`super::ownership`]): a node that lost the client can
//! no longer write it. A CONNECT with Clean Start 1 removes it with the
//! claim.
//!
//! At a CONNECT with Clean Start 0 ([`resume`]) the node reads the owner
//! record and the session record in one transaction. The session its
//! router keeps is the current one when this node owns the client, or
//! when the record is this node's own (its lease ended and came back) or
//! not written yet. Otherwise the record replaces it (the client has been
//! on another node since: CONNACK Session Present 1, with the
//! subscriptions it had there), and without a record the router's stale
//! copy goes. The node then claims the client; the node that had it ends
//! its connection (0x8E) and discards its copy.
//!
//! What moves is the subscriptions and the expiry, and the messages
//! queued for the session: from a node that is alive, over its link (see
//! [`super::handover`]); from etcd when its node is gone
//! or has no link here (see [`super::queue`], and [`super::awaited`] for
//! a node that only looked alive). The session's router deliveries take the next
//! block of packet ids after the one they took on the node it left
//! ([`PacketIdBlock`]): that node could not release the QoS 2 ids the
//! client still keeps. The node writes that block into the session
//! record before its CONNACK (compared on the record's revision; a record
//! that changed meanwhile is read again), so that a node that dies right
//! after taking the session over leaves its block there for the next.
//!
//! A record nobody owns (no owner record: its node died, stopped or lost
//! its lease, and the client did not come back) is adopted by a live
//! node, or removed once its session would have expired (see
//! [`super::orphans`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use router::{Journal, Message, MessageId, Receipt, RestoredSession, RouterHandle, SessionRecord};

use super::ownership::{SessionValue, owner_ids, owner_of};
use super::queue::Queued;
use super::stamps::Stamps;
use super::{Awaited, Ownership, Peers, Queue};
use crate::clock::now_ms;
use crate::durable::format::encode_session;
use crate::sessions::{PacketIdBlock, Resumed, Sessions};

/// The router's journal on a cluster node: sessions go to etcd (through
/// the node's [`Ownership`]) besides the data directory's journal, if any.
pub struct SessionJournal {
    data_dir: Option<Arc<dyn Journal>>,
    ownership: OnceLock<Weak<Ownership>>,
    queue: OnceLock<Weak<Queue>>,
    /// The queue keeps messages in etcd.
    keeps: AtomicBool,
}

impl SessionJournal {
    /// Around the data directory's journal (`data_dir`).
    pub fn new(data_dir: Option<Arc<dyn Journal>>) -> Arc<SessionJournal> {
        Arc::new(SessionJournal {
            data_dir,
            ownership: OnceLock::new(),
            queue: OnceLock::new(),
            keeps: AtomicBool::new(false),
        })
    }

    /// Whether it writes to a data directory too.
    pub fn has_data_dir(&self) -> bool {
        self.data_dir.is_some()
    }

    /// Sessions journaled from now on go to etcd through `ownership`, and
    /// the messages queued for them through `queue`.
    pub fn attach(&self, ownership: &Arc<Ownership>, queue: &Arc<Queue>) {
        let _ = self.ownership.set(Arc::downgrade(ownership));
        let _ = self.queue.set(Arc::downgrade(queue));
        self.keeps.store(queue.keeps(), Ordering::Release);
    }

    fn queue(&self) -> Option<Arc<Queue>> {
        self.queue.get().and_then(Weak::upgrade)
    }
}

impl Journal for SessionJournal {
    fn session(&self, client: &str, session: Option<&SessionRecord>) -> Option<Receipt> {
        if let Some(ownership) = self.ownership.get().and_then(Weak::upgrade) {
            ownership.session_changed(client, session.map(encode_session));
        }
        if session.is_none()
            && let Some(queue) = self.queue()
        {
            queue.forget(client);
        }
        self.data_dir.as_ref()?.session(client, session)
    }

    fn retained(&self, topic: &str, message: Option<&Message>) -> Option<Receipt> {
        self.data_dir.as_ref()?.retained(topic, message)
    }

    fn queued(&self, clients: &[&str], message: &Message) -> Option<(MessageId, Option<Receipt>)> {
        let queue = self.queue();
        let (number, receipt) = match &self.data_dir {
            Some(journal) => journal.queued(clients, message)?,
            // The router tells it of QoS 1 and 2 messages only.
            None => (queue.as_ref().filter(|q| q.keeps())?.number(), None),
        };
        if let Some(queue) = queue {
            queue.keep(clients, number, message);
        }
        Some((number, receipt))
    }

    fn delivered(&self, client: &str, message: MessageId) {
        if let Some(queue) = self.queue() {
            queue.delivered(client, message);
        }
        if let Some(journal) = &self.data_dir {
            journal.delivered(client, message);
        }
    }

    fn keeps_messages(&self) -> bool {
        self.data_dir.is_some() || self.keeps.load(Ordering::Acquire)
    }
}

/// What [`resume`] works with: the node's parts.
pub struct Resume<'a> {
    pub ownership: &'a Ownership,
    pub queue: &'a Arc<Queue>,
    pub awaited: &'a Arc<Awaited>,
    pub stamps: &'a Stamps,
    pub recent: &'a super::recent::Recent,
    pub peers: &'a Peers,
    pub router: &'a RouterHandle,
    pub sessions: &'a Sessions,
    pub timeout: std::time::Duration,
    pub client: etcd_client::Client,
}

/// Makes the router's session of `client_id` the current one before a
/// CONNECT with Clean Start 0 links (see the module's documentation);
/// `max_expiry`: `[broker] max_session_expiry_secs`. Returns the packet
/// ids the session's router deliveries take here (see
/// [`PacketIdBlock`]): this node's own when its copy is current, the next
/// block after the other node's when the session comes from etcd (or
/// from this node's data directory, after a restart), `fresh` for a new
/// session. A block taken after the record's is written into the record
/// before the CONNACK (see [`record_block`]). With them, the revision
/// the owner and session records were read at: the connection's claim
/// is made only if no other node's claim came after it (see
/// [`Resumed::read`]). `Err`: etcd did not answer (the CONNECT is
/// refused: accepting it could lose the session).
pub async fn resume(
    node: Resume<'_>,
    client_id: &str,
    max_expiry: u32,
    fresh: PacketIdBlock,
) -> Result<Resumed, String> {
    // A record that changed between the read and the block's write is
    // read again (its writer was still at work: the newer one is the
    // session).
    for _ in 0..3 {
        if let Some(resumed) = resume_once(&node, client_id, max_expiry, fresh).await? {
            return Ok(resumed);
        }
    }
    Err("the session record kept changing".to_owned())
}

/// One try of [`resume`]: `None` when the session record changed before
/// its new block was written.
async fn resume_once(
    node: &Resume<'_>,
    client_id: &str,
    max_expiry: u32,
    fresh: PacketIdBlock,
) -> Result<Option<Resumed>, String> {
    let (ownership, router, timeout) = (node.ownership, node.router, node.timeout);
    ownership.took_queue(client_id, false);
    let mut client = node.client.clone();
    let Records {
        read,
        owner,
        record,
    } = read_records(&mut client, ownership, client_id, timeout).await?;
    let resumed = |ids| Resumed {
        ids,
        read,
        was_here: true,
        awaits_handover: false,
    };
    let node_id = ownership.node_id();
    let mine = ownership.ids_of(client_id).unwrap_or(fresh);
    if owner
        .as_ref()
        .is_some_and(|(revision, _)| ownership.holds(client_id, *revision))
    {
        return Ok(Some(resumed(mine)));
    }
    let kept_here = router.subscriptions().has_kept_session(client_id);
    let session = match &record {
        None if ownership.writing(client_id) => return Ok(Some(resumed(mine))),
        None => None,
        Some((revision, value)) => match SessionValue::read(value) {
            // This node's copy (its lease ended and came back; or, without
            // a claim, it restarted and its data directory kept the session).
            Ok(record) if record.node == node_id && owner.is_none() && kept_here => {
                let ids = ownership.ids_of(client_id);
                if ids.is_none() {
                    let next = record.ids.next();
                    let key = ownership.session_key(client_id);
                    let written =
                        record_block(&mut client, key, *revision, value, next, timeout).await?;
                    return Ok(written.then_some(resumed(next)));
                }
                return Ok(ids.map(resumed));
            }
            // After the block of the node that has the client now, if it
            // says (its record may not be written yet), or of the record
            // if that is later (a node that resumed the session wrote its
            // block there and died before its claim).
            Ok(record) => Some((
                owner
                    .as_ref()
                    .and_then(|(_, value)| owner_ids(value))
                    .map_or(record.ids, |ids| ids.later(record.ids))
                    .next(),
                record.session,
                record.node,
            )),
            Err(why) => {
                tracing::error!(
                    client_id,
                    why,
                    "clustering: a session record in etcd cannot be read: the session starts afresh"
                );
                None
            }
        },
    };
    let from = owner
        .as_ref()
        .and_then(|(_, value)| owner_of(value))
        .unwrap_or("none")
        .to_owned();
    // The messages queued for the session come from etcd when no node can
    // hand them over: its owner is gone, or has no link here.
    let from_queue = owner.is_none() || (from != node_id && !node.peers.linked_from(&from));
    let mut ids = fresh;
    let mut keys = Vec::new();
    let mut in_flight = Vec::new();
    let mut restored = None;
    let mut dead = None;
    if let Some((next, session, writer)) = session
        && let Some(expires_in) = crate::durable::remaining(&session, now_ms(), max_expiry)
    {
        ids = next;
        // The node that had it, dead (or cut off, or paused).
        if from_queue {
            dead = Some(if owner.is_some() {
                from.clone()
            } else {
                writer.to_owned()
            })
            .filter(|dead| dead != node_id);
        }
        // From the queue with an owner record: another node, unlinked.
        if from_queue && owner.is_some() {
            // Its lease lives: a batch of its in doubt could commit after
            // the read (without an owner record, its fence went with it).
            node.queue.fence_off(&from).await?;
        }
        let waiting = if from_queue {
            waiting_in_etcd(node.queue, client_id, &session, &mut keys, &mut in_flight).await?
        } else {
            Vec::new()
        };
        restored = Some(RestoredSession {
            client_id: client_id.to_owned(),
            filters: session.filters,
            expires_in,
            queue_full: session.queue_full,
            waiting,
        });
    }
    if let (Some(_), Some((revision, value))) = (&restored, &record) {
        let key = ownership.session_key(client_id);
        if !record_block(&mut client, key, *revision, value, ids, timeout).await? {
            return Ok(None);
        }
    }
    if restored.is_none() && !kept_here {
        return Ok(Some(Resumed {
            was_here: false,
            ..resumed(ids)
        }));
    }
    let from_etcd = restored.is_some();
    // The owner is to hand the messages over (it may be dead all the same,
    // see `super::awaited`): what it hands over that this node's router
    // gave the session after taking it is dropped (see `super::stamps`).
    let handover = from_etcd && !from_queue && from != node_id;
    // What the dead node did not have goes after what etcd kept (see
    // `super::recent`).
    let live = |node_id: &str| node.peers.is_member(node_id);
    let taking = dead.as_deref().map(|dead| super::recent::Taking {
        recent: node.recent,
        live: &live,
        stamps: node.stamps,
        queue: node.queue,
        dead,
        client_id,
    });
    let mut given = None;
    if let (Some(taking), Some(restored)) = (&taking, &mut restored) {
        given = Some(super::recent::before_take(taking, restored).await);
    }
    let stamps = (handover || given.is_some()).then_some(node.stamps);
    let replaced = replace_session(router, client_id, restored, stamps).await?;
    let queued = keys.len();
    if replaced && from_etcd && from_queue {
        node.queue.restored(client_id, keys);
        ownership.took_queue(client_id, true);
        resend_in_flight(node.queue, node.sessions, client_id, in_flight, timeout).await;
        if let (Some(taking), Some(given)) = (&taking, given) {
            super::recent::after_take(taking, given);
        }
    } else if replaced && handover {
        node.awaited.wait(client_id, &from);
    }
    tracing::info!(
        client_id,
        owner = from,
        from_etcd,
        from_queue,
        queued,
        replaced,
        ids = ids.number(),
        "clustering: the client's session was on another node since: this node's copy replaced from etcd (or, without a record, discarded)"
    );
    Ok(Some(Resumed {
        was_here: false,
        awaits_handover: replaced && handover,
        ..resumed(ids)
    }))
}

/// Replaces the router's session of `client_id` with `restored` (see
/// `RouterHandle::replace_session`); with `stamps` (a handover is to come),
/// notes how far each node's messages had come as the replacement is
/// queued, and forgets that if it is not made (see `super::stamps`).
pub(super) async fn replace_session(
    router: &RouterHandle,
    client_id: &str,
    restored: Option<RestoredSession>,
    stamps: Option<&Stamps>,
) -> Result<bool, String> {
    let filters: Vec<String> = match (&restored, stamps) {
        (Some(s), Some(_)) => s.filters.iter().map(|(f, _)| f.clone()).collect(),
        _ => Vec::new(),
    };
    let taken = || {
        if let Some(stamps) = stamps {
            stamps.taken(client_id, filters.iter().map(String::as_str));
        }
    };
    let replaced = router
        .replace_session_then(client_id, restored, taken)
        .await
        .map_err(|e| e.to_string())?;
    if !replaced && let Some(stamps) = stamps {
        stamps.forget(client_id);
    }
    Ok(replaced)
}

/// `client_id`'s owner and session records, read in one transaction.
pub(super) struct Records {
    /// The revision they were read at, and the wall clock's ms then (reads
    /// do not move etcd's revision: two CONNECTs read at the same one are
    /// told apart by the wall clock).
    pub read: (i64, u64),
    /// The owner record's mod revision and value, if there is one.
    pub owner: Option<(i64, Vec<u8>)>,
    /// The session record's mod revision and value, if there is one.
    pub record: Option<(i64, Vec<u8>)>,
}

/// Reads `client_id`'s [`Records`] (`Err`: etcd did not answer in time).
pub(super) async fn read_records(
    client: &mut etcd_client::Client,
    ownership: &Ownership,
    client_id: &str,
    timeout: std::time::Duration,
) -> Result<Records, String> {
    let txn = Txn::new().and_then([
        TxnOp::get(ownership.key(client_id), None),
        TxnOp::get(ownership.session_key(client_id), None),
    ]);
    let response = tokio::time::timeout(timeout, client.txn(txn))
        .await
        .map_err(|_| "etcd did not answer in time".to_owned())?
        .map_err(|e| e.to_string())?;
    let read = (response.header().map_or(0, |h| h.revision()), now_ms());
    let mut found = response.op_responses().into_iter().map(|op| match op {
        TxnOpResponse::Get(get) => get
            .kvs()
            .first()
            .map(|kv| (kv.mod_revision(), kv.value().to_vec())),
        _ => None,
    });
    let owner = found.next().flatten();
    let record = found.next().flatten();
    Ok(Records {
        read,
        owner,
        record,
    })
}

/// The messages kept in etcd for `client_id`'s `session` (see
/// [`super::queue`]), each for the session as its subscriptions take it
/// now, numbered here; their keys by number go to `keys`. Those none of
/// its subscriptions take any more go from etcd. Those their node had in
/// flight to the client go to `in_flight` instead (see
/// [`resend_in_flight`]).
pub(super) async fn waiting_in_etcd(
    queue: &Queue,
    client_id: &str,
    session: &SessionRecord,
    keys: &mut Vec<(MessageId, Vec<u8>)>,
    in_flight: &mut Vec<Queued>,
) -> Result<Vec<(MessageId, Message)>, String> {
    let mut waiting = Vec::new();
    let mut gone = Vec::new();
    for mut queued in queue.read(client_id).await? {
        if !crate::durable::for_session(session, &mut queued.message) {
            gone.push(queued.key);
            continue;
        }
        if queued.in_flight.is_some() {
            in_flight.push(queued);
            continue;
        }
        let number = queue.restored_number();
        keys.push((number, queued.key));
        waiting.push((number, queued.message));
    }
    if !gone.is_empty() {
        queue.remove(gone);
    }
    Ok(waiting)
}

/// QoS 2 messages read back from etcd that their node had sent the client
/// (see `Queue::sending`), for the session this node took: each leaves
/// etcd (the client forgets the id at the PUBREL, and a copy sent again
/// after it would be a new message), then goes to the session like a
/// message handed over under the id the client saw, with DUP (see
/// [`crate::sessions::Direct::handed_over`]), before what its router has
/// (a client that had it takes it as the same message; one whose PUBLISH
/// was lost gets it). The removals are waited for `patience` at most (the
/// CONNECT or the adoption waits): past it the messages go all the same,
/// with a WARN (a copy etcd removes later is then sent again only if
/// this node dies first, after the client ended the exchange).
pub(super) async fn resend_in_flight(
    queue: &Queue,
    sessions: &Sessions,
    client_id: &str,
    in_flight: Vec<Queued>,
    patience: std::time::Duration,
) {
    if in_flight.is_empty() {
        return;
    }
    let removals: Vec<_> = in_flight
        .iter()
        .map(|queued| queue.remove_waited(queued.key.clone()))
        .collect();
    let removed = tokio::time::timeout(patience, async {
        for removal in removals {
            if removal.await.is_err() {
                // The node stops.
                return false;
            }
        }
        true
    })
    .await;
    match removed {
        Ok(true) => {}
        Ok(false) => return,
        Err(_) => tracing::warn!(
            client_id,
            "clustering: etcd did not remove the copies of QoS 2 messages the session's last node had in flight in time: sent again all the same"
        ),
    }
    let messages: Vec<_> = in_flight
        .into_iter()
        .map(|queued| queued.handed_over().1)
        .collect();
    tracing::info!(
        client_id,
        count = messages.len(),
        "clustering: QoS 2 messages the session's last node had in flight to the client came from etcd: sent again under their packet ids"
    );
    sessions.keep_handed_over(client_id, messages);
}

/// Writes `ids` into the session record `value` at `key` if it is still
/// the one put at `revision` (`false`: it is not; read it again). The
/// node takes that block for the session's deliveries from its CONNACK
/// on; its own record follows its claim, two etcd round trips later, and
/// a node that died in between left the record's older block: the next
/// node would have taken the same block again, and the QoS 2 ids the
/// client kept from the one that died with it.
pub(super) async fn record_block(
    client: &mut etcd_client::Client,
    key: Vec<u8>,
    revision: i64,
    value: &[u8],
    ids: PacketIdBlock,
    timeout: std::time::Duration,
) -> Result<bool, String> {
    let Some(value) = super::ownership::with_block(value, ids) else {
        return Ok(true);
    };
    let txn = Txn::new()
        .when([Compare::mod_revision(
            key.clone(),
            CompareOp::Equal,
            revision,
        )])
        .and_then([TxnOp::put(key, value, None)]);
    let response = tokio::time::timeout(timeout, client.txn(txn))
        .await
        .map_err(|_| "etcd did not answer in time".to_owned())?
        .map_err(|e| e.to_string())?;
    Ok(response.succeeded())
}
