//! Whether a CONNECT is accepted, and on what terms: an [`Accepted`]
//! value, or the CONNACK that refuses it.
//!
//! In order: the packet's own checks ([`handshake::check_connect`]), the
//! terms ([`Terms::negotiate`]), who the client is (certificate, password
//! or anonymous: [`crate::authentication`]), whether the policy lets it
//! connect, refusals a fault asks for, a connection slot, and the router's
//! session (a persistent session joins the router now; a clean one that
//! has no session to discard joins on first need).

use std::net::SocketAddr;
use std::sync::Arc;

use router::protocol::{ConnAckProperties, Packet};
use tokio::sync::OwnedSemaphorePermit;

use super::handshake::{self, Hello, Refusal, Terms};
use super::link::RouterLink;
use crate::authentication::{Failure, Presented};
use crate::authorization::Principal;
use crate::codec::Protocol;
use crate::config::Listener;
use crate::shared::Shared;
use crate::tls::CertIdentity;

/// A CONNECT the broker accepted.
pub(crate) struct Accepted {
    pub terms: Terms,
    pub principal: Arc<Principal>,
    pub link: RouterLink,
    /// The properties of the CONNACK that accepts it (MQTT 5), within the
    /// client's Maximum Packet Size.
    pub connack: ConnAckProperties,
    /// The router resumed a session (Session Present 1).
    pub session_present: bool,
    /// The connection's slot among `router.max_connections`.
    pub permit: OwnedSemaphorePermit,
    /// Another cluster node's link, and that node's id: what it publishes
    /// goes to this node's subscribers only.
    pub from_node: Option<String>,
    /// The node's stops before it was accepted (see [`crate::standing`]).
    pub epoch: u64,
    /// The packet ids the router's deliveries take (a session that moved
    /// here from another cluster node goes on in the next block), and the
    /// etcd revision a cluster node read the session at.
    pub resumed: crate::sessions::Resumed,
}

/// Where a CONNECT came from.
pub(crate) struct Origin<'a> {
    /// The connection's number.
    pub id: u64,
    pub peer: SocketAddr,
    pub protocol: Protocol,
    pub listener: &'a Listener,
    pub identity: Option<&'a CertIdentity>,
}

