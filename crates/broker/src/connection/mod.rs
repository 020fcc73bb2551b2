//! One task per client connection.
//!
//! The task owns the socket. It reads CONNECT ([`handshake`]), and then moves
//! packets both ways between the client and rumqttd's router, through a
//! `rumqttd::local` link. A persistent session joins the router at CONNECT
//! (the router knows whether the session exists); a clean one when it first
//! sends something for the router, so that a connection that only talks to
//! the state store, or idles, costs the router nothing. The exceptions to
//! "client <-> router":
//!
//! - **State store requests** (PUBLISH on the request topics) never reach the
//!   router: the task checks them ([`crate::store::binding`]) and hands them
//!   to the in-process [`crate::store::StateStoreService`], acknowledging
//!   them itself.
//! - **The notification namespace** is the store's: a PUBLISH into it is
//!   refused (MQTT 5: reason 0x87; 3.1.1 has no negative ack, so it is
//!   acknowledged and dropped), a SUBSCRIBE naming another client's part of it
//!   is refused per filter ([`subscriptions`]), and other clients'
//!   notifications that a wildcard subscription would deliver are dropped
//!   here ([`outbound::RouterAcks`] keeps the router's acks in order).
//! - Answers and notifications the broker delivers directly (see
//!   [`crate::sessions`]) are written here within the client's Receive
//!   Maximum ([`outbound::DirectWindow`]); their acknowledgements stay here.
//! - PINGREQ and UNSUBSCRIBE are answered here (rumqttd sends no UNSUBACK
//!   for a filter that was not subscribed). Topic aliases from the client
//!   are resolved here, so the router and the checks above see full topics.
//!
//! When the connection ends, for whatever reason, the router is told, the
//! client's KEYNOTIFY registrations of this connection are dropped, and its
//! will is scheduled unless it said a normal goodbye.

mod handshake;
mod outbound;
mod socket;
mod subscriptions;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use rumqttd::Notification;
use rumqttd::local::{LinkRx, LinkTx};
use rumqttd::protocol::{
    self, Disconnect, DisconnectProperties, DisconnectReasonCode, Packet, PingResp, PubAck,
    PubAckReason, PubComp, PubCompReason, PubRec, PubRecReason, Publish, PublishProperties, QoS,
    SubAck, Subscribe, SubscribeProperties, UnsubAck, UnsubAckReason, Unsubscribe,
};
use statestore::{Caller, Dialect};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::codec::{CodecError, Incoming, Protocol};
use crate::config::Listener;
use crate::publisher::Publisher;
use crate::router::{Router, poll_once};
use crate::sessions::{Sessions, Sub, ToConnection};
use crate::shared::Shared;
use crate::store::StateStoreService;
use crate::store::binding::{self, Admission};
use crate::topics;
use crate::will::Will;
use handshake::{Refusal, Terms};
use outbound::{DirectWindow, RouterAcks};
use socket::Socket;
pub(crate) use socket::Stream;
use subscriptions::PendingRefusals;

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

impl End {
    /// The DISCONNECT reason an MQTT 5 client is told (none where the
    /// client ended it), and the text for the log.
    fn reason(&self) -> (Option<DisconnectReasonCode>, String) {
        match self {
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
        }
    }
}

