//! Persistent sessions no node holds: their node died, stopped or lost its
//! lease, and their client has not come back yet. Their records stay in
//! etcd (see [`super::sessions`]), and so do the QoS 1 messages queued
//! for them (see [`super::queue`]), but nothing collects what is
//! published meanwhile: no router holds their subscriptions.
//!
//! So a live node **adopts** each one: it takes the session from its
//! record and its queued messages from etcd into its router, as a CONNECT
//! would, but with no connection, and claims the client
//! ([`Ownership::adopt`]); messages for the session are queued there (and
//! in etcd) until the client comes back, on this node or another (which
//! takes the session and its messages from here as from any live node).
//! Which node adopts a session: the node that wrote its record if it is
//! live (it lost its lease and came back, and may keep the session with
//! what etcd does not have), else the live member that ranks first for
//! its client id (rendezvous hashing over the members' ids, the same on
//! every node); any node, once the chosen one had twice etcd's request
//! timeout (it may have died too). Nodes look when a member's
//! registration goes (a watch on `<etcd_prefix>N/`: a node stopped,
//! killed or cut off past its lease), when they start, and every
//! `[clustering] session_reap_interval_s`. An adoption's claim comes
//! before every CONNECT's (see [`Ownership::adopt`]): a client that
//! reconnects while its session is adopted keeps its own connection.
//!
//! A node that stops **offers** the sessions it keeps first, while its
//! links are up ([`Ownership::offer_kept`]): the member ranked first
//! among the others adopts each as from a live node (nothing read from
//! etcd), and the stopping node hands the session's messages over, QoS 2
//! ones too, which etcd does not keep.
//!
//! A record no node can adopt (unreadable; its session expired; the
//! adopting node at `[broker] max_kept_sessions`) is removed once its
//! session would have expired: counted from when its connection ended, or
//! from when a node first found it without an owner, in a transaction that
//! checks its revision and that no owner record exists.

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use etcd_client::{Compare, CompareOp, EventType, GetOptions, Txn, TxnOp, TxnOpResponse};
use futures_util::StreamExt;
use router::RouterHandle;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::ownership::{Offers, SessionValue};
use super::stamps::Stamps;
use super::watch::{Ended, follow_prefix};
use super::{Awaited, Cluster, Membership, Ownership, Peers, Queue};
use crate::clock::now_ms;
use crate::standing::Standing;

mod adopt;

use adopt::adopt;

/// What adopting and reaping work with: the node's parts (weak: the task
/// ends with the node).
pub struct Orphans {
    pub cluster: Weak<Cluster>,
    pub ownership: Weak<Ownership>,
    pub queue: Weak<Queue>,
    pub router: RouterHandle,
    pub peers: Weak<Peers>,
    pub awaited: Weak<Awaited>,
    pub stamps: Weak<Stamps>,
    /// The publishes of the last seconds (see [`super::recent`]).
    pub recent: Weak<super::recent::Recent>,
    pub membership: Weak<Membership>,
    /// Where the messages a dead node had in flight go (see
    /// [`resend_in_flight`]).
    pub sessions: Weak<crate::sessions::Sessions>,
    pub standing: Arc<Standing>,
    /// `[broker] max_session_expiry_secs` (0: none).
    pub max_expiry: u32,
    /// `[broker] max_kept_sessions` (0: none): no adoption past it.
    pub max_kept: usize,
}

/// Records without an owner seen at the last look, by client id.
type Seen = HashMap<Vec<u8>, Orphan>;

/// A record without an owner, as a look found it.
#[derive(Debug, Clone)]
struct Orphan {
    revision: i64,
    /// When it is due for removal (`None`: never).
    due: Option<Instant>,
    /// When a look first found it without an owner.
    since: Instant,
    /// The node that wrote the record (empty: it cannot be read).
    writer: Vec<u8>,
}

