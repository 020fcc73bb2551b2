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

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use metrics::Counter;
use parking_lot::RwLock;
use router::protocol::{Publish, PublishProperties, QoS};
use rumqttc::Outgoing;
use rumqttc::v5::mqttbytes::QoS as LinkQoS;
use rumqttc::v5::mqttbytes::v5::{Packet as LinkPacket, PublishProperties as LinkProperties};
use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};
use subtle::ConstantTimeEq;
use tokio::sync::{oneshot, watch};

use super::Cluster;
use super::confirmations::Confirmations;
use super::membership::Member;
use super::recent::Recent;
use super::stamps::Stamps;

pub use crate::publisher::{LINK_CLIENT_PREFIX, LINK_USERNAME};

/// How long a hand-over waits for room on a link before it gives up.
const HANDOVER_PATIENCE: Duration = Duration::from_secs(5);

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

/// One link, and the task that drives it (it ends when the link is dropped).
struct Link {
    node_id: String,
    address: String,
    client: AsyncClient,
    forwarded: Counter,
    dropped: Counter,
    _stop: oneshot::Sender<()>,
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

    /// Sends `node` the messages queued here for `client_id`'s session,
    /// which moved there: each with the User Property
    /// [`crate::publisher::HANDOVER`] naming the client, which the other
    /// node delivers to that client alone; then, with none or all of them
    /// sent, a publish marked [`crate::publisher::HANDOVER_DONE`], which
    /// tells the client's connection there that what its router gives may
    /// follow. Waits for room on the link; returns how many messages it
    /// took (none without a link to `node`).
    pub async fn hand_over(
        &self,
        node: &str,
        client_id: &str,
        messages: Vec<(Publish, Option<PublishProperties>)>,
    ) -> usize {
        let Some(client) = self
            .links
            .read()
            .iter()
            .find(|l| l.node_id == node)
            .map(|l| l.client.clone())
        else {
            return 0;
        };
        let mut sent = 0;
        let mut whole = true;
        for (publish, properties) in messages {
            let Ok(topic) = std::str::from_utf8(&publish.topic) else {
                continue;
            };
            let mut properties = properties.as_ref().map(link_properties).unwrap_or_default();
            properties
                .user_properties
                .push((crate::publisher::HANDOVER.to_owned(), client_id.to_owned()));
            if publish.retain {
                properties
                    .user_properties
                    .push((crate::publisher::HANDOVER_RETAIN.to_owned(), "1".to_owned()));
            }
            let qos = link_qos(publish.qos);
            if !self
                .hand_one(&client, node, topic, qos, publish.payload, properties)
                .await
            {
                whole = false;
                break;
            }
            sent += 1;
        }
        if whole {
            let mut properties = LinkProperties::default();
            properties.user_properties.push((
                crate::publisher::HANDOVER_DONE.to_owned(),
                client_id.to_owned(),
            ));
            let topic = crate::publisher::HANDOVER_DONE_TOPIC;
            let payload = bytes::Bytes::new();
            self.hand_one(
                &client,
                node,
                topic,
                LinkQoS::AtLeastOnce,
                payload,
                properties,
            )
            .await;
        }
        sent
    }

