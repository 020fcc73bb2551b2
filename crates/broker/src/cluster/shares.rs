//! Shared subscriptions across nodes: each message to one member of a
//! group in the whole cluster, not one per node that has members.
//!
//! Every node records in etcd the shared subscriptions its router has
//! members for, one key each, `<etcd_prefix>G/<node id>/$share/<group>/
//! <filter>`, under its membership lease (so they go with the node), and
//! watches everyone's: for each group it knows the nodes that have
//! members.
//!
//! The node a message is published on chooses, for every group it knows
//! whose filter matches the topic, one of those nodes (round robin per
//! group), and every other node -- itself included -- gets the message
//! marked "not for this group" (the router's [`router::NOT_FOR_GROUP`]
//! User Property, one per group, removed before delivery; patch 28).
//! Within the chosen node the router's own strategy picks the member.
//!
//! Views trail etcd by a watch round trip. A group the publishing node does
//! not know yet (its first member on another node subscribed a moment ago)
//! gets the message once on each node that has members: at least once. A
//! node chosen whose last member left a moment ago delivers it to nobody of
//! that group: a message published in that moment can be lost for the
//! group (documented in docs/cluster.md).
//!
//! Bounds: a node records at most [`MAX_GROUPS`] groups (past it, a WARN;
//! the others get each message once per node, as without this module); the
//! table holds what the members recorded.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use etcd_client::{EventType, GetOptions, PutOptions, Txn, TxnOp};
use parking_lot::RwLock;
use router::protocol::PublishProperties;
use tokio::sync::watch;

use super::membership::Member;
use super::watch::{Ended, follow_prefix};
use super::{Cluster, Membership};

/// Groups one node records in etcd, at most.
pub const MAX_GROUPS: usize = 10_000;
/// Operations per transaction, within etcd's default `--max-txn-ops`.
const BATCH_OPS: usize = 64;

/// One shared subscription across the cluster.
struct Group {
    /// Its filter, without `$share/<group>/`.
    filter: String,
    /// The nodes with members, sorted.
    nodes: Vec<String>,
    /// The next turn.
    turn: AtomicUsize,
}

/// For each shared subscription some node has members for, those nodes.
pub struct Shares {
    node_id: String,
    /// `<etcd_prefix>G/`.
    prefix: Vec<u8>,
    groups: RwLock<HashMap<String, Group>>,
    /// Some group is known: publishes look for theirs.
    any: AtomicBool,
}

/// The node each group gets a message on: (group, node).
pub type Assignment = Vec<(String, String)>;

impl Shares {
    /// Reads the groups recorded, starts watching them and recording this
    /// node's (`local`: the router's); the tasks end with the cluster.
    pub async fn start(
        cluster: &Arc<Cluster>,
        membership: &Arc<Membership>,
        local: watch::Receiver<BTreeSet<String>>,
    ) -> Result<Arc<Shares>, String> {
        let shares = Arc::new(Shares {
            node_id: cluster.node_id().to_owned(),
            prefix: format!("{}G/", cluster.settings.etcd_prefix).into_bytes(),
            groups: RwLock::new(HashMap::new()),
            any: AtomicBool::new(false),
        });
        let from = shares.load(cluster).await?;
        tokio::spawn(follow(
            Arc::downgrade(&shares),
            Arc::downgrade(cluster),
            from,
            cluster.stop.subscribe(),
        ));
        tokio::spawn(record(
            Arc::downgrade(&shares),
            Arc::downgrade(cluster),
            Arc::downgrade(membership),
            local,
            membership.watch(),
            cluster.stop.subscribe(),
        ));
        Ok(shares)
    }

    /// Where each group whose filter matches `topic` gets the message:
    /// empty when no group is known (the usual case, one atomic load).
    /// Each group's next node in turn that is `reachable` (this node, or
    /// one whose link is up): a node whose link broke (killed, say) is
    /// still listed until its lease ends, and what it was given would be
    /// lost for the group. With none reachable, the next in turn.
    pub fn assign(&self, topic: &str, reachable: impl Fn(&str) -> bool) -> Assignment {
        if !self.any.load(Ordering::Relaxed) {
            return Vec::new();
        }
        let groups = self.groups.read();
        groups
            .iter()
            .filter(|(_, g)| router::protocol::matches(topic, &g.filter))
            .map(|(name, g)| {
                let turn = g.turn.fetch_add(1, Ordering::Relaxed);
                let n = g.nodes.len();
                let node = (0..n)
                    .map(|i| &g.nodes[(turn + i) % n])
                    .find(|node| reachable(node))
                    .unwrap_or(&g.nodes[turn % n]);
                (name.clone(), node.clone())
            })
            .collect()
    }

