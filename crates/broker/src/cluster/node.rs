//! A cluster node's MQTT side, started together and owned in one place:
//! its membership, its links to the other nodes, the ownership of client
//! ids, and the retained messages kept in etcd. Their tasks end when the
//! node is dropped (with the broker's shared state).

use std::sync::Arc;

use router::protocol::{Publish, PublishProperties};

use super::origins::Origins;
use super::recent::Recent;
use super::sessions;
use super::stamps::{HeldBack, Stamps, Verdict};
use super::{
    Awaited, Cluster, Membership, Ownership, Peers, Queue, Retained, SessionJournal, Shares,
};
use crate::config::Settings;
use crate::publisher::Publisher;
use crate::sessions::{Sending, Sessions};
use crate::standing::Standing;
use crate::will::WillRegistry;

/// How long a stopping node waits, at most, for the other nodes to adopt
/// the sessions it offers (they take milliseconds; one not adopted then
/// is adopted once the node has left).
const OFFER_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// See the module's documentation.
pub struct Node {
    cluster: Arc<Cluster>,
    router: router::RouterHandle,
    membership: Arc<Membership>,
    peers: Arc<Peers>,
    ownership: Arc<Ownership>,
    retained: Arc<Retained>,
    shares: Arc<Shares>,
    queue: Arc<Queue>,
    awaited: Arc<Awaited>,
    origins: Origins,
    stamps: Arc<Stamps>,
    /// The publishes of the last seconds (see [`super::recent`]).
    recent: Arc<Recent>,
    sessions: Arc<Sessions>,
    /// What connections ask before a QoS 2 delivery goes (one for all).
    before_sending: crate::sessions::BeforeSending,
}

impl Node {
    /// Registers the node, opens its links, publishes the retained
    /// messages kept in etcd into its router (before any client connects:
    /// no subscriber gets them twice) and starts watching client ownership;
    /// the router's `journal` keeps sessions in etcd from then on.
    pub async fn start(
        cluster: &Arc<Cluster>,
        settings: &Settings,
        publisher: &Arc<Publisher>,
        sessions: &Arc<Sessions>,
        wills: &Arc<WillRegistry>,
        router: &router::RouterHandle,
        journal: &SessionJournal,
    ) -> Result<Node, String> {
        let listeners = settings
            .listeners
            .iter()
            .map(|l| format!("{}://{}", l.scheme(), l.addr))
            .collect();
        let membership =
            Membership::join(Arc::clone(cluster), listeners, peer_address(settings)).await?;
        let stamps = Arc::new(Stamps::new(
            cluster.node_id(),
            crate::clock::now_nanos() as u64,
        ));
        let recent = Arc::new(Recent::new(
            cluster.settings.recent_publishes_bytes,
            cluster.settings.lease_ttl * 2 + std::time::Duration::from_secs(10),
        ));
        let peers = Peers::start(
            cluster,
            membership.watch(),
            membership.standing(),
            Arc::clone(&stamps),
            Arc::clone(&recent),
        )
        .await?;
        let shares = Shares::start(cluster, &membership, router.shared_groups())
            .await
            .map_err(|e| format!("cannot read shared subscriptions from etcd: {e}"))?;
        let retained = Retained::start(Arc::clone(cluster));
        // Wills go to the other nodes as a client's publish does, and a
        // retained one to etcd (before, a retained will was not kept there:
        // a node that started again without its data directory, or was
        // down when the will came, never had it).
        let (links, kept) = (Arc::downgrade(&peers), Arc::downgrade(&retained));
        let will_stamps = Arc::clone(&stamps);
        publisher.forward_wills(Box::new(move |publish, properties| {
            if let Some(links) = links.upgrade() {
                links.forward(publish, properties, &Vec::new(), None, &will_stamps);
            }
            if publish.retain
                && let Some(kept) = kept.upgrade()
            {
                kept.keep(publish, properties);
            }
        }));
        let messages = retained
            .load()
            .await
            .map_err(|e| format!("cannot read retained messages from etcd: {e}"))?;
        tracing::info!(
            retained = messages.len(),
            "clustering: retained messages read from etcd"
        );
        publisher.restore_retained(messages);
        let ownership = Ownership::start(
            Arc::clone(cluster),
            Arc::clone(&membership),
            Arc::clone(sessions),
            Arc::clone(wills),
            router.clone(),
            Arc::clone(&peers),
            settings.faults.claim_delay(),
        )
        .await
        .map_err(|e| format!("cannot watch client ownership in etcd: {e}"))?;
        let queue = Queue::start(Arc::clone(cluster), journal.has_data_dir());
        journal.attach(&ownership, &queue);
        ownership.attach(&queue);
        let weak = Arc::downgrade(&queue);
        let before_sending: crate::sessions::BeforeSending = Arc::new(move |client, sending| {
            let queue = weak.upgrade()?;
            match sending {
                Sending::Publish {
                    number,
                    publish,
                    properties,
                } => queue.sending(client, number, publish, properties),
                Sending::PubRel(pkid) => queue.releasing(client, pkid),
            }
        });
        let awaited = Awaited::new(
            Arc::clone(&queue),
            Arc::clone(sessions),
            membership.watch(),
            cluster.settings.lease_ttl * 2 + cluster.settings.request_timeout,
            cluster.stop.subscribe(),
        );
        tokio::spawn(super::orphans::run(super::orphans::Orphans {
            cluster: Arc::downgrade(cluster),
            ownership: Arc::downgrade(&ownership),
            queue: Arc::downgrade(&queue),
            router: router.clone(),
            peers: Arc::downgrade(&peers),
            awaited: Arc::downgrade(&awaited),
            stamps: Arc::downgrade(&stamps),
            recent: Arc::downgrade(&recent),
            membership: Arc::downgrade(&membership),
            sessions: Arc::downgrade(sessions),
            standing: membership.standing(),
            max_expiry: settings.broker.max_session_expiry_secs,
            max_kept: settings.broker.max_kept_sessions,
        }));
        tokio::spawn(super::wills::run(
            Arc::downgrade(cluster),
            membership.watch(),
            Arc::clone(publisher),
        ));
        Ok(Node {
            cluster: Arc::clone(cluster),
            router: router.clone(),
            membership,
            peers,
            ownership,
            retained,
            shares,
            queue,
            awaited,
            origins: Origins::default(),
            stamps,
            recent,
            sessions: Arc::clone(sessions),
            before_sending,
        })
    }

