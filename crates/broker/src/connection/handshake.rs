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
mod tests {
    use super::*;
    use bytes::Bytes;
    use router::protocol::QoS;

    fn listener() -> Listener {
        Listener {
            name: "v5.1".into(),
            addr: "127.0.0.1:0".parse().unwrap(),
            transport: crate::config::Transport::Tcp,
            tls: None,
            allow_anonymous: true,
            connect_timeout_ms: 1000,
            max_packet_size: 1 << 20,
            receive_maximum: 1000,
        }
    }

    fn connect(client_id: &str, clean: bool, keep_alive: u16) -> Connect {
        Connect {
            keep_alive,
            client_id: client_id.into(),
            clean_session: clean,
        }
    }

    fn hello(connect: Connect, properties: Option<ConnectProperties>) -> Hello {
        Hello {
            connect,
            properties,
            will: None,
            will_properties: None,
            login: None,
        }
    }

    fn will(topic: &str) -> LastWill {
        LastWill {
            topic: Bytes::copy_from_slice(topic.as_bytes()),
            message: Bytes::from_static(b"bye"),
            qos: QoS::AtLeastOnce,
            retain: false,
        }
    }

    #[test]
    fn client_ids() {
        let refused = |c: Connect| {
            check_connect(&c, None, None, Protocol::V5)
                .err()
                .map(|e| e.0)
        };
        assert_eq!(refused(connect("", true, 0)), None);
        assert_eq!(refused(connect("", false, 0)), Some(Refusal::BadClientId));
        for bad in ["a/b", "a+", "#", "$sys", "statebroker:publisher"] {
            assert_eq!(
                refused(connect(bad, true, 0)),
                Some(Refusal::BadClientId),
                "{bad}"
            );
        }
        assert_eq!(refused(connect("sensor-1", false, 0)), None);
    }

    #[test]
    fn will_topics() {
        let c = connect("c", true, 0);
        let check = |topic: &str, p| {
            check_connect(&c, Some(&will(topic)), None, p)
                .err()
                .map(|e| e.0)
        };
        for p in [Protocol::V5, Protocol::V4] {
            assert_eq!(check("devices/c/status", p), None);
            assert_eq!(check(topics::REQUEST_TOPIC, p), Some(Refusal::BadWill));
            let notify = format!("{}/x", topics::NOTIFY_NAMESPACE);
            assert_eq!(check(&notify, p), Some(Refusal::BadWill));
            // The broker's own topics: a retained will there would pass
            // for the broker's word (a client's PUBLISH there is refused).
            assert_eq!(check("$SYS/broker/version", p), Some(Refusal::BadWill));
        }
        // Not a topic name: MQTT 5 says so (0x90), 3.1.1 closes.
        for bad in ["", "a/+"] {
            assert_eq!(check(bad, Protocol::V5), Some(Refusal::BadWill));
            assert_eq!(check(bad, Protocol::V4), Some(Refusal::Malformed));
        }
    }

    #[test]
    fn authentication_methods_are_refused() {
        let c = connect("c", true, 0);
        let props = |method: Option<&str>, data: Option<&[u8]>| ConnectProperties {
            session_expiry_interval: None,
            receive_maximum: None,
            max_packet_size: None,
            topic_alias_max: None,
            request_response_info: None,
            request_problem_info: None,
            user_properties: Vec::new(),
            authentication_method: method.map(str::to_owned),
            authentication_data: data.map(Bytes::copy_from_slice),
        };
        let check = |p: ConnectProperties| {
            check_connect(&c, None, Some(&p), Protocol::V5)
                .err()
                .map(|e| e.0)
        };
        assert_eq!(check(props(None, None)), None);
        assert_eq!(
            check(props(Some("SCRAM-SHA-1"), None)),
            Some(Refusal::BadAuthenticationMethod)
        );
        assert_eq!(
            check(props(Some("SCRAM-SHA-1"), Some(b"x"))),
            Some(Refusal::BadAuthenticationMethod)
        );
        assert_eq!(check(props(None, Some(b"x"))), Some(Refusal::ProtocolError));
    }

