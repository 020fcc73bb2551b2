//! The broker's own publishes: state store answers and notifications, the
//! messages a connection could not deliver, and Last Wills.
//!
//! A message the broker publishes goes one of two ways:
//!
//! - **straight to its one recipient's connection** (see [`crate::sessions`]),
//!   when exactly one client can receive it: a notification (private to its
//!   watcher), or a response whose Response Topic only the requester
//!   subscribes to. No router, no per-filter log, no copy kept after delivery;
//! - **through the router**, like any client's publish, over the broker's own
//!   in-process link: to whoever subscribes, at their QoS, kept for
//!   persistent sessions.
//!
//! The publisher knows nothing of the state store: the store service hands it
//! finished messages (see [`crate::store::binding`]).

use std::sync::Arc;

use parking_lot::Mutex;
use router::Notification;
use router::local::{LinkRx, LinkTx};
use router::protocol::{
    LastWill, LastWillProperties, Packet, PubRel, PubRelReason, Publish, PublishProperties,
};

use crate::codec;
use crate::sessions::{Answer, Direct, Route, Sessions, Undelivered};
use router::RouterHandle;

/// Client ids with this prefix belong to the broker itself; clients may not use them.
pub const INTERNAL_PREFIX: &str = "statebroker:";

/// The client ids of other cluster nodes' links (`statebroker:peer:<node
/// id>`, see `cluster::peers`): accepted only with the cluster's secret.
pub const LINK_CLIENT_PREFIX: &str = "statebroker:peer:";
/// The username a link logs in with (its password: the cluster's secret).
pub const LINK_USERNAME: &str = "statebroker:peer";
/// The User Property of a publish another node's link hands over: the
/// client id whose session moved to this node, to whom alone it goes.
pub const HANDOVER: &str = "statebroker:handover";
/// With [`HANDOVER`], on a QoS 2 message the other node had in flight to
/// the client: the packet id it went under (see
/// `crate::sessions::Direct::kept_pkid`).
pub const HANDOVER_PKID: &str = "statebroker:handover-pkid";
/// With [`HANDOVER`]: the message goes to the client with RETAIN 1 (the
/// other node's router had it so for the client: a retained message on a
/// Retain As Published subscription). Links carry publishes with RETAIN 0
/// (1 would make this node's router keep it as the topic's retained
/// message).
pub const HANDOVER_RETAIN: &str = "statebroker:handover-retain";
/// The User Property of the publish that ends another node's handover of
/// a session (after its messages, if any; the publish itself carries
/// none, on [`HANDOVER_DONE_TOPIC`]): the client id whose session moved
/// to this node. Its connection holds back what this node's router gives
/// the session until then, so the older messages come first.
pub const HANDOVER_DONE: &str = "statebroker:handover-done";
/// The topic of that publish (a `$` topic: no wildcard subscription of
/// a node that does not know the mark matches it).
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
pub const HANDOVER_DONE_TOPIC: &str = "$statebroker/handover-done";
/// On a QoS 2 publish another node's link forwards: its origin,
/// `<packet id> <1 if sent again (DUP), else 0> <client id>` (see
/// `crate::cluster::origins`).
pub const ORIGIN: &str = "statebroker:origin";
/// On every publish of a cluster node's clients, in its own router and on
/// its links: `<node id>/<run>/<number>`, which tells a handed-over
/// message the new node had already (see `crate::cluster::stamps`).
/// Never delivered to a client.
pub const STAMP: &str = "statebroker:stamp";

/// The User Property of the publish a node sends every other node when
/// its link to a node breaks or closes (the publish itself carries none,
/// on [`HAD_TOPIC`]): how far that node had the sender's publishes (see
/// `crate::cluster::recent`).
pub const HAD: &str = "statebroker:had";
/// The topic of that publish (a `$` topic, as [`HANDOVER_DONE_TOPIC`]).
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
pub const HAD_TOPIC: &str = "$statebroker/had";

/// Removes a publish's [`STAMP`] before it goes to a client.
#[inline]
pub fn unstamp(properties: &mut PublishProperties) {
    let user = &mut properties.user_properties;
    match user.as_slice() {
        [] => {}
        // Most publishes have no User Property but their stamp.
        [(k, _)] if k == STAMP => user.clear(),
        _ => user.retain(|(k, _)| k != STAMP),
    }
}