/// Looks for ownerless session records at the start, when a member's
/// registration goes, and every `session_reap_interval_s`, until the
/// cluster stops or the node is dropped.
pub async fn run(orphans: Orphans) {
    let Some((mut stop, every, prefix)) = orphans.cluster.upgrade().map(|c| {
        (
            c.stop.subscribe(),
            c.settings.session_reap_interval,
            format!("{}N/", c.settings.etcd_prefix),
        )
    }) else {
        return;
    };
    let member_gone = Arc::new(Notify::new());
    tokio::spawn(watch_members(
        orphans.cluster.clone(),
        prefix.into_bytes(),
        Arc::clone(&member_gone),
    ));
    let Some(offers) = orphans.ownership.upgrade().map(|o| Arc::clone(o.offers())) else {
        return;
    };
    let mut seen = Seen::new();
    let mut next_look = Instant::now();
    loop {
        if Instant::now() >= next_look {
            if look(&orphans, &mut seen).await.is_err() {
                return;
            }
            next_look = Instant::now() + every;
        }
        if take_offers(&orphans, &offers).await.is_err() {
            return;
        }
        tokio::select! {
            () = tokio::time::sleep_until(next_look) => {}
            () = member_gone.notified() => next_look = Instant::now(),
            () = offers.wake.notified() => {}
            _ = stop.changed() => return,
        }
    }
}

/// Offered sessions adopted at once, at most: each takes about four etcd
/// round trips, and the offering node waits for them 2 s at most.
const OFFERS_AT_ONCE: usize = 16;

/// Adopts the sessions stopping nodes offer (see
/// [`Ownership::offer_kept`]) that this node ranks first for among the
/// members but the offering node.
async fn take_offers(orphans: &Orphans, offers: &Offers) -> Result<(), Gone> {
    let offered = offers.take();
    if offered.is_empty() {
        return Ok(());
    }
    let cluster = orphans.cluster.upgrade().ok_or(Gone)?;
    let members = orphans
        .membership
        .upgrade()
        .filter(|m| !m.left())
        .map(|m| m.members())
        .unwrap_or_default();
    let node_id = cluster.node_id().as_bytes();
    let mine = offered.into_iter().filter(|(client_id, from)| {
        let others: Vec<&[u8]> = members
            .iter()
            .filter(|m| *m != from)
            .map(|m| m.as_bytes())
            .collect();
        first_ranked(client_id.as_bytes(), &others) == Some(node_id)
    });
    // Several at once: a stopping node waits for them ([`OFFERS_AT_ONCE`]).
    let cluster = &cluster;
    futures_util::stream::iter(mine)
        .for_each_concurrent(OFFERS_AT_ONCE, |(client_id, from)| async move {
            if !orphans.standing.serving() {
                return;
            }
            if let Err(e) = adopt(orphans, cluster, client_id.as_bytes(), Some(&from)).await {
                tracing::debug!(
                    client_id,
                    from,
                    error = e,
                    "clustering: cannot adopt a session a stopping node offers: it is adopted once that node has left"
                );
            }
        })
        .await;
    Ok(())
}

/// The node is gone: the task ends.
struct Gone;

/// One look; etcd not answering is only logged (the next look tries
/// again).
async fn look(orphans: &Orphans, seen: &mut Seen) -> Result<(), Gone> {
    let cluster = orphans.cluster.upgrade().ok_or(Gone)?;
    if let Err(e) = look_once(orphans, &cluster, seen).await {
        tracing::debug!(
            error = e,
            "clustering: cannot look for sessions no node holds now"
        );
    }
    Ok(())
}

/// Wakes `member_gone` when a member's registration is deleted; resumed
/// after a broken stream, ends with the cluster.
async fn watch_members(cluster: Weak<Cluster>, prefix: Vec<u8>, member_gone: Arc<Notify>) {
    let mut from = 0;
    loop {
        let Some((mut client, mut stop)) = cluster
            .upgrade()
            .map(|c| (c.client.clone(), c.stop.subscribe()))
        else {
            return;
        };
        let ended = follow_prefix(&mut client, &prefix, from, &mut stop, |event| {
            if event.event_type() == EventType::Delete {
                member_gone.notify_one();
            }
            true
        });
        from = match ended.await {
            Ended::Stopped => return,
            Ended::Broken(next) => next,
            // Missed departures are found at the next periodic look.
            Ended::Compacted(_) => 0,
        };
    }
}

