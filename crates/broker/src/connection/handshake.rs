//! CONNECT: reading it in time, the checks that refuse it, the terms the
//! connection runs on, and CONNACK.
//!
//! The decisions ([`check_connect`], [`Terms::negotiate`], [`connack`],
//! [`refusal`]) are plain functions of the packet and the settings, tested
//! here without a socket; [`read_connect`] is the only part that waits.

use std::net::SocketAddr;
use std::time::Duration;

use router::protocol::{
    self, ConnAck, ConnAckProperties, Connect, ConnectProperties, ConnectReturnCode, LastWill,
    LastWillProperties, Login, Packet,
};

use super::socket::{Socket, Stream};
use crate::codec::{CodecError, Protocol};
use crate::config::Listener;
use crate::publisher::{INTERNAL_PREFIX, LINK_CLIENT_PREFIX};
use crate::topics;

/// A CONNECT, in parts.
pub(crate) struct Hello {
    pub connect: Connect,
    pub properties: Option<ConnectProperties>,
    pub will: Option<LastWill>,
    pub will_properties: Option<LastWillProperties>,
    pub login: Option<Login>,
}

/// Reads CONNECT within the listener's connect timeout. `None`: the socket
/// is done with (nothing in time, or not a CONNECT we serve; a CONNECT of an
/// unsupported protocol level was answered "unacceptable protocol version").
pub(crate) async fn read_connect<S: Stream>(
    socket: &mut Socket<S>,
    listener: &Listener,
    peer: SocketAddr,
) -> Option<Hello> {
    let timeout = Duration::from_millis(listener.connect_timeout_ms);
    match tokio::time::timeout(timeout, socket.read_connect(listener.max_packet_size)).await {
        Err(_) => {
            tracing::debug!(%peer, "no CONNECT in time: closing");
            None
        }
        Ok(Err(e)) => {
            tracing::info!(%peer, error = %e, "bad CONNECT: closing");
            match e {
                CodecError::UnsupportedLevel(_) => {
                    // "unacceptable protocol version", understood by every version.
                    let _ = socket.write_raw(&[0x20, 0x02, 0x00, 0x01]).await;
                }
                // MQTT 5 3.1.4 and 4.13: CONNACK 0x81 Malformed Packet, then
                // close; 3.1.1 closes without CONNACK ([MQTT-3.1.4-1]).
                CodecError::Malformed(_) if socket.detected && socket.protocol == Protocol::V5 => {
                    crate::metrics::connection_refused(Refusal::Malformed.label());
                    let _ = socket.write_raw(&[0x20, 0x03, 0x00, 0x81, 0x00]).await;
                }
                CodecError::Malformed(_) if socket.detected => {
                    crate::metrics::connection_refused(Refusal::Malformed.label());
                }
                // A CONNECT the decoder read but MQTT 5 does not allow (a
                // property twice, Receive Maximum 0, ...): CONNACK 0x82
                // Protocol Error, then close (4.13); 3.1.1 closes.
                CodecError::Protocol(_) if socket.detected => {
                    crate::metrics::connection_refused(Refusal::ProtocolError.label());
                    if socket.protocol == Protocol::V5 {
                        let _ = socket.write_raw(&[0x20, 0x03, 0x00, 0x82, 0x00]).await;
                    }
                }
                _ => {}
            }
            None
        }
        Ok(Ok(Packet::Connect(connect, properties, will, will_properties, login))) => Some(Hello {
            connect,
            properties: properties.map(|p| *p),
            will: will.map(|w| *w),
            will_properties: will_properties.map(|p| *p),
            login,
        }),
        Ok(Ok(_)) => None,
    }
}

