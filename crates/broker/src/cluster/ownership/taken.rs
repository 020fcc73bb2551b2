//! Another node took a client id: the owners' watch sees its record,
//! and this node's connection of the client ends (0x8E), its session
//! handed over or discarded (see the module's documentation in `super`).

use std::sync::{Arc, Weak};

use etcd_client::EventType;

use super::Ownership;
use super::claims::Claim;
use super::owner_record::{offered, owner_of, started_clean, wants_handover};
use crate::cluster::watch::{Ended, follow_prefix};

impl Ownership {
    /// Another node (`to`, if known) took `client_id` from `claim` with a
    /// CONNECT that started `clean` or not: its connection ends (0x8E),
    /// its will is judged as a takeover's (see
    /// [`WillRegistry::taken_elsewhere`]), and the session kept here goes,
    /// its queued messages handed to `to` (see [`super::handover`]).
    pub(super) fn lost(&self, client_id: &str, claim: Claim, to: Option<&str>, clean: bool) {
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
                let node = crate::cluster::handover::From {
                    router: &router,
                    sessions: &sessions,
                    peers: &peers,
                    queue: queue.as_deref(),
                };
                crate::cluster::handover::hand_over(node, &client_id, &to, claim.ids).await;
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

/// Watches the owners' records from revision `from`, resumed after the
/// last event when the stream breaks; ends with the ownership or the
/// cluster.
pub(super) async fn watch(
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