/// Serves one accepted stream until it closes.
pub(crate) async fn serve<S: Stream>(
    stream: S,
    peer: SocketAddr,
    listener: Arc<Listener>,
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
        handshake::refusal(protocol, refusal)
    };
    let checked = handshake::check_connect(
        &hello.connect,
        hello.login.as_ref(),
        hello.will.as_ref(),
        &listener,
    )
    .map_err(|(refusal, why)| refuse(refusal, why));
    let permit = match (checked, Arc::clone(&shared.permits).try_acquire_owned()) {
        (Err(connack), _) => return socket.send_and_close(connack).await,
        (Ok(()), Err(_)) => {
            let connack = refuse(Refusal::Busy, "connection limit reached");
            return socket.send_and_close(connack).await;
        }
        (Ok(()), Ok(permit)) => permit,
    };
    let terms = Terms::negotiate(
        &hello,
        protocol,
        shared.settings.broker.max_keep_alive_secs,
        || format!("statebroker-{:x}-{id}", shared.started_nanos),
    );
    let client_id = terms.client_id.clone();
    // A persistent session joins the router now (the router knows whether
    // the session exists); a clean one when it first needs the router.
    let (link, session_present) = if terms.clean_start {
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
                    .send_and_close(handshake::refusal(protocol, Refusal::Busy))
                    .await;
            }
        }
    };
    shared.wills.connected(&client_id, id, terms.clean_start);
    let (direct_tx, direct_rx) = mpsc::unbounded_channel();
    shared
        .sessions
        .connected(&client_id, id, terms.clean_start, direct_tx);
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
        client_id,
        socket,
        link,
        router: shared.router.clone(),
        to_router: Vec::new(),
        idle_limit: terms.idle_limit(),
        last_heard: Instant::now(),
        max_packet_size: listener.max_packet_size,
        topic_alias_max,
        aliases: HashMap::new(),
        refused_filters: PendingRefusals::default(),
        awaiting_pubrel: HashSet::new(),
        router_acks: RouterAcks::default(),
        direct_rx,
        direct: DirectWindow::new(terms.receive_maximum),
        unscheduled: false,
        store: Arc::clone(&shared.store),
        publisher: Arc::clone(&shared.publisher),
        sessions: Arc::clone(&shared.sessions),
        clean_start: terms.clean_start,
        legacy_2023: shared.settings.broker.legacy_2023_topic,
    };
    let end = conn.run(shared.shutdown.clone()).await;
    conn.finish(&end).await;

    let will = match (&end, hello.will) {
        (End::Goodbye { will: false } | End::Shutdown, _) | (_, None) => None,
        (_, Some(will)) => {
            let delay = hello
                .will_properties
                .as_ref()
                .and_then(|p| p.delay_interval)
                .unwrap_or(0);
            Some(Will {
                will,
                properties: hello.will_properties,
                delay: Duration::from_secs(u64::from(delay.min(terms.session_expiry))),
            })
        }
    };
    shared.wills.disconnected(&conn.client_id, id, will);
    drop(permit);
}