    #[test]
    fn refusal_codes_per_protocol() {
        let code = |p, r| match refusal(p, r) {
            Some(Packet::ConnAck(ack, None)) => {
                assert!(!ack.session_present);
                ack.code
            }
            other => panic!("{other:?}"),
        };
        use ConnectReturnCode as C;
        assert_eq!(code(Protocol::V4, Refusal::Busy), C::ServiceUnavailable);
        assert_eq!(code(Protocol::V5, Refusal::Busy), C::ServerBusy);
        assert_eq!(code(Protocol::V4, Refusal::BadWill), C::NotAuthorized);
        assert_eq!(code(Protocol::V5, Refusal::BadWill), C::TopicNameInvalid);
        assert_eq!(code(Protocol::V5, Refusal::Malformed), C::MalformedPacket);
        assert_eq!(code(Protocol::V5, Refusal::ProtocolError), C::ProtocolError);
        assert_eq!(
            code(Protocol::V5, Refusal::ConnAckTooLarge),
            C::ImplementationSpecificError
        );
        assert_eq!(code(Protocol::V5, Refusal::SessionsQuota), C::QuotaExceeded);
        assert_eq!(
            code(Protocol::V4, Refusal::SessionsQuota),
            C::ServiceUnavailable
        );
        for r in [Refusal::Malformed, Refusal::ProtocolError] {
            assert_eq!(refusal(Protocol::V4, r), None, "{r:?}: 3.1.1 closes");
        }
        for r in [Refusal::Joining, Refusal::SessionUnavailable] {
            assert_eq!(code(Protocol::V5, r), C::ServerUnavailable, "{r:?}");
            assert_eq!(code(Protocol::V4, r), C::ServiceUnavailable, "{r:?}");
        }
        for p in [Protocol::V4, Protocol::V5] {
            assert_eq!(code(p, Refusal::BadClientId), C::ClientIdentifierNotValid);
            assert_eq!(code(p, Refusal::BadCredentials), C::BadUserNamePassword);
            assert_eq!(code(p, Refusal::NotAuthorized), C::NotAuthorized);
        }
    }

    #[test]
    fn keep_alive_and_limits() {
        let props = ConnectProperties {
            session_expiry_interval: Some(3600),
            receive_maximum: Some(10),
            max_packet_size: Some(512),
            topic_alias_max: None,
            request_response_info: None,
            request_problem_info: None,
            user_properties: Vec::new(),
            authentication_method: None,
            authentication_data: None,
        };
        let h = hello(connect("c", false, 0), Some(props));
        let t = Terms::negotiate(&h, Protocol::V5, 60, || unreachable!());
        assert_eq!(
            (t.keep_alive, t.server_keep_alive, t.idle_limit()),
            (60, Some(60), Some(Duration::from_secs(90))),
            "no keep-alive asked: the broker's maximum, announced"
        );
        assert_eq!((t.receive_maximum, t.session_expiry), (10, 3600));
        assert_eq!(t.max_packet_size, 512);
        assert!(!t.clean_start && !t.assigned);

        let h = hello(connect("c", true, 30), None);
        let t = Terms::negotiate(&h, Protocol::V5, 60, || unreachable!());
        assert_eq!((t.keep_alive, t.server_keep_alive), (30, None));
        assert_eq!((t.receive_maximum, t.session_expiry), (u16::MAX, 0));
        assert_eq!(t.max_packet_size, usize::MAX);
        let t = Terms::negotiate(
            &hello(connect("c", true, 600), None),
            Protocol::V5,
            60,
            || unreachable!(),
        );
        assert_eq!((t.keep_alive, t.server_keep_alive), (60, Some(60)));
        // MQTT 3.1.1: a persistent session never expires.
        let t = Terms::negotiate(
            &hello(connect("c", false, 0), None),
            Protocol::V4,
            60,
            || unreachable!(),
        );
        assert_eq!(t.session_expiry, u32::MAX);
        // MQTT 3.1.1 has no way to be told: its keep-alive stands.
        let t = Terms::negotiate(
            &hello(connect("c", true, 0), None),
            Protocol::V4,
            60,
            || unreachable!(),
        );
        assert_eq!(
            (t.keep_alive, t.server_keep_alive, t.idle_limit()),
            (0, None, None)
        );
        // No maximum configured.
        let t = Terms::negotiate(
            &hello(connect("c", true, 0), None),
            Protocol::V5,
            0,
            || unreachable!(),
        );
        assert_eq!((t.keep_alive, t.server_keep_alive), (0, None));
    }