    /// Whether the node serves, as its membership lease says.
    pub fn standing(&self) -> Arc<Standing> {
        self.membership.standing()
    }

    /// The node's links to the others, and theirs to it.
    pub fn peers(&self) -> &Peers {
        &self.peers
    }

    /// The QoS 2 publishes this node had from the others, by origin.
    pub fn origins(&self) -> &Origins {
        &self.origins
    }

    /// Whether a handover for `client_id` that came over `node`'s link is
    /// to be delivered (see [`super::awaited`]).
    pub fn handover_welcome(&self, node: &str, client_id: &str) -> bool {
        self.awaited.came(client_id, node)
    }

    /// What this node's router had (see [`super::stamps`]).
    pub fn stamps(&self) -> &Stamps {
        &self.stamps
    }

    /// The publishes of the last seconds (see [`super::recent`]).
    pub fn recent(&self) -> &Recent {
        &self.recent
    }

    /// A message handed over for `client_id` with `stamp`: `Some` to
    /// deliver now; dropped if this node's router gave the session its
    /// own copy, held back while the router holds one for its PUBREL
    /// (delivered if that copy is not released within
    /// [`HOLD_BACK_MAX`]; see [`super::stamps`]).
    pub fn stamped_handover(
        &self,
        client_id: &str,
        stamp: &str,
        message: crate::sessions::Direct,
    ) -> Option<crate::sessions::Direct> {
        let topic = std::str::from_utf8(&message.topic).ok()?;
        match self.stamps.judge(client_id, stamp, topic) {
            Verdict::Had => {
                crate::metrics::handed_over_had();
                tracing::debug!(
                    client_id,
                    stamp,
                    "a handed-over message dropped: this node's router gave it to the session after taking it"
                );
                None
            }
            Verdict::Coming => {
                // Too many held back already: delivered now.
                let Some(message) = self.stamps.hold_back(stamp, client_id, message) else {
                    let (stamps, sessions) =
                        (Arc::downgrade(&self.stamps), Arc::downgrade(&self.sessions));
                    let stamp = stamp.to_owned();
                    tokio::spawn(async move {
                        tokio::time::sleep(HOLD_BACK_MAX).await;
                        if let (Some(stamps), Some(sessions)) =
                            (stamps.upgrade(), sessions.upgrade())
                        {
                            deliver(&sessions, stamps.give_back(&stamp));
                        }
                    });
                    return None;
                };
                Some(message)
            }
            Verdict::New => Some(message),
        }
    }

