//! Adopting an ownerless session: claiming its client id in etcd and
//! restoring the session into this node's router (see `super`'s
//! documentation for when a node adopts).

use router::RestoredSession;

use super::Orphans;
use crate::clock::now_ms;
use crate::cluster::Cluster;
use crate::cluster::ownership::{SessionValue, offered, owner_ids, owner_of};
use crate::cluster::recent;
use crate::cluster::sessions::{
    Records, read_records, record_block, replace_session, resend_in_flight, waiting_in_etcd,
};
use crate::sessions::Resumed;

/// Adopts `client_id`'s session (see the module's documentation) if no
/// node owns it still: `Ok(false)` when there is nothing to adopt (an
/// owner came, the record went, cannot be read or has expired, changed
/// meanwhile, or the router has no room).
pub(super) async fn adopt(
    orphans: &Orphans,
    cluster: &Cluster,
    client_id: &[u8],
    from: Option<&str>,
) -> Result<bool, String> {
    let Ok(client_id) = std::str::from_utf8(client_id) else {
        return Ok(false);
    };
    let (Some(ownership), Some(queue)) = (orphans.ownership.upgrade(), orphans.queue.upgrade())
    else {
        return Ok(false);
    };
    let epoch = orphans.standing.epoch();
    let timeout = cluster.settings.request_timeout;
    let mut client = cluster.client.clone();
    let Records {
        read,
        owner,
        record,
    } = read_records(&mut client, &ownership, client_id, timeout).await?;
    let Some((revision, value)) = record else {
        return Ok(false);
    };
    // Still ownerless, or still offered by the stopping node `from`.
    let offered_by = |value: &[u8]| from.is_some() && owner_of(value) == from && offered(value);
    let owner = match &owner {
        None if from.is_none() => None,
        Some((_, value)) if offered_by(value) => Some(value.as_slice()),
        _ => return Ok(false),
    };
    let Ok(record) = SessionValue::read(&value) else {
        return Ok(false);
    };
    // After the stopping node's block, or the record's if later (see
    // `super::sessions::resume`).
    let ids = owner
        .and_then(owner_ids)
        .map_or(record.ids, |ids| ids.later(record.ids))
        .next();
    let key = ownership.session_key(client_id);
    let resumed = Resumed {
        ids,
        read,
        was_here: false,
        awaits_handover: false,
    };
    // This node's own copy (its lease ended and came back, or its data
    // directory kept it): claimed as it is.
    if from.is_none()
        && record.node == ownership.node_id()
        && orphans.router.subscriptions().has_kept_session(client_id)
    {
        // The ids its router deliveries take already, if it kept a claim.
        let ids = ownership.ids_of(client_id).unwrap_or(ids);
        let resumed = Resumed { ids, ..resumed };
        if !record_block(&mut client, key, revision, &value, ids, timeout).await? {
            return Ok(false);
        }
        return Ok(ownership.adopt(client_id, resumed, epoch));
    }
    let Some(expires_in) = crate::durable::remaining(&record.session, now_ms(), orphans.max_expiry)
    else {
        return Ok(false);
    };
    // From etcd, unless the stopping node hands them over (its link here
    // is up).
    let from_queue =
        from.is_none_or(|node| !orphans.peers.upgrade().is_some_and(|p| p.linked_from(node)));
    let mut keys = Vec::new();
    let mut in_flight = Vec::new();
    let waiting = if from_queue {
        waiting_in_etcd(
            &queue,
            client_id,
            &record.session,
            &mut keys,
            &mut in_flight,
        )
        .await?
    } else {
        Vec::new()
    };
    if !record_block(&mut client, key, revision, &value, ids, timeout).await? {
        return Ok(false);
    }
    let queued = keys.len();
    let mut restored = RestoredSession {
        client_id: client_id.to_owned(),
        filters: record.session.filters,
        expires_in,
        queue_full: record.session.queue_full,
        waiting,
    };
    // What the dead node did not have goes after what etcd kept (see
    // `super::recent`).
    let dead = from.unwrap_or(record.node);
    let parts = (
        orphans.recent.upgrade(),
        orphans.peers.upgrade(),
        orphans.stamps.upgrade(),
    );
    let live = |node: &str| parts.1.as_ref().is_some_and(|peers| peers.is_member(node));
    let taking = match &parts {
        (Some(recent), Some(_), Some(stamps)) if from_queue && dead != ownership.node_id() => {
            Some(recent::Taking {
                recent,
                live: &live,
                stamps,
                queue: &queue,
                dead,
                client_id,
            })
        }
        _ => None,
    };
    let mut given = None;
    if let Some(taking) = &taking {
        given = Some(recent::before_take(taking, &mut restored).await);
    }
    // The stopping node hands the messages over once it sees the claim
    // (or, if it dies first, the messages it wrote to etcd; see
    // `super::awaited`), without what this node's router gave the session
    // after taking it (see `super::stamps`).
    let stamps = orphans
        .stamps
        .upgrade()
        .filter(|_| !from_queue || given.is_some());
    // Not while its client is connected here (its CONNECT came meanwhile),
    // nor past `max_kept_sessions`.
    let replaced = replace_session(
        &orphans.router,
        client_id,
        Some(restored),
        stamps.as_deref(),
    )
    .await?;
    if !replaced {
        return Ok(false);
    }
    if from_queue {
        queue.restored(client_id, keys);
        ownership.took_queue(client_id, true);
    } else if let (Some(node), Some(awaited)) = (from, orphans.awaited.upgrade()) {
        awaited.wait(client_id, node);
    }
    if !ownership.adopt(client_id, resumed, epoch) {
        return Ok(false);
    }
    if let Some(sessions) = orphans.sessions.upgrade() {
        resend_in_flight(&queue, &sessions, client_id, in_flight, timeout).await;
    }
    if let (Some(taking), Some(given)) = (&taking, given) {
        recent::after_take(taking, given);
    }
    crate::metrics::session_adopted();
    tracing::info!(
        client_id,
        node_was = record.node,
        offered_by = from,
        queued,
        ids = ids.number(),
        "clustering: adopted the session of a client whose node is gone: messages for it are kept here until it comes back"
    );
    Ok(true)
}
