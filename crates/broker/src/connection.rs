//! One task per client connection.
//!
//! The task owns the socket. It reads CONNECT (within the configured time),
//! tells MQTT 3.1.1 from MQTT 5, authenticates, and then moves packets both
//! ways between the client and rumqttd's router, through a `rumqttd::local`
//! link. A persistent session joins the router at CONNECT (the router knows
//! whether the session exists); a clean one when it first sends something
//! for the router, so that a connection that only talks to the state store,
//! or idles, costs the router nothing. The exceptions to "client <-> router":
//!
//! - **State store requests** (PUBLISH on the request topics) never reach the
//!   router: the task checks them and hands them to the in-process
//!   [`StateStoreService`], acknowledging them itself. A request whose
//!   Response Topic is reserved gets the client disconnected (MQTT 5 reason
//!   0x87 "not authorized"); one at QoS 0, or without Response Topic or
//!   Correlation Data, is not executed (with a Response Topic it gets an
//!   `-ERR` explaining why).
//! - **The notification namespace** is the store's: a PUBLISH into it is
//!   refused (MQTT 5: reason 0x87; 3.1.1 has no negative ack, so it is
//!   acknowledged and dropped), a SUBSCRIBE naming another client's part of it
//!   is refused per filter (0x87 / 0x80), and other clients' notifications
//!   that a wildcard subscription would deliver are dropped here.
//! - Answers and notifications the state store delivers directly (see
//!   [`crate::sessions`]) are written here, numbered above the packet ids
//!   the router uses (1..=100), within the client's Receive Maximum; their
//!   acknowledgements stay here.
//! - PINGREQ and UNSUBSCRIBE are answered here (rumqttd sends no UNSUBACK
//!   for a filter that was not subscribed). Topic aliases from the client
//!   are resolved here, so the router and the checks above see full topics.
//!
//! When the connection ends, for whatever reason, the router is told, the
//! client's KEYNOTIFY registrations of this connection are dropped, and its
//! will is scheduled unless it said a normal goodbye.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use rumqttd::Notification;
use rumqttd::local::{LinkRx, LinkTx};
use rumqttd::protocol::{
    self, ConnAck, ConnAckProperties, Connect, ConnectReturnCode, Disconnect, DisconnectProperties,
    DisconnectReasonCode, LastWill, Login, Packet, PingResp, PubAck, PubAckReason, PubComp,
    PubCompReason, PubRec, PubRecReason, Publish, PublishProperties, QoS, SubAck, Subscribe,
    SubscribeProperties, SubscribeReasonCode, UnsubAck, UnsubAckReason, Unsubscribe,
};
use statestore::{Caller, Dialect, Request};
use subtle::ConstantTimeEq;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::Shared;
use crate::codec::{self, CodecError, Incoming, Protocol};
use crate::config::Listener;
use crate::router::Router;
use crate::router::{INTERNAL_PREFIX, poll_once};
use crate::service::{ReplyTo, StateStoreService};
use crate::sessions::{Direct, Sessions, Sub, ToConnection};
use crate::topics;
use crate::will::Will;

/// How a connection ended.
#[derive(Debug)]
enum End {
    /// The socket closed without DISCONNECT.
    Closed,
    /// A socket error.
    Io(std::io::Error),
    /// DISCONNECT from the client; `will`: it asked for its will anyway.
    Goodbye { will: bool },
    /// Nothing received for 1.5 times the keep-alive.
    KeepAlive,
    /// The router dropped the link: another connection took the client id,
    /// or the router refused something.
    RouterClosed,
    /// Another connection took the client id (the broker says so).
    TakenOver,
    /// The broker is stopping.
    Shutdown,
    /// The client broke a rule; the reason goes out in DISCONNECT (MQTT 5).
    Violation(DisconnectReasonCode, String),
}

impl From<CodecError> for End {
    fn from(e: CodecError) -> End {
        let code = match &e {
            CodecError::TooLarge(_) => DisconnectReasonCode::PacketTooLarge,
            CodecError::Malformed(_) => DisconnectReasonCode::MalformedPacket,
            CodecError::Protocol(_) | CodecError::UnsupportedLevel(_) => {
                DisconnectReasonCode::ProtocolError
            }
        };
        End::Violation(code, e.to_string())
    }
}

/// Why a CONNECT is refused.
#[derive(Debug, Clone, Copy)]
enum Refusal {
    BadClientId,
    BadCredentials,
    Busy,
    BadWill,
}

