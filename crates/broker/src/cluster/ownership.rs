//! Which node a client id is connected to: one node at a time.
//!
//! A cluster node that accepts a CONNECT records itself as the owner of
//! the client id in etcd, `<etcd_prefix>C/<client id>` = `<node id>\n<its
//! connection number>`, under its membership lease (so the record goes
//! with the node: killed, cut off or paused past its lease). Every node
//! watches these records; a node whose client connected later to another
//! node (a record with a greater revision than its own claim) ends that
//! connection with DISCONNECT 0x8E "session taken over", as MQTT asks of
//! a single server (3.1.4-3). When the connection ends, the node deletes
//! its record if it is still its own.
//!
//! Only the connection moves: the session (subscriptions, queued
//! messages) stays on the node that had it; see docs/cluster.md.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions,
};
use parking_lot::Mutex;

use super::{Cluster, Membership};
use crate::sessions::Sessions;

/// This node's claim on a client id.
#[derive(Debug, Clone, Copy)]
struct Claim {
    connection: u64,
    /// The revision of the claim's record (0: the put is on its way).
    revision: i64,
    /// The greatest revision of another node's claim seen meanwhile.
    superseded: i64,
}

/// The client ids this node owns, and the watch that ends them when
/// another node takes one over.
pub struct Ownership {
    cluster: Arc<Cluster>,
    membership: Arc<Membership>,
    sessions: Arc<Sessions>,
    /// `<etcd_prefix>C/`.
    prefix: Vec<u8>,
    /// One per connection of this node's (not links): bounded by them.
    claims: Mutex<HashMap<String, Claim>>,
}

impl Ownership {
    /// Starts watching the owners' records; the watch ends when the
    /// returned value is dropped.
    pub async fn start(
        cluster: Arc<Cluster>,
        membership: Arc<Membership>,
        sessions: Arc<Sessions>,
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
        let ownership = Arc::new(Ownership {
            cluster,
            membership,
            sessions,
            prefix,
            claims: Mutex::new(HashMap::new()),
        });
        tokio::spawn(watch(
            Arc::downgrade(&ownership),
            from,
            ownership.cluster.stop.subscribe(),
        ));
        Ok(ownership)
    }

    fn key(&self, client_id: &str) -> Vec<u8> {
        [self.prefix.as_slice(), client_id.as_bytes()].concat()
    }

