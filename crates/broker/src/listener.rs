//! Accepting sockets.
//!
//! The accept loop is ours rather than rumqttd's because rumqttd never sets
//! TCP_NODELAY: with Nagle on the broker and delayed ACK on the client, every
//! request/response round trip of the official SDK took about 44 ms; with
//! TCP_NODELAY set on every accepted socket (here), about
//! one millisecond or less.
//!
//! A listener hands each accepted stream to [`connection::serve`], which
//! takes any `AsyncRead + AsyncWrite`: a TLS or WebSocket listener wraps the
//! stream here and hands it on the same way.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpSocket};

use crate::config::Listener;
use crate::connection;
use crate::shared::Shared;

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

/// Accepts connections on `socket` until the broker stops.
pub(crate) async fn accept_loop(socket: TcpListener, listener: Arc<Listener>, shared: Arc<Shared>) {
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
                tokio::spawn(connection::serve(
                    stream,
                    peer,
                    Arc::clone(&listener),
                    Arc::clone(&shared),
                ));
            }
            Err(e) => {
                // Typically out of file descriptors: back off instead of spinning.
                tracing::error!(listener = listener.name, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
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