fn connack_refusal(protocol: Protocol, refusal: Refusal) -> Packet {
    let code = match (protocol, refusal) {
        (_, Refusal::BadClientId) => ConnectReturnCode::ClientIdentifierNotValid,
        (Protocol::V4, Refusal::BadCredentials) => ConnectReturnCode::BadUserNamePassword,
        (Protocol::V5, Refusal::BadCredentials) => ConnectReturnCode::BadUserNamePassword,
        (Protocol::V4, Refusal::Busy) => ConnectReturnCode::ServiceUnavailable,
        (Protocol::V5, Refusal::Busy) => ConnectReturnCode::ServerBusy,
        (Protocol::V4, Refusal::BadWill) => ConnectReturnCode::NotAuthorized,
        (Protocol::V5, Refusal::BadWill) => ConnectReturnCode::TopicNameInvalid,
    };
    Packet::ConnAck(
        ConnAck {
            session_present: false,
            code,
        },
        None,
    )
}

/// Serves one accepted socket until it closes.
pub(crate) async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    listener: Arc<Listener>,
    shared: Arc<Shared>,
) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::warn!(%peer, error = %e, "cannot set TCP_NODELAY");
    }
    let mut socket = Socket {
        stream,
        rbuf: BytesMut::with_capacity(1024),
        wbuf: BytesMut::new(),
        protocol: Protocol::V5,
    };
    let timeout = Duration::from_millis(listener.connect_timeout_ms);
    let connect =
        match tokio::time::timeout(timeout, socket.read_connect(listener.max_packet_size)).await {
            Err(_) => {
                tracing::debug!(%peer, "no CONNECT in time: closing");
                return;
            }
            Ok(Err(e)) => {
                tracing::info!(%peer, error = %e, "bad CONNECT: closing");
                if let CodecError::UnsupportedLevel(_) = e {
                    // "unacceptable protocol version", understood by every version.
                    let _ = socket.stream.write_all(&[0x20, 0x02, 0x00, 0x01]).await;
                }
                return;
            }
            Ok(Ok(connect)) => connect,
        };
    let Packet::Connect(connect, properties, will, will_properties, login) = connect else {
        return;
    };
    let id = shared.next_connection.fetch_add(1, Ordering::Relaxed);
    let protocol = socket.protocol;

    let refuse = |refusal: Refusal, why: &str| {
        tracing::info!(%peer, client_id = connect.client_id, ?protocol, why, "CONNECT refused");
        connack_refusal(protocol, refusal)
    };
    let checked = check_connect(&connect, login.as_ref(), will.as_ref(), &listener)
        .map_err(|(refusal, why)| refuse(refusal, why));
    let permit = match (checked, Arc::clone(&shared.permits).try_acquire_owned()) {
        (Err(connack), _) => return socket.send_and_close(connack).await,
        (Ok(()), Err(_)) => {
            let connack = refuse(Refusal::Busy, "connection limit reached");
            return socket.send_and_close(connack).await;
        }
        (Ok(()), Ok(permit)) => permit,
    };

    let assigned = connect.client_id.is_empty();
    let client_id = if assigned {
        format!("statebroker-{:x}-{id}", shared.started_nanos)
    } else {
        connect.client_id.clone()
    };
    let clean_start = connect.clean_session;
    // A persistent session joins the router now (the router knows whether
    // the session exists); a clean one when it first needs the router.
    let (link, session_present) = if clean_start {
        (None, false)
    } else {
        match shared.router.link_async(client_id.clone(), false).await {
            Ok((tx, rx, connack)) => {
                let present = matches!(
                    Option::<Packet>::from(connack),
                    Some(Packet::ConnAck(ack, _)) if ack.session_present
                );
                (Some(Link { tx, rx }), present)
            }
            Err(e) => {
                tracing::error!(%peer, client_id, error = %e, "router refused the connection");
                return socket
                    .send_and_close(connack_refusal(protocol, Refusal::Busy))
                    .await;
            }
        }
    };
    shared.wills.connected(&client_id, id, clean_start);
    let (direct_tx, direct_rx) = tokio::sync::mpsc::unbounded_channel();
    shared
        .sessions
        .connected(&client_id, id, clean_start, direct_tx);
    let receive_maximum = properties
        .as_ref()
        .and_then(|p| p.receive_maximum)
        .unwrap_or(u16::MAX);

    let max_keep_alive = shared.settings.broker.max_keep_alive_secs;
    let mut keep_alive = connect.keep_alive;
    let mut server_keep_alive = None;
    if protocol == Protocol::V5
        && max_keep_alive > 0
        && (keep_alive == 0 || keep_alive > max_keep_alive)
    {
        keep_alive = max_keep_alive;
        server_keep_alive = Some(max_keep_alive);
    }
    let ack = ConnAck {
        session_present,
        code: ConnectReturnCode::Success,
    };
    let connack_properties = ConnAckProperties {
        assigned_client_identifier: assigned.then(|| client_id.clone()),
        topic_alias_max: Some(shared.settings.broker.topic_alias_max),
        receive_max: Some(listener.receive_maximum),
        max_packet_size: Some(u32::try_from(listener.max_packet_size).unwrap_or(u32::MAX)),
        server_keep_alive,
        retain_available: Some(1),
        wildcard_subscription_available: Some(1),
        shared_subscription_available: Some(1),
        subscription_identifiers_available: Some(1),
        ..ConnAckProperties::default()
    };
    socket.queue(Packet::ConnAck(ack, Some(connack_properties)));
    if let Err(e) = socket.flush().await {
        tracing::debug!(client_id, error = %e, "could not send CONNACK");
    }
    let session_expiry = properties
        .as_ref()
        .and_then(|p| p.session_expiry_interval)
        .unwrap_or(0);
    tracing::info!(%peer, client_id, connection = id, ?protocol, clean_start, keep_alive, "client connected");

    let mut conn = Connection {
        id,
        own_hex: hex::encode_upper(&client_id),
        client_id,
        socket,
        link,
        router: shared.router.clone(),
        to_router: Vec::new(),
        keep_alive: (keep_alive > 0).then(|| Duration::from_millis(u64::from(keep_alive) * 1500)),
        last_heard: Instant::now(),
        max_packet_size: listener.max_packet_size,
        topic_alias_max: shared.settings.broker.topic_alias_max,
        aliases: HashMap::new(),
        refused_filters: HashMap::new(),
        awaiting_pubrel: HashSet::new(),
        inflight: VecDeque::new(),
        direct_rx,
        direct: DirectOut {
            inflight: HashMap::new(),
            pending: VecDeque::new(),
            last_pkid: FIRST_DIRECT_PKID - 1,
            // The router uses up to 100 of the client's Receive Maximum.
            limit: usize::from(receive_maximum.saturating_sub(ROUTER_MAX_PKID).max(1)),
        },
        unscheduled: false,
        store: Arc::clone(&shared.store),
        sessions: Arc::clone(&shared.sessions),
        clean_start,
        legacy_2023: shared.settings.broker.legacy_2023_topic,
    };
    let end = conn.run(shared.shutdown.clone()).await;
    conn.finish(&end).await;

    let will = match (&end, will) {
        (End::Goodbye { will: false } | End::Shutdown, _) | (_, None) => None,
        (_, Some(will)) => {
            let delay = will_properties
                .as_ref()
                .and_then(|p| p.delay_interval)
                .unwrap_or(0);
            Some(Will {
                will,
                properties: will_properties,
                delay: Duration::from_secs(u64::from(delay.min(session_expiry))),
            })
        }
    };
    shared.wills.disconnected(&conn.client_id, id, will);
    drop(permit);
}

