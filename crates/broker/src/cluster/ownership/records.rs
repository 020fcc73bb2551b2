//! The records the owner of a client keeps in etcd besides the owner
//! record: its persistent session (see [`crate::cluster::sessions`]) and
//! its connection's will (see [`crate::cluster::wills`]), written only
//! while this node's claim is the owner record.

use std::sync::{Arc, Weak};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};

use crate::cluster::Queue;
use tokio::sync::Notify;

use super::{Claim, Ownership, Pending, delete_at, owner_of, started_clean, wants_handover};
use crate::durable::format::decode_session;
use crate::sessions::PacketIdBlock;

/// A session record's value: `[0][packet id block][node id length][node
/// id][the session as the data directory keeps it (see `durable`)]`, the
/// node being the one that wrote it. A record of an earlier version has
/// no block: it starts with the node id's length (never 0), and is read
/// as block 0.
pub fn session_value(node_id: &str, ids: PacketIdBlock, session: &[u8]) -> Vec<u8> {
    // Node ids are checked at start: short, no `/` or `:`.
    let id = &node_id.as_bytes()[..node_id.len().min(255)];
    let mut value = Vec::with_capacity(3 + id.len() + session.len());
    value.extend_from_slice(&[0, ids.number(), id.len() as u8]);
    value.extend_from_slice(id);
    value.extend_from_slice(session);
    value
}

/// The session record `value` with its packet id block set to `ids`
/// (written by the node it names, with the session it holds); `None` if
/// the block is `ids` already (or the value is not a record).
pub fn with_block(value: &[u8], ids: PacketIdBlock) -> Option<Vec<u8>> {
    match value {
        [0, block, _, ..] if *block == ids.number() => None,
        [0, _, rest @ ..] => Some([&[0, ids.number()], rest].concat()),
        // The format without a block (block 0).
        [len, ..] if *len > 0 && ids.number() != 0 => Some([&[0, ids.number()], value].concat()),
        _ => None,
    }
}

/// A session record read back (written by [`session_value`]).
pub struct SessionValue<'a> {
    /// The node that wrote it.
    pub node: &'a str,
    /// The packet ids the session's router deliveries took there.
    pub ids: PacketIdBlock,
    pub session: router::SessionRecord,
}

impl SessionValue<'_> {
    pub fn read(value: &[u8]) -> Result<SessionValue<'_>, String> {
        let (ids, rest) = match value {
            [0, ids, rest @ ..] => (PacketIdBlock::new(*ids), rest),
            [0] => return Err("session record without its node id".into()),
            rest => (PacketIdBlock::default(), rest),
        };
        let (&len, rest) = rest.split_first().ok_or("empty session record")?;
        let len = usize::from(len);
        if rest.len() < len {
            return Err("session record shorter than its node id".into());
        }
        let node = std::str::from_utf8(&rest[..len]).map_err(|_| "node id not UTF-8")?;
        Ok(SessionValue {
            node,
            ids,
            session: decode_session(&rest[len..])?,
        })
    }
}

impl Ownership {
    /// `client_id`'s will record.
    pub(super) fn will_key(&self, client_id: &str) -> Vec<u8> {
        [self.wills_prefix.as_slice(), client_id.as_bytes()].concat()
    }

    /// Removes `client_id`'s will record if it is the one the claim put at
    /// `revision`: the connection ended, this node's will module has the
    /// will. Not while the node does not serve (lost its lease): another
    /// node publishes the will from the record then.
    pub(super) fn forget_will(self: &Arc<Self>, client_id: &str, revision: i64) {
        if !self.membership.standing().serving() {
            return;
        }
        let ownership = Arc::clone(self);
        let client_id = client_id.to_owned();
        tokio::spawn(async move {
            if ownership.delete_will(&client_id, revision).await {
                let mut state = ownership.state.lock();
                if state.wills.get(&client_id) == Some(&revision) {
                    state.wills.remove(&client_id);
                }
            }
        });
    }

    /// Deletes `client_id`'s will record if the claim at `revision` put
    /// it; `false`: etcd did not answer.
    pub(super) async fn delete_will(&self, client_id: &str, revision: i64) -> bool {
        let txn = delete_at(self.will_key(client_id), revision);
        let mut client = self.cluster.client.clone();
        let timeout = self.cluster.settings.request_timeout;
        matches!(
            tokio::time::timeout(timeout, client.txn(txn)).await,
            Ok(Ok(_))
        )
    }

    /// The node stops normally (its clients were told): removes the will
    /// records it put, so that no other node publishes them (a single
    /// node publishes no will when it stops either). Waits at most etcd's
    /// request timeout.
    pub async fn forget_wills(&self) {
        let wills: Vec<(String, i64)> = self.state.lock().wills.drain().collect();
        let deletes = wills
            .iter()
            .map(|(client, revision)| self.delete_will(client, *revision));
        let timeout = self.cluster.settings.request_timeout;
        let _ = tokio::time::timeout(timeout, futures_util::future::join_all(deletes)).await;
        if !wills.is_empty() {
            tracing::info!(
                wills = wills.len(),
                "clustering: stopping: this node's clients' wills removed from etcd"
            );
        }
    }

