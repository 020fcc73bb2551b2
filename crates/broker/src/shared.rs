//! What every connection task shares: the settings, the router, the state
//! store, the clients, the wills, the connection limit and the shutdown
//! signal; and how they are put together at start.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use tokio::sync::{Semaphore, watch};

use crate::activity::Activity;
use crate::authentication::Authenticator;
use crate::authorization::Authorizer;
use crate::config::Settings;
use crate::durable::Durable;
use crate::faults::Faults;
use crate::persistence::{Loaded, Persistence};
use crate::publisher::{INTERNAL_LINKS, Publisher};
use crate::sessions::{BeforeSending, Sessions};
use crate::sessions::{PacketIdBlock, Resumed};
use crate::standing::Standing;
use crate::store::StateStoreService;
use crate::tls::Tls;
use crate::will::WillRegistry;

/// What every connection task shares.
pub(crate) struct Shared {
    pub settings: Settings,
    pub router: router::RouterHandle,
    pub store: Arc<StateStoreService>,
    pub publisher: Arc<Publisher>,
    pub sessions: Arc<Sessions>,
    /// Retained messages and sessions on disk (with a data directory).
    pub durable: Option<Arc<Durable>>,
    pub wills: Arc<WillRegistry>,
    /// One permit per open client connection (`router.max_connections`
    /// in all).
    pub permits: Arc<Semaphore>,
    /// One per link from another cluster node (as many again): links do
    /// not take clients' places, and outlive the clients when the node
    /// stops (see [`Shared::hand_over_sessions`]).
    pub link_permits: Arc<Semaphore>,
    /// Becomes `true` when the links from other cluster nodes are to end
    /// (after the clients, when the node stops).
    pub stop_links: watch::Sender<bool>,
    /// The number the next connection gets (never reused).
    pub next_connection: AtomicU64,
    /// When the broker started (assigned client ids carry it).
    pub started_nanos: u128,
    /// When the broker started (for its uptime).
    pub started: std::time::Instant,
    /// The packet ids the router's deliveries take in sessions that start
    /// (or come back from the data directory) in this run: the run's
    /// number on its data directory, so that no id a client kept from
    /// the run before is used again (see [`PacketIdBlock`]).
    pub run_ids: PacketIdBlock,
    /// Requests and notifications as they happen (the web view's live list).
    pub activity: Arc<Activity>,
    /// Becomes `true` when the broker stops.
    pub shutdown: watch::Receiver<bool>,
    /// The password file and the throttle of failed attempts.
    pub authenticator: Authenticator,
    /// The authorization policy.
    pub authorizer: Authorizer,
    /// The TLS configurations of the listeners (reloaded on SIGHUP).
    pub tls: Vec<Arc<Tls>>,
    /// Faults on demand (none unless `[faults] enabled`).
    pub faults: Faults,
    /// Whether this node serves MQTT clients now (a cluster node: while it
    /// holds its membership lease).
    pub standing: Arc<Standing>,
    /// A cluster node's membership, links, client ownership and retained
    /// messages in etcd (their tasks end when this is dropped).
    #[cfg(feature = "cluster")]
    pub cluster_node: Option<crate::cluster::Node>,
}

