//! statebroker's MQTT side.
//!
//! ```text
//!  accept (listener.rs: TCP, TCP_NODELAY on every socket; then tls.rs
//!         │  and/or websocket.rs when the listener asks for them)
//!         │  any AsyncRead + AsyncWrite (connection/socket.rs), MQTT 3.1.1 / 5
//!         │  codecs from rumqttd, guarded (codec.rs)
//!         ▼
//!  connection task, one per client (connection/)
//!    who it is: authentication.rs (passwords.rs, a client certificate)
//!    what it may do: authorization/ (the policy; store keys via
//!    statestore::KeyAccess)
//!    handshake.rs: CONNECT checks, CONNACK      subscriptions.rs: SUBSCRIBE policy
//!    outbound/: acks, in-flight windows         mod.rs: run loop, dispatch, teardown
//!    │ state store requests ──────────────► store/: binding.rs (request rules,
//!    │                                       response properties), service/
//!    │                                       (statestore::Store; expiry.rs,
//!    │                                       durable.rs: persistence first)
//!    │                                            │ answers, notifications
//!    │                                            ▼
//!    │ ◄── direct deliveries ─────────────── publisher.rs: straight to the only
//!    │     (subscription mirror: sessions/)      recipient, or into the router;
//!    │                                           wills (will.rs) go out here too
//!    │ other packets, on first need: a router::local link
//!    ▼
//!  rumqttd router (router.rs): routing, QoS, sessions, retained messages,
//!  shared subscriptions
//! ```
//!
//! With a data directory, `persistence.rs` (fjall, group commit) keeps the
//! store's persisted keys, and `durable/` retained messages, persistent
//! sessions and the messages queued for them: a connection's `gate.rs`
//! holds what must be on disk before the router may act on it, its
//! `saved.rs` saves and releases queued messages, and `Broker::start`
//! restores it all before listening.
//!
//! Data flows one way: a module only uses modules below it in this picture
//! (and the leaves: `config`, `clock`, `codec`, `topics`, `persistence`,
//! `metrics`, `passwords`).
//!
//! [`Broker::start`] runs it all inside the current tokio runtime; the
//! `statebroker` binary and the end-to-end tests both use it.

#![warn(missing_docs)]

pub(crate) mod activity;
pub(crate) mod authentication;
pub(crate) mod authorization;
#[doc(hidden)]
pub mod bench;
pub(crate) mod clock;
#[cfg(feature = "cluster")]
pub(crate) mod cluster;
pub mod codec;
pub mod config;
mod connection;
pub(crate) mod durable;
pub mod fault_control;
pub mod faults;
pub(crate) mod http;
mod listener;
pub(crate) mod metrics;
pub mod passwords;
pub(crate) mod persistence;
pub(crate) mod publisher;
pub mod reload;
pub mod request_publish;
pub(crate) mod sessions;
mod shared;
pub(crate) mod standing;
pub(crate) mod stats;
pub(crate) mod store;
pub mod sys;
pub(crate) mod tls;
pub(crate) mod topics;
mod web;
pub mod websocket;
pub(crate) mod will;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::watch;

pub use config::Settings;
use shared::Shared;
pub use store::StateStoreService;

/// A broker ready to start.
pub struct Broker;

/// A running broker.
pub struct RunningBroker {
    addrs: Vec<SocketAddr>,
    http: Option<SocketAddr>,
    ready: Arc<AtomicBool>,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
}