/// Why a CONNECT is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    BadClientId,
    BadCredentials,
    /// Anonymous where that is not allowed, or denied by the policy.
    NotAuthorized,
    Busy,
    BadWill,
    /// An Authentication Method: statebroker supports none (no AUTH
    /// exchange), so it must refuse and close, MQTT 5 [MQTT-4.12.0-1].
    BadAuthenticationMethod,
    /// A rule of the CONNECT packet broken that the decoder cannot see
    /// (MQTT 5 4.13: CONNACK 0x82; 3.1.1: close without CONNACK).
    ProtocolError,
    /// A CONNECT that does not conform to 3.1 (MQTT 5 4.13: CONNACK 0x81;
    /// 3.1.1 [MQTT-3.1.4-1]: close without CONNACK).
    Malformed,
    /// The client's Maximum Packet Size leaves no room for a CONNACK with
    /// what it must carry (see [`connack_within`]).
    ConnAckTooLarge,
    /// The connection would keep one more session than `[broker]
    /// max_kept_sessions` (for a client id that has none).
    SessionsQuota,
    /// A cluster node that lost its membership lease (MQTT 5: 0x9C "use
    /// another server"; 3.1.1: 0x03 "server unavailable").
    NotAMember,
    /// A cluster node that has just joined, before the other nodes have
    /// linked to it (MQTT 5: 0x88 "server unavailable"; 3.1.1: 0x03).
    Joining,
    /// A cluster node that could not read the client's session from etcd
    /// (MQTT 5: 0x88 "server unavailable"; 3.1.1: 0x03).
    SessionUnavailable,
    /// A User Property statebroker reads ([`QUEUE_FULL`]) with a value it
    /// does not know (MQTT 5: CONNACK 0x83 with a Reason String saying
    /// what is expected).
    BadUserProperty,
}

impl Refusal {
    /// A short name for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::BadClientId => "client_id_not_valid",
            Refusal::BadCredentials => "bad_username_or_password",
            Refusal::NotAuthorized => "not_authorized",
            Refusal::Busy => "server_busy",
            Refusal::BadWill => "will_not_valid",
            Refusal::BadAuthenticationMethod => "bad_authentication_method",
            Refusal::ProtocolError => "protocol_error",
            Refusal::Malformed => "malformed_packet",
            Refusal::ConnAckTooLarge => "connack_too_large",
            Refusal::SessionsQuota => "sessions_quota_exceeded",
            Refusal::BadUserProperty => "user_property_not_valid",
            Refusal::NotAMember => "not_a_cluster_member",
            Refusal::Joining => "cluster_node_joining",
            Refusal::SessionUnavailable => "cluster_session_unavailable",
        }
    }
}

/// The CONNACK that refuses a connection, in the client's protocol;
/// `None`: the connection is closed without one (3.1.1 has no CONNACK for
/// a CONNECT that breaks the protocol, [MQTT-3.1.4-1]).
pub(crate) fn refusal(protocol: Protocol, refusal: Refusal) -> Option<Packet> {
    let code = match (protocol, refusal) {
        (Protocol::V4, Refusal::Malformed | Refusal::ProtocolError) => return None,
        (Protocol::V5, Refusal::Malformed) => ConnectReturnCode::MalformedPacket,
        (Protocol::V5, Refusal::ProtocolError) => ConnectReturnCode::ProtocolError,
        // 3.1.1 has neither (and its encoder knows only codes 0-5).
        (Protocol::V4, Refusal::BadAuthenticationMethod) => ConnectReturnCode::NotAuthorized,
        (Protocol::V4, Refusal::ConnAckTooLarge | Refusal::SessionsQuota) => {
            ConnectReturnCode::ServiceUnavailable
        }
        // 3.1.1 has no User Properties: never refused for one.
        (Protocol::V4, Refusal::BadUserProperty) => ConnectReturnCode::NotAuthorized,
        (Protocol::V5, Refusal::BadUserProperty) => ConnectReturnCode::ImplementationSpecificError,
        (Protocol::V5, Refusal::SessionsQuota) => ConnectReturnCode::QuotaExceeded,
        (Protocol::V4, Refusal::NotAMember) => ConnectReturnCode::ServiceUnavailable,
        (Protocol::V5, Refusal::NotAMember) => ConnectReturnCode::UseAnotherServer,
        (Protocol::V4, Refusal::Joining | Refusal::SessionUnavailable) => {
            ConnectReturnCode::ServiceUnavailable
        }
        (Protocol::V5, Refusal::Joining | Refusal::SessionUnavailable) => {
            ConnectReturnCode::ServerUnavailable
        }
        (Protocol::V5, Refusal::BadAuthenticationMethod) => {
            ConnectReturnCode::BadAuthenticationMethod
        }
        (Protocol::V5, Refusal::ConnAckTooLarge) => ConnectReturnCode::ImplementationSpecificError,
        (_, Refusal::BadClientId) => ConnectReturnCode::ClientIdentifierNotValid,
        (_, Refusal::BadCredentials) => ConnectReturnCode::BadUserNamePassword,
        (_, Refusal::NotAuthorized) => ConnectReturnCode::NotAuthorized,
        (Protocol::V4, Refusal::Busy) => ConnectReturnCode::ServiceUnavailable,
        (Protocol::V5, Refusal::Busy) => ConnectReturnCode::ServerBusy,
        (Protocol::V4, Refusal::BadWill) => ConnectReturnCode::NotAuthorized,
        (Protocol::V5, Refusal::BadWill) => ConnectReturnCode::TopicNameInvalid,
    };
    // MQTT 5: what is wrong, where a code cannot say it (3.2.2.3.9).
    let properties = (protocol == Protocol::V5 && refusal == Refusal::BadUserProperty).then(|| {
        ConnAckProperties {
            reason_string: Some(format!(
                "User Property {QUEUE_FULL} must be \"drop_oldest\" or \"refuse\""
            )),
            ..ConnAckProperties::default()
        }
    });
    Some(Packet::ConnAck(
        ConnAck {
            session_present: false,
            code,
        },
        properties.map(Box::new),
    ))
}