    /// Publishes one message of a handover on the link to `node`, in the
    /// confirmations' order (nobody waits for them); a full queue is
    /// waited for, [`HANDOVER_PATIENCE`] at most. `false`: not taken.
    async fn hand_one(
        &self,
        client: &AsyncClient,
        node: &str,
        topic: &str,
        qos: LinkQoS,
        payload: bytes::Bytes,
        properties: LinkProperties,
    ) -> bool {
        let mut full_since = None;
        loop {
            let taken = self.confirmations.with(|state| {
                let published = client.try_publish_with_properties(
                    topic,
                    qos,
                    false,
                    payload.clone(),
                    properties.clone(),
                );
                published
                    .is_ok()
                    .then(|| state.handed(node, None))
                    .is_some()
            });
            if taken {
                return true;
            }
            let since = *full_since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() > HANDOVER_PATIENCE {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The link to `node` broke (see [`drive`]): notes how far `node` had
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

    /// A link to `node` at `address`, driven by a task of its own.
    fn open(&self, node: &str, address: &str) -> Result<Link, String> {
        let (host, port) = address
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.trim_matches(['[', ']']), p.parse::<u16>().ok()?)))
            .ok_or_else(|| format!("`{address}` is not host:port"))?;
        let mut options =
            MqttOptions::new(format!("{LINK_CLIENT_PREFIX}{}", self.node_id), host, port);
        // Clean Start 1 at first: the other node may keep a session of an
        // earlier link of this node's (before a restart, or before the
        // link was closed), whose QoS 2 publishes waiting for a PUBREL this
        // link knows nothing of: it numbers its own from 1, and the router
        // would take a new publish on such an id for the old one (dropping
        // it, and delivering the old one at its PUBREL). Clean Start 0
        // once connected (see `drive`), so that what a broken connection
        // had in flight is sent again.
        options
            .set_credentials(LINK_USERNAME, self.secret.clone())
            .set_clean_start(true)
            .set_session_expiry_interval(Some(LINK_SESSION_EXPIRY))
            .set_keep_alive(Duration::from_secs(5))
            .set_max_packet_size(Some(u32::MAX >> 4))
            .set_request_channel_capacity(self.forward_queue);
        let (client, events) = AsyncClient::new(options, self.forward_queue);
        let (stop, stopped) = oneshot::channel();
        tokio::spawn(drive(
            events,
            node.to_owned(),
            address.to_owned(),
            Arc::clone(&self.confirmations),
            Arc::clone(&self.standing),
            self.me.clone(),
            stopped,
        ));
        let (forwarded, dropped) = crate::metrics::cluster_forward_counters(node);
        tracing::info!(peer = node, address, "clustering: linking to a node");
        Ok(Link {
            node_id: node.to_owned(),
            address: address.to_owned(),
            client,
            forwarded,
            dropped,
            _stop: stop,
        })
    }
}

/// The properties a publish keeps on its way to another node (the topic
/// alias was resolved on the way in; subscription identifiers are the
/// receiving subscriber's).
/// The link client's QoS for the router's.
fn link_qos(qos: QoS) -> LinkQoS {
    match qos {
        QoS::AtMostOnce => LinkQoS::AtMostOnce,
        QoS::AtLeastOnce => LinkQoS::AtLeastOnce,
        QoS::ExactlyOnce => LinkQoS::ExactlyOnce,
    }
}

