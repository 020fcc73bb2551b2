//! One task per client connection.
//!
//! [`serve`] reads CONNECT ([`handshake`]), decides on it ([`accept`]: an
//! [`accept::Accepted`] value, or the CONNACK that refuses it), registers
//! the client, and runs the connection: a sans-I/O [`machine`] holds every
//! decision (packet in, bytes and router packets out), and a [`driver`]
//! owns the socket, the router link ([`link`], joined at CONNECT for a
//! session kept after the connection, on first need for a clean one), the
//! mailbox's receiving end ([`inbox`]; both wake the task only while it
//! waits, [`waiting`]) and the timers. The exceptions to "client <-> router":
//!
//! - **State store requests** (PUBLISH on the request topics) never reach the
//!   router: the machine checks them (`request.rs`, [`crate::store::binding`],
//!   the authorization policy) and hands them to the in-process
//!   [`crate::store::StateStoreService`], acknowledging them itself.
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
//! - PINGREQ is answered here, and UNSUBSCRIBE when the connection never
//!   joined the router. Topic aliases from the client are resolved here, so
//!   the router and the checks above see full topics.
//!
//! When the connection ends, for whatever reason, the router is told, the
//! client's KEYNOTIFY registrations of this connection are dropped, and its
//! will is scheduled unless it said a normal goodbye.

mod accept;
mod ask_first;
mod driver;
mod end;
mod gate;
mod handshake;
mod hold;
mod inbound;
mod inbox;
mod link;
mod machine;
mod outbound;

mod socket;
mod subscriptions;
mod waiting;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::mpsc;

