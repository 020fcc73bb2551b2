//! What every connection task shares: the settings, the router, the state
//! store, the session mirror, the wills, the connection limit and the
//! shutdown signal.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use tokio::sync::{Semaphore, watch};

use crate::config::Settings;
use crate::durable::Durable;
use crate::publisher::Publisher;
use crate::sessions::Sessions;
use crate::store::StateStoreService;
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
    pub activity: Arc<crate::activity::Activity>,
    /// Becomes `true` when the broker stops.
    pub shutdown: watch::Receiver<bool>,
    /// The password file and the throttle of failed attempts.
    pub authenticator: crate::authentication::Authenticator,
    /// The authorization policy.
    pub authorizer: crate::authorization::Authorizer,
    /// The TLS configurations of the listeners (reloaded on SIGHUP).
    pub tls: Vec<Arc<crate::tls::Tls>>,
    /// Faults on demand (none unless `[faults] enabled`).
    pub faults: crate::faults::Faults,
}
