//! The fence a node's queue batches go behind.
//!
//! A batch of writes etcd did not answer in time may still commit later:
//! a request waiting at a paused member commits when the member wakes,
//! after the removals the node sent since, and leaves a copy of a message
//! the client has, which the next node would send again (a QoS 2 message
//! twice in a long fault round, 2026-11-30). So every batch compares
//! `<etcd_prefix>QF/<node id>` (put under the membership lease) with the
//! revision the node last put it at ([`Fence::commit`]); after a batch
//! fails the writer lowers the fence ([`Fence::lower`]) and the next
//! batch puts it again first, so the late batch can no longer commit. (A
//! late batch that commits before that leaves copies the failed batch's
//! removals delete: its puts count as written, see `super::pending`.) The
//! fence goes with the lease: a node that lost it writes nothing more
//! under the old one.
//!
//! Another node that takes a session from this one while its lease lives
//! (its link is down: killed moments ago, or cut off) reads the session's
//! copies from etcd; a batch of this node's in doubt could commit after
//! that read, and leave a copy the next reader sends again. So that node
//! takes the fence down first ([`fence_off`]): the late batch fails, and
//! this node puts the fence up again for its next one.

use etcd_client::{Client, Compare, CompareOp, Error, PutOptions, Txn, TxnOp};
use parking_lot::Mutex;

use crate::cluster::Cluster;

/// See the module's documentation.
pub(super) struct Fence {
    /// Its etcd key.
    key: Vec<u8>,
    /// The revision the node last put it at, which batches compare with
    /// (`None`: to be put again first).
    at: Mutex<Option<i64>>,
}

/// Node `node_id`'s fence's key.
fn key(etcd_prefix: &str, node_id: &str) -> Vec<u8> {
    format!("{etcd_prefix}QF/{node_id}").into_bytes()
}

/// Takes node `node_id`'s fence down (see the module's documentation):
/// once this returns, no batch it sent before commits.
pub(super) async fn fence_off(
    client: &mut Client,
    etcd_prefix: &str,
    node_id: &str,
) -> Result<(), Error> {
    client.delete(key(etcd_prefix, node_id), None).await?;
    Ok(())
}

impl Fence {
    /// Node `node_id`'s fence, not put yet.
    pub(super) fn new(etcd_prefix: &str, node_id: &str) -> Fence {
        Fence {
            key: key(etcd_prefix, node_id),
            at: Mutex::new(None),
        }
    }

    /// Commits `ops` if the fence is where this node last put it (putting
    /// it under `cluster`'s membership lease first if it is to be):
    /// `Ok(false)` if it moved (nothing committed; it is put again next
    /// time).
    pub(super) async fn commit(
        &self,
        client: &mut Client,
        cluster: &Cluster,
        ops: Vec<TxnOp>,
    ) -> Result<bool, Error> {
        let at = *self.at.lock();
        let at = match at {
            Some(at) => at,
            None => self.put(client, cluster).await?,
        };
        let committed = client.txn(self.behind(at, ops)).await?.succeeded();
        if !committed {
            tracing::debug!(
                "clustering: the queue's fence moved (a new lease, or a late write): put again"
            );
            self.lower();
        }
        Ok(committed)
    }

    /// A batch failed (it may still commit): the next one puts the fence
    /// again first.
    pub(super) fn lower(&self) {
        *self.at.lock() = None;
    }

    /// `ops` if the fence is still at revision `at`.
    pub(super) fn behind(&self, at: i64, ops: Vec<TxnOp>) -> Txn {
        Txn::new()
            .when([Compare::mod_revision(
                self.key.clone(),
                CompareOp::Equal,
                at,
            )])
            .and_then(ops)
    }

    /// The revision batches compare with now, if the fence is up.
    #[cfg(test)]
    pub(super) fn at(&self) -> Option<i64> {
        *self.at.lock()
    }

    /// Puts the fence under the membership lease; returns its revision.
    async fn put(&self, client: &mut Client, cluster: &Cluster) -> Result<i64, Error> {
        let lease = *cluster.lease.borrow();
        if lease == 0 {
            return Err(Error::InvalidArgs(
                "no membership lease to put the queue's fence under yet".into(),
            ));
        }
        let put = client
            .put(
                self.key.clone(),
                cluster.node_id(),
                Some(PutOptions::new().with_lease(lease)),
            )
            .await?;
        let at = put
            .header()
            .map(|h| h.revision())
            .ok_or_else(|| Error::InvalidArgs("etcd answered a put without its revision".into()))?;
        *self.at.lock() = Some(at);
        Ok(at)
    }
}
