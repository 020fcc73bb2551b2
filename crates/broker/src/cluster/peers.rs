//! Links to the other nodes: what this node's clients publish reaches
//! the subscribers of every node.
//!
//! Each node opens one MQTT 5 link to every other member (as a client of
//! its MQTT listener, at the `peer` address its membership record gives)
//! and publishes on it, at the same QoS and with the same properties, each
//! publish its own clients send to the router. The receiving node routes
//! what arrives on such a link to its own subscribers only: a forwarded
//! publish is never forwarded again, so there are no loops and no
//! duplicates, and a publisher's messages stay in order (one link per pair
//! of nodes carries them in the order they arrived).
//!
//! Every publish goes to every node, subscribed there or not: a subscriber
//! that has its SUBACK on one node gets whatever is published on any node
//! after it, with nothing to set up between the nodes first. What that
//! costs (every node reads every publish) is measured in
//! docs/performance.md.
//!
//! A link logs in with the cluster's secret, which the first node puts in
//! etcd (`<etcd_prefix>secret`): a client that cannot read etcd cannot
//! pose as a node. A link keeps its session on the other node (Clean
//! Start 0), so what was in flight when it broke is sent again when it
//! comes back; `forward_queue` publishes at most wait for one link, past
//! that they are not forwarded to that node (counted).
//!
//! Wills go the same way (`Publisher::forward_wills`), but unmarked: a
//! shared subscription gets a will once per node that has members (a
//! client's publish once in all, see [`super::shares`]). The broker's own
//! other publishes (state store answers and notifications) stay on their
//! node.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::RwLock;
use router::protocol::{Publish, PublishProperties};
use rumqttc::v5::mqttbytes::QoS as LinkQoS;
use rumqttc::v5::mqttbytes::v5::PublishProperties as LinkProperties;
use subtle::ConstantTimeEq;
use tokio::sync::watch;

use super::Cluster;
use super::confirmations::Confirmations;
use super::membership::Member;
use super::recent::Recent;
use super::stamps::Stamps;

mod hand_over;
mod link;

pub use crate::publisher::{LINK_CLIENT_PREFIX, LINK_USERNAME};
use link::{Link, link_properties, link_qos, secret};

/// How long a link's session outlives it on the other node (seconds): what
/// was in flight when it broke is sent again within it.
pub(super) const LINK_SESSION_EXPIRY: u32 = 300;

/// This node's links to the others.
pub struct Peers {
    node_id: String,
    secret: String,
    forward_queue: usize,
    links: RwLock<Vec<Link>>,
    /// The other nodes' links to this one connected now, by node id: each
    /// link's connection number and the node's stops before it was
    /// accepted (see [`crate::standing::Standing::epoch`]).
    inbound: parking_lot::Mutex<HashMap<String, Vec<(u64, u64)>>>,
    /// Told when a link to this node connects.
    linked: Arc<tokio::sync::Notify>,
    /// The node takes clients: every other member has linked to it (or
    /// the wait for that ran out).
    joined: std::sync::atomic::AtomicBool,
    /// What the other nodes have acknowledged of the publishes forwarded.
    confirmations: Arc<Confirmations>,
    /// Whether this node serves (a broken link waits for it to connect
    /// again).
    standing: Arc<crate::standing::Standing>,
    /// This node's stamps (its origin).
    stamps: Arc<Stamps>,
    /// Where this node notes how far a node whose link broke had its
    /// publishes (see [`super::recent`]).
    recent: Arc<Recent>,
    /// Itself, for its links' tasks.
    me: Weak<Peers>,
}