    /// Marks `properties` for `node`: not for the groups assigned to
    /// another node.
    pub fn mark(assignment: &Assignment, node: &str, properties: &mut PublishProperties) {
        for (group, to) in assignment {
            if to != node {
                properties
                    .user_properties
                    .push((router::NOT_FOR_GROUP.into(), group.as_str().into()));
            }
        }
    }

    /// This node's id (what [`Shares::mark`] takes for its own copy).
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// The group and node a record's key names.
    fn parse<'a>(&self, key: &'a [u8]) -> Option<(&'a str, &'a str)> {
        let rest = std::str::from_utf8(key.get(self.prefix.len()..)?).ok()?;
        rest.split_once('/')
    }

    /// Reads every record into the table; the revision to watch from.
    async fn load(&self, cluster: &Cluster) -> Result<i64, String> {
        let mut client = cluster.client.clone();
        let read = client.get(self.prefix.clone(), Some(GetOptions::new().with_prefix()));
        let response = tokio::time::timeout(cluster.settings.request_timeout * 5, read)
            .await
            .map_err(|_| "etcd did not answer in time".to_owned())?
            .map_err(|e| e.to_string())?;
        let mut table: HashMap<String, Vec<String>> = HashMap::new();
        for kv in response.kvs() {
            if let Some((node, group)) = self.parse(kv.key()) {
                table
                    .entry(group.to_owned())
                    .or_default()
                    .push(node.to_owned());
            }
        }
        let mut groups = self.groups.write();
        groups.clear();
        for (name, nodes) in table {
            self.add(&mut groups, &name, nodes);
        }
        published(&groups, &self.any);
        Ok(response.header().map_or(0, |h| h.revision()) + 1)
    }

    fn add(&self, groups: &mut HashMap<String, Group>, name: &str, nodes: Vec<String>) {
        let Some(filter) = name
            .strip_prefix("$share/")
            .and_then(|rest| rest.split_once('/'))
            .map(|(_, filter)| filter.to_owned())
        else {
            return;
        };
        let mut nodes = nodes;
        nodes.sort();
        nodes.dedup();
        groups.insert(
            name.to_owned(),
            Group {
                filter,
                nodes,
                turn: AtomicUsize::new(0),
            },
        );
    }

    /// A record came (`present`) or went.
    fn changed(&self, node: &str, name: &str, present: bool) {
        let mut groups = self.groups.write();
        match groups.get_mut(name) {
            Some(group) if present => {
                if let Err(at) = group.nodes.binary_search_by(|n| n.as_str().cmp(node)) {
                    group.nodes.insert(at, node.to_owned());
                }
            }
            Some(group) => {
                group.nodes.retain(|n| n != node);
                if group.nodes.is_empty() {
                    groups.remove(name);
                }
            }
            None if present => self.add(&mut groups, name, vec![node.to_owned()]),
            None => {}
        }
        published(&groups, &self.any);
    }
}

/// Tells publishes (`any`) and the metrics what the table holds now.
fn published(groups: &HashMap<String, Group>, any: &AtomicBool) {
    any.store(!groups.is_empty(), Ordering::Relaxed);
    crate::metrics::cluster_shared_group_nodes(groups.values().map(|g| g.nodes.len()).sum());
}

/// Watches the records from revision `from`; after a broken stream reads
/// them all again and watches from there. Ends with the cluster or the
/// table.
async fn follow(
    shares: Weak<Shares>,
    cluster: Weak<Cluster>,
    mut from: i64,
    mut stop: watch::Receiver<()>,
) {
    loop {
        let (Some(s), Some(c)) = (shares.upgrade(), cluster.upgrade()) else {
            return;
        };
        let (mut client, prefix) = (c.client.clone(), s.prefix.clone());
        drop((s, c));
        let ended = follow_prefix(&mut client, &prefix, from, &mut stop, |event| {
            let Some(s) = shares.upgrade() else {
                return false;
            };
            if let Some((node, group)) = event.kv().and_then(|kv| s.parse(kv.key())) {
                s.changed(node, group, event.event_type() == EventType::Put);
            }
            true
        });
        if let Ended::Stopped = ended.await {
            return;
        }
        // Broken or cancelled (compaction): read everything again.
        loop {
            let (Some(s), Some(c)) = (shares.upgrade(), cluster.upgrade()) else {
                return;
            };
            match s.load(&c).await {
                Ok(next) => {
                    from = next;
                    break;
                }
                Err(e) => {
                    drop((s, c));
                    tracing::debug!(
                        error = e,
                        "clustering: cannot read the shared subscriptions"
                    );
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(250)) => {}
                        _ = stop.changed() => return,
                    }
                }
            }
        }
    }
}