impl Shared {
    /// Starts the router (with the MQTT side's journal, given a data
    /// directory), gives it back what was saved, starts the state store
    /// service and loads the password file and the policy: all a
    /// connection needs, before any listener accepts one.
    pub async fn build(
        settings: Settings,
        persistence: Option<(Arc<Persistence>, Loaded)>,
        tls: Vec<Arc<Tls>>,
        shutdown: watch::Receiver<bool>,
    ) -> std::io::Result<Arc<Shared>> {
        // The router's journal: what of the MQTT side survives a restart.
        let durable = persistence
            .as_ref()
            .map(|(persistence, _)| Durable::new(Arc::clone(persistence)));
        // The router enforces `[broker] max_kept_sessions` (patch 22), the
        // retained messages' bounds (patch 46) and those of QoS 2 publishes
        // waiting for their PUBREL (patch 47).
        let router_config = router::RouterConfig {
            max_kept_sessions: settings.broker.max_kept_sessions,
            queue_full: settings.broker.queue_full,
            max_retained_messages: settings.broker.max_retained_messages,
            max_retained_bytes: settings.broker.max_retained_bytes,
            internal_prefix: crate::publisher::INTERNAL_PREFIX.to_owned(),
            max_unreleased_qos2_bytes: settings.broker.max_unreleased_qos2_bytes,
            max_unreleased_qos2_bytes_total: settings.broker.max_unreleased_qos2_bytes_total,
            ..settings.router.clone()
        };
        #[cfg_attr(not(feature = "cluster"), allow(unused_mut))]
        let mut journal = durable
            .clone()
            .map(|durable| durable as Arc<dyn router::Journal>);
        // A cluster node keeps persistent sessions in etcd too.
        #[cfg(feature = "cluster")]
        let session_journal = settings.clustering.as_ref().map(|_| {
            let sessions = crate::cluster::SessionJournal::new(journal.take());
            journal = Some(Arc::clone(&sessions) as Arc<dyn router::Journal>);
            sessions
        });
        let router =
            router::RouterHandle::spawn(settings.router_id, router_config, INTERNAL_LINKS, journal);
        let sessions = Arc::new(Sessions::new(Arc::clone(router.subscriptions())));
        let publisher = Publisher::start(&router, Arc::clone(&sessions)).await?;
        let run_ids = persistence
            .as_ref()
            .map_or_else(PacketIdBlock::default, |(_, loaded)| {
                PacketIdBlock::new((loaded.starts % u64::from(PacketIdBlock::COUNT)) as u8)
            });
        let persistence = match (persistence, &durable) {
            (Some((persistence, mut loaded)), Some(durable)) => {
                let kept = crate::durable::Saved {
                    retained: std::mem::take(&mut loaded.retained),
                    sessions: std::mem::take(&mut loaded.sessions),
                    queued: std::mem::take(&mut loaded.queued),
                };
                let started = std::time::Instant::now();
                let (restore, restored) =
                    durable.restore(kept, settings.broker.max_session_expiry_secs);
                let decoded = started.elapsed();
                router
                    .restore(restore)
                    .await
                    .map_err(std::io::Error::other)?;
                let rebuilt = started.elapsed() - decoded;
                // Every saved session comes back and counts: the bound held
                // when they were made, so more than it means the bound was
                // lowered; new ones are refused until expiry makes room.
                let max_kept = settings.broker.max_kept_sessions;
                if max_kept > 0 && router.kept_sessions() > max_kept {
                    tracing::warn!(
                        kept_sessions = router.kept_sessions(),
                        max_kept_sessions = max_kept,
                        "more sessions restored than max_kept_sessions: all are kept, and CONNECTs that would keep a new one are refused until expiry brings them below it"
                    );
                }
                tracing::info!(
                    retained = restored.retained,
                    sessions = restored.sessions,
                    queued_messages = restored.queued,
                    expired_while_down = restored.expired,
                    unreadable = restored.unreadable,
                    read_ms = loaded.elapsed.as_millis() as u64,
                    decode_ms = decoded.as_millis() as u64,
                    router_ms = rebuilt.as_millis() as u64,
                    "restored retained messages and persistent sessions"
                );
                Some((persistence, loaded))
            }
            _ => None,
        };
        let activity = Arc::new(Activity::default());
        #[allow(unused_mut)] // set by a cluster node only
        let mut standing = Arc::new(Standing::always());
        #[cfg(feature = "cluster")]
        let mut cluster_node = None;
        let wills = WillRegistry::new(Arc::clone(&publisher));
        let store = match &settings.clustering {
            None => StateStoreService::start(
                settings.store_config(),
                persistence,
                Arc::clone(&publisher),
                Arc::clone(&activity),
            ),
            #[cfg(feature = "cluster")]
            Some(clustering) => {
                if let Some(p) = &settings.persistence {
                    tracing::info!(
                        data_dir = %p.data_dir.display(),
                        "clustering: the data directory keeps MQTT sessions and retained messages; the state store's keys are in etcd"
                    );
                }
                let cluster = crate::cluster::Cluster::connect(clustering.clone())
                    .await
                    .map_err(std::io::Error::other)?;
                let journal = session_journal.as_ref().expect("made with [clustering]");
                let node = crate::cluster::Node::start(
                    &cluster, &settings, &publisher, &sessions, &wills, &router, journal,
                )
                .await
                .map_err(std::io::Error::other)?;
                standing = node.standing();
                cluster_node = Some(node);
                StateStoreService::start_clustered(
                    settings.store_config(),
                    persistence,
                    Arc::clone(&publisher),
                    Arc::clone(&activity),
                    cluster,
                )
                .await
                .map_err(std::io::Error::other)?
            }
            #[cfg(not(feature = "cluster"))]
            Some(_) => {
                return Err(std::io::Error::other(
                    "[clustering] is configured, but this statebroker was built without clustering: build it with `cargo build --release --features cluster` (building needs protoc: apt-get install protobuf-compiler libprotobuf-dev)",
                ));
            }
        };
        let faults = Faults::new(&settings.faults).map_err(std::io::Error::other)?;
        if faults.enabled() {
            tracing::warn!(
                rules = settings.faults.rules.len(),
                clock_offset_ms = settings.faults.clock_offset_ms,
                "faults may be injected ([faults] enabled): a broker for tests only"
            );
            store.set_clock_offset(settings.faults.clock_offset_ms);
        }
        let authenticator = Authenticator::load(settings.password_file.as_deref())
            .map_err(std::io::Error::other)?;
        let authorizer =
            Authorizer::load(settings.authorization.as_deref()).map_err(std::io::Error::other)?;
        Ok(Arc::new(Shared {
            permits: Arc::new(Semaphore::new(settings.router.max_connections)),
            link_permits: Arc::new(Semaphore::new(settings.router.max_connections)),
            stop_links: watch::Sender::new(false),
            settings,
            router,
            store,
            publisher,
            sessions,
            durable,
            wills,
            next_connection: AtomicU64::new(1),
            started_nanos: crate::clock::now_nanos(),
            started: std::time::Instant::now(),
            run_ids,
            activity,
            shutdown,
            authenticator,
            authorizer,
            tls,
            faults,
            standing,
            #[cfg(feature = "cluster")]
            cluster_node,
        }))
    }