/// Checks a CONNECT before the client is registered.
fn check_connect(
    connect: &Connect,
    login: Option<&Login>,
    will: Option<&LastWill>,
    listener: &Listener,
) -> Result<(), (Refusal, &'static str)> {
    let id = &connect.client_id;
    if id.is_empty() && !connect.clean_session {
        return Err((
            Refusal::BadClientId,
            "an empty client id needs a clean session",
        ));
    }
    // The router cannot route for ids with these characters; the prefix is ours.
    if id.contains(['+', '#', '/', '$']) || id.starts_with(INTERNAL_PREFIX) {
        return Err((Refusal::BadClientId, "client id not allowed"));
    }
    if let Some(users) = &listener.auth {
        let ok = login.is_some_and(|login| {
            users
                .get(&login.username)
                .is_some_and(|pw| bool::from(pw.as_bytes().ct_eq(login.password.as_bytes())))
        });
        if !ok {
            return Err((Refusal::BadCredentials, "bad username or password"));
        }
    }
    if let Some(will) = will {
        let topic = std::str::from_utf8(&will.topic).unwrap_or("");
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

/// The socket with its buffers and codec.
struct Socket {
    stream: TcpStream,
    rbuf: BytesMut,
    wbuf: BytesMut,
    protocol: Protocol,
}

impl Socket {
    async fn read_connect(&mut self, max_packet_size: usize) -> Result<Packet, CodecError> {
        loop {
            if let Some(protocol) = codec::detect(&self.rbuf, max_packet_size)? {
                self.protocol = protocol;
                if let Some(incoming) = protocol.read(&mut self.rbuf, max_packet_size)? {
                    return Ok(incoming.packet);
                }
            }
            match self.stream.read_buf(&mut self.rbuf).await {
                Ok(0) => return Err(CodecError::Malformed("closed before CONNECT".into())),
                Ok(_) => {}
                Err(e) => return Err(CodecError::Malformed(e.to_string())),
            }
        }
    }

    fn queue(&mut self, packet: Packet) {
        if let Err(e) = self.protocol.write(packet, &mut self.wbuf) {
            tracing::warn!(error = %e, "dropping a packet that cannot be encoded");
        }
    }

    async fn flush(&mut self) -> std::io::Result<()> {
        if !self.wbuf.is_empty() {
            self.stream.write_all(&self.wbuf).await?;
            self.wbuf.clear();
        }
        Ok(())
    }

    async fn send_and_close(mut self, packet: Packet) {
        self.queue(packet);
        let _ = self.flush().await;
        let _ = self.stream.shutdown().await;
    }
}

struct Connection {
    id: u64,
    client_id: String,
    own_hex: String,
    socket: Socket,
    /// The connection's link to the router, once it has one.
    link: Option<Link>,
    router: Router,
    /// Packets for the router from the current read, sent in one batch.
    to_router: Vec<Packet>,
    keep_alive: Option<Duration>,
    last_heard: Instant,
    max_packet_size: usize,
    topic_alias_max: u16,
    aliases: HashMap<u16, Bytes>,
    /// SUBSCRIBE packet id -> (position, code) of filters refused here.
    refused_filters: HashMap<u16, Vec<(usize, SubscribeReasonCode)>>,
    /// QoS 2 publishes answered here, waiting for PUBREL.
    awaiting_pubrel: HashSet<u16>,
    /// QoS 1/2 publishes from the router not yet acknowledged, in order;
    /// `true` for those dropped here (acknowledged to the router in their
    /// turn, since rumqttd, like MQTT, wants acknowledgements in order).
    inflight: VecDeque<(u16, bool)>,
    /// Direct deliveries and takeover notices (see [`crate::sessions`]).
    direct_rx: mpsc::UnboundedReceiver<ToConnection>,
    direct: DirectOut,
    unscheduled: bool,
    store: Arc<StateStoreService>,
    sessions: Arc<Sessions>,
    clean_start: bool,
    legacy_2023: bool,
}

/// A connection's link to the router.
struct Link {
    tx: LinkTx,
    rx: LinkRx,
}

/// The next notification from the router; never, without a link.
async fn next_notification(
    link: &mut Option<Link>,
) -> Result<Option<Notification>, rumqttd::local::LinkError> {
    match link {
        Some(link) => link.rx.next().await,
        None => std::future::pending().await,
    }
}

/// rumqttd numbers the publishes it sends a client 1..=100 (its
/// `MAX_INFLIGHT`); direct deliveries use the ids above.
const ROUTER_MAX_PKID: u16 = 100;
const FIRST_DIRECT_PKID: u16 = ROUTER_MAX_PKID + 1;

/// Direct deliveries in flight to this client.
struct DirectOut {
    /// Sent at QoS 1, not yet acknowledged, by packet id.
    inflight: HashMap<u16, Direct>,
    /// Waiting for room under the client's Receive Maximum.
    pending: VecDeque<Direct>,
    last_pkid: u16,
    limit: usize,
}

impl Connection {
    async fn run(&mut self, shutdown: tokio::sync::watch::Receiver<bool>) -> End {
        match self.serve_packets(shutdown).await {
            Err(end) => end,
            Ok(never) => match never {},
        }
    }

    async fn serve_packets(
        &mut self,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> Result<std::convert::Infallible, End> {
        loop {
            let deadline = self.keep_alive.map(|k| self.last_heard + k);
            tokio::select! {
                read = self.socket.stream.read_buf(&mut self.socket.rbuf) => {
                    match read {
                        Ok(0) => return Err(End::Closed),
                        Err(e) => return Err(End::Io(e)),
                        Ok(_) => {
                            self.last_heard = Instant::now();
                            let read = self.read_packets();
                            self.forward().await?;
                            read?;
                        }
                    }
                }
                notification = next_notification(&mut self.link) => {
                    match notification {
                        Ok(Some(n)) => {
                            self.on_router_notification(n)?;
                            // Take everything else the router has ready before writing.
                            while let Some(Ok(Some(n))) =
                                self.link.as_mut().and_then(|l| poll_once(l.rx.next()))
                            {
                                self.on_router_notification(n)?;
                            }
                            // Acknowledgements of dropped publishes.
                            self.forward().await?;
                        }
                        Ok(None) => {}
                        Err(_) => return Err(End::RouterClosed),
                    }
                }
                Some(message) = self.direct_rx.recv() => self.on_broker_message(message)?,
                () = sleep_until(deadline) => return Err(End::KeepAlive),
                _ = shutdown.changed() => return Err(End::Shutdown),
            }
            // Direct deliveries that are ready (the answers to what was just
            // read among them) go out with the same write.
            while let Ok(message) = self.direct_rx.try_recv() {
                self.on_broker_message(message)?;
            }
            if let Err(e) = self.socket.flush().await {
                return Err(End::Io(e));
            }
            if self.unscheduled {
                self.unscheduled = false;
                if let Some(link) = &self.link
                    && link.rx.wake().await.is_err()
                {
                    return Err(End::RouterClosed);
                }
            }
        }
    }

    /// Decodes and handles every complete packet in the read buffer.
    fn read_packets(&mut self) -> Result<(), End> {
        while let Some(incoming) = self
            .socket
            .protocol
            .read(&mut self.socket.rbuf, self.max_packet_size)?
        {
            self.on_packet(incoming)?;
        }
        Ok(())
    }

    fn on_packet(&mut self, incoming: Incoming) -> Result<(), End> {
        let Incoming { packet, qos, pkid } = incoming;
        match packet {
            Packet::Publish(publish, properties) => self.on_publish(publish, properties, qos, pkid),
            Packet::PubRel(pubrel, properties) => {
                if self.awaiting_pubrel.remove(&pubrel.pkid) {
                    self.socket.queue(Packet::PubComp(
                        PubComp {
                            pkid: pubrel.pkid,
                            reason: PubCompReason::Success,
                        },
                        None,
                    ));
                } else if self.link.is_some() {
                    self.to_router.push(Packet::PubRel(pubrel, properties));
                }
                Ok(())
            }
            Packet::Subscribe(subscribe, properties) => {
                self.on_subscribe(subscribe, properties);
                Ok(())
            }
            Packet::Unsubscribe(unsubscribe, properties) => {
                for filter in &unsubscribe.filters {
                    self.sessions.unsubscribe(&self.client_id, filter);
                }
                let reasons = vec![UnsubAckReason::Success; unsubscribe.filters.len()];
                self.socket.queue(Packet::UnsubAck(
                    UnsubAck {
                        pkid: unsubscribe.pkid,
                        reasons,
                    },
                    None,
                ));
                // Without a link the router holds no subscription to remove.
                if self.link.is_some() {
                    self.to_router.push(Packet::Unsubscribe(
                        Unsubscribe {
                            pkid: unsubscribe.pkid,
                            filters: unsubscribe.filters,
                        },
                        properties,
                    ));
                }
                Ok(())
            }
            Packet::PingReq(_) => {
                self.socket.queue(Packet::PingResp(PingResp));
                Ok(())
            }
            Packet::Disconnect(disconnect, _) => Err(End::Goodbye {
                will: disconnect.reason_code == DisconnectReasonCode::DisconnectWithWillMessage,
            }),
            Packet::Connect(..) => Err(End::Violation(
                DisconnectReasonCode::ProtocolError,
                "second CONNECT".into(),
            )),
            Packet::PubAck(ack, _) if ack.pkid > ROUTER_MAX_PKID => {
                if self.direct.inflight.remove(&ack.pkid).is_some() {
                    while self.direct.inflight.len() < self.direct.limit
                        && let Some(message) = self.direct.pending.pop_front()
                    {
                        self.deliver_direct(message);
                    }
                }
                Ok(())
            }
            Packet::PubAck(ack, properties) if self.link.is_some() => {
                let pkid = ack.pkid;
                self.to_router.push(Packet::PubAck(ack, properties));
                self.acknowledged(pkid);
                Ok(())
            }
            Packet::PubRec(rec, properties) if self.link.is_some() => {
                let pkid = rec.pkid;
                self.to_router.push(Packet::PubRec(rec, properties));
                self.acknowledged(pkid);
                Ok(())
            }
            ack @ Packet::PubComp(..) if self.link.is_some() => {
                self.to_router.push(ack);
                Ok(())
            }
            // Without a link the router sent nothing: nothing to acknowledge.
            Packet::PubAck(..) | Packet::PubRec(..) | Packet::PubComp(..) => Ok(()),
            other => Err(End::Violation(
                DisconnectReasonCode::ProtocolError,
                format!("unexpected packet {other:?}"),
            )),
        }
    }

    fn on_publish(
        &mut self,
        mut publish: Publish,
        mut properties: Option<PublishProperties>,
        qos: u8,
        pkid: u16,
    ) -> Result<(), End> {
        // Resolve topic aliases here, so every check below sees the topic.
        if let Some(alias) = properties.as_mut().and_then(|p| p.topic_alias.take()) {
            if alias == 0 || alias > self.topic_alias_max {
                return Err(End::Violation(
                    DisconnectReasonCode::TopicAliasInvalid,
                    format!("topic alias {alias} out of range"),
                ));
            }
            if publish.topic.is_empty() {
                match self.aliases.get(&alias) {
                    Some(topic) => publish.topic = topic.clone(),
                    None => {
                        return Err(End::Violation(
                            DisconnectReasonCode::ProtocolError,
                            format!("unknown topic alias {alias}"),
                        ));
                    }
                }
            } else {
                self.aliases.insert(alias, publish.topic.clone());
            }
        }
        let topic = match std::str::from_utf8(&publish.topic) {
            Ok(t) if !t.is_empty() && protocol::valid_topic(t) => t,
            _ => {
                return Err(End::Violation(
                    DisconnectReasonCode::TopicNameInvalid,
                    "invalid topic name".into(),
                ));
            }
        };
        let dialect = if topic == topics::REQUEST_TOPIC {
            Some(Dialect::V1)
        } else if self.legacy_2023 && topic == topics::LEGACY_REQUEST_TOPIC {
            Some(Dialect::Legacy2023)
        } else {
            None
        };
        if let Some(dialect) = dialect {
            return self.on_request(publish, properties, qos, pkid, dialect);
        }
        if topics::in_notify_namespace(topic) {
            tracing::warn!(
                client_id = self.client_id,
                topic,
                "publish into the notification namespace refused"
            );
            self.ack(qos, pkid, false);
            return Ok(());
        }
        self.to_router.push(Packet::Publish(publish, properties));
        Ok(())
    }

    /// Acknowledges a publish handled here (not by the router).
    fn ack(&mut self, qos: u8, pkid: u16, accepted: bool) {
        // 3.1.1 has no negative acknowledgement: a refused publish is acked and dropped.
        let v5 = self.socket.protocol == Protocol::V5;
        match qos {
            1 => {
                let reason = if accepted || !v5 {
                    PubAckReason::Success
                } else {
                    PubAckReason::NotAuthorized
                };
                self.socket
                    .queue(Packet::PubAck(PubAck { pkid, reason }, None));
            }
            2 => {
                let reason = if accepted || !v5 {
                    PubRecReason::Success
                } else {
                    PubRecReason::NotAuthorized
                };
                self.awaiting_pubrel.insert(pkid);
                self.socket
                    .queue(Packet::PubRec(PubRec { pkid, reason }, None));
            }
            _ => {}
        }
    }

    fn on_request(
        &mut self,
        publish: Publish,
        properties: Option<PublishProperties>,
        qos: u8,
        pkid: u16,
        dialect: Dialect,
    ) -> Result<(), End> {
        let properties = properties.unwrap_or_default();
        if let Some(topic) = &properties.response_topic {
            if topics::is_reserved_response_topic(topic) {
                tracing::warn!(
                    client_id = self.client_id,
                    topic,
                    "reserved response topic: disconnecting"
                );
                return Err(End::Violation(
                    DisconnectReasonCode::NotAuthorized,
                    format!("response topic {topic} is reserved"),
                ));
            }
            if topic.is_empty() || !protocol::valid_topic(topic) {
                return Err(End::Violation(
                    DisconnectReasonCode::ProtocolError,
                    "response topic is not a valid topic name".into(),
                ));
            }
        }
        // A QoS 2 duplicate of a request already executed: acknowledge again only.
        let duplicate = qos == 2 && self.awaiting_pubrel.contains(&pkid);
        self.ack(qos, pkid, true);
        if duplicate {
            return Ok(());
        }
        let Some(response_topic) = properties.response_topic.clone() else {
            tracing::info!(
                client_id = self.client_id,
                "request without response topic ignored"
            );
            return Ok(());
        };
        let reply_to = ReplyTo {
            topic: response_topic,
            // A copy: a slice would keep the whole read buffer alive for as
            // long as the router keeps the response.
            correlation: properties
                .correlation_data
                .as_deref()
                .map(Bytes::copy_from_slice),
        };
        if qos == 0 {
            tracing::info!(client_id = self.client_id, "QoS 0 request not executed");
            self.store.refuse(
                reply_to,
                &self.client_id,
                "requests must be published with QoS 1",
            );
            return Ok(());
        }
        if reply_to.correlation.is_none() {
            tracing::info!(
                client_id = self.client_id,
                "request without correlation data not executed"
            );
            self.store.refuse(
                reply_to,
                &self.client_id,
                "requests must carry correlation data",
            );
            return Ok(());
        }
        let property = |name: &str| {
            properties
                .user_properties
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        };
        let request = Request {
            payload: &publish.payload,
            timestamp: property("__ts"),
            fencing_token: property("__ft"),
            persist: property("aio-persistence").is_some_and(|v| v.eq_ignore_ascii_case("true")),
            dialect,
        };
        let caller = Caller {
            client_id: &self.client_id,
            connection: self.id,
        };
        self.store.serve(&request, caller, reply_to);
        Ok(())
    }

    fn on_subscribe(&mut self, subscribe: Subscribe, properties: Option<SubscribeProperties>) {
        let pkid = subscribe.pkid;
        let mut allowed = Vec::with_capacity(subscribe.filters.len());
        let mut refused = Vec::new();
        for (position, filter) in subscribe.filters.into_iter().enumerate() {
            let path = filter.path.as_str();
            let code = if !protocol::valid_filter(path)
                || path.starts_with("$share/") && path.split('/').count() < 3
            {
                Some(SubscribeReasonCode::TopicFilterInvalid)
            } else if path.starts_with('$') && !path.starts_with("$share/") {
                // rumqttd would disconnect the client for these.
                Some(SubscribeReasonCode::NotAuthorized)
            } else if !topics::may_subscribe(path, &self.own_hex) {
                Some(SubscribeReasonCode::NotAuthorized)
            } else {
                None
            };
            match code {
                Some(code) => {
                    tracing::info!(
                        client_id = self.client_id,
                        filter = path,
                        ?code,
                        "subscription refused"
                    );
                    refused.push((position, self.suback_failure(code)));
                }
                None => allowed.push(filter),
            }
        }
        if allowed.is_empty() {
            let return_codes = refused.into_iter().map(|(_, c)| c).collect();
            self.socket
                .queue(Packet::SubAck(SubAck { pkid, return_codes }, None));
            return;
        }
        if !refused.is_empty() {
            self.refused_filters.insert(pkid, refused);
        }
        let id = properties.as_ref().and_then(|p| p.id);
        for filter in &allowed {
            let qos = match filter.qos {
                QoS::AtMostOnce => 0,
                QoS::AtLeastOnce => 1,
                QoS::ExactlyOnce => 2,
            };
            self.sessions
                .subscribe(&self.client_id, &filter.path, Sub { qos, id });
        }
        self.to_router.push(Packet::Subscribe(
            Subscribe {
                pkid,
                filters: allowed,
            },
            properties,
        ));
    }

    fn suback_failure(&self, code: SubscribeReasonCode) -> SubscribeReasonCode {
        match self.socket.protocol {
            Protocol::V4 => SubscribeReasonCode::Failure,
            Protocol::V5 => code,
        }
    }

    /// Sends what was gathered for the router, with one wake-up; joins the
    /// router first if this connection has not yet.
    async fn forward(&mut self) -> Result<(), End> {
        let Some(last) = self.to_router.pop() else {
            return Ok(());
        };
        if self.link.is_none() {
            match self
                .router
                .link_async(self.client_id.clone(), self.clean_start)
                .await
            {
                Ok((tx, rx, _connack)) => self.link = Some(Link { tx, rx }),
                Err(e) => {
                    tracing::error!(client_id = self.client_id, error = %e, "cannot join the router");
                    return Err(End::Violation(
                        DisconnectReasonCode::ServerBusy,
                        e.to_string(),
                    ));
                }
            }
        }
        if let Some(link) = &mut self.link {
            link.tx.buffer().extend(self.to_router.drain(..));
            match poll_once(link.tx.send(last)) {
                Some(Ok(_)) => {}
                _ => return Err(End::RouterClosed),
            }
        }
        Ok(())
    }

    /// Handles what the broker tells this connection.
    fn on_broker_message(&mut self, message: ToConnection) -> Result<(), End> {
        match message {
            ToConnection::Deliver(direct) => {
                self.deliver_direct(direct);
                Ok(())
            }
            ToConnection::TakenOver => Err(End::TakenOver),
        }
    }

    /// Handles one notification from the router.
    fn on_router_notification(&mut self, notification: Notification) -> Result<(), End> {
        match notification {
            Notification::Forward(forward) => {
                let topic = std::str::from_utf8(&forward.publish.topic).unwrap_or("");
                let deliver = topics::may_receive(topic, &self.own_hex);
                let packet = Packet::Publish(forward.publish, forward.properties);
                let start = self.socket.wbuf.len();
                self.socket.queue(packet);
                let id = codec::encoded_publish_id(&self.socket.wbuf[start..]);
                if !deliver {
                    // Another client's notification, reached through a wildcard.
                    self.socket.wbuf.truncate(start);
                }
                if let Some((qos, pkid)) = id
                    && qos > 0
                {
                    self.inflight.push_back((pkid, !deliver));
                    self.acknowledge_dropped();
                }
            }
            Notification::Unschedule => self.unscheduled = true,
            other => match Option::<Packet>::from(other) {
                Some(Packet::SubAck(mut suback, properties)) => {
                    if let Some(refused) = self.refused_filters.remove(&suback.pkid) {
                        for (position, code) in refused {
                            let at = position.min(suback.return_codes.len());
                            suback.return_codes.insert(at, code);
                        }
                    }
                    self.socket.queue(Packet::SubAck(suback, properties));
                }
                // Answered here already.
                Some(Packet::UnsubAck(..) | Packet::PingResp(_) | Packet::ConnAck(..)) | None => {}
                Some(Packet::Disconnect(disconnect, properties)) => {
                    let reason = properties.and_then(|p| p.reason_string).unwrap_or_default();
                    return Err(End::Violation(
                        disconnect.reason_code,
                        format!("router: {reason}"),
                    ));
                }
                Some(packet) => self.socket.queue(packet),
            },
        }
        Ok(())
    }

    /// The client acknowledged `pkid` (PUBACK, or PUBREC at QoS 2).
    fn acknowledged(&mut self, pkid: u16) {
        if let Some(at) = self
            .inflight
            .iter()
            .position(|&(id, dropped)| id == pkid && !dropped)
        {
            self.inflight.remove(at);
        }
        self.acknowledge_dropped();
    }

    /// Acknowledges to the router, in their turn, the publishes dropped here.
    fn acknowledge_dropped(&mut self) {
        while let Some(&(pkid, true)) = self.inflight.front() {
            self.inflight.pop_front();
            self.to_router.push(Packet::PubAck(
                PubAck {
                    pkid,
                    reason: PubAckReason::Success,
                },
                None,
            ));
        }
    }

    /// Cleans up after the connection ended.
    async fn finish(&mut self, end: &End) {
        let (reason, text) = match end {
            End::Closed => (None, "socket closed".to_owned()),
            End::Io(e) => (None, format!("socket error: {e}")),
            End::Goodbye { will } => (None, format!("DISCONNECT (will: {will})")),
            End::KeepAlive => (
                Some(DisconnectReasonCode::KeepAliveTimeout),
                "keep-alive timeout".to_owned(),
            ),
            End::RouterClosed => (
                Some(DisconnectReasonCode::SessionTakenOver),
                "session taken over or closed by the router".to_owned(),
            ),
            End::TakenOver => (
                Some(DisconnectReasonCode::SessionTakenOver),
                "session taken over by a new connection".to_owned(),
            ),
            End::Shutdown => (
                Some(DisconnectReasonCode::ServerShuttingDown),
                "broker stopping".to_owned(),
            ),
            End::Violation(code, text) => (Some(*code), text.clone()),
        };
        tracing::info!(
            client_id = self.client_id,
            connection = self.id,
            reason = text,
            "client disconnected"
        );
        if let Some(reason_code) = reason
            && self.socket.protocol == Protocol::V5
        {
            self.socket.queue(Packet::Disconnect(
                Disconnect { reason_code },
                Some(DisconnectProperties {
                    session_expiry_interval: None,
                    reason_string: Some(text),
                    user_properties: Vec::new(),
                    server_reference: None,
                }),
            ));
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), self.socket.flush()).await;
        let _ = self.socket.stream.shutdown().await;
        if self.link.is_some() && !matches!(end, End::RouterClosed) {
            // The router forgets the connection (and keeps a persistent session).
            self.to_router.push(Packet::Disconnect(
                Disconnect {
                    reason_code: DisconnectReasonCode::NormalDisconnection,
                },
                None,
            ));
            let _ = self.forward().await;
        }
        self.store.connection_closed(&self.client_id, self.id);
        // No more direct deliveries; what was not acknowledged goes to the
        // router, which keeps it for a persistent session.
        self.sessions
            .disconnected(&self.client_id, self.id, self.clean_start);
        let mut unacked: Vec<Direct> = self.direct.inflight.drain().map(|(_, m)| m).collect();
        unacked.extend(self.direct.pending.drain(..));
        while let Ok(message) = self.direct_rx.try_recv() {
            if let ToConnection::Deliver(message) = message {
                unacked.push(message);
            }
        }
        unacked.retain(|m| m.qos > 0);
        if !self.clean_start && !unacked.is_empty() && !matches!(end, End::Shutdown) {
            tracing::debug!(
                client_id = self.client_id,
                count = unacked.len(),
                "unacknowledged deliveries kept for the session"
            );
            self.store.redeliver_later(unacked);
        }
    }

    /// Sends a direct delivery, at QoS 1 with a packet id of our own range
    /// unless the client has too many in flight already.
    fn deliver_direct(&mut self, message: Direct) {
        let pkid = match message.qos {
            0 => 0,
            _ if self.direct.inflight.len() >= self.direct.limit => {
                self.direct.pending.push_back(message);
                return;
            }
            _ => {
                let mut pkid = self.direct.last_pkid;
                loop {
                    pkid = if pkid == u16::MAX {
                        FIRST_DIRECT_PKID
                    } else {
                        pkid + 1
                    };
                    if !self.direct.inflight.contains_key(&pkid) {
                        break;
                    }
                }
                self.direct.last_pkid = pkid;
                pkid
            }
        };
        codec::encode_publish(
            self.socket.protocol,
            &message.topic,
            &message.payload,
            message.qos,
            pkid,
            &message.properties,
            &mut self.socket.wbuf,
        );
        if pkid != 0 {
            self.direct.inflight.insert(pkid, message);
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