/// The CONNECT User Property by which a session chooses what a publish
/// does when it would push out of a subscription's log a message the
/// session has not had: `drop_oldest` or `refuse` (`[broker] queue_full`'s
/// values). The CONNACK answers with the same property and the value in
/// force.
pub(crate) const QUEUE_FULL: &str = "queue_full";

/// The session's choice in `properties` ([`QUEUE_FULL`]; the last one if
/// several), `Ok(None)` without one, `Err` for a value not known.
pub(crate) fn requested_queue_full(
    properties: Option<&ConnectProperties>,
) -> Result<Option<router::QueueFull>, ()> {
    let Some(value) = properties.and_then(|p| {
        p.user_properties
            .iter()
            .rev()
            .find(|(k, _)| k == QUEUE_FULL)
            .map(|(_, v)| v.as_str())
    }) else {
        return Ok(None);
    };
    match value {
        "drop_oldest" => Ok(Some(router::QueueFull::DropOldest)),
        "refuse" => Ok(Some(router::QueueFull::Refuse)),
        _ => Err(()),
    }
}

/// The name of a [`router::QueueFull`] as configured and in [`QUEUE_FULL`].
pub(crate) fn queue_full_name(queue_full: router::QueueFull) -> &'static str {
    match queue_full {
        router::QueueFull::DropOldest => "drop_oldest",
        router::QueueFull::Refuse => "refuse",
    }
}

/// Checks a CONNECT before the client is registered.
///
/// Who the client is and whether it may connect are decided after this,
/// by [`crate::authentication`] and [`crate::authorization`].
pub(crate) fn check_connect(
    connect: &Connect,
    will: Option<&LastWill>,
    properties: Option<&ConnectProperties>,
    protocol: Protocol,
) -> Result<(), (Refusal, &'static str)> {
    if let Some(p) = properties {
        if p.authentication_method.is_some() {
            return Err((
                Refusal::BadAuthenticationMethod,
                "authentication methods are not supported [MQTT-4.12.0-1]",
            ));
        }
        if p.authentication_data.is_some() {
            return Err((
                Refusal::ProtocolError,
                "Authentication Data without an Authentication Method (3.1.2.11.10)",
            ));
        }
        if requested_queue_full(Some(p)).is_err() {
            return Err((
                Refusal::BadUserProperty,
                "User Property queue_full is neither drop_oldest nor refuse",
            ));
        }
    }
    let id = &connect.client_id;
    if id.is_empty() && !connect.clean_session {
        return Err((
            Refusal::BadClientId,
            "an empty client id needs a clean session",
        ));
    }
    // The router cannot route for ids with these characters; the prefix is
    // ours (another node's link is let through here, and accepted only
    // with the cluster's secret, see accept.rs).
    if id.contains(['+', '#', '/', '$'])
        || id.starts_with(INTERNAL_PREFIX) && !id.starts_with(LINK_CLIENT_PREFIX)
    {
        return Err((Refusal::BadClientId, "client id not allowed"));
    }
    if let Some(will) = will {
        let topic = std::str::from_utf8(&will.topic).unwrap_or("");
        // 3.1.1: not a topic name at all, so not a CONNECT of 3.1
        // ([MQTT-4.7.3-1], [MQTT-4.7.1-1]); MQTT 5 names the reason (0x90).
        if protocol == Protocol::V4 && (topic.is_empty() || !protocol::valid_topic(topic)) {
            return Err((
                Refusal::Malformed,
                "will topic empty or with wildcards [MQTT-4.7.3-1]",
            ));
        }
        if topic.is_empty()
            || !protocol::valid_topic(topic)
            || topics::is_reserved_response_topic(topic)
            || topics::in_notify_namespace(topic)
        {
            return Err((Refusal::BadWill, "will topic not allowed"));
        }
    }
    Ok(())
}

