//! Accepting sockets.
//!
//! The accept loop is ours rather than rumqttd's because rumqttd never sets
//! TCP_NODELAY: with Nagle on the broker and delayed ACK on the client, every
//! request/response round trip of the official SDK took about 44 ms; with
//! TCP_NODELAY set on every accepted socket (in [`crate::connection`]), about
//! one millisecond or less.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::Shared;
use crate::config::Listener;
use crate::connection;

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
