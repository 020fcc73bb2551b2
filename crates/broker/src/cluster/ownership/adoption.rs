//! Claims without a connection: sessions this node adopts (see
//! `crate::cluster::orphans`), and the offers of the sessions a stopping
//! node keeps, for the others to adopt.

use std::collections::HashSet;
use std::sync::Arc;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use parking_lot::Mutex;
use tokio::sync::Notify;

use super::{Claim, Ownership, claim_of, owner_record};
use crate::sessions::Resumed;

/// The numbers of adopted sessions' claims (see [`Ownership::adopt`]):
/// apart from connections' (counted from 0).
const ADOPTED: u64 = 1 << 63;

/// Sessions other nodes offer as they stop, in the order their records
/// came: (client id, node).
#[derive(Default)]
pub struct Offers {
    list: Mutex<std::collections::VecDeque<(String, String)>>,
    /// Offers are waiting.
    pub wake: Notify,
}

/// Offers waiting, at most (past it the oldest go: those sessions are
/// adopted once their node has left, see `crate::cluster::orphans`).
const OFFERS_MAX: usize = 100_000;

impl Offers {
    pub(super) fn push(&self, client_id: &str, node: &str) {
        let mut list = self.list.lock();
        if list.len() >= OFFERS_MAX {
            list.pop_front();
        }
        list.push_back((client_id.to_owned(), node.to_owned()));
        drop(list);
        self.wake.notify_one();
    }

    /// The offers waiting, oldest first; none are kept.
    pub fn take(&self) -> Vec<(String, String)> {
        self.list.lock().drain(..).collect()
    }
}

impl Ownership {
    /// The sessions other nodes offer as they stop.
    pub fn offers(&self) -> &Arc<Offers> {
        &self.offers
    }

    /// The node stops, its clients gone (those that came back elsewhere
    /// took their sessions): offers the sessions it still keeps to the
    /// other nodes, while its links to them are up. Each claim's record
    /// is put again (compared with its revision) marked `\nleaving`, and
    /// before every CONNECT (`at 0 0`); a live node adopts the session
    /// (see `crate::cluster::orphans`), and this node hands its queued messages
    /// over as to a client's new node. Before, the sessions were adopted
    /// only once the node had left: what was published between its links'
    /// end and the adoption was lost for them. Returns the client ids
    /// offered.
    pub async fn offer_kept(&self) -> HashSet<String> {
        let epoch = self.membership.standing().epoch();
        let kept: Vec<(String, Claim)> = {
            let state = self.state.lock();
            state
                .claims
                .iter()
                .filter(|(_, c)| c.ended && c.kept && c.revision > 0 && c.epoch == epoch)
                .map(|(client, c)| (client.clone(), *c))
                .collect()
        };
        let lease = self.membership.lease();
        let timeout = self.cluster.settings.request_timeout;
        let offers = kept.into_iter().map(|(client_id, claim)| {
            let mut client = self.cluster.client.clone();
            let key = self.key(&client_id);
            let value = owner_record(
                self.cluster.node_id(),
                claim.connection,
                claim.ids,
                Some((0, 0)),
                "\nleaving",
            );
            async move {
                let txn = Txn::new()
                    .when([Compare::mod_revision(
                        key.clone(),
                        CompareOp::Equal,
                        claim.revision,
                    )])
                    .and_then([TxnOp::put(
                        key,
                        value,
                        Some(PutOptions::new().with_lease(lease)),
                    )]);
                match tokio::time::timeout(timeout, client.txn(txn)).await {
                    Ok(Ok(response)) if response.succeeded() => {
                        let revision = response.header().map_or(0, |h| h.revision());
                        Some((client_id, claim.connection, revision))
                    }
                    _ => None,
                }
            }
        });
        let put = futures_util::future::join_all(offers).await;
        let mut state = self.state.lock();
        let mut offered = HashSet::new();
        for (client_id, connection, revision) in put.into_iter().flatten() {
            if let Some(claim) = claim_of(&mut state.claims, &client_id, connection) {
                claim.revision = claim.revision.max(revision);
                offered.insert(client_id);
            }
        }
        offered
    }

    /// Records this node as the owner of `client_id`'s session, which no
    /// node held (its node is gone) and which this node's router has now
    /// (see `crate::cluster::orphans`), with no connection: its claim is kept as a
    /// session's after its connection ended, in the background. Its
    /// record says it comes before every CONNECT (`at 0 0`): a client
    /// that connects to another node meanwhile takes the session there,
    /// as if from a node it had left, and this node hands over what it
    /// queued. It is put only if the owner record did not change since
    /// `resumed.read` (the session's read; the client may have connected
    /// since), and leaves the will record alone (the dead node's will is
    /// still to come, see `crate::cluster::wills`). `false`: this node has a claim
    /// on the client already (its CONNECT came meanwhile), other than one
    /// kept for a session from before a lease loss (never recorded since:
    /// the adoption replaces it).
    pub fn adopt(self: &Arc<Self>, client_id: &str, resumed: Resumed, epoch: u64) -> bool {
        let mut state = self.state.lock();
        if state
            .claims
            .get(client_id)
            .is_some_and(|c| !(c.ended && c.kept && c.epoch != epoch))
        {
            return false;
        }
        let took_queue = state.took_queue.remove(client_id);
        let connection = ADOPTED
            | self
                .adoptions
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        state.claims.insert(
            client_id.to_owned(),
            Claim {
                ended: true,
                kept: true,
                read: (0, 0),
                adopted: true,
                ..Claim::new(connection, &resumed, took_queue, epoch)
            },
        );
        drop(state);
        self.keep_recording(client_id, connection, None, None);
        true
    }
}