impl Peers {
    /// Reads the cluster's secret from etcd (the first node puts one
    /// there), and follows `members`: a link to each other member, opened
    /// as it appears and closed as it goes. The links end when the
    /// returned value is dropped.
    pub async fn start(
        cluster: &Arc<Cluster>,
        members: watch::Receiver<Vec<Member>>,
        standing: Arc<crate::standing::Standing>,
        stamps: Arc<Stamps>,
        recent: Arc<Recent>,
    ) -> Result<Arc<Peers>, String> {
        let secret = secret(cluster)
            .await
            .map_err(|e| format!("cannot read the cluster's secret from etcd: {e}"))?;
        let peers = Arc::new_cyclic(|me| Peers {
            node_id: cluster.node_id().to_owned(),
            secret,
            forward_queue: cluster.settings.forward_queue,
            links: RwLock::new(Vec::new()),
            inbound: parking_lot::Mutex::new(HashMap::new()),
            linked: Arc::new(tokio::sync::Notify::new()),
            joined: std::sync::atomic::AtomicBool::new(false),
            confirmations: Arc::new(Confirmations::default()),
            standing: Arc::clone(&standing),
            stamps,
            recent,
            me: me.clone(),
        });
        tokio::spawn(follow(Arc::downgrade(&peers), members.clone()));
        tokio::spawn(expire(Arc::downgrade(&peers.confirmations)));
        tokio::spawn(join(
            Arc::downgrade(&peers),
            members,
            standing,
            cluster.settings.lease_ttl,
        ));
        Ok(peers)
    }