impl Broker {
    /// Binds every listener, starts the router and the state store service,
    /// and starts accepting clients. Returns once the broker is serving.
    pub async fn start(settings: Settings) -> std::io::Result<RunningBroker> {
        clock::warm_up();
        for advice in settings.advisories() {
            tracing::warn!("{advice}");
        }
        let (stop, shutdown) = watch::channel(false);
        let ready = Arc::new(AtomicBool::new(false));
        let described = web::Broker::default();
        let http = match settings.http {
            Some(addr) => Some(
                http::start(
                    addr,
                    &settings.http_options,
                    Arc::clone(&ready),
                    Arc::clone(&described),
                    shutdown.clone(),
                )
                .await?,
            ),
            None => None,
        };
        let persistence = match &settings.persistence {
            Some(p) => {
                let (opened, loaded) =
                    persistence::Persistence::open(p).map_err(std::io::Error::other)?;
                tracing::info!(data_dir = %p.data_dir.display(), mode = ?p.mode, "persistence on");
                Some((Arc::new(opened), loaded))
            }
            None => {
                tracing::info!(
                    "persistence off: keys, retained messages and sessions live in memory only"
                );
                None
            }
        };
        let mut sockets = Vec::new();
        let mut tls_configs = Vec::new();
        for (index, listener) in settings.listeners.iter().enumerate() {
            let tls = match &listener.tls {
                Some(files) => {
                    let tls = tls::Tls::load(index, files).map_err(|e| {
                        std::io::Error::other(format!("{} ({}): {e}", listener.name, listener.addr))
                    })?;
                    let tls = Arc::new(tls);
                    tls_configs.push(Arc::clone(&tls));
                    Some(tls)
                }
                None => None,
            };
            let socket = match listener::bind(listener.addr) {
                Ok(socket) => socket,
                Err(e)
                    if listener::no_such_address(&e)
                        && listener.addr == listener::IPV6_LOOPBACK_DEFAULT
                        && settings.listeners.len() > 1 =>
                {
                    tracing::warn!(addr = %listener.addr, error = %e, "no IPv6 loopback on this machine: not listening there");
                    continue;
                }
                Err(e) => {
                    return Err(std::io::Error::new(
                        e.kind(),
                        format!(
                            "cannot listen on {} ({}): {e}",
                            listener.addr, listener.name
                        ),
                    ));
                }
            };
            sockets.push((socket, Arc::new(listener.clone()), tls));
        }
        let shared = Shared::build(settings, persistence, tls_configs, shutdown).await?;
        let _ = described.set(Arc::clone(&shared));
        let sys_interval = shared.settings.broker.sys_interval;
        if sys_interval > 0 {
            tokio::spawn(sys::publish_every(
                Arc::clone(&shared),
                Duration::from_secs(sys_interval),
            ));
        }
        // A cluster node that loses its membership sends its clients away.
        tokio::spawn(send_away_when_not_serving(Arc::clone(&shared)));
        // The web view's chart of requests and messages per second.
        if http.is_some() {
            tokio::spawn(web::sample_rates(Arc::clone(&shared)));
        }
        tokio::spawn(end_expired_sessions(
            Arc::clone(&shared.sessions),
            shared.shutdown.clone(),
        ));
        // Every socket is bound: what the endpoint serves (not before, so
        // that no line announces an endpoint when a bind then fails).
        http::Parts {
            addr: http,
            options: &shared.settings.http_options,
            password_file: shared.authenticator.has_password_file(),
            policy: shared.authorizer.current().is_some(),
            allow_edit: shared.settings.http_allow_edit,
            faults: shared.settings.faults.enabled,
        }
        .log();
        let mut addrs = Vec::new();
        for (socket, listener, tls) in sockets {
            let addr = socket.local_addr()?;
            tracing::info!(%addr, listener = listener.name, scheme = listener.scheme(), allow_anonymous = listener.allow_anonymous, "listening (MQTT 3.1.1 and 5)");
            addrs.push(addr);
            tokio::spawn(listener::accept_loop(
                socket,
                listener,
                tls,
                Arc::clone(&shared),
            ));
        }
        listener::explain(&shared.settings.listeners);
        listener::warn_unreachable(
            &shared.settings.listeners,
            shared.authenticator.has_password_file(),
        );
        ready.store(true, Ordering::Release);
        Ok(RunningBroker {
            addrs,
            http,
            ready,
            shared,
            stop,
        })
    }
}

impl RunningBroker {
    /// The address of the first listener (with the real port if 0 was configured).
    pub fn local_addr(&self) -> SocketAddr {
        self.addrs[0]
    }

    /// Controls this broker's faults (refused unless `[faults] enabled`).
    pub fn faults(&self) -> fault_control::FaultControl {
        fault_control::FaultControl::new(Arc::clone(&self.shared))
    }