    /// Hands a publish of this node's clients to the other nodes (a
    /// cluster node; nothing on a single node), and a retained one to
    /// etcd; `properties` get the marks of the shared subscriptions
    /// another node delivers it to.
    /// A QoS 1/2 publish's forwarding ticket: its acknowledgement waits
    /// until [`Shared::forwarding_confirmed`] reaches it.
    #[inline]
    pub fn forward_to_peers(
        &self,
        _client: &str,
        _publish: &router::protocol::Publish,
        _properties: &mut Option<router::protocol::PublishProperties>,
    ) -> Option<u64> {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            return node.client_published(_client, _publish, _properties);
        }
        None
    }

    /// What connections ask before a QoS 2 delivery goes (see
    /// [`BeforeSending`]); `None` on a single node.
    pub fn before_sending(&self) -> Option<BeforeSending> {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            return node.before_sending();
        }
        None
    }

    /// Whether `client`'s QoS 2 `publish`, which it sends again here
    /// (DUP), came from another node before: its node died before its
    /// PUBREC (a cluster node; see `cluster::origins`).
    pub fn had_from_another_node(
        &self,
        _client: &str,
        _publish: &router::protocol::Publish,
    ) -> bool {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            let digest = crate::cluster::origins::digest(&_publish.topic, &_publish.payload);
            return node.origins().had(_client, _publish.pkid, digest);
        }
        false
    }

    /// Whether a QoS 2 publish another node forwarded with its `origin`
    /// (see `crate::publisher::ORIGIN`) is a copy sent again of one this
    /// node had (a cluster node; see `cluster::origins`).
    pub fn had_copy_from_another_node(&self, _origin: &str) -> bool {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            return node.origins().had_copy(_origin);
        }
        false
    }

    /// A QoS 2 publish `pkid` came on `via`'s connection (another node's
    /// link, or a client of this node) with `origin`, and waits in the
    /// router for its PUBREL (a cluster node; see `cluster::origins`);
    /// `None`: without one (a client's publish not sent again).
    pub fn hold_qos2(&self, _via: &str, _pkid: u16, _origin: Option<String>) {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            node.origins().hold(_via, _pkid, _origin);
        }
    }

    /// The origin of `client`'s QoS 2 `publish` if it is sent again (DUP)
    /// on a cluster node (see `cluster::origins`).
    pub fn resent_origin(
        &self,
        _client: &str,
        _publish: &router::protocol::Publish,
    ) -> Option<String> {
        #[cfg(feature = "cluster")]
        if self.cluster_node.is_some() && _publish.dup {
            return Some(crate::cluster::origins::origin(
                _client,
                _publish.pkid,
                true,
                &_publish.topic,
                &_publish.payload,
            ));
        }
        None
    }

    /// Whether messages handed over for `client_id` over the link with
    /// client id `link` are to be delivered (a cluster node: not those
    /// etcd gave already, see `cluster::awaited`).
    pub fn handover_welcome(&self, _link: &str, _client_id: &str) -> bool {
        #[cfg(feature = "cluster")]
        if let (Some(node), Some(from)) = (
            &self.cluster_node,
            _link.strip_prefix(crate::publisher::LINK_CLIENT_PREFIX),
        ) {
            return node.handover_welcome(from, _client_id);
        }
        true
    }

    /// A message handed over for `client_id` with `stamp`: to deliver
    /// now, or not (a cluster node: dropped, this node's router gave the
    /// session its own copy; or held back until it does; see
    /// `cluster::stamps`).
    pub fn stamped_handover(
        &self,
        _client_id: &str,
        _stamp: &str,
        message: crate::sessions::Direct,
    ) -> Option<crate::sessions::Direct> {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            return node.stamped_handover(_client_id, _stamp, message);
        }
        Some(message)
    }

    /// A message handed over for `client_id`'s session, to be delivered
    /// now: a cluster node keeps a copy in etcd until the client has it
    /// (see `cluster::queue`).
    pub fn keep_handed_over(&self, _client_id: &str, _message: &mut crate::sessions::Direct) {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            node.keep_handed_over(_client_id, _message);
        }
    }

    /// Another node's link (client id `link`) passes publish `pkid` at
    /// `qos` with `stamp` on to the router (a cluster node, see
    /// `cluster::stamps`; kept a while, see `cluster::recent`).
    pub fn stamp_arrived(
        &self,
        _link: &str,
        _qos: u8,
        _pkid: u16,
        _stamp: &str,
        _publish: &router::protocol::Publish,
        _properties: Option<&router::protocol::PublishProperties>,
    ) {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            node.stamp_arrived(_link, _qos, _pkid, _stamp);
            node.recent().note(_publish, _properties);
        }
    }

    /// Another node's link (client id `link`) says how far a node whose
    /// link broke had that node's publishes (a cluster node, see
    /// `cluster::recent`).
    pub fn heard_had(&self, _link: &str, _said: &str) {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node
            && !node.recent().heard(_said)
        {
            tracing::warn!(
                link = _link,
                said = _said,
                "clustering: a node's word on how far another had its publishes cannot be read: ignored"
            );
        }
    }

    /// The PUBREL of the QoS 2 publish `pkid` that came on `via`'s
    /// connection: whether the router is to deliver it (a cluster node:
    /// not a copy of a message this node had, see `cluster::origins`).
    /// The stamp of one it delivers goes to `_sending` (a cluster node):
    /// [`Shared::qos2_sent`] once it is in the router's queue.
    pub fn qos2_released(&self, _via: &str, _pkid: u16, _sending: &mut Vec<String>) -> bool {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            let released = node.origins().released(_via, _pkid);
            node.give_back(node.stamps().released(_via, _pkid, released, _sending));
            return released;
        }
        true
    }

    /// The PUBRELs whose stamps [`Shared::qos2_released`] put in `sent`
    /// are in the router's queue (or never will be: the connection ended).
    pub fn qos2_sent(&self, sent: &mut Vec<String>) {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            node.stamps().sent(sent);
        }
        sent.clear();
    }

    /// How far the other nodes have confirmed this node's forwarded
    /// publishes (a cluster node; `None` on a single node).
    pub fn forwarding_confirmed(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            return Some(node.peers().confirmed());
        }
        None
    }

    /// Records this node as the owner of `client_id` for `connection` (a
    /// cluster node: its connection on another node ends; in the
    /// background).
    /// `clean_start`: the session kept in etcd ends; `resumed`: the packet
    /// ids its router deliveries take, kept with its records, and the
    /// revision its session was read at (see [`Resumed`]); `will`: the
    /// connection's will, kept in etcd for the case its node dies, with
    /// the Session Expiry Interval that bounds its delay; `epoch`: the
    /// node's lease losses when the connection was accepted.
    pub fn claim_client(
        &self,
        _client_id: &str,
        _connection: u64,
        _clean_start: bool,
        _resumed: Resumed,
        _will: Option<(
            &router::protocol::LastWill,
            Option<&router::protocol::LastWillProperties>,
            u32,
        )>,
        _epoch: u64,
    ) {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            let will = _will.and_then(|(will, properties, session_expiry)| {
                crate::cluster::wills::encode(will, properties, session_expiry)
            });
            node.ownership().claim(
                _client_id,
                _connection,
                _clean_start,
                _resumed,
                will,
                _epoch,
            );
        }
    }

    /// `connection` of `client_id` ended (a cluster node: its ownership
    /// record goes, unless the session is `kept`).
    pub fn release_client(&self, _client_id: &str, _connection: u64, _kept: bool) {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            node.ownership().release(_client_id, _connection, _kept);
        }
    }

    /// Before a CONNECT with Clean Start 0 of `client_id` links: a cluster
    /// node makes its router's session the current one across the cluster
    /// (it may come from etcd). Returns the packet ids the session's
    /// router deliveries take (see [`PacketIdBlock`]: on a single node the
    /// run's; on a cluster node the next block when the session moved
    /// here), and the etcd revision it was read at (see [`Resumed`]).
    /// `Err`: etcd did not answer.
    pub async fn resume_session(&self, _client_id: &str) -> Result<Resumed, String> {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            let max_expiry = self.settings.broker.max_session_expiry_secs;
            return node.resume(_client_id, max_expiry, self.run_ids).await;
        }
        Ok(Resumed {
            ids: self.run_ids,
            read: (0, 0),
            was_here: true,
            awaits_handover: false,
        })
    }

    /// The broker stops normally and its clients are gone; a cluster
    /// node's links to the other nodes are still up. Waits, until
    /// `deadline`, for the other nodes to take the sessions of the
    /// clients `leaving` names (they come back there and the messages
    /// queued here are handed over), then writes to etcd the messages
    /// queued for the sessions left (see `cluster::ownership::leaving`).
    pub async fn hand_over_sessions(&self, _leaving: Leaving, _deadline: tokio::time::Instant) {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            node.hand_over_sessions(&_leaving.0, _deadline).await;
        }
    }

    /// The clients connected now, whose sessions a cluster node that
    /// stops waits to hand over (see [`Shared::hand_over_sessions`]).
    pub fn leaving(&self) -> Leaving {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            return Leaving(node.ownership().connected_clients());
        }
        Leaving(Default::default())
    }

    /// The broker stops normally, its clients and links gone (a cluster
    /// node: it writes to etcd what was queued since
    /// [`Shared::hand_over_sessions`], removes its clients' will records
    /// from etcd, so that no other node publishes them, and revokes its
    /// membership lease, so that another node adopts the sessions left).
    pub async fn leave_cluster(&self) {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            node.flush_queue().await;
            node.ownership().forget_wills().await;
            node.leave().await;
        }
    }

    /// Whether the node takes clients: a cluster node once every other
    /// node has linked to it (see `cluster::peers`); always on a single node.
    pub fn takes_clients(&self) -> bool {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            return node.peers().joined();
        }
        true
    }

    /// Another node's link to this one connected (`up`) or ended.
    pub fn inbound_link(&self, _node: &str, _connection: u64, _epoch: u64, _up: bool) {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            node.peers().inbound_link(_node, _connection, _epoch, _up);
        }
    }

    /// The node id of another node whose link this CONNECT is (client id
    /// and login), if it is one.
    pub fn peer_link<'a>(
        &self,
        _client_id: &'a str,
        _login: Option<(&str, &str)>,
    ) -> Option<&'a str> {
        #[cfg(feature = "cluster")]
        if let Some(node) = &self.cluster_node {
            return node.peers().link_login(_client_id, _login);
        }
        None
    }
}

/// The clients connected when the broker began to stop (see
/// [`Shared::leaving`]).
pub struct Leaving(
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))] std::collections::HashSet<String>,
);