/// What an accepted connection runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Terms {
    pub client_id: String,
    /// The broker chose the client id (the client sent an empty one).
    pub assigned: bool,
    pub clean_start: bool,
    /// Keep-alive in seconds (0: none).
    pub keep_alive: u16,
    /// The keep-alive the broker imposes, told in CONNACK (MQTT 5).
    pub server_keep_alive: Option<u16>,
    /// The client's Receive Maximum.
    pub receive_maximum: u16,
    /// How long the session outlives the connection, seconds (`u32::MAX`:
    /// for ever): the client's Session Expiry Interval in MQTT 5; in 3.1.1
    /// 0 for a clean session and for ever otherwise; at most the broker's
    /// maximum once [`Terms::cap_session_expiry`] applied it.
    pub session_expiry: u32,
    /// The Session Expiry Interval the broker imposes, told in CONNACK
    /// (MQTT 5, 3.2.2.3.2): set when the client asked for more.
    pub server_session_expiry: Option<u32>,
    /// The largest packet the client accepts (its Maximum Packet Size).
    pub max_packet_size: usize,
    /// The topic aliases the client accepts from the broker (its Topic
    /// Alias Maximum, MQTT 5 3.1.2.11.5; 0: none).
    pub client_topic_alias_max: u16,
    /// The session's own `queue_full`, as asked for in CONNECT
    /// ([`QUEUE_FULL`]) until [`Terms::settle_queue_full`] decides it.
    pub queue_full: Option<router::QueueFull>,
    /// The `queue_full` in force, told in CONNACK when the client asked.
    pub told_queue_full: Option<router::QueueFull>,
}

impl Terms {
    /// The terms of a CONNECT that passed [`check_connect`]. `assign` makes
    /// a client id for a client that sent none; `max_keep_alive` (seconds,
    /// 0 for none) bounds what an MQTT 5 client may ask for.
    pub fn negotiate(
        hello: &Hello,
        protocol: Protocol,
        max_keep_alive: u16,
        assign: impl FnOnce() -> String,
    ) -> Terms {
        let connect = &hello.connect;
        let assigned = connect.client_id.is_empty();
        let client_id = if assigned {
            assign()
        } else {
            connect.client_id.clone()
        };
        let mut keep_alive = connect.keep_alive;
        let mut server_keep_alive = None;
        if protocol == Protocol::V5
            && max_keep_alive > 0
            && (keep_alive == 0 || keep_alive > max_keep_alive)
        {
            keep_alive = max_keep_alive;
            server_keep_alive = Some(max_keep_alive);
        }
        let properties = hello.properties.as_ref();
        Terms {
            client_id,
            assigned,
            clean_start: connect.clean_session,
            keep_alive,
            server_keep_alive,
            receive_maximum: properties
                .and_then(|p| p.receive_maximum)
                .unwrap_or(u16::MAX),
            session_expiry: match protocol {
                Protocol::V5 => properties
                    .and_then(|p| p.session_expiry_interval)
                    .unwrap_or(0),
                Protocol::V4 if connect.clean_session => 0,
                Protocol::V4 => u32::MAX,
            },
            server_session_expiry: None,
            max_packet_size: properties
                .and_then(|p| p.max_packet_size)
                .map_or(usize::MAX, |max| max as usize),
            client_topic_alias_max: match protocol {
                Protocol::V5 => properties.and_then(|p| p.topic_alias_max).unwrap_or(0),
                Protocol::V4 => 0,
            },
            queue_full: requested_queue_full(properties).ok().flatten(),
            told_queue_full: None,
        }
    }

    /// Decides the session's `queue_full`: `refuse` (which lets a lagging
    /// session hold up publishers) only where the broker refuses anyway
    /// (`default`) or `allow_refuse`; `drop_oldest` always. Returns the
    /// refused choice, if any, for the log.
    pub fn settle_queue_full(
        &mut self,
        default: router::QueueFull,
        allow_refuse: bool,
    ) -> Option<router::QueueFull> {
        let asked = self.queue_full?;
        let denied = asked == router::QueueFull::Refuse
            && default != router::QueueFull::Refuse
            && !allow_refuse;
        if denied {
            self.queue_full = None;
        }
        self.told_queue_full = Some(self.queue_full.unwrap_or(default));
        denied.then_some(asked)
    }

