//! The HTTP endpoint for operators and tools (on by default at
//! `127.0.0.1:9883`; `[http] listen`, `--http ADDR`, `--no-http`):
//!
//! - `GET /metrics`: every metric of [`crate::metrics`], Prometheus text
//!   format;
//! - `GET /healthz`: 200 while the process serves HTTP at all;
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
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(Served {
            metrics,
            ready,
            broker: Arc::clone(&broker),
        })
        .merge(crate::web::routes(
            broker,
            !local.ip().is_loopback(),
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
    tracing::info!(
        addr = %local,
        max_connections = options.max_connections,
        header_timeout_ms = options.header_timeout.as_millis(),
        idle_timeout_ms = options.idle_timeout.as_millis(),
        "HTTP endpoint: / (live view) /metrics /healthz /readyz"
    );
    Ok(local)
}

async fn metrics_text(State(served): State<Served>) -> impl IntoResponse {
    if let Some(shared) = served.broker.get() {
        crate::stats::set_gauges(&crate::stats::sample(shared));
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        served.metrics.render(),
    )
}

async fn readyz(State(served): State<Served>) -> impl IntoResponse {
    if !served.ready.load(Ordering::Acquire) {
        return (StatusCode::SERVICE_UNAVAILABLE, "not ready\n");
    }
    // A cluster node is ready while etcd answers.
    match served.broker.get() {
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