async fn look_once(orphans: &Orphans, cluster: &Cluster, seen: &mut Seen) -> Result<(), String> {
    let prefix = &cluster.settings.etcd_prefix;
    let (members, owners, records) = (
        format!("{prefix}N/"),
        format!("{prefix}C/"),
        format!("{prefix}S/"),
    );
    let timeout = cluster.settings.request_timeout;
    let mut client = cluster.client.clone();
    let keys = |p: &str| TxnOp::get(p, Some(GetOptions::new().with_prefix().with_keys_only()));
    // One read: the members, owners and records of one revision.
    let read = client.txn(Txn::new().and_then([keys(&members), keys(&owners), keys(&records)]));
    let response = tokio::time::timeout(timeout, read)
        .await
        .map_err(|_| "etcd did not answer in time".to_owned())?
        .map_err(|e| e.to_string())?;
    let mut lists = response.op_responses().into_iter().map(|op| match op {
        TxnOpResponse::Get(get) => get
            .kvs()
            .iter()
            .map(|kv| (kv.key().to_vec(), kv.mod_revision()))
            .collect(),
        _ => Vec::new(),
    });
    let mut list = || -> Vec<(Vec<u8>, i64)> { lists.next().unwrap_or_default() };
    let (live, owned, kept) = (list(), list(), list());
    let live: Vec<&[u8]> = live.iter().map(|(k, _)| &k[members.len()..]).collect();
    let owned: HashSet<&[u8]> = owned.iter().map(|(k, _)| &k[owners.len()..]).collect();
    // Owned: a stream of borrowed items cannot be sent to another thread
    // (rust-lang/rust#64552).
    let ownerless: Vec<(Vec<u8>, i64)> = kept
        .iter()
        .map(|(k, revision)| (k[records.len()..].to_vec(), *revision))
        .filter(|(client, _)| !owned.contains(client.as_slice()))
        .collect();
    let before = std::mem::take(seen);
    let node_id = cluster.node_id().as_bytes();
    let now = Instant::now();
    let room = AtomicUsize::new(if orphans.max_kept == 0 {
        usize::MAX
    } else {
        orphans
            .max_kept
            .saturating_sub(orphans.router.kept_sessions())
    });
    let at = At {
        orphans,
        cluster,
        before: &before,
        live: &live,
        room: &room,
        node_id,
        now,
    };
    // Several at once ([`ADOPTIONS_AT_ONCE`]): each takes about four etcd
    // round trips, and what is published for a session before its
    // adoption is lost for it.
    let looked: Vec<_> = futures_util::stream::iter(ownerless)
        .map(|(client_id, revision)| look_at(&at, client_id, revision))
        .buffer_unordered(ADOPTIONS_AT_ONCE)
        .collect()
        .await;
    let (mut adopted, mut failed) = (0, 0);
    let mut unread = None;
    for result in looked {
        let (client_id, orphan, looked) = match result {
            Ok(ok) => ok,
            Err(e) => {
                unread.get_or_insert(e);
                continue;
            }
        };
        match looked {
            Looked::Adopted => {
                adopted += 1;
                continue;
            }
            Looked::Failed => failed += 1,
            Looked::Left => {}
        }
        if orphan.due.is_none_or(|due| due > now) {
            seen.insert(client_id, orphan);
        } else {
            reap(cluster, &client_id, orphan.revision).await;
        }
    }
    if adopted > 0 || failed > 0 {
        tracing::info!(
            adopted,
            failed,
            "clustering: sessions no node held adopted here (kept until their clients come back)"
        );
    }
    unread.map_or(Ok(()), Err)
}

/// What a look knows (see [`look_at`]).
struct At<'a> {
    orphans: &'a Orphans,
    cluster: &'a Cluster,
    /// What the last look found.
    before: &'a Seen,
    /// The live members.
    live: &'a [&'a [u8]],
    /// Room for adoptions under `[broker] max_kept_sessions`, taken before
    /// each (several run at once).
    room: &'a AtomicUsize,
    node_id: &'a [u8],
    now: Instant,
}

/// Adopts ownerless `client_id`'s session (its record put at `revision`)
/// if this node is to.
async fn look_at(
    at: &At<'_>,
    client_id: Vec<u8>,
    revision: i64,
) -> Result<(Vec<u8>, Orphan, Looked), String> {
    let At {
        orphans,
        cluster,
        now,
        ..
    } = *at;
    let orphan = match at.before.get(&client_id).filter(|o| o.revision == revision) {
        Some(orphan) => orphan.clone(),
        None => read_orphan(orphans, cluster, &client_id, revision, now).await?,
    };
    // The node that wrote the record if it is live (it lost its lease and
    // came back: it may keep the session still, with what etcd does not
    // have), else the first ranked; any once the chosen one had time to
    // (it may be gone too).
    let chosen = if at.live.contains(&orphan.writer.as_slice()) {
        orphan.writer == at.node_id
    } else {
        first_ranked(&client_id, at.live) == Some(at.node_id)
    } || now - orphan.since >= cluster.settings.request_timeout * 2;
    let leaving = orphans.membership.upgrade().is_none_or(|m| m.left());
    let took_room = || {
        at.room
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| r.checked_sub(1))
            .is_ok()
    };
    if !chosen || !orphans.standing.serving() || leaving || !took_room() {
        return Ok((client_id, orphan, Looked::Left));
    }
    let looked = match adopt(orphans, cluster, &client_id, None).await {
        Ok(true) => Looked::Adopted,
        Ok(false) => Looked::Left,
        Err(e) => {
            tracing::debug!(
                client_id = %String::from_utf8_lossy(&client_id),
                error = e,
                "clustering: cannot adopt a session no node holds now"
            );
            Looked::Failed
        }
    };
    if looked != Looked::Adopted {
        at.room.fetch_add(1, Ordering::Relaxed);
    }
    Ok((client_id, orphan, looked))
}

