//! One task per client connection.
//!
//! The task owns the socket. [`serve`] (here) reads CONNECT ([`handshake`])
//! and registers the client; the [`task`] then moves packets both ways
//! between the client and rumqttd's router, through a `router::local` link
//! ([`link`]: a session kept after the connection joins the router at
//! CONNECT, a clean one when it first sends something for the router, so
//! that a connection that only talks to the state store, or idles, costs the
//! router nothing). The exceptions to
//! "client <-> router":
//!
//! - **State store requests** (PUBLISH on the request topics) never reach the
//!   router: the task checks them (`request.rs`, [`crate::store::binding`],
//!   the authorization policy) and hands them
//!   to the in-process [`crate::store::StateStoreService`], acknowledging
//!   them itself.
//! - **The notification namespace** is the store's: a PUBLISH into it is
//!   refused (MQTT 5: reason 0x87; 3.1.1 has no negative ack, so it is
//!   acknowledged and dropped), a SUBSCRIBE naming another client's part of it
//!   is refused per filter ([`subscriptions`]), and other clients'
//!   notifications that a wildcard subscription would deliver are dropped
//!   here ([`outbound::RouterAcks`] keeps the router's acks in order).
//! - Answers and notifications the broker delivers directly (see
//!   [`crate::sessions`]) are written here, within the client's Receive
//!   Maximum shared with the router's deliveries ([`outbound`]); their
//!   acknowledgements stay here.
//! - PINGREQ and UNSUBSCRIBE are answered here (rumqttd sends no UNSUBACK
//!   for a filter that was not subscribed). Topic aliases from the client
//!   are resolved here, so the router and the checks above see full topics.
//!
//! When the connection ends, for whatever reason, the router is told, the
//! client's KEYNOTIFY registrations of this connection are dropped, and its
//! will is scheduled unless it said a normal goodbye.

mod end;
mod gate;
mod handshake;
mod hold;
mod inbound;
mod link;
mod outbound;
mod request;
mod socket;
mod subscriptions;
mod task;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::authentication::{Failure, Presented};
use crate::config::Listener;
use crate::sessions::{Mailbox, Peer, QueueBound};
use crate::shared::Shared;
use crate::tls::CertIdentity;
use gate::Gate;
use handshake::{Refusal, Terms};
use inbound::{AckOrder, Inbound};
use link::RouterLink;
use outbound::Outbound;
use socket::Socket;
pub(crate) use socket::Stream;
use subscriptions::PendingRefusals;
use task::Connection;

