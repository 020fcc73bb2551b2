//! Accepting sockets.
//!
//! The accept loop is ours rather than rumqttd's because rumqttd never sets
//! TCP_NODELAY: with Nagle on the broker and delayed ACK on the client, every
//! request/response round trip of the official SDK took about 44 ms; with
//! TCP_NODELAY set on every accepted socket (here), about
//! one millisecond or less.
//!
//! A listener hands each accepted stream to [`connection::serve`], which
//! takes any `AsyncRead + AsyncWrite`: a TLS listener ([`crate::tls`]) and a
//! WebSocket one ([`crate::websocket`]) wrap the stream here, each
//! handshake within the listener's connect timeout, and hand it on the same
//! way, with the identity of a client certificate.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpSocket, TcpStream};

use crate::config::{Listener, Transport};
use crate::connection::{self, Stream};
use crate::shared::Shared;
use crate::tls::{CertIdentity, Tls};
use crate::websocket;

/// How many finished TCP handshakes the kernel may queue before the accept
/// loop takes them (capped by `net.core.somaxconn`). tokio's `bind` asks for
/// 128, like the standard library; when a few hundred clients reconnect at
/// once (a broker restart, a network blip), the overflow has its handshakes
/// dropped and retried by the client a second or more later. Redis asks for
/// 511, nginx for 511, a broker expecting thousands of clients for more.
pub(crate) const LISTEN_BACKLOG: u32 = 1024;

/// Binds a listening socket as tokio's `TcpListener::bind` does
/// (`SO_REUSEADDR`), with a backlog of [`LISTEN_BACKLOG`].
pub(crate) fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// The IPv6 half of the embedded default's loopback listeners: skipped
/// with a warning on a machine without IPv6.
pub(crate) const IPV6_LOOPBACK_DEFAULT: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V6(std::net::Ipv6Addr::LOCALHOST), 1883);

/// Whether a bind failed because the machine has no such address (or no
/// IPv6 at all).
pub(crate) fn no_such_address(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::AddrNotAvailable || matches!(e.raw_os_error(), Some(97)) // EAFNOSUPPORT
}

/// Says at start what the listeners let in, when it may surprise.
pub(crate) fn explain(listeners: &[Listener]) {
    if listeners.iter().all(|l| l.addr.ip().is_loopback()) {
        tracing::info!(
            "listening on loopback only: to accept other hosts, pass --listen 0.0.0.0:1883 \
             or define listeners in a config file (anonymous clients are then refused \
             unless allow_anonymous = true; see [broker] password_file)"
        );
    }
}

/// Warns of each listener nobody can connect to (at start, and when a
/// reload changes the password file).
pub(crate) fn warn_unreachable(listeners: &[Listener], password_file: bool) {
    for l in listeners {
        let certificates = l.tls.as_ref().is_some_and(|t| t.ca.is_some());
        if !l.allow_anonymous && !password_file && !certificates {
            tracing::warn!(
                listener = l.name,
                addr = %l.addr,
                "refuses anonymous clients, and there is no [broker] password_file nor client \
                 certificates: nobody can connect here (set allow_anonymous = true, or add users)"
            );
        }
    }
}

