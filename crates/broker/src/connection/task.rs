//! The connection task once CONNECT is accepted: the run loop, the
//! dispatch of what the client sends and of what the router and the broker
//! deliver, and the teardown.

use std::sync::Arc;
use std::time::Duration;

use router::Notification;
use router::protocol::{
    self, Disconnect, DisconnectProperties, DisconnectReasonCode, Packet, PingResp, Publish,
    PublishProperties, SubAck, Subscribe, SubscribeProperties, Unsubscribe, UnsubscribeProperties,
};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::end::End;
use super::gate::{Gate, Held};
use super::hold::{AckHold, Awaited};
use super::inbound::{self, AckOrder, Inbound};
use super::link::RouterLink;
use super::outbound::{self, Outbound};
use super::socket::{Socket, Stream};
use super::subscriptions::{self, PendingRefusals};
use crate::authorization::Principal;
use crate::codec::{Incoming, Protocol};
use crate::publisher::Publisher;
use crate::sessions::{Sessions, ToConnection};
use crate::shared::Shared;
use crate::store::StateStoreService;
use crate::store::binding;
use crate::topics;

/// A connected client: its socket, its link to the router, and what is
/// in flight either way.
pub(super) struct Connection<S> {
    pub(super) id: u64,
    pub(super) client_id: String,
    pub(super) own_hex: String,
    pub(super) socket: Socket<S>,
    /// The link to the router, made on first need.
    pub(super) link: RouterLink,
    /// How long the client may stay silent (1.5 times its keep-alive).
    pub(super) idle_limit: Option<Duration>,
    pub(super) last_heard: Instant,
    pub(super) max_packet_size: usize,
    /// Topic aliases and QoS 2 state of the client's publishes.
    pub(super) inbound: Inbound,
    /// Acknowledgements in the order the publishes arrived.
    pub(super) ack_order: AckOrder,
    /// Refused filters waiting for the router's SUBACK.
    pub(super) refused_filters: PendingRefusals,
    /// Acks owed and windows: what goes to the client at QoS 1/2.
    pub(super) out: Outbound,
    /// Direct deliveries and takeover notices (see [`crate::sessions`]).
    pub(super) direct_rx: mpsc::UnboundedReceiver<ToConnection>,
    pub(super) unscheduled: bool,
    pub(super) store: Arc<StateStoreService>,
    pub(super) publisher: Arc<Publisher>,
    pub(super) sessions: Arc<Sessions>,
    /// How long the session outlives the connection, seconds (`u32::MAX`:
    /// for ever); DISCONNECT may change it.
    pub(super) session_expiry: u32,
    pub(super) legacy_2023: bool,
    /// Acknowledgements waiting for the disk.
    pub(super) gate: Gate,
    /// Acknowledgements that wait to go out with their answers.
    pub(super) ack_hold: AckHold,
    /// The answers this connection waits for (reading stops at a bound).
    pub(super) awaited: Awaited,
    /// Where the store's published answers are (see `StateStoreService::
    /// answered`): one subscription for the connection's life.
    pub(super) answered: tokio::sync::watch::Receiver<u64>,
    /// Who the client is, for the authorization policy.
    pub(super) principal: Arc<Principal>,
    /// The broker's shared parts (the policy in use among them).
    pub(super) shared: Arc<Shared>,
    /// What the web view shows of this connection.
    pub(super) peer: Arc<crate::sessions::Peer>,
}

/// How long a write to a client without keep-alive may stall before the
/// client is disconnected.
const WRITE_STALL: Duration = Duration::from_secs(60);

impl<S: Stream> Connection<S> {
    pub(super) async fn run(&mut self, shutdown: tokio::sync::watch::Receiver<bool>) -> End {
        match self.serve_packets(shutdown).await {
            Err(end) => end,
            Ok(never) => match never {},
        }
    }