struct Connection<S> {
    id: u64,
    client_id: String,
    own_hex: String,
    socket: Socket<S>,
    /// The connection's link to the router, once it has one.
    link: Option<Link>,
    router: Router,
    /// Packets for the router from the current read, sent in one batch.
    to_router: Vec<Packet>,
    /// How long the client may stay silent (1.5 times its keep-alive).
    idle_limit: Option<Duration>,
    last_heard: Instant,
    max_packet_size: usize,
    topic_alias_max: u16,
    aliases: HashMap<u16, Bytes>,
    /// Refused filters waiting for the router's SUBACK.
    refused_filters: PendingRefusals,
    /// QoS 2 publishes answered here, waiting for PUBREL.
    awaiting_pubrel: HashSet<u16>,
    /// The router's QoS 1/2 deliveries the client has not acknowledged.
    router_acks: RouterAcks,
    /// Direct deliveries and takeover notices (see [`crate::sessions`]).
    direct_rx: mpsc::UnboundedReceiver<ToConnection>,
    direct: DirectWindow,
    unscheduled: bool,
    store: Arc<StateStoreService>,
    publisher: Arc<Publisher>,
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

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

impl<S: Stream> Connection<S> {
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
            let deadline = self.idle_limit.map(|k| self.last_heard + k);
            tokio::select! {
                read = self.socket.fill() => {
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
        while let Some(incoming) = self.socket.next_packet(self.max_packet_size)? {
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
                self.on_unsubscribe(unsubscribe, properties);
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
            Packet::PubAck(ack, _) if outbound::is_direct(ack.pkid) => {
                let protocol = self.socket.protocol;
                self.direct
                    .acknowledged(ack.pkid, protocol, &mut self.socket.wbuf);
                Ok(())
            }
            Packet::PubAck(ack, properties) if self.link.is_some() => {
                let pkid = ack.pkid;
                self.to_router.push(Packet::PubAck(ack, properties));
                self.router_acks.acknowledged(pkid, &mut self.to_router);
                Ok(())
            }
            Packet::PubRec(rec, properties) if self.link.is_some() => {
                let pkid = rec.pkid;
                self.to_router.push(Packet::PubRec(rec, properties));
                self.router_acks.acknowledged(pkid, &mut self.to_router);
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
            self.resolve_alias(&mut publish, alias)?;
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
        if let Some(dialect) = binding::dialect(topic, self.legacy_2023) {
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

    /// Replaces an aliased empty topic by the one the alias stands for, or
    /// records the alias for a topic.
    fn resolve_alias(&mut self, publish: &mut Publish, alias: u16) -> Result<(), End> {
        if alias == 0 || alias > self.topic_alias_max {
            return Err(End::Violation(
                DisconnectReasonCode::TopicAliasInvalid,
                format!("topic alias {alias} out of range"),
            ));
        }
        if !publish.topic.is_empty() {
            self.aliases.insert(alias, publish.topic.clone());
            return Ok(());
        }
        match self.aliases.get(&alias) {
            Some(topic) => {
                publish.topic = topic.clone();
                Ok(())
            }
            None => Err(End::Violation(
                DisconnectReasonCode::ProtocolError,
                format!("unknown topic alias {alias}"),
            )),
        }
    }

    /// Acknowledges a publish handled here (not by the router).
    fn ack(&mut self, qos: u8, pkid: u16, accepted: bool) {
        // 3.1.1 has no negative acknowledgement: a refused publish is acked and dropped.
        let success = accepted || self.socket.protocol == Protocol::V4;
        match qos {
            1 => {
                let reason = if success {
                    PubAckReason::Success
                } else {
                    PubAckReason::NotAuthorized
                };
                self.socket
                    .queue(Packet::PubAck(PubAck { pkid, reason }, None));
            }
            2 => {
                let reason = if success {
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

    /// A state store request: checked by the binding, acknowledged here,
    /// executed by the store.
    fn on_request(
        &mut self,
        publish: Publish,
        properties: Option<PublishProperties>,
        qos: u8,
        pkid: u16,
        dialect: Dialect,
    ) -> Result<(), End> {
        let properties = properties.unwrap_or_default();
        if let Err((code, why)) = binding::check_response_topic(&properties) {
            tracing::warn!(
                client_id = self.client_id,
                reason = why,
                "bad response topic: disconnecting"
            );
            return Err(End::Violation(code, why));
        }
        // A QoS 2 duplicate of a request already executed: acknowledge again only.
        let duplicate = qos == 2 && self.awaiting_pubrel.contains(&pkid);
        self.ack(qos, pkid, true);
        if duplicate {
            return Ok(());
        }
        match binding::admit(&publish.payload, &properties, qos, dialect) {
            Admission::Serve(request, reply_to) => {
                let caller = Caller {
                    client_id: &self.client_id,
                    connection: self.id,
                };
                self.store.serve(&request, caller, reply_to);
            }
            Admission::Refuse(reply_to, text) => {
                tracing::info!(
                    client_id = self.client_id,
                    reason = text,
                    "request not executed"
                );
                self.store.refuse(reply_to, &self.client_id, text);
            }
            Admission::Ignore => {
                tracing::info!(
                    client_id = self.client_id,
                    "request without response topic ignored"
                );
            }
        }
        Ok(())
    }

    fn on_subscribe(&mut self, subscribe: Subscribe, properties: Option<SubscribeProperties>) {
        let pkid = subscribe.pkid;
        let checked = subscriptions::check(
            subscribe.filters,
            &self.own_hex,
            self.socket.protocol,
            &self.client_id,
        );
        if checked.allowed.is_empty() {
            let return_codes = checked.refused.into_iter().map(|(_, c)| c).collect();
            self.socket
                .queue(Packet::SubAck(SubAck { pkid, return_codes }, None));
            return;
        }
        self.refused_filters.hold(pkid, checked.refused);
        let id = properties.as_ref().and_then(|p| p.id);
        for filter in &checked.allowed {
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
                filters: checked.allowed,
            },
            properties,
        ));
    }

    fn on_unsubscribe(
        &mut self,
        unsubscribe: Unsubscribe,
        properties: Option<rumqttd::protocol::UnsubscribeProperties>,
    ) {
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
            self.to_router
                .push(Packet::Unsubscribe(unsubscribe, properties));
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
            // `LinkTx::send` is an async fn that never awaits (see `poll_once`).
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
                let protocol = self.socket.protocol;
                self.direct.send(direct, protocol, &mut self.socket.wbuf);
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
                let id = crate::codec::encoded_publish_id(&self.socket.wbuf[start..]);
                if !deliver {
                    // Another client's notification, reached through a wildcard.
                    self.socket.wbuf.truncate(start);
                }
                if let Some((qos, pkid)) = id
                    && qos > 0
                {
                    self.router_acks.sent(pkid, !deliver, &mut self.to_router);
                }
            }
            Notification::Unschedule => self.unscheduled = true,
            other => match Option::<Packet>::from(other) {
                Some(Packet::SubAck(mut suback, properties)) => {
                    self.refused_filters.complete(&mut suback);
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

    /// Cleans up after the connection ended.
    async fn finish(&mut self, end: &End) {
        let (reason, text) = end.reason();
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
        self.socket.shutdown().await;
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
        let mut unacked = self.direct.take_unacknowledged();
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
            self.publisher.redeliver_later(unacked);
        }
    }
}