/// Serves one accepted stream until it closes.
pub(crate) async fn serve<S: Stream>(
    stream: S,
    peer: SocketAddr,
    listener: Arc<Listener>,
    identity: Option<CertIdentity>,
    shared: Arc<Shared>,
) {
    let mut socket = Socket::new(stream);
    let Some(hello) = handshake::read_connect(&mut socket, &listener, peer).await else {
        return socket.shutdown().await;
    };
    let id = shared.next_connection.fetch_add(1, Ordering::Relaxed);
    let protocol = socket.protocol;

    let refuse = |refusal: Refusal, why: &str| {
        tracing::info!(%peer, client_id = hello.connect.client_id, ?protocol, why, "CONNECT refused");
        crate::metrics::connection_refused(refusal.label());
        handshake::refusal(protocol, refusal)
    };
    let checked = handshake::check_connect(&hello.connect, hello.will.as_ref())
        .map_err(|(refusal, why)| refuse(refusal, why));
    if let Err(connack) = checked {
        return socket.send_and_close(connack).await;
    }
    let terms = Terms::negotiate(
        &hello,
        protocol,
        shared.settings.broker.max_keep_alive_secs,
        || format!("statebroker-{:x}-{id}", shared.started_nanos),
    );
    let client_id = terms.client_id.clone();
    // Who it is (certificate, password, or anonymous), and whether it may
    // connect (the policy sees an assigned client id).
    let presented = Presented {
        client_id: &client_id,
        login: hello
            .login
            .as_ref()
            .map(|l| (l.username.as_str(), l.password.as_str())),
        certificate: identity.as_ref(),
        allow_anonymous: listener.allow_anonymous,
        source: peer.ip(),
    };
    let principal = match shared.authenticator.authenticate(presented).await {
        Ok(principal) => Arc::new(principal),
        Err(Failure::BadCredentials) => {
            let connack = refuse(Refusal::BadCredentials, "bad username or password");
            return socket.send_and_close(connack).await;
        }
        Err(Failure::Anonymous) => {
            let connack = refuse(
                Refusal::NotAuthorized,
                "anonymous clients are not allowed on this listener",
            );
            return socket.send_and_close(connack).await;
        }
    };
    if let Some(policy) = shared.authorizer.current()
        && !policy.may_connect(&principal)
    {
        let connack = refuse(
            Refusal::NotAuthorized,
            "the authorization policy denies Connect",
        );
        return socket.send_and_close(connack).await;
    }
    if shared.faults.refusing() {
        let connack = refuse(Refusal::Busy, "fault injected: refusing connections");
        return socket.send_and_close(connack).await;
    }
    let Ok(permit) = Arc::clone(&shared.permits).try_acquire_owned() else {
        let connack = refuse(Refusal::Busy, "connection limit reached");
        return socket.send_and_close(connack).await;
    };
    // A persistent session joins the router now (the router knows whether
    // the session exists); a clean one when it first needs the router.
    let (link, session_present) = match RouterLink::open(
        &shared.router,
        &client_id,
        terms.clean_start,
        terms.session_expiry,
        // A connection that starts clean, keeps nothing after it ends
        // and has no session to discard joins on first need.
        terms.clean_start
            && terms.session_expiry == 0
            && !shared.sessions.has_session_to_discard(&client_id),
    )
    .await
    {
        Ok(opened) => opened,
        Err(e) => {
            tracing::error!(%peer, client_id, error = %e, "router refused the connection");
            crate::metrics::connection_refused(Refusal::Busy.label());
            return socket
                .send_and_close(handshake::refusal(protocol, Refusal::Busy))
                .await;
        }
    };
    shared.wills.connected(&client_id, id, terms.clean_start);
    let (direct_tx, direct_rx) = mpsc::unbounded_channel();
    let broker = &shared.settings.broker;
    let bound = QueueBound::new(broker.max_queued_messages, broker.max_queued_bytes);
    let mailbox = Mailbox::new(direct_tx, Arc::clone(&bound));
    let peer_view = Arc::new(Peer {
        protocol: protocol.name(),
        address: peer,
        listener: listener.name.clone(),
        in_flight: AtomicUsize::new(0),
    });
    let acknowledged = shared.sessions.connected(
        &client_id,
        id,
        session_present,
        mailbox,
        Arc::clone(&peer_view),
    );
    let topic_alias_max = shared.settings.broker.topic_alias_max;
    socket.queue(handshake::connack(
        &terms,
        session_present,
        &listener,
        topic_alias_max,
    ));
    if let Err(e) = socket.flush().await {
        tracing::debug!(client_id, error = %e, "could not send CONNACK");
    }
    tracing::info!(%peer, client_id, connection = id, ?protocol, clean_start = terms.clean_start, keep_alive = terms.keep_alive, "client connected");

    let mut conn = Connection {
        id,
        own_hex: hex::encode_upper(&client_id),
        out: Outbound::new(
            &client_id,
            terms.receive_maximum,
            terms.max_packet_size,
            bound,
        ),
        client_id,
        socket,
        link,
        idle_limit: terms.idle_limit(),
        last_heard: Instant::now(),
        max_packet_size: listener.max_packet_size,
        // 3.1.1 has no Receive Maximum.
        inbound: Inbound::new(
            topic_alias_max,
            match protocol {
                crate::codec::Protocol::V5 => listener.receive_maximum,
                crate::codec::Protocol::V4 => u16::MAX,
            },
            // As many requests as may be unacknowledged (3.1.1: the same).
            (acknowledged, listener.receive_maximum),
        ),
        ack_order: AckOrder::default(),
        refused_filters: PendingRefusals::default(),
        direct_rx,
        unscheduled: false,
        store: Arc::clone(&shared.store),
        publisher: Arc::clone(&shared.publisher),
        sessions: Arc::clone(&shared.sessions),
        session_expiry: terms.session_expiry,
        legacy_2023: shared.settings.broker.legacy_2023_topic,
        gate: Gate::new(shared.durable.clone()),
        ack_hold: hold::AckHold::default(),
        awaited: hold::Awaited::default(),
        answered: shared.store.answered(),
        principal,
        shared: Arc::clone(&shared),
        peer: peer_view,
    };
    crate::metrics::connection_opened();
    let end = conn.run(shared.shutdown.clone()).await;
    crate::metrics::connection_closed(end.label());
    // Boxed: `finish` (8.5 KB of state) runs once, at the end; inline, its
    // room would be held by every connection for its whole life.
    Box::pin(conn.finish(&end)).await;

    let will = end.will(hello.will, hello.will_properties, conn.session_expiry);
    shared.wills.disconnected(&conn.client_id, id, will);
    drop(permit);
}