/// Accepts connections on `socket` until the broker stops.
pub(crate) async fn accept_loop(
    socket: TcpListener,
    listener: Arc<Listener>,
    tls: Option<Arc<Tls>>,
    shared: Arc<Shared>,
) {
    let mut shutdown = shared.shutdown.clone();
    loop {
        let accepted = tokio::select! {
            accepted = socket.accept() => accepted,
            _ = shutdown.changed() => return,
        };
        match accepted {
            Ok((stream, peer)) => {
                tracing::debug!(%peer, listener = listener.name, "accepted");
                if let Err(e) = stream.set_nodelay(true) {
                    tracing::warn!(%peer, error = %e, "cannot set TCP_NODELAY");
                }
                let listener = Arc::clone(&listener);
                let shared = Arc::clone(&shared);
                // A plain TCP connection's task is the connection itself:
                // no layer of futures around it to go through at every
                // turn (see `open`).
                if tls.is_none() && listener.transport == Transport::Tcp {
                    tokio::spawn(connection::serve(stream, peer, listener, None, shared));
                } else {
                    tokio::spawn(open(stream, peer, listener, tls.clone(), shared));
                }
            }
            Err(e) => {
                // Typically out of file descriptors: back off instead of spinning.
                tracing::error!(listener = listener.name, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The TLS and WebSocket handshakes a listener asks for (within its
/// connect timeout), then the MQTT connection. (A plain TCP connection is
/// spawned as `connection::serve` itself: each layer of futures here is
/// polled at every turn of the connection, and its state sits on lines of
/// its own: ~3 cold cache lines and ~65 instructions a request.)
async fn open(
    stream: TcpStream,
    peer: SocketAddr,
    listener: Arc<Listener>,
    tls: Option<Arc<Tls>>,
    shared: Arc<Shared>,
) {
    let timeout = Duration::from_millis(listener.connect_timeout_ms);
    let Some(tls) = tls else {
        return carry(stream, peer, listener, None, shared, timeout).await;
    };
    let handshake = tokio::time::timeout(timeout, Box::pin(tls.acceptor().accept(stream))).await;
    match handshake {
        Ok(Ok(stream)) => {
            let identity = crate::tls::peer_identity(stream.get_ref().1);
            Box::pin(carry(stream, peer, listener, identity, shared, timeout)).await;
        }
        Ok(Err(e)) => {
            tracing::info!(%peer, listener = listener.name, error = %e, "TLS handshake failed");
            crate::metrics::connection_refused("tls_handshake_failed");
        }
        Err(_) => tracing::debug!(%peer, "no TLS handshake in time: closing"),
    }
}

/// Over TCP or TLS: MQTT directly, or in WebSocket messages.
///
/// Each `serve` is boxed: one task's future is as large as the largest
/// state it may be in, so unboxed, every plain TCP connection would carry
/// room for the TLS and WebSocket variants' (9.3 KB a connection, measured
/// with massif at 1,000 idle connections).
async fn carry<S: Stream>(
    stream: S,
    peer: SocketAddr,
    listener: Arc<Listener>,
    identity: Option<CertIdentity>,
    shared: Arc<Shared>,
    timeout: Duration,
) {
    match listener.transport {
        Transport::Tcp => {
            Box::pin(connection::serve(stream, peer, listener, identity, shared)).await;
        }
        Transport::WebSocket => {
            let upgrade = Box::pin(websocket::accept(stream, listener.max_packet_size));
            match tokio::time::timeout(timeout, upgrade).await {
                Ok(Ok(ws)) => {
                    Box::pin(connection::serve(ws, peer, listener, identity, shared)).await;
                }
                Ok(Err(e)) => {
                    tracing::info!(%peer, listener = listener.name, error = %e, "WebSocket upgrade failed");
                    crate::metrics::connection_refused("websocket_upgrade_failed");
                }
                Err(_) => tracing::debug!(%peer, "no WebSocket upgrade in time: closing"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Far more clients than tokio's default backlog of 128 finish their
    /// handshakes while nobody accepts: none of them is dropped.
    #[tokio::test]
    async fn the_backlog_holds_a_reconnect_storm() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let clients = 300;
        let connects: Vec<_> = (0..clients)
            .map(|_| {
                tokio::spawn(tokio::time::timeout(
                    Duration::from_millis(800),
                    tokio::net::TcpStream::connect(addr),
                ))
            })
            .collect();
        let mut connected = Vec::new();
        for connect in connects {
            if let Ok(Ok(stream)) = connect.await.unwrap() {
                connected.push(stream);
            }
        }
        assert_eq!(connected.len(), clients, "handshakes dropped");
        drop(listener);
    }
}
