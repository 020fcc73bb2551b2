//! The endpoint's accept loop: hyper's HTTP/1.1 server on each connection,
//! within `[http]`'s bounds (instead of `axum::serve`, which has none:
//! 18,000 idle sockets once held the process at its open-file limit).
//!
//! - at most `max_connections` open at once, apart from MQTT's: one more
//!   is closed at accept (a `503` line first, when the socket takes it),
//!   counted, and logged at most once a second;
//! - each is closed at its header or idle timeout (`timeouts.rs`);
//! - at shutdown the listener closes and each connection ends after the
//!   response it is writing (the event stream ends with the broker).
//!
//! Requests carry `ConnectInfo<SocketAddr>` (the peer), as with
//! `into_make_service_with_connect_info`: the web view's guard uses it.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::Instant;
use tower::ServiceExt;

use super::timeouts::{Finishing, Limits, Watch, Watched};

/// What a refused connection reads, if its socket takes it at once.
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n\
Connection: close\r\n\r\ntoo many HTTP connections: try again later\n";

/// `[http]`'s bounds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    pub max_connections: usize,
    pub limits: Limits,
}

/// Accepts on `listener` until `shutdown`, serving `app` on each
/// connection within `bounds`.
pub(crate) async fn run(
    listener: TcpListener,
    app: Router,
    bounds: Bounds,
    mut shutdown: watch::Receiver<bool>,
) {
    // (A semaphore holds at most MAX_PERMITS: more would panic.)
    let permits = Arc::new(Semaphore::new(
        bounds.max_connections.min(Semaphore::MAX_PERMITS),
    ));
    let mut refusals = Refusals::default();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.changed() => return,
        };
        let (socket, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                accept_failed(&e, &mut refusals).await;
                continue;
            }
        };
        match Arc::clone(&permits).try_acquire_owned() {
            Ok(permit) => {
                tokio::spawn(connection(
                    socket,
                    peer,
                    app.clone(),
                    bounds.limits,
                    shutdown.clone(),
                    permit,
                ));
            }
            Err(_) => {
                // Full: closed now rather than queued. A new socket's
                // send buffer is empty, so this never waits.
                let _ = socket.try_write(BUSY);
                drop(socket);
                crate::metrics::http_connection_refused();
                refusals.count(peer, bounds.max_connections);
            }
        }
    }
}

/// A log line at most once a second.
#[derive(Default)]
struct OncePerSecond(Option<Instant>);

impl OncePerSecond {
    fn due(&mut self) -> bool {
        let now = Instant::now();
        let due = self
            .0
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1));
        if due {
            self.0 = Some(now);
        }
        due
    }
}

/// Refused connections (and failed accepts), each logged at most once a
/// second.
#[derive(Default)]
struct Refusals {
    log: OncePerSecond,
    unlogged: u64,
    accept_log: OncePerSecond,
}

impl Refusals {
    fn count(&mut self, peer: SocketAddr, max_connections: usize) {
        self.unlogged += 1;
        if self.log.due() {
            tracing::warn!(
                %peer,
                refused = self.unlogged,
                max_connections,
                "HTTP endpoint full: new connections closed at once ([http] max_connections)"
            );
            self.unlogged = 0;
        }
    }
}

/// An accept that failed: a connection reset before it was accepted is
/// skipped; anything else (out of file descriptors) is logged at most
/// once a second, and the loop pauses a little before trying again.
async fn accept_failed(e: &std::io::Error, refusals: &mut Refusals) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    if refusals.accept_log.due() {
        tracing::error!(error = %e, "HTTP endpoint: accept failed");
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// Serves one connection until it ends, times out or the broker stops.
async fn connection(
    socket: TcpStream,
    peer: SocketAddr,
    app: Router,
    limits: Limits,
    mut shutdown: watch::Receiver<bool>,
    _permit: OwnedSemaphorePermit,
) {
    crate::metrics::http_connection_opened();
    let _ = socket.set_nodelay(true);
    let watch = Watch::new(Instant::now());
    let io = TokioIo::new(Watched::new(socket, Arc::clone(&watch)));
    let service = hyper::service::service_fn({
        let watch = Arc::clone(&watch);
        move |mut request: hyper::Request<Incoming>| {
            let busy = watch.request();
            request.extensions_mut().insert(ConnectInfo(peer));
            let app = app.clone();
            async move {
                let response = match app.oneshot(request.map(axum::body::Body::new)).await {
                    Ok(response) => response,
                    Err(never) => match never {},
                };
                Ok::<_, Infallible>(response.map(|body| Finishing { body, _busy: busy }))
            }
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    // Timeouts are ours (timeouts.rs); hyper's needs a timer it has not.
    builder.header_read_timeout(None);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let mut stopping = false;
    let timed_out = loop {
        let (deadline, _) = watch.deadline(limits);
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(%peer, error = %e, "HTTP connection ended");
                }
                break None;
            }
            () = tokio::time::sleep_until(deadline) => {
                // Bytes may have moved meanwhile: only a deadline still
                // passed closes the connection.
                let (deadline, why) = watch.deadline(limits);
                if deadline <= Instant::now() {
                    tracing::debug!(%peer, reason = why, "HTTP connection closed");
                    break Some(why);
                }
            }
            _ = shutdown.changed(), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    };
    crate::metrics::http_connection_closed(timed_out);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn refusals_are_logged_at_most_once_a_second() {
        let mut refusals = Refusals::default();
        let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();
        refusals.count(peer, 4);
        assert_eq!(refusals.unlogged, 0, "the first is logged");
        for _ in 0..100 {
            refusals.count(peer, 4);
        }
        assert_eq!(refusals.unlogged, 100, "then none for a second");
        tokio::time::advance(Duration::from_secs(1)).await;
        refusals.count(peer, 4);
        assert_eq!(refusals.unlogged, 0, "then one line with the count");
        assert!(refusals.accept_log.due(), "failed accepts apart");
    }
}
