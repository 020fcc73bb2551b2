//! The reaper: one node at a time, elected through etcd's election API
//! under a lease it keeps alive, replaces expired records by tombstones
//! (their watchers on every node get DELETE) and removes tombstones older
//! than `tombstone_ttl_s`.
//!
//! Expiry is exact without it: a read treats a record past its `PX` as
//! absent. The reaper only makes the DELETE notification happen and the
//! space come back; if its node dies, another takes over once the lease
//! runs out (a few seconds), and notifications come late, not never.
//!
//! Each removal compares the key's revision with the one the watch
//! indexed, so a key set again meanwhile is left alone.

use std::sync::Weak;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, Txn, TxnOp};

use super::Cluster;
use super::record::Record;

/// The reaper's lease, seconds.
const LEASE_TTL_S: i64 = 5;
/// How often the reaper looks for what is due.
const TICK: Duration = Duration::from_millis(20);
/// Keys removed per tick at most (the rest wait for the next).
const PER_TICK: usize = 64;

pub(super) async fn run(cluster: Weak<Cluster>, mut stop: tokio::sync::watch::Receiver<()>) {
    loop {
        let Some(c) = cluster.upgrade() else { return };
        let mut client = c.client.clone();
        let name = format!("{}E/reaper", c.settings.etcd_prefix);
        let node = c.node_id().to_owned();
        drop(c);
        let lease = match client.lease_grant(LEASE_TTL_S, None).await {
            Ok(lease) => lease.id(),
            Err(_) => {
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    _ = stop.changed() => return,
                }
            }
        };
        let mut lost = keep_alive(client.clone(), lease);
        let won = tokio::select! {
            r = client.campaign(name.clone(), node.clone(), lease) => r.is_ok(),
            _ = &mut lost => false,
            _ = stop.changed() => return,
        };
        if !won {
            continue;
        }
        tracing::info!(node, "clustering: elected to expire keys");
        loop {
            tokio::select! {
                _ = &mut lost => break,
                _ = stop.changed() => {
                    let _ = client.lease_revoke(lease).await;
                    return;
                }
                () = tokio::time::sleep(TICK) => {}
            }
            let Some(c) = cluster.upgrade() else { return };
            reap(&c).await;
        }
        tracing::warn!(
            node,
            "clustering: lost the lease of the key expiry election; campaigning again"
        );
    }
}

/// Keeps `lease` alive from a task of its own; the receiver completes when
/// the lease is lost (or cannot be renewed for its TTL).
fn keep_alive(mut client: etcd_client::Client, lease: i64) -> tokio::sync::oneshot::Receiver<()> {
    let (mut lost, on_lost) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let Ok((mut keeper, mut acks)) = client.lease_keep_alive(lease).await else {
            let _ = lost.send(());
            return;
        };
        let ttl = Duration::from_secs(LEASE_TTL_S as u64);
        let mut renewed = tokio::time::Instant::now();
        loop {
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
                () = lost.closed() => return,
            }
            if keeper.keep_alive().await.is_ok()
                && let Ok(Ok(Some(ack))) =
                    tokio::time::timeout(Duration::from_secs(1), acks.message()).await
                && ack.ttl() > 0
            {
                renewed = tokio::time::Instant::now();
            }
            // Give up a second before etcd would, so two reapers never
            // overlap for long.
            if renewed.elapsed() + Duration::from_secs(1) >= ttl {
                let _ = lost.send(());
                return;
            }
        }
    });
    on_lost
}

async fn reap(cluster: &Cluster) {
    let now = crate::clock::now_ms();
    let due = cluster.index.lock().due(now, PER_TICK);
    for (key, tracked) in due {
        let full = cluster.key(&key);
        let mut client = cluster.client.clone();
        let then = if tracked.tombstone {
            TxnOp::delete(full.clone(), None)
        } else {
            let Ok(response) = client.get(full.clone(), None).await else {
                return;
            };
            let Some(kv) = response.kvs().first() else {
                continue;
            };
            let Ok(record) = Record::decode(kv.value()) else {
                continue;
            };
            if kv.mod_revision() != tracked.revision || record.tombstone {
                continue;
            }
            let tombstone = Record {
                tombstone: true,
                after_expiry: false,
                expires_at: None,
                fencing_token: None,
                request: 0,
                value: Vec::new(),
                ..record
            };
            TxnOp::put(full.clone(), tombstone.encode(), None)
        };
        let txn = Txn::new()
            .when([Compare::mod_revision(
                full,
                CompareOp::Equal,
                tracked.revision,
            )])
            .and_then([then]);
        match client.txn(txn).await {
            Ok(r) if r.succeeded() && !tracked.tombstone => crate::metrics::expired(1),
            Ok(_) => {}
            // etcd is away: the next tick tries again.
            Err(_) => return,
        }
    }
}