fn link_properties(p: &PublishProperties) -> LinkProperties {
    LinkProperties {
        payload_format_indicator: p.payload_format_indicator,
        message_expiry_interval: p.message_expiry_interval,
        topic_alias: None,
        response_topic: p.response_topic.as_deref().map(str::to_owned),
        correlation_data: p.correlation_data.clone(),
        user_properties: p
            .user_properties
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        subscription_identifiers: Vec::new(),
        content_type: p.content_type.as_deref().map(str::to_owned),
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

/// Drives one link: connects, sends, reconnects (backing off) until
/// `stop` fires or its sender is dropped. A link that breaks while the
/// node does not serve (its lease lost) connects again only once it
/// serves: a node whose id another process registered meanwhile (two
/// nodes given one `node_id`) would otherwise take that process's links
/// over, and be taken over by them, again and again.
async fn drive(
    mut events: EventLoop,
    peer: String,
    address: String,
    confirmations: Arc<Confirmations>,
    standing: Arc<crate::standing::Standing>,
    peers: Weak<Peers>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut connected = false;
    let mut backoff = Duration::from_millis(100);
    let set = |connected: &mut bool, now: bool| {
        if std::mem::replace(connected, now) != now {
            crate::metrics::cluster_peer_link(now);
        }
    };
    loop {
        // (Nothing else here may interrupt `poll`: it can be cut between
        // taking a publish and writing it, which then never goes.)
        let event = tokio::select! {
            _ = &mut stop => break,
            event = events.poll() => event,
        };
        match event {
            Ok(Event::Outgoing(Outgoing::Publish(pkid))) => confirmations.went_out(&peer, pkid),
            Ok(Event::Outgoing(Outgoing::AwaitAck(_))) => confirmations.held_back(&peer),
            Ok(Event::Incoming(LinkPacket::PubAck(ack))) => {
                confirmations.acknowledged(&peer, ack.pkid);
            }
            Ok(Event::Incoming(LinkPacket::PubRec(rec))) => {
                confirmations.acknowledged(&peer, rec.pkid);
            }
            Ok(Event::Incoming(LinkPacket::ConnAck(ack))) => {
                events.options.set_clean_start(false);
                confirmations.link_up(&peer, ack.session_present);
                if let Some(peers) = peers.upgrade() {
                    peers.recent.link_up(&peer);
                }
                tracing::info!(
                    peer,
                    address,
                    session_present = ack.session_present,
                    "clustering: link to a node up"
                );
                backoff = Duration::from_millis(100);
                set(&mut connected, true);
            }
            Ok(Event::Incoming(LinkPacket::Disconnect(d))) => {
                tracing::warn!(peer, address, reason = ?d.reason_code, "clustering: a node ended its link");
            }
            Ok(_) => {}
            Err(e) => {
                if connected {
                    tracing::warn!(peer, address, error = %e, "clustering: link to a node broken: reconnecting");
                    if let Some(peers) = peers.upgrade() {
                        peers.link_broke(&peer);
                    }
                } else {
                    tracing::debug!(peer, address, error = %e, "clustering: cannot link to a node yet");
                }
                set(&mut connected, false);
                confirmations.link_down(&peer);
                tokio::select! {
                    _ = &mut stop => break,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
                if !standing.serving() {
                    tracing::debug!(
                        peer,
                        "clustering: not serving: the link waits until this node serves again"
                    );
                    tokio::select! {
                        _ = &mut stop => break,
                        () = standing.serves() => {}
                    }
                }
            }
        }
    }
    set(&mut connected, false);
}

/// The cluster's secret: the one in etcd, or a new one put there if there
/// is none yet (only one of several nodes starting at once succeeds).
async fn secret(cluster: &Cluster) -> Result<String, String> {
    let key = format!("{}secret", cluster.settings.etcd_prefix);
    let mut fresh = [0u8; 32];
    getrandom::fill(&mut fresh).map_err(|e| e.to_string())?;
    let fresh = hex::encode(fresh);
    let txn = Txn::new()
        .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
        .and_then([TxnOp::put(key.clone(), fresh.clone(), None)])
        .or_else([TxnOp::get(key, None)]);
    let mut client = cluster.client.clone();
    let response = tokio::time::timeout(cluster.settings.request_timeout, client.txn(txn))
        .await
        .map_err(|_| "etcd did not answer in time".to_owned())?
        .map_err(|e| e.to_string())?;
    if response.succeeded() {
        return Ok(fresh);
    }
    response
        .op_responses()
        .into_iter()
        .find_map(|op| match op {
            TxnOpResponse::Get(get) => get
                .kvs()
                .first()
                .and_then(|kv| kv.value_str().ok().map(str::to_owned)),
            _ => None,
        })
        .filter(|s| !s.is_empty())
        .ok_or_else(|| "the secret's key is there but empty".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers() -> Peers {
        Peers {
            node_id: "sb1".into(),
            secret: String::new(),
            forward_queue: 1,
            links: RwLock::new(Vec::new()),
            inbound: parking_lot::Mutex::new(HashMap::new()),
            linked: Arc::new(tokio::sync::Notify::new()),
            joined: std::sync::atomic::AtomicBool::new(false),
            confirmations: Arc::new(Confirmations::default()),
            standing: Arc::new(crate::standing::Standing::always()),
            stamps: Arc::new(Stamps::new("sb1", 1)),
            recent: Arc::new(Recent::new(0, Duration::from_secs(1))),
            me: Weak::new(),
        }
    }

    fn member(node_id: &str) -> Member {
        Member {
            node_id: node_id.into(),
            peer_address: Some("127.0.0.1:1883".into()),
            lease: 1,
        }
    }

    /// A link accepted before the node's last stop was sent away with it:
    /// it does not count as linked again; one accepted since does, and a
    /// link that ends is no longer counted.
    #[test]
    fn only_links_accepted_since_the_last_stop_count() {
        let p = peers();
        let members = [member("sb1"), member("sb2"), member("sb3")];
        assert_eq!(p.not_linked(&members, 0), ["sb2", "sb3"]);
        p.inbound_link("sb2", 10, 0, true);
        p.inbound_link("sb3", 11, 0, true);
        assert!(p.not_linked(&members, 0).is_empty());
        // The node stopped serving (epoch 1): the old links do not count.
        assert_eq!(p.not_linked(&members, 1), ["sb2", "sb3"]);
        p.inbound_link("sb2", 12, 1, true);
        assert_eq!(p.not_linked(&members, 1), ["sb3"]);
        // The old link of sb2 ends after its new one came: still linked.
        p.inbound_link("sb2", 10, 0, false);
        assert_eq!(p.not_linked(&members, 1), ["sb3"]);
        p.inbound_link("sb2", 12, 1, false);
        assert_eq!(p.not_linked(&members, 1), ["sb2", "sb3"]);
    }
}
