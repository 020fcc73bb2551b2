//! The HTTP endpoint for operators and tools (on by default at
//! `127.0.0.1:9883`; `[http] listen`, `--http ADDR`, `--no-http`):
//!
//! - `GET /metrics`: every metric of [`crate::metrics`], Prometheus text
//!   format;
//! - `GET /healthz`: 200 while the process serves HTTP at all and its
//!   router runs (503 once the router's thread has ended: a bug, see
//!   the log; the binary exits then, for its supervisor to restart it);
//! - `GET /readyz`: 200 once persisted state is restored and every MQTT
//!   listener accepts, 503 before (and while stopping), and while the
//!   data directory refuses writes (a full disk: persisted writes wait);
//! - `GET /` and `/api/...`: the live web view ([`crate::web`]), only
//!   for the host names it serves (`localhost`, IP literals, `[http]
//!   allowed_hosts`); the three above answer any `Host`: scrapers and
//!   probes use many names, and they reveal no key.
//!
//! axum's router on hyper's HTTP/1.1 server serves it: a well-kept parser
//! rather than a hand-written one facing the network; our accept loop
//! (`serve.rs`) bounds the connections and their timeouts (`timeouts.rs`,
//! `[http] max_connections`, `header_timeout_ms`, `idle_timeout_ms`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::sync::watch;

use crate::config::HttpOptions;
use crate::web::{AllowedHosts, Broker};
use serve::Bounds;
use timeouts::Limits;

mod serve;
mod timeouts;

/// Why the endpoint could not bind `addr`, and what to do about it: a
/// second broker on one machine finds the default port taken.
fn bind_error(addr: SocketAddr, e: &std::io::Error) -> String {
    let taken = if e.kind() == std::io::ErrorKind::AddrInUse {
        " (another process, another statebroker perhaps, serves it)"
    } else {
        ""
    };
    format!(
        "cannot serve HTTP on {addr}: {e}{taken}; pick another address with \
         --http ADDR or `[http] listen = \"ADDR\"` (port 0: any free one), \
         or turn the endpoint off with --no-http or `[http] listen = \"\"`"
    )
}

/// What the endpoint serves from.
#[derive(Clone)]
struct Served {
    metrics: PrometheusHandle,
    ready: Arc<AtomicBool>,
    broker: Broker,
}

/// Binds `addr` (so a busy port fails the start, like an MQTT listener)
/// and serves until `shutdown`. `ready` answers `/readyz`.
pub(crate) async fn start(
    addr: SocketAddr,
    options: &HttpOptions,
    ready: Arc<AtomicBool>,
    broker: Broker,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), bind_error(addr, &e)))?;
    let local = listener.local_addr()?;
    let metrics = crate::metrics::install();
    let upkeep = metrics.clone();
    let mut upkeep_stop = shutdown.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(5)) => upkeep.run_upkeep(),
                _ = upkeep_stop.changed() => return,
            }
        }
    });
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(Served {
            metrics,
            ready,
            broker: Arc::clone(&broker),
        })
        .merge(crate::web::routes(
            broker,
            !local.ip().is_loopback(),
            options.allow_anonymous,
            AllowedHosts::new(&options.allowed_hosts),
        ));
    let bounds = Bounds {
        max_connections: options.max_connections,
        limits: Limits {
            header: options.header_timeout,
            idle: options.idle_timeout,
        },
    };
    tokio::spawn(serve::run(listener, app, bounds, shutdown));
    Ok(local)
}

/// What the HTTP endpoint serves and why a part is off (logged once the
/// broker has started; `addr`: where it listens, `None`: off).
pub(crate) struct Parts<'a> {
    pub addr: Option<SocketAddr>,
    pub options: &'a HttpOptions,
    pub password_file: bool,
    /// An authorization policy is loaded.
    pub policy: bool,
    pub allow_edit: bool,
    pub faults: bool,
}

