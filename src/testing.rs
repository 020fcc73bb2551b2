//! statebroker inside your own tests: [`TestBroker`] starts an in-memory
//! broker on a free loopback port in a few milliseconds, and lets the test
//! make it misbehave on purpose (faults: delays, `-ERR` answers, lost
//! answers, disconnects, refused connections, a skewed clock, keys expired
//! on demand).
//!
//! ```
//! use statebroker::testing::{RuleSpec, TestBroker};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let broker = TestBroker::builder()
//!     .node_id("test-node")
//!     .fault(RuleSpec {
//!         keys: "boom*".into(),
//!         error: Some("the quota has been exceeded".into()),
//!         ..RuleSpec::default()
//!     })
//!     .start()
//!     .await;
//! let addr = broker.addr(); // 127.0.0.1:<free port>: point your client here
//! assert!(addr.ip().is_loopback());
//! // Faults can change while the test runs.
//! broker.faults().clear_rules().unwrap();
//! broker.stop().await;
//! # }
//! ```
//!
//! No HTTP port is opened unless [`Builder::http`] asks for one, so tests
//! run in parallel. Everything a test does to the broker is also possible
//! from outside (`statebroker-cli faults ...`, the HTTP endpoint's
//! `/api/faults`) on a broker started with `[faults] enabled = true`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use broker::config::{Mode, PersistenceSettings};
use broker::{Broker, RunningBroker, Settings};

pub use broker::fault_control::{FaultControl, FaultStatus};
pub use broker::faults::{DelaySpec, FaultError, RuleSpec};
pub use statestore::browse::KeyView;

/// How long [`TestBroker::stop`] waits for clients to go.
const GRACE: Duration = Duration::from_secs(2);

/// A broker for one test. Dropping it stops it (without waiting); `stop`
/// waits until it is down.
pub struct TestBroker {
    running: Option<RunningBroker>,
    settings: Settings,
    addr: SocketAddr,
}

/// Builds a [`TestBroker`]; every setting has a test-friendly default
/// (in memory, node id `statebroker`, faults enabled with no rule).
pub struct Builder {
    settings: Settings,
}

impl TestBroker {
    /// Starts a broker with the defaults (see [`Builder`]).
    pub async fn start() -> TestBroker {
        TestBroker::builder().start().await
    }

    /// A builder to change the defaults.
    pub fn builder() -> Builder {
        let mut settings = Settings::listening_on(SocketAddr::from(([127, 0, 0, 1], 0)));
        settings.faults.enabled = true;
        Builder { settings }
    }

    /// The MQTT address (TCP, MQTT 3.1.1 and 5, anonymous clients allowed).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The HTTP endpoint's address, if [`Builder::http`] asked for it.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.running().http_addr()
    }

    /// The faults: rules, disconnects, refused connections, the clock,
    /// keys expired now.
    pub fn faults(&self) -> FaultControl {
        self.running().faults()
    }

    /// `key` as stored now (value, version, expiry, fencing token,
    /// watchers), if it exists: read directly, not as a client.
    pub fn key(&self, key: &[u8]) -> Option<KeyView> {
        self.running().store().with_store(|store| store.view(key))
    }

    /// How many keys the store holds.
    pub fn key_count(&self) -> usize {
        self.running().store().with_store(|store| store.len())
    }

    /// The underlying broker (everything [`broker::RunningBroker`] offers).
    pub fn running(&self) -> &RunningBroker {
        self.running
            .as_ref()
            .expect("a TestBroker runs between start and stop")
    }

    /// Stops the broker: clients are disconnected (MQTT 5: "server
    /// shutting down"), persisted data synced.
    pub async fn stop(mut self) {
        if let Some(running) = self.running.take() {
            running.shutdown(GRACE).await;
        }
    }

    /// Stops and starts again on the same port, with the same settings:
    /// with a data directory ([`Builder::data_dir`]) persisted keys,
    /// retained messages and sessions come back; fault rules start again
    /// from the builder's.
    pub async fn restart(&mut self) {
        if let Some(running) = self.running.take() {
            running.shutdown(GRACE).await;
        }
        let mut settings = self.settings.clone();
        settings.listeners[0].addr = self.addr;
        let running = Broker::start(settings)
            .await
            .unwrap_or_else(|e| panic!("TestBroker restart on {}: {e}", self.addr));
        self.running = Some(running);
    }
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        // Dropping the running broker signals its tasks to end.
        self.running.take();
    }
}

impl Builder {
    /// The node id in every version (HLC) the store hands out.
    pub fn node_id(mut self, node_id: &str) -> Builder {
        self.settings.statestore.node_id = node_id.to_owned();
        self
    }

    /// Moves the store's clock this far from the machine's (for the
    /// 60-second skew rule and HLC behaviour); changeable later through
    /// [`TestBroker::faults`].
    pub fn clock_offset(mut self, offset_ms: i64) -> Builder {
        self.settings.faults.clock_offset_ms = offset_ms;
        self
    }

    /// At most this many keys (`SET` of a new key beyond: `-ERR the quota
    /// has been exceeded`).
    pub fn max_keys(mut self, keys: u64) -> Builder {
        self.settings.statestore.quota.max_keys = keys;
        self
    }

    /// At most this many bytes of keys and values.
    pub fn max_bytes(mut self, bytes: u64) -> Builder {
        self.settings.statestore.quota.max_bytes = bytes;
        self
    }

    /// At most this many KEYNOTIFY registrations per client.
    pub fn max_watches_per_client(mut self, watches: usize) -> Builder {
        self.settings.statestore.max_watches_per_client = watches;
        self
    }

    /// Keeps persisted keys, retained messages and sessions in `dir`
    /// (fsync mode), so [`TestBroker::restart`] finds them again.
    pub fn data_dir(mut self, dir: &Path) -> Builder {
        self.settings.persistence = Some(PersistenceSettings {
            data_dir: PathBuf::from(dir),
            mode: Mode::Fsync,
            accept_data_loss: false,
        });
        self
    }

    /// A fault rule, in force from the start (more can be added later).
    pub fn fault(mut self, rule: RuleSpec) -> Builder {
        self.settings.faults.rules.push(rule);
        self
    }

    /// Refuses every fault, as a production broker does.
    pub fn without_faults(mut self) -> Builder {
        self.settings.faults.enabled = false;
        self
    }

    /// Serves the HTTP endpoint (metrics, web view, `/api/faults`) on a
    /// free loopback port.
    pub fn http(mut self) -> Builder {
        self.settings.http = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
        self
    }

    /// Any other setting (see `broker::Settings` and `rumqttd.toml`).
    pub fn settings(mut self, tweak: impl FnOnce(&mut Settings)) -> Builder {
        tweak(&mut self.settings);
        self
    }

    /// Starts the broker; panics with the reason if it cannot (a test
    /// cannot go on without it).
    pub async fn start(self) -> TestBroker {
        self.try_start()
            .await
            .unwrap_or_else(|e| panic!("TestBroker did not start: {e}"))
    }

    /// Starts the broker, or says why not (fault rules given to a broker
    /// built `without_faults` are refused, as in a config file).
    pub async fn try_start(self) -> std::io::Result<TestBroker> {
        let running = Broker::start(self.settings.clone()).await?;
        Ok(TestBroker {
            addr: running.local_addr(),
            running: Some(running),
            settings: self.settings,
        })
    }
}