/// Records this node's groups (`local`, as the router has them) under its
/// membership lease, again under each new lease; ends with the cluster.
async fn record(
    shares: Weak<Shares>,
    cluster: Weak<Cluster>,
    membership: Weak<Membership>,
    mut local: watch::Receiver<BTreeSet<String>>,
    mut members: watch::Receiver<Vec<Member>>,
    mut stop: watch::Receiver<()>,
) {
    let mut written: BTreeSet<String> = BTreeSet::new();
    let mut written_lease = 0;
    let mut warned = false;
    loop {
        let want: BTreeSet<String> = {
            let all = local.borrow_and_update();
            if all.len() > MAX_GROUPS && !warned {
                warned = true;
                tracing::warn!(
                    groups = all.len(),
                    recorded = MAX_GROUPS,
                    "clustering: more shared subscriptions than a node records: the others get each message once per node that has members"
                );
            }
            all.iter().take(MAX_GROUPS).cloned().collect()
        };
        let (Some(s), Some(c), Some(m)) =
            (shares.upgrade(), cluster.upgrade(), membership.upgrade())
        else {
            return;
        };
        let lease = m.lease();
        if lease != written_lease {
            // Records under an earlier lease went (or go) with it.
            written.clear();
        }
        let mut ops: Vec<TxnOp> = Vec::new();
        let key = |group: &str| {
            [
                s.prefix.as_slice(),
                s.node_id.as_bytes(),
                b"/",
                group.as_bytes(),
            ]
            .concat()
        };
        if lease != 0 {
            for group in want.difference(&written) {
                let options = PutOptions::new().with_lease(lease);
                ops.push(TxnOp::put(key(group), Vec::new(), Some(options)));
            }
            for group in written.difference(&want) {
                ops.push(TxnOp::delete(key(group), None));
            }
        }
        let mut client = c.client.clone();
        let timeout = c.settings.request_timeout;
        drop((s, c, m));
        let mut failed = false;
        for batch in ops.chunks(BATCH_OPS) {
            let txn = Txn::new().and_then(batch.to_vec());
            match tokio::time::timeout(timeout, client.txn(txn)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "clustering: cannot record the shared subscriptions");
                    failed = true;
                    break;
                }
                Err(_) => {
                    failed = true;
                    break;
                }
            }
        }
        if failed {
            // Again from the start: puts and deletes are idempotent.
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(250)) => continue,
                _ = stop.changed() => return,
            }
        }
        if lease != 0 {
            written = want;
            written_lease = lease;
        }
        tokio::select! {
            r = local.changed() => if r.is_err() { return },
            r = members.changed() => if r.is_err() { return },
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shares() -> Shares {
        Shares {
            node_id: "a".into(),
            prefix: b"/p/G/".to_vec(),
            groups: RwLock::new(HashMap::new()),
            any: AtomicBool::new(false),
        }
    }

    #[test]
    fn each_matching_group_goes_to_its_nodes_in_turn() {
        let s = shares();
        assert!(s.assign("t/1", |_| true).is_empty());
        s.changed("a", "$share/g/t/+", true);
        s.changed("b", "$share/g/t/+", true);
        s.changed("b", "$share/h/other", true);
        let turns: Vec<_> = (0..4).map(|_| s.assign("t/1", |_| true)).collect();
        let nodes: Vec<&str> = turns.iter().map(|a| a[0].1.as_str()).collect();
        assert_eq!(nodes, ["a", "b", "a", "b"]);
        // A node whose link is down is passed over while another can take
        // it; with none reachable, the turn decides.
        let nodes: Vec<String> = (0..4)
            .map(|_| s.assign("t/1", |n| n != "b")[0].1.clone())
            .collect();
        assert_eq!(nodes, ["a", "a", "a", "a"]);
        let nodes: Vec<String> = (0..2)
            .map(|_| s.assign("t/1", |_| false)[0].1.clone())
            .collect();
        assert_eq!(nodes, ["a", "b"]);
        assert!(
            turns
                .iter()
                .all(|a| a.len() == 1 && a[0].0 == "$share/g/t/+")
        );

        let mut to_b = PublishProperties::default();
        Shares::mark(&turns[0], "b", &mut to_b);
        assert_eq!(
            to_b.user_properties,
            [(router::NOT_FOR_GROUP.into(), "$share/g/t/+".into())]
        );
        let mut to_a = PublishProperties::default();
        Shares::mark(&turns[0], "a", &mut to_a);
        assert!(to_a.user_properties.is_empty());

        s.changed("a", "$share/g/t/+", false);
        s.changed("b", "$share/g/t/+", false);
        s.changed("b", "$share/h/other", false);
        assert!(s.assign("t/1", |_| true).is_empty());
        assert!(!s.any.load(Ordering::Relaxed));
    }

    #[test]
    fn keys_name_node_and_group() {
        let s = shares();
        assert_eq!(
            s.parse(b"/p/G/n1/$share/g/a/b"),
            Some(("n1", "$share/g/a/b"))
        );
        assert_eq!(s.parse(b"/p/G/n1"), None);
    }
}