    /// A QoS 1 message handed over for `client_id`'s session is kept in
    /// etcd by this node too until the client has it (see
    /// [`Queue::keep_handed_over`]): its `on_done` removes the copy.
    pub fn keep_handed_over(&self, client_id: &str, message: &mut crate::sessions::Direct) {
        self.queue.keep_direct(client_id, message);
    }

    /// Delivers handed-over messages held back that are to go after all.
    pub fn give_back(&self, back: Vec<HeldBack>) {
        deliver(&self.sessions, back);
    }

    /// Publish `pkid` at `qos` with `stamp` goes to the router on
    /// connection `via` (a client's, or another node's link): noted
    /// before the router has it, a QoS 2 one at its PUBREL (see
    /// [`super::stamps`]).
    pub fn stamp_arrived(&self, via: &str, qos: u8, pkid: u16, stamp: &str) {
        if qos == 2 {
            self.give_back(self.stamps.held(via, pkid, stamp));
        } else {
            self.stamps.arrived(stamp);
        }
    }

    /// Which node each client id is connected to.
    pub fn ownership(&self) -> &Arc<Ownership> {
        &self.ownership
    }

    /// The node stops and its clients are gone: waits until `deadline`
    /// for the other nodes to take the sessions of `clients` (those
    /// connected when it began to stop), then writes the
    /// messages queued for those left to etcd (see
    /// `ownership::leaving`).
    pub async fn hand_over_sessions(
        &self,
        clients: &std::collections::HashSet<String>,
        deadline: tokio::time::Instant,
    ) {
        let left = self.ownership.wait_moved(clients, deadline).await;
        // The rest go to the other nodes while the links are up (see
        // `Ownership::offer_kept`), if there are others.
        let offered = if self.membership.members().len() > 1 {
            self.ownership.offer_kept().await
        } else {
            Default::default()
        };
        let wait = deadline.min(tokio::time::Instant::now() + OFFER_WAIT);
        let not_adopted = self.ownership.wait_moved(&offered, wait).await;
        let kept = self.ownership.kept_sessions();
        tracing::info!(
            connected_at_stop = clients.len(),
            not_back_in_time = left,
            offered = offered.len(),
            not_adopted,
            kept_here = kept,
            "clustering: stopping: the sessions of the clients connected at the stop went to the nodes they came back to, and those kept here were offered to the others; what is queued for those still here is written to etcd"
        );
        self.flush_queue().await;
    }

    /// The node stops: it leaves the cluster (see [`Membership::leave`]).
    pub async fn leave(&self) {
        self.membership.leave().await;
    }

    /// Writes what waits to be written to etcd's queue now (at most
    /// etcd's request timeout).
    pub async fn flush_queue(&self) {
        let left = self
            .queue
            .flush(self.cluster.settings.request_timeout)
            .await;
        if left > 0 {
            tracing::warn!(
                writes = left,
                "clustering: stopping: messages queued for sessions not written to etcd (etcd did not take them in time): they are lost with this node"
            );
        }
    }

    /// What a connection asks before a QoS 2 delivery goes (see
    /// [`Queue::sending`]).
    pub fn before_sending(&self) -> Option<crate::sessions::BeforeSending> {
        Some(Arc::clone(&self.before_sending))
    }