impl Parts<'_> {
    /// The INFO line at start: each part on or off, and why.
    pub(crate) fn log(&self) {
        let Some(addr) = self.addr else {
            tracing::info!(
                "HTTP endpoint off (--no-http or [http] listen = \"\"): no /metrics, /healthz, /readyz, web view"
            );
            return;
        };
        let options = self.options;
        tracing::info!(
            addr = %addr,
            max_connections = options.max_connections,
            header_timeout_ms = options.header_timeout.as_millis(),
            idle_timeout_ms = options.idle_timeout.as_millis(),
            "HTTP endpoint: /metrics /healthz /readyz on; {}",
            self.describe(addr)
        );
    }

    /// The web view's part of the line.
    fn describe(&self, addr: SocketAddr) -> String {
        let users_decide = self.policy && self.password_file;
        let view = if addr.ip().is_loopback() && !users_decide {
            "web view / on (loopback: no password)"
        } else if addr.ip().is_loopback() {
            "web view / on for users of the password file (HTTP Basic; on loopback too, under the authorization policy)"
        } else if self.options.allow_anonymous && self.password_file {
            "web view / on: reads without a password ([http] allow_anonymous), changes for users of the password file"
        } else if self.options.allow_anonymous {
            "web view / on: reads without a password ([http] allow_anonymous)"
        } else if self.password_file {
            "web view / on for users of the password file (HTTP Basic)"
        } else {
            "web view / off (answers 403): on a non-loopback address it needs users \
             ([broker] password_file) or [http] allow_anonymous = true"
        };
        let edit = if self.allow_edit {
            "edit forms on"
        } else {
            "edit forms off ([http] allow_edit = false)"
        };
        let faults = if self.faults {
            "faults on"
        } else {
            "faults off ([faults] enabled = false)"
        };
        let policy = if self.policy {
            "; each user sees and changes what the authorization policy allows"
        } else {
            ""
        };
        format!("{view}{policy}; {edit}; {faults}")
    }
}

async fn metrics_text(State(served): State<Served>) -> impl IntoResponse {
    if let Some(shared) = served.broker.get() {
        crate::stats::set_gauges(&crate::stats::sample(shared));
    }
    crate::metrics::publish_traffic();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        served.metrics.render(),
    )
}

/// 200 while the router runs.
async fn healthz(State(served): State<Served>) -> impl IntoResponse {
    match served.broker.get() {
        Some(shared) if !shared.router.is_running() => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the router stopped (see the log)\n",
        ),
        _ => (StatusCode::OK, "ok\n"),
    }
}

async fn readyz(State(served): State<Served>) -> impl IntoResponse {
    if !served.ready.load(Ordering::Acquire) {
        return (StatusCode::SERVICE_UNAVAILABLE, "not ready\n");
    }
    if served
        .broker
        .get()
        .is_some_and(|shared| !shared.router.is_running())
    {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: the router stopped (see the log)\n",
        );
    }
    // A cluster node is ready while etcd answers.
    match served.broker.get() {
        Some(shared) if !shared.standing.serving() => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: this cluster node has no confirmed membership lease in etcd (lost, or etcd not answering)\n",
        ),
        Some(shared) if !shared.takes_clients() => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: this cluster node waits for the other nodes to link to it\n",
        ),
        Some(shared) if !shared.store.is_ready() => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: etcd does not answer\n",
        ),
        Some(shared) if shared.store.disk_refuses_writes() => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: the data directory refuses writes (persisted writes wait)\n",
        ),
        _ => (StatusCode::OK, "ready\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_start_line_says_why_the_view_is_off() {
        let mut options = HttpOptions {
            allowed_hosts: Vec::new(),
            allow_anonymous: false,
            max_connections: 1,
            header_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(1),
        };
        let parts = |options: &HttpOptions, password_file| {
            Parts {
                addr: None,
                options,
                password_file,
                policy: false,
                allow_edit: false,
                faults: true,
            }
            .describe("0.0.0.0:9883".parse().unwrap())
        };
        let off = parts(&options, false);
        assert!(off.starts_with("web view / off (answers 403)"), "{off}");
        assert!(off.contains("[http] allow_anonymous = true"), "{off}");
        assert!(off.contains("edit forms off"), "{off}");
        assert!(off.ends_with("faults on"), "{off}");
        assert!(parts(&options, true).contains("for users of the password file"));
        options.allow_anonymous = true;
        assert!(parts(&options, false).contains("reads without a password"));
        let mut local = Parts {
            addr: None,
            options: &options,
            password_file: false,
            policy: false,
            allow_edit: true,
            faults: false,
        };
        let loopback = "127.0.0.1:9883".parse().unwrap();
        assert_eq!(
            local.describe(loopback),
            "web view / on (loopback: no password); edit forms on; faults off ([faults] enabled = false)"
        );
        // A policy and users: users on loopback too, and the policy says
        // what each sees.
        local.policy = true;
        local.password_file = true;
        let under_policy = local.describe(loopback);
        assert!(under_policy.contains("loopback too"), "{under_policy}");
        assert!(
            under_policy.contains("authorization policy allows"),
            "{under_policy}"
        );
    }
}