    /// The address of the HTTP endpoint, if it is on.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http
    }

    /// Becomes `true` if the router's thread ends while the broker runs (a
    /// bug: it panicked, see the log). Nothing MQTT works after it; the
    /// binary exits with an error, for its supervisor to restart it.
    pub fn router_stopped(&self) -> watch::Receiver<bool> {
        self.shared.router.stopped()
    }

    /// Reads the password file, the authorization policy and the TLS
    /// certificates in use again and applies what changed, all or nothing:
    /// if any does not load, each error is logged and nothing changes.
    /// Returns whether it was applied.
    pub fn reload(&self) -> bool {
        let mut same = self.shared.settings.clone();
        same.password_file = self.shared.authenticator.path();
        same.authorization = self.shared.authorizer.path();
        for tls in &self.shared.tls {
            same.listeners[tls.listener()].tls = Some(tls.files());
        }
        match self.prepare_reload(&same) {
            Ok(prepared) => {
                prepared.apply();
                true
            }
            Err(errors) => {
                for e in errors {
                    tracing::error!("reload refused: {e}");
                }
                false
            }
        }
    }

    /// SIGHUP, first step: reads and checks everything `new` (the
    /// configuration read again) names, as a start would, and sees what
    /// differs from what runs; changes nothing. `Err`: why the reload must
    /// be refused, one line per problem, each naming its setting. See
    /// [`reload`] for what [`reload::Prepared::apply`] then applies and
    /// what needs a restart.
    pub fn prepare_reload(&self, new: &Settings) -> Result<reload::Prepared, Vec<String>> {
        reload::prepare(&self.shared, new)
    }

    /// The addresses of every listener.
    pub fn local_addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// The state store service (for tests and tools).
    pub fn store(&self) -> &Arc<StateStoreService> {
        &self.shared.store
    }

    /// Connections open right now.
    pub fn connection_count(&self) -> usize {
        self.shared.settings.router.max_connections - self.shared.permits.available_permits()
    }

    /// Stops accepting, disconnects every client (MQTT 5 clients hear
    /// "server shutting down"), waits up to `grace` for them to go, then
    /// syncs and closes the storage engine. A cluster node keeps its links
    /// to the other nodes until they took the sessions it kept (within
    /// `grace`), and leaves the rest's queued messages in etcd.
    pub async fn shutdown(self, grace: Duration) {
        let deadline = tokio::time::Instant::now() + grace;
        self.ready.store(false, Ordering::Release);
        let leaving = self.shared.leaving();
        let _ = self.stop.send(true);
        // Every connection holds a permit until it has ended: all of them
        // back means every connection is gone.
        let all = u32::try_from(self.shared.settings.router.max_connections).unwrap_or(u32::MAX);
        let _ = tokio::time::timeout_at(deadline, self.shared.permits.acquire_many(all)).await;
        self.shared.hand_over_sessions(leaving, deadline).await;
        let _ = self.shared.stop_links.send(true);
        let _ = tokio::time::timeout(LINKS_GRACE, self.shared.link_permits.acquire_many(all)).await;
        // A cluster node: the other nodes publish no will of its clients.
        self.shared.leave_cluster().await;
        let store = Arc::clone(&self.shared.store);
        let _ = tokio::task::spawn_blocking(move || store.close()).await;
    }
}

/// How long a stopping cluster node waits for the other nodes' links to
/// it to end, once told.
const LINKS_GRACE: Duration = Duration::from_secs(2);

/// Forgets, every few seconds, the sessions whose expiry passed (the router
/// ends its side of them itself), until the broker stops.
async fn end_expired_sessions(
    sessions: Arc<sessions::Sessions>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(2)) => {}
            _ = shutdown.changed() => return,
        }
        let ended = sessions.end_expired();
        if ended > 0 {
            tracing::debug!(ended, "sessions expired");
        }
    }
}

/// Ends every connection with DISCONNECT 0x9C "use another server" each
/// time the node stops serving (a cluster node lost its membership lease;
/// see `standing.rs`), until the broker stops: for each loss, even when
/// the node has registered again by the time this task runs.
async fn send_away_when_not_serving(shared: Arc<Shared>) {
    let mut losses = shared.standing.losses();
    let mut shutdown = shared.shutdown.clone();
    loop {
        tokio::select! {
            changed = losses.changed() => if changed.is_err() { return },
            _ = shutdown.changed() => return,
        }
        let epoch = *losses.borrow_and_update();
        let told = shared.sessions.send_all_away(epoch);
        tracing::warn!(
            connections = told,
            "not serving: connections ended with DISCONNECT 0x9C (use another server)"
        );
    }
}