/// Decides on `hello` (see the module's documentation). `Err`: the
/// CONNACK that refuses it, or `None` where the connection is closed
/// without one (logged and counted already).
pub(crate) async fn accept(
    hello: &Hello,
    origin: Origin<'_>,
    shared: &Shared,
) -> Result<Accepted, Option<Packet>> {
    let Origin {
        id,
        peer,
        protocol,
        listener,
        identity,
    } = origin;
    // The smallest CONNACK (MQTT 5: 5 bytes) may be too large for the client.
    let max_packet_size = hello.properties.as_ref().and_then(|p| p.max_packet_size);
    let refuse = |refusal: Refusal, why: &str| {
        tracing::info!(%peer, client_id = hello.connect.client_id, ?protocol, why, "CONNECT refused");
        crate::metrics::connection_refused(refusal.label());
        handshake::refusal(protocol, refusal).filter(|_| max_packet_size.is_none_or(|max| max >= 5))
    };
    handshake::check_connect(
        &hello.connect,
        hello.will.as_ref(),
        hello.properties.as_ref(),
        protocol,
    )
    .map_err(|(refusal, why)| refuse(refusal, why))?;
    let mut terms = Terms::negotiate(
        hello,
        protocol,
        shared.settings.broker.max_keep_alive_secs,
        || format!("statebroker-{:x}-{id}", shared.started_nanos),
    );
    terms.cap_session_expiry(shared.settings.broker.max_session_expiry_secs, protocol);
    let broker = &shared.settings.broker;
    if terms
        .settle_queue_full(broker.queue_full, broker.allow_session_refuse)
        .is_some()
    {
        tracing::info!(
            %peer,
            client_id = terms.client_id,
            "queue_full = \"refuse\" asked for the session, not allowed \
             ([broker] allow_session_refuse): the session drops the oldest"
        );
    }
    let client_id = terms.client_id.as_str();
    let topic_alias_max = shared.settings.broker.topic_alias_max;
    let Some(connack) = handshake::connack_properties(&terms, listener, topic_alias_max) else {
        return Err(refuse(
            Refusal::ConnAckTooLarge,
            "a CONNACK with what it must carry is larger than the client's Maximum Packet Size",
        ));
    };
    // Who it is, and whether it may connect (the policy sees an assigned
    // client id). Another node's link proves itself with the cluster's
    // secret; the password file and the policy are for clients.
    let login = hello
        .login
        .as_ref()
        .map(|l| (l.username.as_str(), l.password.as_str()));
    let from_node = shared.peer_link(client_id, login).map(str::to_owned);
    if from_node.is_none() && client_id.starts_with(crate::publisher::LINK_CLIENT_PREFIX) {
        return Err(refuse(
            Refusal::BadCredentials,
            "a client id for another cluster node's link, without the cluster's secret",
        ));
    }
    let presented = Presented {
        client_id,
        login,
        certificate: identity,
        allow_anonymous: listener.allow_anonymous,
        source: peer.ip(),
    };
    let principal = match &from_node {
        Some(_) => Arc::new(Principal {
            client_id: client_id.to_owned(),
            username: Some(crate::publisher::LINK_USERNAME.to_owned()),
            attributes: Default::default(),
        }),
        None => match shared.authenticator.authenticate(presented).await {
            Ok(principal) => Arc::new(principal),
            Err(Failure::BadCredentials) => {
                return Err(refuse(Refusal::BadCredentials, "bad username or password"));
            }
            Err(Failure::Anonymous) => {
                return Err(refuse(
                    Refusal::NotAuthorized,
                    "anonymous clients are not allowed on this listener",
                ));
            }
        },
    };
    if let Some(policy) = shared.authorizer.current()
        && from_node.is_none()
        && !policy.may_connect(&principal)
    {
        return Err(refuse(
            Refusal::NotAuthorized,
            "the authorization policy denies Connect",
        ));
    }
    // A will is a publish the broker makes for the client later: the same
    // rule as the client's own PUBLISH (mosquitto refuses it the same way).
    if let Some(policy) = shared.authorizer.current()
        && let Some(will) = &hello.will
        && from_node.is_none()
        && !policy.may_publish(&principal, &String::from_utf8_lossy(&will.topic))
    {
        return Err(refuse(
            Refusal::NotAuthorized,
            "the authorization policy denies Publish on the will topic",
        ));
    }
    // Read before the check: a stop after it sends this connection away.
    let epoch = shared.standing.epoch();
    if !shared.standing.serving() {
        return Err(refuse(
            Refusal::NotAMember,
            "this cluster node has no confirmed membership lease in etcd: use another node",
        ));
    }
    if from_node.is_none() && !shared.takes_clients() {
        return Err(refuse(
            Refusal::Joining,
            "this cluster node has just joined: the other nodes have not all linked to it yet",
        ));
    }
    if shared.faults.refusing() {
        return Err(refuse(
            Refusal::Busy,
            "fault injected: refusing connections",
        ));
    }
    let permits = if from_node.is_some() {
        &shared.link_permits
    } else {
        &shared.permits
    };
    let Ok(permit) = Arc::clone(permits).try_acquire_owned() else {
        return Err(refuse(Refusal::Busy, "connection limit reached"));
    };
    // A cluster node: the session may have been on another node since.
    let resumed = if terms.clean_start || from_node.is_some() {
        crate::sessions::Resumed {
            ids: shared.run_ids,
            read: (0, 0),
            was_here: true,
            awaits_handover: false,
        }
    } else {
        match shared.resume_session(client_id).await {
            Ok(resumed) => resumed,
            Err(e) => {
                tracing::warn!(%peer, client_id, error = e, "clustering: cannot read the client's session from etcd");
                return Err(refuse(
                    Refusal::SessionUnavailable,
                    "this cluster node cannot read the client's session from etcd now",
                ));
            }
        }
    };
    // The node lost its lease while the CONNECT waited for etcd (and may
    // serve again under a new one): the client may be on another node by
    // now, and this late CONNECT's claim would take it from there.
    if shared.standing.epoch() != epoch {
        if !resumed.was_here {
            // A session the read brought from etcd is not this node's to
            // keep (see `connection::serve`).
            let _ = shared.router.replace_session(client_id, None).await;
        }
        return Err(refuse(
            Refusal::NotAMember,
            "this cluster node lost its membership lease while the CONNECT waited for etcd: use another node",
        ));
    }
    // A connection that starts clean, keeps nothing after it ends and has
    // no session to discard joins on first need.
    let lazy = terms.clean_start
        && terms.session_expiry == 0
        && !shared.sessions.has_session_to_discard(client_id);
    let opened = RouterLink::open(
        &shared.router,
        client_id,
        terms.clean_start,
        terms.session_expiry,
        terms.queue_full,
        lazy,
    )
    .await;
    let (mut link, session_present) = match opened {
        Ok(opened) => opened,
        // The router keeps `max_kept_sessions` and this would be one more:
        // refused, not accepted without its session (see docs/architecture.md,
        // "Sessions kept after their connection").
        Err(e) if e.sessions_quota() => {
            tracing::warn!(
                %peer,
                client_id,
                ?protocol,
                max_kept_sessions = shared.settings.broker.max_kept_sessions,
                "CONNECT refused: kept sessions at their bound (max_kept_sessions)"
            );
            crate::metrics::connection_refused(Refusal::SessionsQuota.label());
            return Err(handshake::refusal(protocol, Refusal::SessionsQuota)
                .filter(|_| max_packet_size.is_none_or(|max| max >= 5)));
        }
        Err(e) => {
            tracing::error!(%peer, client_id, error = %e, "router refused the connection");
            crate::metrics::connection_refused(Refusal::Busy.label());
            return Err(handshake::refusal(protocol, Refusal::Busy));
        }
    };
    link.ask_before_sending(shared.before_sending());
    Ok(Accepted {
        terms,
        principal,
        link,
        connack,
        session_present,
        permit,
        from_node,
        epoch,
        resumed,
    })
}
