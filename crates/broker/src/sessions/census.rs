//! The session mirror in numbers and as a list: for `/metrics`, `$SYS`
//! and the web view. One pass under the read lock; nothing is counted on
//! the hot path for it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::Sessions;

/// What the view shows of a live connection: given at CONNECT, the
/// in-flight count kept up to date by the connection task.
#[derive(Debug)]
pub struct Peer {
    /// "MQTT 5" or "MQTT 3.1.1".
    pub protocol: &'static str,
    /// The client's address.
    pub address: SocketAddr,
    /// The listener's name in the config (`v5.1`, `ws.1`, ...).
    pub listener: String,
    /// QoS 1/2 publishes written to the client and not yet acknowledged.
    pub in_flight: AtomicUsize,
    /// How many times the node had stopped serving when the connection
    /// was accepted ([`crate::standing::Standing::epoch`]): a later stop
    /// sends it away, an earlier one does not.
    pub epoch: u64,
}

/// [`Peer`] as the view shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ConnectionView {
    /// See [`Peer::protocol`].
    pub protocol: &'static str,
    /// See [`Peer::address`].
    pub address: String,
    /// See [`Peer::listener`].
    pub listener: String,
    /// See [`Peer::in_flight`].
    pub in_flight: usize,
}

/// One client as the web view shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ClientView {
    /// Its client id.
    pub client_id: String,
    /// Connected now (else: a session kept).
    pub connected: bool,
    /// The connection, when connected.
    pub connection: Option<ConnectionView>,
    /// Its subscription filters.
    pub subscriptions: Vec<String>,
    /// The broker's own deliveries queued or in flight to it.
    pub queued: usize,
}

/// What [`Sessions::census`] counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Census {
    /// Clients known: connected, or with a session kept.
    pub clients: usize,
    /// Clients connected now.
    pub connected: usize,
    /// Subscriptions, of connected clients and of kept sessions.
    pub subscriptions: usize,
    /// The broker's own deliveries (answers, notifications) queued or in
    /// flight to connections, in messages and bytes.
    pub queued_messages: usize,
    /// See `queued_messages`.
    pub queued_bytes: usize,
}

impl Sessions {
    /// How many clients, connections, subscriptions and queued deliveries
    /// there are now (one pass over the clients: for /metrics and `$SYS`).
    pub fn census(&self) -> Census {
        let counts = self.subscriptions.counts();
        let clients = self.clients.read();
        let mut census = Census {
            subscriptions: counts.subscriptions,
            ..Census::default()
        };
        let mut only_here = 0;
        for (id, client) in clients.iter() {
            if let Some(live) = &client.live {
                census.connected += 1;
                let (messages, bytes) = live.mailbox.bound.held();
                census.queued_messages += messages;
                census.queued_bytes += bytes;
                // A connection without subscriptions or a kept session is
                // not in the router's count.
                if !self.subscriptions.knows(id) {
                    only_here += 1;
                }
            }
        }
        census.clients = counts.clients + only_here;
        census
    }

    /// Every client (connected, or with a kept session), sorted by id, for
    /// the web view.
    pub fn clients(&self) -> Vec<ClientView> {
        let clients = self.clients.read();
        let mut views: Vec<ClientView> = Vec::with_capacity(clients.len());
        let mut seen = std::collections::HashSet::new();
        for (id, client) in clients.iter() {
            let live = client.live.as_ref();
            if live.is_none() && !self.subscriptions.has_kept_session(id) {
                continue;
            }
            seen.insert(id.to_string());
            views.push(ClientView {
                client_id: id.to_string(),
                connected: live.is_some(),
                connection: live.map(|l| ConnectionView {
                    protocol: l.peer.protocol,
                    address: l.peer.address.to_string(),
                    listener: l.peer.listener.clone(),
                    in_flight: l.peer.in_flight.load(Ordering::Relaxed),
                }),
                subscriptions: self.subscriptions.filters(id),
                queued: live.map_or(0, |l| l.mailbox.bound.held().0),
            });
        }
        // Sessions the router keeps for clients the broker has not seen
        // since a restart.
        for (id, filters, kept) in self.subscriptions.clients() {
            if kept && !seen.contains(&id) {
                views.push(ClientView {
                    client_id: id,
                    connected: false,
                    connection: None,
                    subscriptions: filters,
                    queued: 0,
                });
            }
        }
        views.sort_by(|a, b| a.client_id.cmp(&b.client_id));
        views
    }
}