    /// 3.2.2.3.2: the broker's maximum Session Expiry Interval, told in
    /// CONNACK to an MQTT 5 client that asked for more; applied to 3.1.1
    /// persistent sessions without a word.
    #[test]
    fn session_expiry_is_capped() {
        let asking = |expiry: Option<u32>| ConnectProperties {
            session_expiry_interval: expiry,
            receive_maximum: None,
            max_packet_size: None,
            topic_alias_max: None,
            request_response_info: None,
            request_problem_info: None,
            user_properties: Vec::new(),
            authentication_method: None,
            authentication_data: None,
        };
        let l = listener();
        let capped = |expiry: Option<u32>, max: u32| {
            let h = hello(connect("c", false, 0), Some(asking(expiry)));
            let mut t = Terms::negotiate(&h, Protocol::V5, 0, || unreachable!());
            t.cap_session_expiry(max, Protocol::V5);
            let told = connack_properties(&t, &l, 0)
                .unwrap()
                .session_expiry_interval;
            (t.session_expiry, told)
        };
        assert_eq!(capped(Some(u32::MAX), 604_800), (604_800, Some(604_800)));
        assert_eq!(capped(Some(604_801), 604_800), (604_800, Some(604_800)));
        assert_eq!(capped(Some(604_800), 604_800), (604_800, None), "not more");
        assert_eq!(capped(Some(60), 604_800), (60, None));
        assert_eq!(capped(None, 604_800), (0, None), "nothing kept");
        assert_eq!(capped(Some(u32::MAX), 0), (u32::MAX, None), "no maximum");
        let h = hello(connect("c", false, 0), None);
        let mut t = Terms::negotiate(&h, Protocol::V4, 0, || unreachable!());
        t.cap_session_expiry(604_800, Protocol::V4);
        assert_eq!((t.session_expiry, t.server_session_expiry), (604_800, None));
        let h = hello(connect("c", true, 0), None);
        let mut t = Terms::negotiate(&h, Protocol::V4, 0, || unreachable!());
        t.cap_session_expiry(604_800, Protocol::V4);
        assert_eq!(t.session_expiry, 0, "a clean 3.1.1 session keeps nothing");
    }

    #[test]
    fn assigned_client_id_is_announced() {
        let h = hello(connect("", true, 0), None);
        let t = Terms::negotiate(&h, Protocol::V5, 0, || "statebroker-1-7".into());
        assert_eq!(
            (t.client_id.as_str(), t.assigned),
            ("statebroker-1-7", true)
        );
        let l = listener();
        match connack(false, connack_properties(&t, &l, 1024).unwrap()) {
            Packet::ConnAck(ack, Some(p)) => {
                assert_eq!(ack.code, ConnectReturnCode::Success);
                assert_eq!(
                    p.assigned_client_identifier.as_deref(),
                    Some("statebroker-1-7")
                );
                assert_eq!(p.receive_max, Some(1000));
                assert_eq!(p.topic_alias_max, Some(1024));
                assert_eq!(p.max_packet_size, Some(1 << 20));
                assert_eq!(p.server_keep_alive, None);
            }
            other => panic!("{other:?}"),
        }
        let named = Terms::negotiate(
            &hello(connect("me", false, 0), None),
            Protocol::V5,
            0,
            || unreachable!(),
        );
        match connack(true, connack_properties(&named, &l, 0).unwrap()) {
            Packet::ConnAck(ack, Some(p)) => {
                assert!(ack.session_present);
                assert_eq!(p.assigned_client_identifier, None);
            }
            other => panic!("{other:?}"),
        }
    }

    /// [MQTT-3.1.2-24]: the CONNACK fits the client's Maximum Packet Size,
    /// leaving out what matters least first.
    #[test]
    fn connack_within_the_clients_maximum_packet_size() {
        let l = listener();
        let size = |t: &Terms| {
            let mut out = bytes::BytesMut::new();
            let p = connack_properties(t, &l, 1024).unwrap();
            Protocol::V5
                .write(connack(false, p.clone()), &mut out)
                .unwrap();
            (out.len(), p)
        };
        let terms = |max: u32, id: &str| {
            let props = ConnectProperties {
                session_expiry_interval: None,
                receive_maximum: None,
                max_packet_size: Some(max),
                topic_alias_max: None,
                request_response_info: None,
                request_problem_info: None,
                user_properties: Vec::new(),
                authentication_method: None,
                authentication_data: None,
            };
            let h = hello(connect(id, true, 0), Some(props));
            Terms::negotiate(&h, Protocol::V5, 0, || "statebroker-1-7".into())
        };
        let (full, p) = size(&terms(1 << 20, "c"));
        assert_eq!(full, 24);
        assert_eq!(p.retain_available, Some(1));
        let (len, p) = size(&terms(20, "c"));
        assert_eq!(len, 20, "two 'available' flags left out");
        assert_eq!(
            (
                p.shared_subscription_available,
                p.wildcard_subscription_available
            ),
            (None, None)
        );
        assert_eq!(p.retain_available, Some(1));
        let (len, p) = size(&terms(16, "c"));
        assert_eq!(len, 16, "the four 'available' flags left out");
        assert_eq!(
            (p.retain_available, p.subscription_identifiers_available),
            (None, None)
        );
        assert_eq!(p.topic_alias_max, Some(1024));
        let (len, p) = size(&terms(22, "c"));
        assert_eq!(len, 22, "only as much left out as needed");
        assert_eq!(p.retain_available, Some(1));
        assert_eq!(p.shared_subscription_available, None);
        let (len, p) = size(&terms(13, "c"));
        assert_eq!(len, 13);
        assert_eq!(p.topic_alias_max, None);
        assert_eq!(
            (p.receive_max, p.max_packet_size),
            (Some(1000), Some(1 << 20))
        );
        // Receive Maximum and Maximum Packet Size never left out.
        assert!(connack_properties(&terms(12, "c"), &l, 1024).is_none());
        // Nor an assigned client id.
        assert!(connack_properties(&terms(20, ""), &l, 1024).is_none());
        let (len, p) = size(&terms(31, ""));
        assert_eq!(len, 31);
        assert_eq!(
            p.assigned_client_identifier.as_deref(),
            Some("statebroker-1-7")
        );
    }