/// What a look did with one ownerless session.
#[derive(PartialEq, Eq)]
enum Looked {
    Adopted,
    /// Not adopted here (another node's to, no room, or it found an
    /// owner): left for the next look, or removed if it expired.
    Left,
    Failed,
}

/// Ownerless sessions a look adopts at once, at most.
const ADOPTIONS_AT_ONCE: usize = 16;

/// The member of `live` that ranks first for `client_id` (rendezvous
/// hashing: every node ranks them alike, and a member's departure moves
/// only the sessions it ranked first for).
fn first_ranked<'a>(client_id: &[u8], live: &[&'a [u8]]) -> Option<&'a [u8]> {
    live.iter().copied().max_by_key(|node| {
        // Fixed keys: the same in every process of one build (nodes of
        // different builds may both adopt: one claim wins, see `adopt`).
        let mut hasher = std::hash::DefaultHasher::new();
        (client_id, *node).hash(&mut hasher);
        hasher.finish()
    })
}

/// `client_id`'s ownerless record, found at `revision` (`now`): who
/// wrote it, and when its session expires, as it says (a record that
/// cannot be read, or is gone: now).
async fn read_orphan(
    orphans: &Orphans,
    cluster: &Cluster,
    client_id: &[u8],
    revision: i64,
    now: Instant,
) -> Result<Orphan, String> {
    let prefix = &cluster.settings.etcd_prefix;
    let key = [format!("{prefix}S/").as_bytes(), client_id].concat();
    let mut client = cluster.client.clone();
    let response = tokio::time::timeout(cluster.settings.request_timeout, client.get(key, None))
        .await
        .map_err(|_| "etcd did not answer in time".to_owned())?
        .map_err(|e| e.to_string())?;
    let mut orphan = Orphan {
        revision,
        due: Some(now),
        since: now,
        writer: Vec::new(),
    };
    let Some(kv) = response.kvs().first() else {
        return Ok(orphan);
    };
    if let Ok(SessionValue {
        node, mut session, ..
    }) = SessionValue::read(kv.value())
    {
        // Connected when its node went: from now.
        let at = session.disconnected_at_ms.unwrap_or_else(now_ms);
        session.disconnected_at_ms = Some(at);
        orphan.due = crate::durable::remaining(&session, now_ms(), orphans.max_expiry)
            .map(|left| left.map(|left| now + left))
            .unwrap_or(Some(now));
        orphan.writer = node.as_bytes().to_vec();
    }
    Ok(orphan)
}

/// Removes `client_id`'s session record, and its messages queued in etcd,
/// if it is still the one put at `revision` and no node owns the client.
async fn reap(cluster: &Cluster, client_id: &[u8], revision: i64) {
    let prefix = &cluster.settings.etcd_prefix;
    let key = [format!("{prefix}S/").as_bytes(), client_id].concat();
    let owner = [format!("{prefix}C/").as_bytes(), client_id].concat();
    let txn = Txn::new()
        .when([
            Compare::mod_revision(key.clone(), CompareOp::Equal, revision),
            Compare::create_revision(owner, CompareOp::Equal, 0),
        ])
        .and_then([
            TxnOp::delete(key, None),
            // Its messages queued in etcd go with it.
            Queue::delete_session(prefix, &String::from_utf8_lossy(client_id)),
        ]);
    let mut client = cluster.client.clone();
    let done = tokio::time::timeout(cluster.settings.request_timeout, client.txn(txn)).await;
    if let Ok(Ok(response)) = done
        && response.succeeded()
    {
        tracing::info!(
            client_id = %String::from_utf8_lossy(client_id),
            "clustering: removed the session record nobody owns: its session expired"
        );
    }
}

#[cfg(test)]
mod tests;
