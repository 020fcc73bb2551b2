//! This node's claims on client ids: each CONNECT's owner record, put
//! in etcd in the background, tried again while it may still be put, and
//! what a claim finds when another node's record came first (see the
//! module's documentation in `super`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};

use super::owner_record::{owner_of, owner_read, owner_record, started_clean};
use super::{Ownership, TOOK_QUEUE_MAX};
use crate::sessions::{PacketIdBlock, Resumed};

/// This node's claim on a client id.
#[derive(Debug, Clone, Copy)]
pub(super) struct Claim {
    pub(super) connection: u64,
    /// The revision of the claim's record (0: the put is on its way).
    pub(super) revision: i64,
    /// The greatest revision of another node's claim seen meanwhile,
    /// and whether that claim's CONNECT started clean.
    pub(super) superseded: (i64, bool),
    /// The connection started clean: the claim removes the session record
    /// another node left.
    pub(super) clean_start: bool,
    /// The connection ended.
    pub(super) ended: bool,
    /// The session outlives the connection (kept by the router).
    pub(super) kept: bool,
    /// The packet ids its router deliveries take.
    pub(super) ids: PacketIdBlock,
    /// The session's queued messages came from etcd (see
    /// [`Ownership::took_queue`]).
    pub(super) took_queue: bool,
    /// The node's lease losses when the connection was accepted (see
    /// [`crate::standing`]): a claim made before a loss is not recorded
    /// after it.
    pub(super) epoch: u64,
    /// The etcd revision its CONNECT read the session at (Clean Start 0;
    /// 0: not read) and the wall clock's ms then: where the CONNECT comes,
    /// kept in the record (see the module's documentation).
    pub(super) read: (i64, u64),
    /// The record is put only if the owner record's revision is at most
    /// this one (`read`, or the revision of a record found put over it
    /// that this claim comes after).
    pub(super) put_over: i64,
    /// A session no node held, adopted without a connection (see
    /// [`Ownership::adopt`]): its record comes before any CONNECT's, and
    /// leaves the will record alone.
    pub(super) adopted: bool,
}

impl Claim {
    /// `connection`'s claim, not recorded yet, on a session `resumed` as
    /// its CONNECT read it (see [`Ownership::claim`]).
    pub(super) fn new(connection: u64, resumed: &Resumed, took_queue: bool, epoch: u64) -> Claim {
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

impl Ownership {
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
    pub(super) fn keep_recording(
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
                    crate::cluster::wills::with_lease(lease, will),
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
}

/// Why [`Ownership::record`] did not put a claim's record.
pub(super) enum NotRecorded {
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

/// `client_id`'s claim, if it is `connection`'s (a newer connection of
/// this node's replaces it).
pub(super) fn claim_of<'a>(
    claims: &'a mut HashMap<String, Claim>,
    client_id: &str,
    connection: u64,
) -> Option<&'a mut Claim> {
    claims
        .get_mut(client_id)
        .filter(|c| c.connection == connection)
}