    /// Removes every message queued in etcd for `client_id`'s session
    /// (see [`crate::cluster::queue`]).
    pub(super) fn delete_queue(&self, client_id: &str) -> TxnOp {
        Queue::delete_session(&self.cluster.settings.etcd_prefix, client_id)
    }

    /// `client_id`'s session record.
    pub fn session_key(&self, client_id: &str) -> Vec<u8> {
        [self.sessions_prefix.as_slice(), client_id.as_bytes()].concat()
    }

    /// Whether a session record of `client_id`'s is still to be written.
    pub fn writing(&self, client_id: &str) -> bool {
        self.state.lock().records.contains_key(client_id)
    }

    /// The router journaled `client_id`'s persistent session: the session
    /// as the data directory keeps it (see `durable`), or `None` when it
    /// ended. Its record (see [`session_value`]) is written while this
    /// node owns the client.
    pub fn session_changed(&self, client_id: &str, value: Option<Vec<u8>>) {
        let mut state = self.state.lock();
        if value.is_none() && !state.claims.contains_key(client_id) {
            // Not this node's to end (another node took the client).
            state.records.remove(client_id);
            return;
        }
        state.numbers += 1;
        let number = state.numbers;
        state
            .records
            .insert(client_id.to_owned(), Pending { number, value });
        drop(state);
        self.wake.notify_one();
    }

    /// Writes the waiting session records (see [`write_records`]); `false`
    /// where etcd did not answer (try again).
    pub(super) async fn write_waiting(&self) -> bool {
        let waiting: Vec<(String, u64, Option<Vec<u8>>, Claim)> = {
            let state = self.state.lock();
            state
                .records
                .iter()
                .filter_map(|(client, pending)| {
                    let claim = state.claims.get(client).filter(|c| c.revision > 0)?;
                    Some((
                        client.clone(),
                        pending.number,
                        pending.value.clone(),
                        *claim,
                    ))
                })
                .collect()
        };
        let mut answered = true;
        for (client_id, number, value, claim) in waiting {
            // The session ended, or the connection did and nothing is kept:
            // the client is no longer this node's.
            let done = claim.ended && (value.is_none() || !claim.kept);
            let owner = self.key(&client_id);
            let key = self.session_key(&client_id);
            let limit = self.cluster.settings.max_request_bytes / 2;
            let mut ops = Vec::with_capacity(2);
            let value = value.map(|v| session_value(self.cluster.node_id(), claim.ids, &v));
            match value {
                Some(value) if value.len() + key.len() > limit => {
                    tracing::warn!(
                        client_id,
                        bytes = value.len(),
                        limit,
                        "clustering: a session record over half of etcd's request limit is not kept in etcd: the session stays on this node"
                    );
                }
                Some(value) => ops.push(TxnOp::put(key, value, None)),
                // The messages queued for it in etcd go with it.
                None => ops.extend([TxnOp::delete(key, None), self.delete_queue(&client_id)]),
            }
            if done {
                ops.push(TxnOp::delete(owner.clone(), None));
            }
            let txn = Txn::new()
                .when([Compare::mod_revision(
                    owner.clone(),
                    CompareOp::Equal,
                    claim.revision,
                )])
                .and_then(ops)
                .or_else([TxnOp::get(owner, None)]);
            let mut client = self.cluster.client.clone();
            let timeout = self.cluster.settings.request_timeout;
            let (written, taken) = match tokio::time::timeout(timeout, client.txn(txn)).await {
                Ok(Ok(response)) => {
                    let holder = response.op_responses().into_iter().find_map(|op| match op {
                        TxnOpResponse::Get(get) => get.kvs().first().map(|kv| kv.value().to_vec()),
                        _ => None,
                    });
                    // Another node's claim: the node to hand over to (none
                    // after a clean start), and whether it started clean.
                    let taken = holder.as_deref().and_then(|value| {
                        let node = owner_of(value).filter(|n| *n != self.cluster.node_id())?;
                        Some((
                            wants_handover(value).then(|| node.to_owned()),
                            started_clean(value),
                        ))
                    });
                    (response.succeeded(), taken)
                }
                Ok(Err(e)) => {
                    tracing::debug!(client_id, error = %e, "clustering: session record not written yet");
                    answered = false;
                    continue;
                }
                Err(_) => {
                    answered = false;
                    continue;
                }
            };
            let mut state = self.state.lock();
            if state
                .records
                .get(&client_id)
                .is_some_and(|p| p.number == number)
            {
                state.records.remove(&client_id);
            }
            let Some(current) = state
                .claims
                .get(&client_id)
                .copied()
                .filter(|c| c.revision == claim.revision)
            else {
                continue;
            };
            if !written {
                // Another node owns the client now (its connection here
                // ends, its session goes), or none does (this node's lease
                // ended with its records).
                if let Some((to, clean)) = taken {
                    // `lost` removes the claim (with the handover counted).
                    drop(state);
                    self.lost(&client_id, current, to.as_deref(), clean);
                } else if !done && (current.kept || !current.ended) {
                    // No node owns the client, and the session is still
                    // here: kept (its client may come back: see
                    // `sessions::resume`), or its connection still open
                    // (sent away soon, its lease gone). So is the claim,
                    // so that another node's claim later ends the
                    // connection, or discards the session or takes its
                    // messages (`taken`). Without it, the copy stayed
                    // after its client had moved and collected the
                    // client's messages, into etcd's queue under this
                    // node, for the client's next node to give again.
                    // (Until 2026-11-30 only for a kept session: a write
                    // that found the owner record gone while the
                    // connection was open dropped the claim; 10,012
                    // messages came twice in one long fault round.)
                    tracing::debug!(
                        client_id,
                        "clustering: session record not written: no node owns the client (this node's lease ended with its records?); the claim stays with the session"
                    );
                } else {
                    self.remove_claim(&mut state, &client_id);
                }
            } else if current.ended
                && !state.records.contains_key(&client_id)
                && (done || !current.kept)
            {
                // Let go: the owner record went with the write, or goes now.
                self.remove_claim(&mut state, &client_id);
                drop(state);
                if !done {
                    self.delete(&client_id, current.revision);
                }
            }
        }
        answered
    }
}