    /// Keeps the session at most `max` seconds after the connection (0: no
    /// maximum). An MQTT 5 client that asked for more, or for ever, is told
    /// the broker's value in CONNACK (3.2.2.3.2: the server may use a value
    /// other than the client's); a 3.1.1 persistent session (for ever in
    /// that protocol) gets the maximum without being told.
    pub fn cap_session_expiry(&mut self, max: u32, protocol: Protocol) {
        if max == 0 || self.session_expiry <= max {
            return;
        }
        self.session_expiry = max;
        if protocol == Protocol::V5 {
            self.server_session_expiry = Some(max);
        }
    }

    /// How long the broker waits for the next packet: 1.5 times the
    /// keep-alive, or forever without one.
    pub fn idle_limit(&self) -> Option<Duration> {
        (self.keep_alive > 0).then(|| Duration::from_millis(u64::from(self.keep_alive) * 1500))
    }
}

/// The CONNACK that accepts a connection, with what the broker announces.
///
/// Its properties are [`connack_properties`]'s: call that first, it
/// decides whether the client can take a CONNACK at all.
pub(crate) fn connack(session_present: bool, properties: ConnAckProperties) -> Packet {
    let ack = ConnAck {
        session_present,
        code: ConnectReturnCode::Success,
    };
    Packet::ConnAck(ack, Some(Box::new(properties)))
}

/// The properties of the CONNACK that accepts a connection (MQTT 5), within
/// the client's Maximum Packet Size ([MQTT-3.1.2-24]: no packet larger than
/// it goes to the client, the CONNACK included). `None`: not even what
/// the CONNACK must carry fits; the connection is refused
/// ([`Refusal::ConnAckTooLarge`]).
///
/// What is left out first, until the packet fits:
///
/// 1. Retain Available, Wildcard Subscription Available, Subscription
///    Identifiers Available, Shared Subscription Available: all 1, which
///    is what their absence means (3.2.2.3.5, 3.2.2.3.11-13); nothing is
///    lost;
/// 2. Topic Alias Maximum: absent means 0 (3.2.2.3.8), so the client
///    sends no aliases (the broker still resolves any it gets).
///
/// What stays, as the client must know it: the Assigned Client Identifier
/// (the client has no other way to learn its id, 3.2.2.3.7), the Server
/// Keep Alive (the broker's timeout follows it, 3.2.2.3.14), the Session
/// Expiry Interval when the broker shortened the client's (3.2.2.3.2),
/// the Receive
/// Maximum and Maximum Packet Size (absent they mean 65,535 and no limit,
/// and the broker enforces its own: a client that believed them would be
/// disconnected). The broker sends no Reason String in CONNACK; its one
/// User Property answers a client that asked for a `queue_full`
/// ([`QUEUE_FULL`]), and is left out first when the packet does not fit
/// (3.2.2.3.10 allows leaving it out).
pub(crate) fn connack_properties(
    terms: &Terms,
    listener: &Listener,
    topic_alias_max: u16,
) -> Option<ConnAckProperties> {
    let mut properties = ConnAckProperties {
        assigned_client_identifier: terms.assigned.then(|| terms.client_id.clone()),
        topic_alias_max: Some(topic_alias_max),
        receive_max: Some(listener.receive_maximum),
        max_packet_size: Some(u32::try_from(listener.max_packet_size).unwrap_or(u32::MAX)),
        server_keep_alive: terms.server_keep_alive,
        session_expiry_interval: terms.server_session_expiry,
        retain_available: Some(1),
        wildcard_subscription_available: Some(1),
        shared_subscription_available: Some(1),
        subscription_identifiers_available: Some(1),
        user_properties: terms
            .told_queue_full
            .map(|q| vec![(QUEUE_FULL.to_owned(), queue_full_name(q).to_owned())])
            .unwrap_or_default(),
        ..ConnAckProperties::default()
    };
    let fits = |p: &ConnAckProperties| {
        let mut out = bytes::BytesMut::new();
        Protocol::V5
            .write(connack(false, p.clone()), &mut out)
            .is_ok_and(|()| out.len() <= terms.max_packet_size)
    };
    type Leave = fn(&mut ConnAckProperties);
    let optional: [Leave; 6] = [
        |p| p.user_properties.clear(),
        |p| p.shared_subscription_available = None,
        |p| p.wildcard_subscription_available = None,
        |p| p.subscription_identifiers_available = None,
        |p| p.retain_available = None,
        |p| p.topic_alias_max = None,
    ];
    let mut left_out = optional.iter();
    while !fits(&properties) {
        left_out.next()?(&mut properties);
    }
    Some(properties)
}

#[cfg(test)]
mod tests;
