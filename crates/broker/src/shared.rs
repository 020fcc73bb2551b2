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
use crate::sessions::Sessions;
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
    /// One permit per open connection (`router.max_connections` in all).
    pub permits: Arc<Semaphore>,
    /// The number the next connection gets (never reused).
    pub next_connection: AtomicU64,
    /// When the broker started (assigned client ids carry it).
    pub started_nanos: u128,
    /// When the broker started (for its uptime).
    pub started: std::time::Instant,
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
    /// A cluster node's registration (its task ends when this is dropped).
    #[cfg(feature = "cluster")]
    pub _membership: Option<Arc<crate::cluster::Membership>>,
    /// A cluster node's links to the other nodes.
    #[cfg(feature = "cluster")]
    pub peers: Option<Arc<crate::cluster::Peers>>,
    /// Which node each client id is connected to (a cluster node).
    #[cfg(feature = "cluster")]
    pub ownership: Option<Arc<crate::cluster::Ownership>>,
    /// Retained messages on their way to etcd (a cluster node).
    #[cfg(feature = "cluster")]
    pub retained: Option<Arc<crate::cluster::Retained>>,
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
        // The router enforces `[broker] max_kept_sessions` (patch 22).
        let router_config = router::RouterConfig {
            max_kept_sessions: settings.broker.max_kept_sessions,
            queue_full: settings.broker.queue_full,
            ..settings.router.clone()
        };
        let router = router::RouterHandle::spawn(
            settings.router_id,
            router_config,
            INTERNAL_LINKS,
            durable
                .clone()
                .map(|durable| durable as Arc<dyn router::Journal>),
        );
        let sessions = Arc::new(Sessions::new(Arc::clone(router.subscriptions())));
        let publisher = Publisher::start(&router, Arc::clone(&sessions)).await?;
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
        let (mut membership, mut peers, mut ownership, mut retained) = (None, None, None, None);
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
                let listeners = settings
                    .listeners
                    .iter()
                    .map(|l| format!("{}://{}", l.scheme(), l.addr))
                    .collect();
                let peer_address = peer_address(&settings, clustering);
                let member =
                    crate::cluster::Membership::join(Arc::clone(&cluster), listeners, peer_address)
                        .await
                        .map_err(std::io::Error::other)?;
                standing = member.standing();
                let links = crate::cluster::Peers::start(&cluster, member.watch())
                    .await
                    .map_err(std::io::Error::other)?;
                let weak = Arc::downgrade(&links);
                publisher.forward_wills(Box::new(move |publish, properties| {
                    if let Some(links) = weak.upgrade() {
                        links.forward(publish, properties);
                    }
                }));
                peers = Some(links);
                // The retained messages the cluster keeps in etcd, before
                // any client connects (no subscriber gets them twice).
                let kept = crate::cluster::Retained::start(Arc::clone(&cluster));
                let messages = kept.load().await.map_err(|e| {
                    std::io::Error::other(format!("cannot read retained messages from etcd: {e}"))
                })?;
                tracing::info!(
                    retained = messages.len(),
                    "clustering: retained messages read from etcd"
                );
                publisher.restore_retained(messages);
                retained = Some(kept);
                ownership = Some(
                    crate::cluster::Ownership::start(
                        Arc::clone(&cluster),
                        Arc::clone(&member),
                        Arc::clone(&sessions),
                    )
                    .await
                    .map_err(|e| {
                        std::io::Error::other(format!("cannot watch client ownership in etcd: {e}"))
                    })?,
                );
                membership = Some(member);
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
        let wills = WillRegistry::new(Arc::clone(&publisher));
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
            activity,
            shutdown,
            authenticator,
            authorizer,
            tls,
            faults,
            standing,
            #[cfg(feature = "cluster")]
            _membership: membership,
            #[cfg(feature = "cluster")]
            peers,
            #[cfg(feature = "cluster")]
            ownership,
            #[cfg(feature = "cluster")]
            retained,
        }))
    }

    /// Hands a publish of this node's clients to the other nodes (a
    /// cluster node; nothing on a single node), and a retained one to
    /// etcd.
    #[inline]
    pub fn forward_to_peers(
        &self,
        _publish: &router::protocol::Publish,
        _properties: Option<&router::protocol::PublishProperties>,
    ) {
        #[cfg(feature = "cluster")]
        if let Some(peers) = &self.peers {
            peers.forward(_publish, _properties);
            if _publish.retain
                && let Some(retained) = &self.retained
            {
                retained.keep(_publish, _properties);
            }
        }
    }

    /// Records this node as the owner of `client_id` for `connection` (a
    /// cluster node: its connection on another node ends; in the
    /// background).
    pub fn claim_client(&self, _client_id: &str, _connection: u64) {
        #[cfg(feature = "cluster")]
        if let Some(ownership) = &self.ownership {
            ownership.claim(_client_id, _connection);
        }
    }

    /// `connection` of `client_id` ended (a cluster node: its ownership
    /// record goes).
    pub fn release_client(&self, _client_id: &str, _connection: u64) {
        #[cfg(feature = "cluster")]
        if let Some(ownership) = &self.ownership {
            ownership.release(_client_id, _connection);
        }
    }

    /// Whether the node takes clients: a cluster node once every other
    /// node has linked to it (see `cluster::peers`); always on a single node.
    pub fn takes_clients(&self) -> bool {
        #[cfg(feature = "cluster")]
        if let Some(peers) = &self.peers {
            return peers.joined();
        }
        true
    }

    /// Another node's link to this one connected (`up`) or ended.
    pub fn inbound_link(&self, _node: &str, _up: bool) {
        #[cfg(feature = "cluster")]
        if let Some(peers) = &self.peers {
            peers.inbound_link(_node, _up);
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
        if let Some(peers) = &self.peers {
            return peers.link_login(_client_id, _login);
        }
        None
    }
}

/// Where the other nodes' links reach this node: `[clustering]
/// peer_address`, or the first plain TCP listener's address (127.0.0.1 for
/// an unspecified one).
#[cfg(feature = "cluster")]
fn peer_address(
    settings: &Settings,
    clustering: &crate::config::ClusteringSettings,
) -> Option<String> {
    if let Some(address) = &clustering.peer_address {
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
