//! At start, before the node takes clients: the sessions it restored
//! from its data directory whose clients moved to another node while it
//! was down are discarded.

use etcd_client::GetOptions;
use router::RouterHandle;

use super::owner_of;
use crate::cluster::Cluster;

/// Discards the sessions this node kept (restored from its data
/// directory at start) whose clients another node owns now, as of etcd
/// `revision`: they moved while this node was away, and a copy kept here
/// would collect their messages (into etcd's queue, under this node) and
/// hand them over again when the client's node later stops. Runs before
/// the node takes clients. Found by probing: 100 duplicates for 110
/// messages in a small run, up to 886 per publisher in a rolling restart.
pub(super) async fn drop_copies_owned_elsewhere(
    cluster: &Cluster,
    router: &RouterHandle,
    prefix: &[u8],
    revision: i64,
) -> Result<(), String> {
    let subscriptions = router.subscriptions();
    if subscriptions.kept_sessions() == 0 {
        return Ok(());
    }
    let mut client = cluster.client.clone();
    let end = crate::cluster::kv::prefix_end(prefix);
    let mut from = prefix.to_vec();
    let mut elsewhere = Vec::new();
    loop {
        let options = GetOptions::new()
            .with_range(end.clone())
            .with_revision(revision)
            .with_limit(1000);
        let page = tokio::time::timeout(
            cluster.settings.request_timeout,
            client.get(from.clone(), Some(options)),
        )
        .await
        .map_err(|_| "etcd did not answer in time".to_owned())?
        .map_err(|e| e.to_string())?;
        for kv in page.kvs() {
            let Ok(client_id) = std::str::from_utf8(&kv.key()[prefix.len()..]) else {
                continue;
            };
            let other = owner_of(kv.value()).is_some_and(|node| node != cluster.node_id());
            if other && subscriptions.has_kept_session(client_id) {
                elsewhere.push(client_id.to_owned());
            }
        }
        match page.kvs().last() {
            Some(kv) if page.more() => {
                from = kv.key().to_vec();
                from.push(0);
            }
            _ => break,
        }
    }
    let mut dropped = 0;
    for client_id in &elsewhere {
        if let Ok(true) = router.replace_session(client_id, None).await {
            dropped += 1;
        }
    }
    if dropped > 0 {
        tracing::info!(
            dropped,
            "clustering: sessions kept here that other nodes took meanwhile are discarded"
        );
    }
    Ok(())
}