/// A publish's [`STAMP`], if it has one (a cluster node's publishes, and
/// those another node's link passed on).
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
pub fn stamp_of(properties: Option<&PublishProperties>) -> Option<&str> {
    properties?
        .user_properties
        .iter()
        .find(|(k, _)| k == STAMP)
        .map(|(_, v)| v.as_ref())
}

/// Links the broker needs besides client connections: the publisher's.
pub const INTERNAL_LINKS: usize = 1;

/// The router link the broker publishes on, and its packet ids.
struct Link {
    tx: LinkTx,
    next_pkid: u16,
}

impl Link {
    fn next_pkid(&mut self) -> u16 {
        self.next_pkid = self.next_pkid.checked_add(1).unwrap_or(1);
        self.next_pkid
    }

    /// Hands `packets` to the router with one wake-up.
    fn send(&mut self, packets: Vec<Packet>) {
        if let Err(e) = self.tx.send_all(packets) {
            tracing::error!(error = %e, "router link failed: cannot publish");
        }
    }
}

/// Where a cluster node's wills go besides its own router: the other nodes.
pub type Forward = Box<dyn Fn(&Publish, Option<&PublishProperties>) + Send + Sync>;

/// Publishes as the broker itself.
pub struct Publisher {
    link: Mutex<Link>,
    sessions: Arc<Sessions>,
    /// A cluster node's links to the other nodes (set once, at start).
    forward: std::sync::OnceLock<Forward>,
}

impl Publisher {
    /// Links the publisher to `router`; direct deliveries go through `sessions`.
    pub async fn start(
        router: &RouterHandle,
        sessions: Arc<Sessions>,
    ) -> std::io::Result<Arc<Publisher>> {
        let (tx, rx, _connack) = router
            .link(&format!("{INTERNAL_PREFIX}publisher"), true, 0, None)
            .await
            .map_err(|e| {
                std::io::Error::other(format!("cannot link the broker to the router: {e}"))
            })?;
        tokio::spawn(drain_acks(rx));
        Ok(Arc::new(Publisher {
            link: Mutex::new(Link { tx, next_pkid: 0 }),
            sessions,
            forward: std::sync::OnceLock::new(),
        }))
    }

    /// Delivers `message` to `client` only, if it is connected and
    /// subscribed and its queue has room.
    pub fn deliver_to(&self, client: &str, message: Direct) -> Result<(), Undelivered> {
        self.sessions.deliver(client, message)
    }

    /// Delivers `message` straight to `client` when it is the only subscriber
    /// of the message's topic (on `route` while it holds, see
    /// [`crate::sessions::Route`]), through the router otherwise (and when
    /// the client's connection cannot take it). `true`: it went straight
    /// to the client's connection.
    pub fn publish_for(&self, client: &str, route: Option<&Route>, message: Direct) -> bool {
        let delivered = match route {
            Some(route) => self.sessions.deliver_on(client, route, message),
            None => self.sessions.deliver_to_only_subscriber(client, message),
        };
        match delivered {
            Ok(()) => return true,
            Err(Undelivered::NoRecipient(message)) => self.route(vec![*message]),
            Err(Undelivered::Overflow) => {
                tracing::debug!(
                    client_id = client,
                    "answer dropped: the client's queue is full"
                );
            }
        }
        false
    }

    /// The answer in `here` (to `client`) left there for the connection
    /// `route` leads to, to be delivered by that connection's own task
    /// (see [`Sessions::take_on`]); otherwise taken out and published as
    /// [`Publisher::publish_for`] does. `true`: it is the client's
    /// connection's, here or in its mailbox.
    pub fn take_or_publish(&self, client: &str, route: &Route, here: &mut Option<Answer>) -> bool {
        if let Some(answer) = here
            && !self.sessions.take_on(route, answer)
            && let Some(answer) = here.take()
        {
            return self.publish_for(client, Some(route), answer.into_direct());
        }
        here.is_some()
    }

    /// Tells `client`'s connection that answers it may hold
    /// acknowledgements for went elsewhere (see
    /// [`crate::sessions::ToConnection::AnswersOut`]).
    pub fn answers_out(&self, client: &str) {
        self.sessions.answers_out(client);
    }