    /// Records this node as `client_id`'s owner for `connection`, in the
    /// background (the connection does not wait for etcd: one that cannot
    /// answer is tried again while the connection lasts and the node
    /// serves). A CONNECT another node recorded after it ends
    /// `connection` (0x8E), whichever record etcd took first.
    pub fn claim(self: &Arc<Self>, client_id: &str, connection: u64) {
        self.claims.lock().insert(
            client_id.to_owned(),
            Claim {
                connection,
                revision: 0,
                superseded: 0,
            },
        );
        let ownership = Arc::clone(self);
        let client_id = client_id.to_owned();
        tokio::spawn(async move {
            let mut said = false;
            loop {
                match ownership.record(&client_id, connection).await {
                    Ok(()) => return,
                    Err(None) => return,
                    Err(Some(e)) => {
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

    /// Puts the record of `connection`'s claim. `Err(Some(why))`: etcd did
    /// not take it, try again; `Err(None)`: no more to do (the claim is
    /// gone, or lost to another node's).
    async fn record(&self, client_id: &str, connection: u64) -> Result<(), Option<String>> {
        if claim_of(&mut self.claims.lock(), client_id, connection).is_none()
            || !self.membership.standing().serving()
        {
            return Err(None);
        }
        let value = format!("{}\n{connection}", self.cluster.node_id());
        let options = PutOptions::new()
            .with_lease(self.membership.lease())
            .with_prev_key();
        let mut client = self.cluster.client.clone();
        let put = client.put(self.key(client_id), value, Some(options));
        let response = tokio::time::timeout(self.cluster.settings.request_timeout, put)
            .await
            .map_err(|_| Some("etcd did not answer in time".to_owned()))?
            .map_err(|e| Some(e.to_string()))?;
        let revision = response.header().map_or(0, |h| h.revision());
        let mut claims = self.claims.lock();
        let Some(claim) = claim_of(&mut claims, client_id, connection) else {
            // The connection ended meanwhile: its record goes too.
            drop(claims);
            self.delete(client_id, revision);
            return Err(None);
        };
        claim.revision = revision;
        if claim.superseded > revision {
            // Another node's CONNECT came after this one's.
            claims.remove(client_id);
            drop(claims);
            self.sessions.take_over(client_id, connection);
            return Err(None);
        }
        drop(claims);
        if let Some(node) = response
            .prev_key()
            .and_then(|kv| owner(kv.value()))
            .filter(|node| *node != self.cluster.node_id())
        {
            tracing::info!(
                client_id,
                previous_node = node,
                "clustering: the client was connected to another node: that connection ends (0x8E)"
            );
        }
        Ok(())
    }

    /// Deletes `client_id`'s record if it is still the one put at
    /// `revision`.
    fn delete(&self, client_id: &str, revision: i64) {
        let key = self.key(client_id);
        let mut client = self.cluster.client.clone();
        let timeout = self.cluster.settings.request_timeout;
        tokio::spawn(async move {
            let txn = Txn::new()
                .when([Compare::mod_revision(
                    key.clone(),
                    CompareOp::Equal,
                    revision,
                )])
                .and_then([TxnOp::delete(key, None)]);
            let _ = tokio::time::timeout(timeout, client.txn(txn)).await;
        });
    }

    /// `connection` of `client_id` ended: its record goes, if it is still
    /// this connection's.
    pub fn release(&self, client_id: &str, connection: u64) {
        let mut claims = self.claims.lock();
        let Some(claim) = claim_of(&mut claims, client_id, connection).copied() else {
            return;
        };
        claims.remove(client_id);
        drop(claims);
        if claim.revision > 0 {
            self.delete(client_id, claim.revision);
        }
    }

    /// Another node recorded itself as `client_id`'s owner at `revision`:
    /// this node's connection of it ends, if it claimed before.
    fn taken(&self, client_id: &str, revision: i64) {
        let mut claims = self.claims.lock();
        let Some(claim) = claims.get_mut(client_id) else {
            return;
        };
        if claim.revision == 0 {
            claim.superseded = claim.superseded.max(revision);
            return;
        }
        if claim.revision < revision {
            let connection = claim.connection;
            claims.remove(client_id);
            drop(claims);
            if self.sessions.take_over(client_id, connection) {
                tracing::info!(
                    client_id,
                    "clustering: the client connected to another node: connection ended (0x8E session taken over)"
                );
            }
        }
    }
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

/// The node an owner's record (`<node id>\n<connection>`) names.
fn owner(value: &[u8]) -> Option<&str> {
    let (node, connection) = std::str::from_utf8(value).ok()?.split_once('\n')?;
    connection.parse::<u64>().ok().map(|_| node)
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
        let options = WatchOptions::new().with_prefix().with_start_revision(from);
        let Some(mut stream) = super::watch::open(&mut client, &prefix, options, &mut stop).await
        else {
            return;
        };
        loop {
            let message = tokio::select! {
                m = stream.message() => m,
                _ = stop.changed() => return,
            };
            let Ok(Some(response)) = message else { break };
            if response.canceled() {
                if response.compact_revision() > 0 {
                    // Takeovers in between are not seen here; the other
                    // node owns those clients all the same.
                    tracing::warn!(
                        from,
                        "clustering: the owners' watch fell behind etcd's compaction"
                    );
                    from = response.compact_revision();
                }
                break;
            }
            let Some(o) = ownership.upgrade() else { return };
            for event in response.events() {
                let Some(kv) = event.kv() else { continue };
                from = from.max(kv.mod_revision() + 1);
                if event.event_type() != EventType::Put {
                    continue;
                }
                let Some(owner_node) = owner(kv.value()) else {
                    continue;
                };
                if owner_node == node {
                    continue;
                }
                let Ok(client_id) = std::str::from_utf8(&kv.key()[prefix.len()..]) else {
                    continue;
                };
                o.taken(client_id, kv.mod_revision());
            }
        }
    }
}