use crate::codec::Protocol;
use crate::config::Listener;
use crate::sessions::{Mailbox, Peer, QueueBound};
use crate::shared::Shared;
use crate::tls::CertIdentity;
use accept::{Accepted, Origin};
use driver::Driver;
use machine::{Machine, Start};
use socket::Socket;
pub(crate) use socket::Stream;

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
    let origin = Origin {
        id,
        peer,
        protocol,
        listener: &listener,
        identity: identity.as_ref(),
    };
    let Accepted {
        terms,
        principal,
        mut link,
        connack,
        session_present,
        permit,
        from_node,
        epoch,
        resumed,
    } = match accept::accept(&hello, origin, &shared).await {
        Ok(accepted) => accepted,
        Err(Some(connack)) => return socket.send_and_close(connack).await,
        Err(None) => return socket.shutdown().await,
    };
    // A CONNECT that waited for etcd (a cluster node read its session
    // there) whose client gave up meanwhile: the client may be on another
    // node by now, and this connection's claim would take it from there.
    if resumed.read.0 > 0 && socket.closed_by_peer() {
        tracing::info!(
            %peer,
            client_id = terms.client_id,
            "clustering: the client closed the connection while its CONNECT waited for etcd: not accepted"
        );
        // The router has the connection: it leaves, and a session its
        // read brought from etcd (or its link made) is not this node's to
        // keep (it would collect the client's messages, and copies of them
        // in etcd, until it expired); one the node had stays as it was.
        let expiry = if resumed.was_here {
            terms.session_expiry
        } else {
            0
        };
        link.leave(expiry, driver::ROUTER_GOODBYE).await;
        return socket.shutdown().await;
    }
    // A session that moved from a live node: what the router gives waits
    // for that node's handover (see `link::RouterLink::hold_until`).
    if resumed.awaits_handover && from_node.is_none() {
        link.hold_until(tokio::time::Instant::now() + driver::HANDOVER_WAIT);
    }
    let client_id = terms.client_id.clone();
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
        epoch,
    });
    shared.store.connection_opened(&client_id, id);
    let acknowledged = shared.sessions.connected(
        &client_id,
        id,
        session_present,
        mailbox,
        Arc::clone(&peer_view),
    );
    // What another node handed over for the session and an earlier
    // connection here did not acknowledge comes first.
    for message in shared.sessions.take_handed_over(&client_id) {
        if shared.publisher.deliver_to(&client_id, message).is_err() {
            tracing::warn!(
                client_id,
                "a handed-over message kept for the session cannot be delivered: dropped"
            );
        }
    }
    // A cluster node records that it owns the client id now: its
    // connection on another node ends (0x8E). A link between nodes is not
    // a client. A node that lost its lease since it accepted the CONNECT
    // sends the connection away instead (it may have missed it: it was
    // not among the sessions yet), and claims nothing.
    let now = shared.standing.epoch();
    if now != epoch {
        shared.sessions.send_all_away(now);
    } else if from_node.is_none() {
        let will = hello
            .will
            .as_ref()
            .map(|w| (w, hello.will_properties.as_ref(), terms.session_expiry));
        shared.claim_client(&client_id, id, terms.clean_start, resumed, will, epoch);
    }
    let topic_alias_max = shared.settings.broker.topic_alias_max;
    let owner = crate::authentication::quota_owner(&principal, peer.ip()).into();
    let start = Start {
        id,
        client_id: client_id.clone(),
        protocol,
        session_expiry: terms.session_expiry,
        receive_maximum: terms.receive_maximum,
        max_packet_size: terms.max_packet_size,
        // 3.1.1 has no Receive Maximum.
        broker_receive_maximum: match protocol {
            Protocol::V5 => listener.receive_maximum,
            Protocol::V4 => u16::MAX,
        },
        topic_alias_max,
        client_topic_alias_max: terms.client_topic_alias_max,
        // As many requests as may be unacknowledged (3.1.1: the same).
        acknowledged: (acknowledged, listener.receive_maximum),
        joined: link.is_linked(),
        bound,
        principal: Arc::clone(&principal),
        owner,
        disk: shared.store.answered(),
        from_link: from_node.is_some(),
        ids: resumed.ids,
    };
    let mut machine = Machine::new(start, Arc::clone(&shared));
    let mut driver = Driver {
        socket,
        link,
        inbox: inbox::Inbox::new(direct_rx),
        idle_limit: terms.idle_limit(),
        max_packet_size: listener.max_packet_size,
        peer: peer_view,
        stop: if from_node.is_some() {
            shared.stop_links.subscribe()
        } else {
            shared.shutdown.clone()
        },
        shared: Arc::clone(&shared),
        first_source: 0,
    };
    machine.queue(handshake::connack(session_present, connack));
    if let Err(e) = driver.socket.write_all(&mut machine.wbuf).await {
        tracing::debug!(client_id, error = %e, "could not send CONNACK");
    }
    tracing::info!(%peer, client_id, connection = id, ?protocol, clean_start = terms.clean_start, keep_alive = terms.keep_alive, "client connected");

    crate::metrics::connection_opened();
    if let Some(node) = &from_node {
        shared.inbound_link(node, id, epoch, true);
    }
    let end = driver.run(&mut machine).await;
    if let Some(node) = &from_node {
        shared.inbound_link(node, id, epoch, false);
    }
    crate::metrics::connection_closed(end.label());
    // Boxed: `finish` (its state) runs once, at the end; inline, its room
    // would be held by every connection for its whole life.
    Box::pin(driver.finish(&mut machine, &end)).await;
    shared.store.connection_closed(&client_id, id);
    shared.release_client(&client_id, id, machine.session_expiry > 0);
    // No more direct deliveries; what was not acknowledged goes to the
    // router, which keeps it for a persistent session.
    shared
        .sessions
        .disconnected(&client_id, id, machine.session_expiry);
    let (handed_over, unacked): (Vec<_>, Vec<_>) = machine
        .out
        .hand_back(&mut driver.inbox)
        .into_iter()
        .partition(|m| m.handed_over);
    // Those another node handed over are the session's alone: published
    // on their topics, every subscriber would get them again. To the
    // client's connection that took this one over, if there is one; else
    // kept for its next.
    if machine.session_expiry > 0 {
        for message in handed_over {
            shared.sessions.deliver_handed_over(&client_id, message);
        }
    }
    if machine.session_expiry > 0 && !unacked.is_empty() && !matches!(end, end::End::Shutdown) {
        tracing::debug!(
            client_id,
            count = unacked.len(),
            "unacknowledged deliveries kept for the session"
        );
        shared.publisher.redeliver_later(unacked);
    }
    let will = end
        .will(hello.will, hello.will_properties, machine.session_expiry)
        .filter(|will| may_publish_will(&shared, &principal, &client_id, will));
    shared.wills.disconnected(&client_id, id, will);
    drop(permit);
}

/// Whether the policy in force now lets the client's will be published (a
/// policy reloaded since the CONNECT may deny what it allowed); logged
/// when it does not.
fn may_publish_will(
    shared: &Shared,
    principal: &crate::authorization::Principal,
    client_id: &str,
    will: &crate::will::Will,
) -> bool {
    let topic = String::from_utf8_lossy(&will.will.topic);
    let allowed = shared
        .authorizer
        .current()
        .is_none_or(|policy| policy.may_publish(principal, &topic));
    if !allowed {
        tracing::info!(
            client_id,
            %topic,
            "will not published: the authorization policy denies Publish on its topic"
        );
    }
    allowed
}