    /// A session's `queue_full` (CONNECT User Property): read, checked,
    /// settled against the broker's, told in CONNACK (left out first when
    /// the CONNACK would not fit).
    #[test]
    fn queue_full_asked_settled_and_told() {
        use router::QueueFull::{DropOldest, Refuse};
        let asking = |value: &str, max_packet_size: Option<u32>| ConnectProperties {
            session_expiry_interval: None,
            receive_maximum: None,
            max_packet_size,
            topic_alias_max: None,
            request_response_info: None,
            request_problem_info: None,
            user_properties: vec![("queue_full".into(), value.into())],
            authentication_method: None,
            authentication_data: None,
        };
        let v5 = Protocol::V5;
        let checked =
            |p: &ConnectProperties| check_connect(&connect("c", true, 0), None, Some(p), v5);
        assert_eq!(
            checked(&asking("later", None)).unwrap_err().0,
            Refusal::BadUserProperty
        );
        assert!(checked(&asking("refuse", None)).is_ok());
        let Some(Packet::ConnAck(ack, Some(p))) = refusal(v5, Refusal::BadUserProperty) else {
            panic!("a CONNACK with properties");
        };
        assert_eq!(ack.code, ConnectReturnCode::ImplementationSpecificError);
        assert!(
            p.reason_string
                .unwrap()
                .contains("\"drop_oldest\" or \"refuse\"")
        );

        let terms = |value: &str, max: Option<u32>| {
            let h = hello(connect("c", false, 0), Some(asking(value, max)));
            Terms::negotiate(&h, v5, 0, || unreachable!())
        };
        // (broker's, allow_session_refuse, asked) -> in force, denied
        let cases = [
            (DropOldest, false, "refuse", None, Some(Refuse)),
            (DropOldest, true, "refuse", Some(Refuse), None),
            (Refuse, false, "refuse", Some(Refuse), None),
            (Refuse, false, "drop_oldest", Some(DropOldest), None),
            (DropOldest, false, "drop_oldest", Some(DropOldest), None),
        ];
        for (default, allow, asked, in_force, denied) in cases {
            let mut t = terms(asked, None);
            assert_eq!(t.settle_queue_full(default, allow), denied, "{asked}");
            assert_eq!(t.queue_full, in_force, "{asked}");
            let told = in_force.unwrap_or(default);
            assert_eq!(t.told_queue_full, Some(told));
            let p = connack_properties(&t, &listener(), 0).unwrap();
            assert_eq!(
                p.user_properties,
                vec![("queue_full".to_owned(), queue_full_name(told).to_owned())]
            );
        }
        // Nothing asked, nothing told.
        let mut t = Terms::negotiate(
            &hello(connect("c", false, 0), None),
            v5,
            0,
            || unreachable!(),
        );
        assert_eq!(t.settle_queue_full(Refuse, false), None);
        assert_eq!((t.queue_full, t.told_queue_full), (None, None));
        // A CONNACK that fits only without it.
        let mut t = terms("refuse", Some(30));
        t.settle_queue_full(Refuse, false);
        let p = connack_properties(&t, &listener(), 0).unwrap();
        assert!(p.user_properties.is_empty());
        assert_eq!(p.retain_available, Some(1), "left out first");
    }
}