    async fn serve_packets(
        &mut self,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> Result<std::convert::Infallible, End> {
        // The keep-alive timer is set once and moved on only when it fires
        // (to the last time the client was heard, plus the limit), and the
        // shutdown signal is awaited by one future: making both anew on
        // every turn registered and removed a timer and a waiter per
        // request (1,400 instructions, 6% of a request).
        let keep_alive = tokio::time::sleep_until(
            self.last_heard + self.idle_limit.unwrap_or(Duration::from_secs(86_400)),
        );
        tokio::pin!(keep_alive);
        let shutdown = shutdown.changed();
        tokio::pin!(shutdown);
        loop {
            // Answers from the disk to wait for (see hold.rs): those of
            // held acknowledgements, and the one reading waits for at the
            // bound; the earlier batch first.
            let answers = match (self.ack_hold.waiting_for(), self.awaited_full()) {
                (Some(held), Some(resume)) => Some(held.min(resume)),
                (held, resume) => held.or(resume),
            };
            tokio::select! {
                read = self.socket.fill(), if !self.reading_paused() => {
                    match read {
                        Ok(0) => return Err(End::Closed),
                        Err(e) => return Err(End::Io(e)),
                        Ok(_) => {
                            self.last_heard = Instant::now();
                            let read = self.read_packets();
                            self.flush_link().await?;
                            read?;
                        }
                    }
                }
                () = self.gate.durable_now() => {
                    // In order; what closes the gate again holds the rest.
                    for held in self.gate.open() {
                        match held {
                            Held::Ack(ack) => {
                                let socket = &mut self.socket;
                                self.gate.send(ack, None, |ack| socket.queue(ack));
                            }
                            Held::Router(notification) => {
                                self.on_router_notification(notification)?;
                            }
                        }
                    }
                    // Reading may have stopped while they waited.
                    let read = self.read_packets();
                    self.flush_link().await?;
                    read?;
                }
                notification = self.link.next() => {
                    match notification {
                        Ok(Some(n)) => {
                            self.on_router_notification(n)?;
                            // Take everything else the router has ready before writing.
                            while let Some(n) = self.link.next_ready() {
                                self.on_router_notification(n)?;
                            }
                            // Acknowledgements of dropped publishes.
                            self.flush_link().await?;
                        }
                        Ok(None) => {}
                        Err(_) => return Err(End::RouterClosed),
                    }
                }
                Some(message) = self.direct_rx.recv() => self.on_broker_message(message)?,
                // The answers are out: held acknowledgements whose answers
                // went elsewhere, or nowhere, go below; reading stopped at
                // the bound goes on.
                () = async {
                    let _ = self.answered.wait_for(|&p| p >= answers.unwrap_or(0)).await;
                }, if answers.is_some() => {
                    let read = self.read_packets();
                    self.flush_link().await?;
                    read?;
                }
                () = &mut keep_alive, if self.idle_limit.is_some() => {
                    let deadline = self.last_heard + self.idle_limit.unwrap_or_default();
                    if Instant::now() >= deadline {
                        return Err(End::KeepAlive);
                    }
                    keep_alive.as_mut().reset(deadline);
                }
                _ = &mut shutdown => return Err(End::Shutdown),
            }
            // Direct deliveries that are ready (the answers to what was just
            // read among them) go out with the same write.
            while let Ok(message) = self.direct_rx.try_recv() {
                self.on_broker_message(message)?;
            }
            // A client that stops reading cannot hold its connection: the
            // write may stall for as long as the client may stay silent.
            let stall = self.idle_limit.unwrap_or(WRITE_STALL);
            let store = &self.store;
            if !self
                .ack_hold
                .may_wait(self.socket.wbuf.len(), |seq| store.is_answered(seq))
            {
                match tokio::time::timeout(stall, self.socket.flush()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(End::Io(e)),
                    Err(_) => return Err(End::WriteStalled),
                }
            }
            self.peer
                .in_flight
                .store(self.out.in_flight(), std::sync::atomic::Ordering::Relaxed);
            if self.unscheduled {
                self.unscheduled = false;
                self.link.wake().await?;
            }
        }
    }

    /// Whether reading stops until the disk catches up: while too many
    /// acknowledgements or answers wait for it.
    fn reading_paused(&self) -> bool {
        self.gate.is_full() || self.awaited_full().is_some()
    }

    /// The batch to wait for when this connection waits for too many
    /// answers (see [`Awaited`]).
    fn awaited_full(&self) -> Option<u64> {
        self.awaited.full(|seq| self.store.is_answered(seq))
    }

    /// Decodes and handles every complete packet in the read buffer, until
    /// too much waits for the disk.
    fn read_packets(&mut self) -> Result<(), End> {
        while !self.reading_paused()
            && let Some(incoming) = self.socket.next_packet(self.max_packet_size)?
        {
            self.on_packet(incoming)?;
        }
        Ok(())
    }

    /// Hands the router what was queued for it.
    async fn flush_link(&mut self) -> Result<(), End> {
        self.link.flush().await?;
        Ok(())
    }

    fn on_packet(&mut self, incoming: Incoming) -> Result<(), End> {
        let header = (incoming.qos, incoming.pkid, incoming.dup);
        match incoming.packet {
            Packet::Publish(publish, properties) => self.on_publish(publish, properties, header),
            Packet::PubRel(pubrel, properties) => {
                if let Some(pubcomp) = self.inbound.release(pubrel.pkid) {
                    self.inbound.completed(&pubcomp);
                    self.socket.queue(pubcomp);
                } else if self.link.is_linked() {
                    self.link.push(Packet::PubRel(pubrel, properties));
                } else {
                    // Nothing of this connection is waiting for it.
                    self.socket.queue(inbound::unknown_pubrel(pubrel.pkid));
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
            Packet::Disconnect(disconnect, properties) => {
                // MQTT 5 3.14.2.2.2: DISCONNECT may change the Session
                // Expiry Interval, but not from 0 to more.
                if let Some(expiry) = properties.and_then(|p| p.session_expiry_interval) {
                    if self.session_expiry == 0 && expiry > 0 {
                        return Err(End::Violation(
                            DisconnectReasonCode::ProtocolError,
                            "a session that ends with its connection cannot be given an expiry at DISCONNECT".into(),
                        ));
                    }
                    self.session_expiry = expiry;
                }
                Err(End::Goodbye {
                    will: disconnect.reason_code == DisconnectReasonCode::DisconnectWithWillMessage,
                })
            }
            Packet::Connect(..) => Err(End::Violation(
                DisconnectReasonCode::ProtocolError,
                "second CONNECT".into(),
            )),
            Packet::PubAck(ack, _) if outbound::is_direct(ack.pkid) => {
                let protocol = self.socket.protocol;
                self.out
                    .direct_acknowledged(ack.pkid, protocol, &mut self.socket.wbuf);
                Ok(())
            }
            Packet::PubAck(ack, properties) if self.link.is_linked() => {
                self.on_router_ack(ack.pkid, false, Packet::PubAck(ack, properties));
                Ok(())
            }
            Packet::PubRec(rec, properties) if self.link.is_linked() => {
                self.on_router_ack(rec.pkid, true, Packet::PubRec(rec, properties));
                Ok(())
            }
            Packet::PubComp(comp, properties) if self.link.is_linked() => {
                let protocol = self.socket.protocol;
                self.out
                    .router_completed(comp.pkid, protocol, &mut self.socket.wbuf);
                self.link.push(Packet::PubComp(comp, properties));
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
        (qos, pkid, dup): (u8, u16, bool),
    ) -> Result<(), End> {
        // Resolve topic aliases here, so every check below sees the topic.
        if let Some(alias) = properties.as_mut().and_then(|p| p.topic_alias.take()) {
            self.inbound
                .resolve_alias(&mut publish, alias)
                .map_err(|(code, why)| End::Violation(code, why))?;
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
        crate::metrics::received(qos, publish.payload.len());
        self.inbound
            .arrived(qos, pkid)
            .map_err(|(code, why)| End::Violation(code, why))?;
        if let Some(dialect) = binding::dialect(topic, self.legacy_2023) {
            return self.on_request(publish, properties, (qos, pkid, dup), dialect);
        }
        if topics::in_notify_namespace(topic) || crate::sys::is_sys_topic(topic) {
            tracing::warn!(
                client_id = self.client_id,
                topic,
                "publish refused: the notification namespace and $SYS are the broker's"
            );
            self.ack(qos, pkid, false);
            return Ok(());
        }
        if let Some(policy) = self.shared.authorizer.current()
            && !policy.may_publish(&self.principal, topic)
        {
            tracing::info!(
                client_id = self.client_id,
                topic,
                "publish refused: the authorization policy denies it"
            );
            self.ack(qos, pkid, false);
            return Ok(());
        }
        // The router saves what a restart must not lose of it (its PUBACK
        // waits for the disk, see gate.rs); a retransmission it knows.
        self.link.push(Packet::Publish(publish, properties));
        if qos > 0 {
            self.ack_order.routed();
        }
        Ok(())
    }

    /// Acknowledges a publish handled here (not by the router).
    pub(super) fn ack(&mut self, qos: u8, pkid: u16, accepted: bool) {
        if let Some(ack) = self.inbound.ack(self.socket.protocol, qos, pkid, accepted) {
            self.inbound.completed(&ack);
            if let Some(ack) = self.ack_order.local(ack) {
                let socket = &mut self.socket;
                self.gate.send(ack, None, |ack| socket.queue(ack));
            }
        }
    }

    fn on_subscribe(&mut self, subscribe: Subscribe, properties: Option<SubscribeProperties>) {
        let pkid = subscribe.pkid;
        let policy = self.shared.authorizer.current();
        let checked = subscriptions::check(
            subscribe.filters,
            &self.own_hex,
            self.socket.protocol,
            &self.client_id,
            policy.as_deref().map(|p| (p, &*self.principal)),
        );
        if checked.allowed.is_empty() {
            let return_codes = checked.refused.into_iter().map(|(_, c)| c).collect();
            self.socket
                .queue(Packet::SubAck(SubAck { pkid, return_codes }, None));
            return;
        }
        self.refused_filters.hold(pkid, checked.refused);
        self.link.push(Packet::Subscribe(
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
        properties: Option<UnsubscribeProperties>,
    ) {
        // The router answers (one reason per filter); without a link it
        // holds no subscription of this connection.
        if self.link.is_linked() {
            self.link.push(Packet::Unsubscribe(unsubscribe, properties));
        } else {
            let unsuback = subscriptions::unsuback_without_subscriptions(&unsubscribe);
            let socket = &mut self.socket;
            self.gate.send(unsuback, None, |ack| socket.queue(ack));
        }
    }

    /// Handles what the broker tells this connection.
    /// The client acknowledged the router's delivery `pkid` with `ack`
    /// (PUBACK, or PUBREC: `qos2`).
    fn on_router_ack(&mut self, pkid: u16, qos2: bool, ack: Packet) {
        self.link.push(ack);
        let protocol = self.socket.protocol;
        let out = &mut self.socket.wbuf;
        self.out
            .router_acknowledged(pkid, qos2, self.link.batch(), protocol, out);
    }

    fn on_broker_message(&mut self, message: ToConnection) -> Result<(), End> {
        match message {
            ToConnection::Deliver(direct) => {
                let protocol = self.socket.protocol;
                self.out.deliver(*direct, protocol, &mut self.socket.wbuf);
                Ok(())
            }
            ToConnection::TakenOver => Err(End::TakenOver),
            ToConnection::Overflow => Err(End::Overflow),
            ToConnection::Disconnect(code) => Err(End::Fault(code)),
        }
    }

    /// Handles one notification from the router.
    fn on_router_notification(&mut self, notification: Notification) -> Result<(), End> {
        let Some(notification) = self.gate.defer(notification) else {
            return Ok(());
        };
        match notification {
            Notification::Forward(forward) => {
                let topic = std::str::from_utf8(&forward.publish.topic).unwrap_or("");
                // Another client's notification, reached through a wildcard.
                let withheld = !topics::may_receive(topic, &self.own_hex);
                let protocol = self.socket.protocol;
                self.out.forward(
                    Packet::Publish(forward.publish, forward.properties),
                    withheld,
                    protocol,
                    &mut self.socket.wbuf,
                    self.link.batch(),
                );
            }
            Notification::Unschedule => self.unscheduled = true,
            Notification::DurableAck(receipt, ack) => {
                self.on_router_answer(ack.into(), Some(receipt))?
            }
            other => {
                if let Some(packet) = Option::<Packet>::from(other) {
                    self.on_router_answer(packet, None)?;
                }
            }
        }
        Ok(())
    }

    /// A packet the router answers the client with: an acknowledgement,
    /// held while `receipt` is not durable (see gate.rs), or its DISCONNECT.
    fn on_router_answer(
        &mut self,
        packet: Packet,
        receipt: Option<router::Receipt>,
    ) -> Result<(), End> {
        let socket = &mut self.socket;
        match packet {
            Packet::SubAck(mut suback, properties) => {
                self.refused_filters.complete(&mut suback);
                let suback = Packet::SubAck(suback, properties);
                self.gate.send(suback, receipt, |ack| socket.queue(ack));
            }
            // Answered here already.
            Packet::PingResp(_) | Packet::ConnAck(..) => {}
            Packet::Disconnect(disconnect, properties) => {
                let reason = properties.and_then(|p| p.reason_string).unwrap_or_default();
                return Err(End::Violation(
                    disconnect.reason_code,
                    format!("router: {reason}"),
                ));
            }
            // The router's acknowledgement of a publish: then those made
            // here that waited for it.
            ack @ (Packet::PubAck(..) | Packet::PubRec(..)) => {
                self.inbound.completed(&ack);
                self.gate.send(ack, receipt, |ack| socket.queue(ack));
                for held in self.ack_order.router_acknowledged() {
                    self.gate.send(held, None, |ack| socket.queue(ack));
                }
            }
            packet => {
                self.inbound.completed(&packet);
                self.gate.send(packet, receipt, |ack| socket.queue(ack));
            }
        }
        Ok(())
    }

    /// Cleans up after the connection ended.
    pub(super) async fn finish(&mut self, end: &End) {
        let (reason, text) = end.reason();
        tracing::info!(
            client_id = self.client_id,
            connection = self.id,
            reason = text,
            discarded_too_large = self.out.discarded(),
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
        if reason.is_some() {
            // The broker ended it: let the client read why before closing.
            self.socket.linger(Duration::from_millis(500)).await;
        }
        if self.link.is_linked() && !matches!(end, End::RouterClosed) {
            // The router forgets the connection, and keeps the session for
            // its (possibly updated) expiry.
            self.link.push(Packet::Disconnect(
                Disconnect {
                    reason_code: DisconnectReasonCode::NormalDisconnection,
                },
                Some(DisconnectProperties {
                    session_expiry_interval: Some(self.session_expiry),
                    reason_string: None,
                    user_properties: Vec::new(),
                    server_reference: None,
                }),
            ));
            let _ = self.link.flush().await;
        }
        self.store.connection_closed(&self.client_id, self.id);
        // No more direct deliveries; what was not acknowledged goes to the
        // router, which keeps it for a persistent session.
        self.sessions
            .disconnected(&self.client_id, self.id, self.session_expiry);
        let unacked = self.out.hand_back(&mut self.direct_rx);
        if self.session_expiry > 0 && !unacked.is_empty() && !matches!(end, End::Shutdown) {
            tracing::debug!(
                client_id = self.client_id,
                count = unacked.len(),
                "unacknowledged deliveries kept for the session"
            );
            self.publisher.redeliver_later(unacked);
        }
    }
}