    /// Makes the router's session of `client_id` the current one across
    /// the cluster before a CONNECT with Clean Start 0 links (see
    /// [`sessions::resume`]).
    pub async fn resume(
        &self,
        client_id: &str,
        max_expiry: u32,
        fresh: crate::sessions::PacketIdBlock,
    ) -> Result<crate::sessions::Resumed, String> {
        let node = sessions::Resume {
            ownership: &self.ownership,
            queue: &self.queue,
            awaited: &self.awaited,
            stamps: &self.stamps,
            recent: &self.recent,
            peers: &self.peers,
            router: &self.router,
            sessions: &self.sessions,
            timeout: self.cluster.settings.request_timeout,
            client: self.cluster.client.clone(),
        };
        sessions::resume(node, client_id, max_expiry, fresh).await
    }

    /// A client of this node published `publish`: to every other node,
    /// and to etcd if retained. `properties` get this node's marks (see
    /// [`Shares`]) and the publish's stamp (see [`super::stamps`]) for its
    /// own router; a QoS 2 publish goes with its
    /// origin, `client`'s (see [`super::origins`]). A QoS 1/2 publish's
    /// forwarding ticket (see [`Peers::forward`]).
    pub fn client_published(
        &self,
        client: &str,
        publish: &Publish,
        properties: &mut Option<PublishProperties>,
    ) -> Option<u64> {
        let topic = std::str::from_utf8(&publish.topic).unwrap_or_default();
        let own = self.shares.node_id();
        let assignment = self
            .shares
            .assign(topic, |node| node == own || self.peers.link_to_is_up(node));
        let origin = (publish.qos == router::protocol::QoS::ExactlyOnce).then(|| {
            super::origins::origin(
                client,
                publish.pkid,
                publish.dup,
                &publish.topic,
                &publish.payload,
            )
        });
        let (ticket, stamp) = self.peers.forward(
            publish,
            properties.as_ref(),
            &assignment,
            origin,
            &self.stamps,
        );
        if publish.retain {
            self.retained.keep(publish, properties.as_ref());
        }
        let own = properties.get_or_insert_with(Default::default);
        if !assignment.is_empty() {
            Shares::mark(&assignment, self.shares.node_id(), own);
        }
        self.stamp_arrived(client, publish.qos as u8, publish.pkid, &stamp);
        own.user_properties.push((
            router::protocol::ByteString::from_static(crate::publisher::STAMP),
            stamp.into(),
        ));
        self.recent.note(publish, properties.as_ref());
        ticket
    }
}

/// How long a handed-over message waits, at most, for the router's own
/// copy's PUBREL (see [`Node::stamped_handover`]): a link's PUBREL comes
/// within milliseconds, or after its reconnection.
const HOLD_BACK_MAX: std::time::Duration = std::time::Duration::from_secs(5);

/// Delivers handed-over messages held back (see [`super::stamps`]).
fn deliver(sessions: &Sessions, back: Vec<HeldBack>) {
    for b in back {
        tracing::debug!(
            client_id = b.client,
            "a handed-over message held back is delivered: this node's router did not deliver its own copy"
        );
        sessions.deliver_handed_over(&b.client, b.message);
    }
}

/// Where the other nodes' links reach this node: `[clustering]
/// peer_address`, or the first plain TCP listener's address (127.0.0.1 for
/// an unspecified one).
fn peer_address(settings: &Settings) -> Option<String> {
    if let Some(address) = settings
        .clustering
        .as_ref()
        .and_then(|c| c.peer_address.as_ref())
    {
        return Some(address.clone());
    }
    let listener = settings.listeners.iter().find(|l| l.scheme() == "mqtt");
    let Some(listener) = listener else {
        tracing::warn!(
            "clustering: no plain TCP MQTT listener: the other nodes cannot forward their clients' publishes here; set [clustering] peer_address"
        );
        return None;
    };
    let mut addr = listener.addr;
    if addr.ip().is_unspecified() {
        addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        tracing::warn!(
            listener = %listener.addr,
            "clustering: the other nodes reach this one at {addr}, which serves nodes on this machine only: set [clustering] peer_address to an address they can reach"
        );
    }
    Some(addr.to_string())
}