/// Writes session records as they wait, while the ownership lasts; etcd
/// not answering is tried again every 250 ms.
pub(super) async fn write_records(
    ownership: Weak<Ownership>,
    wake: Arc<Notify>,
    mut stop: tokio::sync::watch::Receiver<()>,
) {
    loop {
        let notified = wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let Some(o) = ownership.upgrade() else { return };
        let answered = o.write_waiting().await;
        drop(o);
        if !answered {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(250)) => continue,
                _ = stop.changed() => return,
            }
        }
        tokio::select! {
            _ = notified => {}
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::durable::format::encode_session;
    use router::SessionRecord;

    fn session() -> SessionRecord {
        SessionRecord {
            expiry: 300,
            disconnected_at_ms: Some(1_000),
            filters: vec![("a/#".into(), router::SubOptions::default())],
            queue_full: None,
        }
    }

    #[test]
    fn a_session_record_names_its_node_and_block_and_garbage_is_refused() {
        let value = session_value("sb2", PacketIdBlock::new(7), &encode_session(&session()));
        let back = SessionValue::read(&value).unwrap();
        assert_eq!((back.node, back.ids), ("sb2", PacketIdBlock::new(7)));
        assert_eq!(back.session.expiry, 300);
        assert_eq!(back.session.disconnected_at_ms, Some(1_000));
        assert_eq!(back.session.filters.len(), 1);
        for bad in [
            &[][..],
            &[0],
            &[0, 1],
            &[9, b's'],
            &value[..value.len() - 1],
        ] {
            assert!(SessionValue::read(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_record_without_a_block_is_read_as_block_0() {
        let mut value = vec![3];
        value.extend_from_slice(b"sb1");
        value.extend_from_slice(&encode_session(&session()));
        let back = SessionValue::read(&value).unwrap();
        assert_eq!((back.node, back.ids), ("sb1", PacketIdBlock::default()));
        assert_eq!(back.session.filters.len(), 1);
    }

    /// A node that takes a session from a record writes its block into
    /// the record before the CONNACK: the same record (node, session),
    /// another block; nothing to write for the same block.
    #[test]
    fn a_records_block_is_set_without_changing_the_rest() {
        let value = session_value("sb2", PacketIdBlock::new(7), &encode_session(&session()));
        let moved = with_block(&value, PacketIdBlock::new(8)).unwrap();
        let back = SessionValue::read(&moved).unwrap();
        assert_eq!((back.node, back.ids), ("sb2", PacketIdBlock::new(8)));
        assert_eq!(moved[2..], value[2..]);
        assert_eq!(with_block(&value, PacketIdBlock::new(7)), None);
        let mut old = vec![3];
        old.extend_from_slice(b"sb1");
        old.extend_from_slice(&encode_session(&session()));
        let moved = with_block(&old, PacketIdBlock::new(1)).unwrap();
        let back = SessionValue::read(&moved).unwrap();
        assert_eq!((back.node, back.ids), ("sb1", PacketIdBlock::new(1)));
        assert_eq!(with_block(&old, PacketIdBlock::default()), None);
        assert_eq!(with_block(&[], PacketIdBlock::new(1)), None);
    }
}