    /// Publishes through the router, as the broker, at QoS 1 (QoS 0 stays 0).
    pub fn route(&self, messages: Vec<Direct>) {
        if messages.is_empty() {
            return;
        }
        let mut link = self.link.lock();
        let packets = messages
            .into_iter()
            .map(|m| {
                let pkid = if m.qos == 0 { 0 } else { link.next_pkid() };
                let publish = codec::publish(&m.topic, &m.payload, m.qos.min(1), pkid, false);
                Packet::Publish(publish, Some(m.properties.into_publish()))
            })
            .collect();
        link.send(packets);
    }

    /// Hands messages that a connection delivered directly, but that were
    /// not acknowledged when it ended, to the router, which keeps them for
    /// the client's persistent session.
    pub fn redeliver_later(&self, mut messages: Vec<Direct>) {
        for m in &mut messages {
            m.properties.set_subscription_identifiers(Vec::new());
            m.qos = 1;
        }
        self.route(messages);
    }

    /// Publishes retained QoS 0 messages of the broker's own (`$SYS`).
    pub fn publish_retained(&self, messages: Vec<(String, String)>) {
        let packets = messages
            .into_iter()
            .map(|(topic, payload)| {
                let publish = codec::publish(topic.as_bytes(), payload.as_bytes(), 0, 0, true);
                Packet::Publish(publish, None)
            })
            .collect();
        self.link.lock().send(packets);
    }

    /// Publishes retained messages kept elsewhere (a cluster node at
    /// start: those in etcd), at their QoS, with RETAIN.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub fn restore_retained(&self, messages: Vec<router::Message>) {
        let mut link = self.link.lock();
        let mut packets = Vec::with_capacity(messages.len());
        for router::Message {
            mut publish,
            properties,
        } in messages
        {
            let qos = publish.qos as u8;
            publish.retain = true;
            publish.dup = false;
            publish.pkid = if qos == 0 { 0 } else { link.next_pkid() };
            let pkid = publish.pkid;
            packets.push(Packet::Publish(publish, properties));
            release_at_once(&mut packets, qos, pkid);
        }
        link.send(packets);
    }

    /// Wills go to the other nodes too, through `forward` (a cluster node).
    pub fn forward_wills(&self, forward: Forward) {
        let _ = self.forward.set(forward);
    }

    /// Publishes a client's Last Will at its QoS (a QoS 2 one is released
    /// at once, as a client would after the router's PUBREC), on every
    /// node of a cluster.
    pub fn publish_will(&self, will: LastWill, properties: Option<LastWillProperties>) {
        let (publish, properties) = will_publish(&will, properties, 0);
        self.publish_as_client(publish, properties);
    }

    /// Publishes what a client would have (a will), with a packet id of
    /// the broker's, on every node of a cluster.
    pub fn publish_as_client(&self, mut publish: Publish, properties: Option<PublishProperties>) {
        let mut link = self.link.lock();
        let qos = publish.qos as u8;
        publish.pkid = if qos == 0 { 0 } else { link.next_pkid() };
        let pkid = publish.pkid;
        if let Some(forward) = self.forward.get() {
            forward(&publish, properties.as_ref());
        }
        let mut packets = vec![Packet::Publish(publish, properties)];
        release_at_once(&mut packets, qos, pkid);
        link.send(packets);
    }
}

/// A QoS 2 publish of the broker's own is released at once (PUBREL after
/// it), as a client would after the router's PUBREC.
fn release_at_once(packets: &mut Vec<Packet>, qos: u8, pkid: u16) {
    if qos == 2 {
        let release = PubRel {
            pkid,
            reason: PubRelReason::Success,
        };
        packets.push(Packet::PubRel(release, None));
    }
}

/// A Last Will as the PUBLISH it becomes, with packet id `pkid`.
pub fn will_publish(
    will: &LastWill,
    properties: Option<LastWillProperties>,
    pkid: u16,
) -> (Publish, Option<PublishProperties>) {
    let publish = codec::publish(
        &will.topic,
        &will.message,
        will.qos as u8,
        pkid,
        will.retain,
    );
    let properties = properties.map(PublishProperties::from);
    (publish, properties)
}

/// The router acknowledges the publisher's QoS 1 publishes; nothing to do
/// with them.
async fn drain_acks(mut rx: LinkRx) {
    loop {
        match rx.next().await {
            Ok(Some(Notification::Unschedule)) => {
                if rx.wake().await.is_err() {
                    break;
                }
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    tracing::debug!("publisher link closed");
}