    /// Whether the node takes clients yet: once every other member has
    /// linked to it, so that a SUBACK it gives means every node forwards
    /// to it already.
    pub fn joined(&self) -> bool {
        self.joined.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Another node's link to this one, connection `connection` accepted
    /// after `epoch` stops of this node, connected (`up`) or ended.
    pub fn inbound_link(&self, node: &str, connection: u64, epoch: u64, up: bool) {
        let mut inbound = self.inbound.lock();
        if up {
            inbound
                .entry(node.to_owned())
                .or_default()
                .push((connection, epoch));
            drop(inbound);
            self.linked.notify_one();
        } else if let Some(links) = inbound.get_mut(node) {
            links.retain(|(c, _)| *c != connection);
            if links.is_empty() {
                inbound.remove(node);
            }
        }
    }

    /// The other members (with an address) whose link to this node is
    /// not connected.
    /// The other members without a link to this node accepted since its
    /// last stop (`epoch`: a link from before was sent away with it).
    fn not_linked(&self, members: &[Member], epoch: u64) -> Vec<String> {
        let inbound = self.inbound.lock();
        members
            .iter()
            .filter(|m| m.node_id != self.node_id && m.peer_address.is_some())
            .filter(|m| {
                inbound
                    .get(&m.node_id)
                    .is_none_or(|links| links.iter().all(|(_, e)| *e < epoch))
            })
            .map(|m| m.node_id.clone())
            .collect()
    }

    /// Whether this node's link to `node` is connected now (a publish
    /// handed to it now reaches `node`, unless the link breaks).
    pub fn link_to_is_up(&self, node: &str) -> bool {
        self.confirmations.is_up(node)
    }

    /// Whether `node`'s link to this one is connected now (it could hand
    /// a session over).
    pub fn linked_from(&self, node: &str) -> bool {
        self.inbound
            .lock()
            .get(node)
            .is_some_and(|links| !links.is_empty())
    }

    /// Whether a CONNECT with `client_id` and this login is another node's
    /// link: its node id, if it is.
    pub fn link_login<'a>(
        &self,
        client_id: &'a str,
        login: Option<(&str, &str)>,
    ) -> Option<&'a str> {
        let node = client_id.strip_prefix(LINK_CLIENT_PREFIX)?;
        let (username, password) = login?;
        let valid = username == LINK_USERNAME
            && bool::from(password.as_bytes().ct_eq(self.secret.as_bytes()))
            && !node.is_empty()
            && node != self.node_id;
        valid.then_some(node)
    }

    /// Every forwarded publish up to the value is acknowledged by the
    /// nodes whose links were up (see [`Confirmations`]).
    pub fn confirmed(&self) -> watch::Receiver<u64> {
        self.confirmations.watch()
    }

    /// Hands a publish of this node's clients to every link (never waits:
    /// a link whose queue is full does not get it, counted), each marked
    /// not for the groups `assignment` gives another node (see
    /// [`super::Shares`]), and with its `origin` (a QoS 2 publish's, see
    /// [`super::origins`]) and its stamp, taken from `stamps` in the order
    /// the links get them (see [`super::stamps`]). A QoS 1/2 publish's
    /// ticket: its acknowledgement waits until [`Peers::confirmed`]
    /// reaches it; and the stamp.
    pub fn forward(
        &self,
        publish: &Publish,
        properties: Option<&PublishProperties>,
        assignment: &super::shares::Assignment,
        origin: Option<String>,
        stamps: &Stamps,
    ) -> (Option<u64>, String) {
        let links = self.links.read();
        let topic = match std::str::from_utf8(&publish.topic) {
            Ok(topic) if !links.is_empty() => topic,
            _ => return (None, stamps.stamp()),
        };
        let qos = link_qos(publish.qos);
        let mut properties = properties.map(link_properties).unwrap_or_default();
        if let Some(origin) = origin {
            properties
                .user_properties
                .push((crate::publisher::ORIGIN.to_owned(), origin));
        }
        self.confirmations.with(|state| {
            let (stamp, number) = stamps.numbered();
            state.stamped(number);
            properties
                .user_properties
                .push((crate::publisher::STAMP.to_owned(), stamp.clone()));
            let ticket = (qos != LinkQoS::AtMostOnce).then(|| state.issue());
            for (i, link) in links.iter().enumerate() {
                // The last link takes the properties, the others a copy.
                let properties = if i + 1 == links.len() {
                    std::mem::take(&mut properties)
                } else {
                    properties.clone()
                };
                if Self::forward_on(link, topic, qos, publish, properties, assignment) {
                    state.handed(&link.node_id, ticket);
                }
            }
            (ticket, stamp)
        })
    }

    /// Hands a publish to one link; whether it took it.
    fn forward_on(
        link: &Link,
        topic: &str,
        qos: LinkQoS,
        publish: &Publish,
        mut properties: LinkProperties,
        assignment: &super::shares::Assignment,
    ) -> bool {
        {
            if !assignment.is_empty() {
                let mut marks = PublishProperties::default();
                super::Shares::mark(assignment, &link.node_id, &mut marks);
                properties.user_properties.extend(
                    marks
                        .user_properties
                        .into_iter()
                        .map(|(k, v)| (k.into(), v.into())),
                );
            }
            let sent = link.client.try_publish_with_properties(
                topic,
                qos,
                publish.retain,
                publish.payload.clone(),
                properties,
            );
            match sent {
                Ok(()) => {
                    link.forwarded.increment(1);
                    true
                }
                Err(e) => {
                    link.dropped.increment(1);
                    tracing::debug!(peer = link.node_id, error = %e, "publish not forwarded: the link's queue is full");
                    false
                }
            }
        }
    }

    /// The link to `node` broke (see `link::drive`): notes how far `node` had
    /// this node's publishes, and tells the other nodes.
    fn link_broke(&self, node: &str) {
        self.tell_had(&self.links.read(), node);
    }

    /// Notes how far `node` had this node's QoS 1/2 publishes (its link
    /// broke or closes), and tells the other nodes on `links`, after what
    /// was forwarded to them (see [`super::recent`]).
    fn tell_had(&self, links: &[Link], node: &str) {
        let origin = self.stamps.origin();
        self.confirmations.with(|state| {
            let Some(up_to) = state.had_up_to(node) else {
                return;
            };
            self.recent.own_link_down(node, origin, up_to);
            let said = super::recent::said(node, origin, up_to);
            for link in links.iter().filter(|l| l.node_id != node) {
                let mut properties = LinkProperties::default();
                properties
                    .user_properties
                    .push((crate::publisher::HAD.to_owned(), said.clone()));
                let sent = link.client.try_publish_with_properties(
                    crate::publisher::HAD_TOPIC,
                    LinkQoS::AtLeastOnce,
                    false,
                    bytes::Bytes::new(),
                    properties,
                );
                match sent {
                    Ok(()) => state.handed(&link.node_id, None),
                    Err(e) => tracing::warn!(
                        peer = link.node_id,
                        node,
                        error = %e,
                        "clustering: cannot tell a node how far a node whose link broke had this node's publishes: the link's queue is full"
                    ),
                }
            }
            tracing::debug!(node, up_to, "clustering: a node's link broke: how far it had this node's publishes noted and told");
        });
    }

    /// Whether `node` is a member: this node, or one it links to.
    pub fn is_member(&self, node: &str) -> bool {
        node == self.node_id || self.links.read().iter().any(|l| l.node_id == node)
    }

    /// Opens links to the members not linked yet and closes those to nodes
    /// gone (or moved).
    fn follow_members(&self, members: &[Member]) {
        let wanted: HashMap<&str, &str> = members
            .iter()
            .filter(|m| m.node_id != self.node_id)
            .filter_map(|m| Some((m.node_id.as_str(), m.peer_address.as_deref()?)))
            .collect();
        let mut links = self.links.write();
        let gone: Vec<String> = links
            .iter()
            .filter(|l| wanted.get(l.node_id.as_str()) != Some(&l.address.as_str()))
            .map(|l| l.node_id.clone())
            .collect();
        for node in &gone {
            self.tell_had(&links, node);
        }
        links.retain(|link| {
            let keep = !gone.contains(&link.node_id);
            if !keep {
                self.confirmations.link_closed(&link.node_id);
                tracing::info!(
                    peer = link.node_id,
                    address = link.address,
                    "clustering: link to a node closed (it left the cluster)"
                );
            }
            keep
        });
        for (node, address) in wanted {
            if links.iter().any(|l| l.node_id == node) {
                continue;
            }
            match self.open(node, address) {
                Ok(link) => links.push(link),
                Err(e) => tracing::warn!(
                    peer = node,
                    address,
                    error = e,
                    "clustering: cannot link to a node"
                ),
            }
        }
    }
}

/// Lets the node take clients once every other member has linked to it,
/// or after `limit` (a WARN names those that did not); again after each
/// time it stopped serving (a lost lease: the links were sent away with
/// the clients, and a subscriber that came back before they did would
/// miss what the other nodes publish).
async fn join(
    peers: Weak<Peers>,
    mut members: watch::Receiver<Vec<Member>>,
    standing: Arc<crate::standing::Standing>,
    limit: Duration,
) {
    let mut losses = standing.losses();
    loop {
        let epoch = *losses.borrow_and_update();
        if !wait_for_links(&peers, &mut members, epoch, limit).await {
            return;
        }
        if losses.changed().await.is_err() {
            return;
        }
        let Some(p) = peers.upgrade() else { return };
        p.joined.store(false, std::sync::atomic::Ordering::Release);
        tracing::info!(
            "clustering: this node stopped serving: it takes clients again once the other nodes have linked to it again"
        );
    }
}

/// Waits until every other member has a link to this node accepted since
/// stop `epoch`, or `limit`, then lets the node take clients; `false`:
/// the links' owner is gone.
async fn wait_for_links(
    peers: &Weak<Peers>,
    members: &mut watch::Receiver<Vec<Member>>,
    epoch: u64,
    limit: Duration,
) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let Some(p) = peers.upgrade() else {
            return false;
        };
        let missing = p.not_linked(&members.borrow_and_update(), epoch);
        if missing.is_empty() {
            tracing::info!("clustering: every other node has linked to this one: taking clients");
            p.joined.store(true, std::sync::atomic::Ordering::Release);
            return true;
        }
        let linked = Arc::clone(&p.linked);
        drop(p);
        tokio::select! {
            () = linked.notified() => {}
            changed = members.changed() => if changed.is_err() { return false },
            () = tokio::time::sleep_until(deadline) => {
                let Some(p) = peers.upgrade() else { return false };
                tracing::warn!(
                    ?missing,
                    wait_ms = limit.as_millis() as u64,
                    "clustering: taking clients although these nodes have not linked to this one: they do not forward to it yet"
                );
                p.joined.store(true, std::sync::atomic::Ordering::Release);
                return true;
            }
        }
    }
}

/// Follows the membership until the links' owner is dropped.
async fn follow(peers: Weak<Peers>, mut members: watch::Receiver<Vec<Member>>) {
    loop {
        {
            let Some(peers) = peers.upgrade() else {
                return;
            };
            let current = members.borrow_and_update().clone();
            peers.follow_members(&current);
        }
        if members.changed().await.is_err() {
            return;
        }
    }
}

/// Every second, stops waiting for what a node has not acknowledged in
/// [`super::confirmations::MAX_WAIT`]; ends with the links.
async fn expire(confirmations: Weak<Confirmations>) {
    let mut every = tokio::time::interval(Duration::from_secs(1));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let Some(confirmations) = confirmations.upgrade() else {
            return;
        };
        for (peer, expired) in confirmations.expire() {
            crate::metrics::cluster_unconfirmed(expired);
            tracing::warn!(
                peer,
                publishes = expired,
                "clustering: a node has not acknowledged forwarded publishes in 5 s: their publishers are acknowledged without it"
            );
        }
    }
}

#[cfg(test)]
mod tests;
