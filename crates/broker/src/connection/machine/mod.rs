//! The connection as a machine: what the client sends, what the router and
//! the broker deliver, and what the disk finished go in; what goes to the
//! client, to the router, and the connection's end come out. No I/O: the
//! driver (`driver.rs`) owns the socket, the router link and the timers,
//! feeds the machine and writes what it produced; the machine is tested
//! here on its own, packet in, bytes out.
//!
//! What the machine decides, by the file that knows:
//!
//! - a client's publish: topic aliases and QoS state (`inbound.rs`); a
//!   state store request goes to the store (`machine/request.rs`); the
//!   notification namespace and `$SYS` are refused; the authorization
//!   policy; the rest goes to the router, which acknowledges it;
//! - SUBSCRIBE: the broker's refusals (`subscriptions.rs`), the rest to the
//!   router; UNSUBSCRIBE to the router, or answered here when the
//!   connection never joined it;
//! - what goes to the client at QoS 1/2 from the router and the broker
//!   together, within the client's limits (`outbound/`);
//! - acknowledgements in order (`inbound::AckOrder`), held while what they
//!   acknowledge is not on disk (`gate.rs`), or to leave with their
//!   answers (`hold.rs`);
//! - how the connection ends (`end.rs`).

use std::sync::Arc;

use bytes::BytesMut;
use router::Notification;
use router::protocol::{
    self, Disconnect, DisconnectProperties, DisconnectReasonCode, Packet, PingResp, Publish,
    PublishProperties, SubAck, Subscribe, SubscribeProperties, SubscribeReasonCode, Unsubscribe,
    UnsubscribeProperties,
};
use tokio::sync::watch;

use super::end::End;
use super::gate::{Gate, Held, Waits};
use super::hold::{AckHold, Awaited};
use super::inbound::{self, AckOrder, Inbound};
use super::outbound::{self, Outbound};
use super::subscriptions::{self, PendingRefusals};

mod request;

use crate::authorization::Principal;
use crate::codec::{Incoming, Protocol};
use crate::persistence::{Batch, Position};
use crate::sessions::{SharedAcknowledged, ToConnection};
use crate::shared::Shared;
use crate::store::binding;
use crate::topics;
pub(crate) use request::Delayed;

/// What a connection starts with, once its CONNECT is accepted.
pub(crate) struct Start {
    /// The connection's number (never reused).
    pub id: u64,
    pub client_id: String,
    pub protocol: Protocol,
    /// The session outlives the connection this long, seconds (`u32::MAX`:
    /// for ever).
    pub session_expiry: u32,
    /// The client's Receive Maximum and Maximum Packet Size.
    pub receive_maximum: u16,
    pub max_packet_size: usize,
    /// The Receive Maximum the broker announced (`u16::MAX` for 3.1.1),
    /// and the topic aliases it allows.
    pub broker_receive_maximum: u16,
    pub topic_alias_max: u16,
    /// The topic aliases the client accepts from the broker.
    pub client_topic_alias_max: u16,
    /// The session's record of requests run (and how many it keeps).
    pub acknowledged: (SharedAcknowledged, u16),
    /// The connection has joined the router already (a persistent session
    /// joins at CONNECT).
    pub joined: bool,
    /// The bound on the broker's own deliveries queued for this client.
    pub bound: Arc<crate::sessions::QueueBound>,
    pub principal: Arc<Principal>,
    /// Whom the client's state store quotas count against
    /// ([`crate::authentication::quota_owner`]).
    pub owner: Arc<str>,
    /// How far the disk and the answers waiting for it are (the store's
    /// `StateStoreService::answered`).
    pub disk: watch::Receiver<Position>,
    /// Another cluster node's link: what it publishes was checked on its
    /// own node and goes to this node's subscribers only.
    pub from_link: bool,
    /// The packet ids the router's deliveries take on this connection.
    pub ids: crate::sessions::PacketIdBlock,
}

/// A successful PUBACK without properties, as MQTT 3.1.1 and 5 both encode
/// it.
fn puback_bytes(pkid: u16) -> [u8; 4] {
    let [hi, lo] = pkid.to_be_bytes();
    [0x40, 0x02, hi, lo]
}

/// One connection's protocol state; see the module's documentation.
pub(crate) struct Machine {
    pub id: u64,
    pub client_id: String,
    pub own_hex: String,
    pub protocol: Protocol,
    /// Encoded packets for the client, not yet written.
    pub wbuf: BytesMut,
    /// Packets for the router, not yet handed over.
    pub to_router: Vec<Packet>,
    /// Requests a fault delays, to start.
    pub later: Vec<Delayed>,
    /// The router asked to be told when this connection can take more.
    pub unscheduled: bool,
    /// A SUBSCRIBE or UNSUBSCRIBE waits in `to_router`: the router gets it
    /// before the connection serves another packet. A state store
    /// request read with it could otherwise be answered (through the
    /// router) before the router has the filter the answer goes to
    /// (`SUBSCRIBE` and a request in one write lost the answer).
    pub router_first: bool,
    /// The connection has joined the router, or will with the next
    /// hand-over: only then has the router anything of it.
    joined: bool,
    /// Topic aliases and QoS state of the client's publishes.
    pub(super) inbound: Inbound,
    /// Acknowledgements in the order the publishes arrived.
    ack_order: AckOrder,
    /// Refused filters waiting for the router's SUBACK.
    refused_filters: PendingRefusals,
    /// Acks owed and windows: what goes to the client at QoS 1/2.
    pub(super) out: Outbound,
    /// Acknowledgements waiting for the disk.
    gate: Gate,
    /// Acknowledgements that wait to go out with their answers.
    pub(super) ack_hold: AckHold,
    /// The answers this connection waits for (reading stops at a bound).
    pub(super) awaited: Awaited,
    /// How far the disk and the answers waiting for it are (see
    /// `StateStoreService::answered`).
    answered: watch::Receiver<Position>,
    /// How long the session outlives the connection, seconds (`u32::MAX`:
    /// for ever); DISCONNECT may change it.
    pub session_expiry: u32,
    pub(super) legacy_2023: bool,
    /// Who the client is, for the authorization policy.
    pub(super) principal: Arc<Principal>,
    /// Whom its state store quotas count against.
    pub(super) owner: Arc<str>,
    /// The broker's shared parts: the store, the policy, the faults.
    pub(super) shared: Arc<Shared>,
    /// Another cluster node's link (see [`Start::from_link`]).
    from_link: bool,
    /// How the last answer reached this client (see
    /// [`crate::sessions::Route`]): the next on the same Response Topic
    /// goes the same way while it holds.
    answer_route: Option<Arc<crate::sessions::Route>>,
    /// A cluster node's: how far the other nodes have confirmed the
    /// publishes forwarded (see `cluster::confirmations`).
    forwarded: Option<watch::Receiver<u64>>,
    /// The forwarding tickets of the publishes the router has to
    /// acknowledge, in order (a cluster node's).
    tickets: std::collections::VecDeque<Option<u64>>,
    /// A cluster node's: the tickets of the state store requests whose
    /// acknowledgements wait for their outcome (see `store::tickets`).
    pub(super) outcomes: Option<Arc<crate::store::tickets::Tickets>>,
}

impl Machine {
    pub fn new(start: Start, shared: Arc<Shared>) -> Machine {
        Machine {
            id: start.id,
            own_hex: hex::encode_upper(&start.client_id),
            out: Outbound::new(
                &start.client_id,
                start.receive_maximum,
                start.max_packet_size,
                start.bound,
                start.client_topic_alias_max,
                start.ids,
            ),
            client_id: start.client_id,
            protocol: start.protocol,
            wbuf: BytesMut::new(),
            to_router: Vec::new(),
            later: Vec::new(),
            unscheduled: false,
            router_first: false,
            joined: start.joined,
            inbound: Inbound::new(
                start.topic_alias_max,
                start.broker_receive_maximum,
                start.acknowledged,
            ),
            ack_order: AckOrder::default(),
            refused_filters: PendingRefusals::default(),
            gate: Gate::default(),
            ack_hold: AckHold::default(),
            awaited: Awaited::default(),
            answered: start.disk,
            session_expiry: start.session_expiry,
            legacy_2023: shared.settings.broker.legacy_2023_topic,
            principal: start.principal,
            owner: start.owner,
            forwarded: shared.forwarding_confirmed(),
            outcomes: shared
                .store
                .acknowledges_on_outcome()
                .then(crate::store::tickets::Tickets::new),
            shared,
            from_link: start.from_link,
            answer_route: None,
            tickets: std::collections::VecDeque::new(),
        }
    }

    /// How far the disk and its answers are now.
    pub(super) fn position(&self) -> Position {
        *self.answered.borrow()
    }

    /// Encodes `packet` for the client.
    pub(super) fn queue(&mut self, packet: Packet) {
        if let Err(e) = self.protocol.write(packet, &mut self.wbuf) {
            tracing::warn!(error = %e, "dropping a packet that cannot be encoded");
        }
    }

    /// Queues `packet` for the router (the connection joins it with the
    /// next hand-over, if it has not yet).
    fn route(&mut self, packet: Packet) {
        self.joined = true;
        self.to_router.push(packet);
    }

    /// Queues an acknowledgement for the client, behind those that wait
    /// for the disk (`batch`: what this one waits for itself).
    fn acknowledge(&mut self, ack: Packet, batch: Option<Batch>) {
        self.acknowledge_after(ack, batch, None);
    }

    /// [`Machine::acknowledge`], waiting also for forwarding `ticket`.
    fn acknowledge_after(&mut self, ack: Packet, batch: Option<Batch>, ticket: Option<u64>) {
        self.acknowledge_when(ack, batch, ticket, None);
    }

    /// [`Machine::acknowledge_after`], waiting also for the outcome of the
    /// request with ticket `outcome` (a cluster node's, see
    /// `store::tickets`).
    pub(super) fn acknowledge_when(
        &mut self,
        ack: Packet,
        batch: Option<Batch>,
        ticket: Option<u64>,
        outcome: Option<u64>,
    ) {
        // (The disk's position is read only when there is a batch: it is a
        // lock, on every request's path otherwise.)
        let waits = Waits {
            batch: batch.filter(|&batch| !self.position().covers(batch)),
            links: ticket.filter(|&t| !self.confirmed(t)),
            outcome: outcome.filter(|&n| !self.outcome_out(n)),
        };
        let (protocol, wbuf) = (self.protocol, &mut self.wbuf);
        self.gate.send(ack, waits, |ack| {
            if let Err(e) = protocol.write(ack, wbuf) {
                tracing::warn!(error = %e, "dropping a packet that cannot be encoded");
            }
        });
    }

    /// Whether the requests up to ticket `number` have their outcome out.
    fn outcome_out(&self, number: u64) -> bool {
        self.outcomes.as_ref().is_none_or(|t| t.is_done(number))
    }

    /// The request ticket held acknowledgements wait for (a cluster node's;
    /// see `store::tickets`), and the number to wait on.
    pub fn waiting_for_outcome(&self) -> Option<u64> {
        self.gate.waits().outcome
    }

    /// The tickets' progress to wait on (a cluster node's).
    pub fn outcomes_done(&self) -> Option<watch::Receiver<u64>> {
        self.outcomes.as_ref().map(|t| t.done())
    }

    /// Whether reading stops until the disk catches up: while too many
    /// acknowledgements or answers wait for it.
    pub fn reading_paused(&self) -> bool {
        self.gate.is_full() || self.awaited_full().is_some()
    }

    /// When too many answers wait for the disk, the batch to wait for.
    fn awaited_full(&self) -> Option<Batch> {
        if self.awaited.may_be_full() {
            self.awaited.full(self.position())
        } else {
            None
        }
    }

    /// The earliest batch something here waits for: acknowledgements held
    /// for the disk or for their answers, and reading stopped at the bound.
    pub fn waiting_for(&self) -> Option<Batch> {
        [
            self.gate.waits().batch,
            self.ack_hold.waiting_for(),
            self.awaited_full(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Whether what is encoded for the client may stay unwritten for now:
    /// it holds only acknowledgements that will leave with their answers
    /// (see `hold.rs`).
    pub fn may_hold_output(&mut self) -> bool {
        if self.ack_hold.waiting_for().is_none() {
            return false;
        }
        let position = self.position();
        self.ack_hold.may_wait(self.wbuf.len(), position)
    }

    /// Whether the other nodes have confirmed forwarding `ticket`.
    fn confirmed(&self, ticket: u64) -> bool {
        self.forwarded
            .as_ref()
            .is_none_or(|c| *c.borrow() >= ticket)
    }

    /// The forwarding ticket held acknowledgements wait for (a cluster
    /// node's; see `Shared::forwarding_confirmed`).
    pub fn waiting_for_links(&self) -> Option<u64> {
        self.gate.waits().links
    }

    /// The disk (or the other nodes, or requests' outcomes) moved on: what
    /// the gate held for it goes, in order.
    pub fn on_disk(&mut self) -> Result<(), End> {
        let waits = self.gate.waits();
        let disk = waits
            .batch
            .is_none_or(|batch| self.position().covers(batch));
        let links = waits.links.is_none_or(|ticket| self.confirmed(ticket));
        let outcome = waits.outcome.is_none_or(|n| self.outcome_out(n));
        if self.gate.is_closed() && disk && links && outcome {
            // What closes the gate again holds the rest.
            for held in self.gate.open() {
                match held {
                    Held::Ack(ack) => self.acknowledge(ack, None),
                    Held::Router(notification) => self.on_router(notification)?,
                }
            }
        }
        Ok(())
    }

    /// A packet from the client.
    pub fn on_packet(&mut self, mut incoming: Incoming) -> Result<(), End> {
        // What a client may not send, though the decoder reads it (it
        // reads stored messages too). Here rather than in the socket: a
        // check there moved every decoded packet once more (~200
        // instructions a request).
        crate::codec::check_from_client(&incoming.packet)?;
        let header = (incoming.qos, incoming.pkid, incoming.dup);
        // A handed-over QoS 2 message's flow is finished here.
        if self
            .out
            .kept_ack(&incoming.packet, self.protocol, &mut self.wbuf)
        {
            return Ok(());
        }
        if !self.translate_acks(&mut incoming.packet) {
            return Ok(());
        }
        match incoming.packet {
            Packet::Publish(publish, properties) => self.on_publish(publish, properties, header),
            Packet::PubRel(pubrel, mut properties) => {
                // Whether the router delivers it: not a copy of a message
                // this node had (a cluster node's, see `cluster::origins`).
                let deliver = self.shared.qos2_released(&self.client_id, pubrel.pkid);
                if let Some(pubcomp) = self.inbound.release(pubrel.pkid) {
                    self.inbound.completed(&pubcomp);
                    self.queue(pubcomp);
                } else if self.joined {
                    inbound::mark_discard(&mut properties, !deliver);
                    if !deliver {
                        tracing::debug!(
                            client_id = self.client_id,
                            pkid = pubrel.pkid,
                            "PUBREL: a QoS 2 copy of a message this node had, not delivered again"
                        );
                    }
                    self.route(Packet::PubRel(pubrel, properties));
                } else {
                    // Nothing of this connection is waiting for it.
                    self.queue(inbound::unknown_pubrel(pubrel.pkid));
                }
                Ok(())
            }
            Packet::Subscribe(subscribe, _)
                if subscribe
                    .filters
                    .iter()
                    .any(|f| f.nolocal && f.path.starts_with("$share/")) =>
            {
                Err(End::Violation(
                    DisconnectReasonCode::ProtocolError,
                    "No Local set on a shared subscription (MQTT 5 3.8.3-4)".into(),
                ))
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
                self.queue(Packet::PingResp(PingResp));
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
                    // No longer than the broker keeps any session.
                    let max = self.shared.settings.broker.max_session_expiry_secs;
                    self.session_expiry = if max > 0 { expiry.min(max) } else { expiry };
                }
                Err(End::Goodbye {
                    will: disconnect.reason_code == DisconnectReasonCode::DisconnectWithWillMessage,
                })
            }
            Packet::Connect(..) => Err(End::Violation(
                DisconnectReasonCode::ProtocolError,
                "second CONNECT".into(),
            )),
            // 4.3.2, 4.3.3: a delivery is acknowledged as its QoS says.
            Packet::PubAck(ack, _) if self.out.delivery_qos(ack.pkid) == Some(2) => {
                Err(End::Violation(
                    DisconnectReasonCode::ProtocolError,
                    format!(
                        "PUBACK for QoS 2 delivery {} (4.3.3: PUBREC, then PUBCOMP)",
                        ack.pkid
                    ),
                ))
            }
            Packet::PubRec(rec, _) if self.out.delivery_qos(rec.pkid) == Some(1) => {
                Err(End::Violation(
                    DisconnectReasonCode::ProtocolError,
                    format!("PUBREC for QoS 1 delivery {} (4.3.2: PUBACK)", rec.pkid),
                ))
            }
            // 4.3.3: a PUBREC of 0x80 or more ends the flow, no PUBREL: the
            // router is told the delivery is done as by a PUBACK.
            Packet::PubRec(rec, _) if self.joined && failed(&rec.reason) => {
                tracing::debug!(
                    client_id = self.client_id,
                    pkid = rec.pkid,
                    reason = ?rec.reason,
                    "QoS 2 delivery refused by the client (PUBREC >= 0x80): flow ended"
                );
                let done = Packet::PubAck(
                    protocol::PubAck {
                        pkid: rec.pkid,
                        reason: protocol::PubAckReason::Success,
                    },
                    None,
                );
                self.on_router_ack(rec.pkid, false, done);
                Ok(())
            }
            Packet::PubAck(ack, _) if outbound::is_direct(ack.pkid) => {
                self.out
                    .direct_acknowledged(ack.pkid, self.protocol, &mut self.wbuf);
                Ok(())
            }
            Packet::PubAck(ack, properties) if self.joined => {
                self.on_router_ack(ack.pkid, false, Packet::PubAck(ack, properties));
                Ok(())
            }
            Packet::PubRec(rec, properties) if self.joined => {
                self.on_router_ack(rec.pkid, true, Packet::PubRec(rec, properties));
                Ok(())
            }
            Packet::PubComp(comp, properties) if self.joined => {
                self.out
                    .router_completed(comp.pkid, self.protocol, &mut self.wbuf);
                self.route(Packet::PubComp(comp, properties));
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
        let topic = match protocol::mqtt_str(&publish.topic) {
            Some(t) if !t.is_empty() && protocol::valid_topic(t) => t,
            _ => {
                return Err(End::Violation(
                    DisconnectReasonCode::TopicNameInvalid,
                    "invalid topic name".into(),
                ));
            }
        };
        crate::metrics::received(qos, publish.payload.len());
        let retransmitted = self.inbound.is_retransmission(qos, pkid);
        self.inbound
            .arrived(qos, pkid)
            .map_err(|(code, why)| End::Violation(code, why))?;
        if let Some(dialect) = binding::dialect(topic, self.legacy_2023) {
            return self.on_request(publish, properties, (qos, pkid, dup), dialect);
        }
        if topics::in_notify_namespace(topic) || crate::topics::is_sys_topic(topic) {
            tracing::warn!(
                client_id = self.client_id,
                topic,
                "publish refused: the notification namespace and $SYS are the broker's"
            );
            self.ack(qos, pkid, false);
            return Ok(());
        }
        if let Some(policy) = self.shared.authorizer.current()
            && !self.from_link
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
        // What another node's link sends that this node handles itself.
        let (publish, mut properties) = if self.from_link {
            match self.on_peer_publish(publish, properties, qos, pkid) {
                Some(rest) => rest,
                None => return Ok(()),
            }
        } else {
            (publish, properties)
        };
        // Every other node's subscribers get it too (a cluster node), once:
        // not a QoS 2 retransmission, not what another node forwarded.
        let mut ticket = None;
        if !self.from_link {
            peer::unmarked(&mut properties, &self.client_id);
            if !retransmitted {
                ticket = self
                    .shared
                    .forward_to_peers(&self.client_id, &publish, &mut properties);
            }
        }
        // The publisher's node died after forwarding it, before its
        // PUBREC: this node has it, and the others now too.
        if !self.from_link
            && !retransmitted
            && qos == 2
            && dup
            && self.shared.had_from_another_node(&self.client_id, &publish)
        {
            tracing::debug!(
                client_id = self.client_id,
                pkid,
                "a QoS 2 publish sent again after its first node died: had from that node, not delivered again"
            );
            self.ack_forwarded(qos, pkid, ticket);
            return Ok(());
        }
        // One sent again waits for its PUBREL with its origin: if its
        // first copy comes late from the first node, one of the two goes
        // no further (see `cluster::origins`).
        if !self.from_link && !retransmitted && qos == 2 {
            let origin = self.shared.resent_origin(&self.client_id, &publish);
            self.shared.hold_qos2(&self.client_id, pkid, origin);
        }
        // The router saves what a restart must not lose of it (its PUBACK
        // waits for the disk, see gate.rs, and on a cluster node for the
        // other nodes); a retransmission it knows.
        self.route(Packet::Publish(publish, properties));
        if qos > 0 {
            self.ack_order.routed();
            if self.forwarded.is_some() {
                self.tickets.push_back(ticket);
            }
        }
        Ok(())
    }

    /// Acknowledges a publish handled here (not by the router).
    pub(super) fn ack(&mut self, qos: u8, pkid: u16, accepted: bool) {
        self.ack_when(qos, pkid, accepted, None);
    }

    /// Acknowledges a publish not routed here once the other nodes have
    /// its forwarded copy (`ticket`).
    fn ack_forwarded(&mut self, qos: u8, pkid: u16, ticket: Option<u64>) {
        if let Some(ack) = self.inbound.ack(self.protocol, qos, pkid, true) {
            self.inbound.completed(&ack);
            if let Some((ack, outcome)) = self.ack_order.local(ack, None) {
                self.acknowledge_when(ack, None, ticket, outcome);
            }
        }
    }

    /// [`Machine::ack`], held until the request with ticket `outcome` has
    /// its outcome out (a cluster node's, see `store::tickets`).
    pub(super) fn ack_when(&mut self, qos: u8, pkid: u16, accepted: bool, outcome: Option<u64>) {
        // Every state store request's case: a QoS 1 PUBACK with nothing
        // ahead of it and nothing to wait for goes straight into the
        // buffer, the 4 bytes either protocol encodes it as (the packet
        // made for it, 392 bytes, was moved through five calls).
        if qos == 1
            && accepted
            && outcome.is_none()
            && !self.gate.is_closed()
            && self.ack_order.is_clear()
        {
            self.inbound.acknowledged_at_once();
            self.wbuf.extend_from_slice(&puback_bytes(pkid));
            return;
        }
        if let Some(ack) = self.inbound.ack(self.protocol, qos, pkid, accepted) {
            self.inbound.completed(&ack);
            if let Some((ack, outcome)) = self.ack_order.local(ack, outcome) {
                self.acknowledge_when(ack, None, None, outcome);
            }
        }
    }

    fn on_subscribe(&mut self, subscribe: Subscribe, properties: Option<SubscribeProperties>) {
        let pkid = subscribe.pkid;
        let policy = self.shared.authorizer.current();
        let checked = subscriptions::check(
            subscribe.filters,
            &self.own_hex,
            self.protocol,
            &self.client_id,
            policy.as_deref().map(|p| (p, &*self.principal)),
        );
        if checked.allowed.is_empty() {
            let return_codes = checked.refused.into_iter().map(|(_, c)| c).collect();
            self.queue(Packet::SubAck(SubAck { pkid, return_codes }, None));
            return;
        }
        self.refused_filters.hold(pkid, checked.refused);
        self.router_first = true;
        self.route(Packet::Subscribe(
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
        if self.joined {
            self.router_first = true;
            self.route(Packet::Unsubscribe(unsubscribe, properties));
        } else {
            let unsuback = subscriptions::unsuback_without_subscriptions(&unsubscribe);
            self.acknowledge(unsuback, None);
        }
    }

    /// Puts the router's packet id into the client's acknowledgement of
    /// one of its deliveries (see [`crate::sessions::PacketIdBlock`]);
    /// `false`: the id is not of this session's block (a node the session
    /// left had used it, or the client made it up): nothing to do.
    fn translate_acks(&mut self, packet: &mut Packet) -> bool {
        let pkid = match packet {
            Packet::PubAck(ack, _) if !outbound::is_direct(ack.pkid) => &mut ack.pkid,
            Packet::PubRec(rec, _) => &mut rec.pkid,
            Packet::PubComp(comp, _) => &mut comp.pkid,
            _ => return true,
        };
        match self.out.router_pkid(*pkid) {
            Some(id) => {
                *pkid = id;
                true
            }
            None => {
                tracing::debug!(
                    client_id = self.client_id,
                    pkid = *pkid,
                    "acknowledgement of a packet id this session has not used here: ignored"
                );
                false
            }
        }
    }

    /// The client acknowledged the router's delivery `pkid` with `ack`
    /// (PUBACK, or PUBREC: `qos2`).
    fn on_router_ack(&mut self, pkid: u16, qos2: bool, ack: Packet) {
        self.route(ack);
        self.out.router_acknowledged(
            pkid,
            qos2,
            &mut self.to_router,
            self.protocol,
            &mut self.wbuf,
        );
    }

    /// What the broker tells this connection.
    pub fn on_broker(&mut self, message: ToConnection) -> Result<(), End> {
        match message {
            ToConnection::Deliver(direct) => {
                self.out.deliver(*direct, self.protocol, &mut self.wbuf);
                Ok(())
            }
            ToConnection::TakenOver => Err(End::TakenOver),
            ToConnection::Overflow => Err(End::Overflow),
            ToConnection::Disconnect(code) => Err(End::Fault(code)),
            ToConnection::SendAway => Err(End::NotServing),
        }
    }

    /// A notification from the router.
    pub fn on_router(&mut self, notification: Notification) -> Result<(), End> {
        let Some(notification) = self.gate.defer(notification) else {
            return Ok(());
        };
        match notification {
            Notification::Forward(forward) => {
                // (The router checked the topic: valid UTF-8 without U+0000.)
                let topic = router::protocol::mqtt_str(&forward.publish.topic).unwrap_or("");
                // Another client's notification, reached through a wildcard.
                let withheld = !topics::may_receive(topic, &self.own_hex);
                self.out.forward(
                    Packet::Publish(forward.publish, forward.properties),
                    withheld,
                    self.protocol,
                    &mut self.wbuf,
                    &mut self.to_router,
                );
            }
            Notification::Unschedule => self.unscheduled = true,
            Notification::DurableAck(receipt, ack) => {
                self.on_router_answer(ack.into(), Some(receipt.into()))?;
            }
            other => {
                if let Some(packet) = Option::<Packet>::from(other) {
                    self.on_router_answer(packet, None)?;
                }
            }
        }
        Ok(())
    }

    /// A packet the router answers the client with: an acknowledgement
    /// (held while `batch` is not on disk, see gate.rs), or its DISCONNECT.
    fn on_router_answer(&mut self, packet: Packet, batch: Option<Batch>) -> Result<(), End> {
        match packet {
            Packet::SubAck(mut suback, properties) => {
                // The router refuses filters beyond
                // `router.max_subscriptions_per_client` (and logs it);
                // 3.1.1 has one failure code.
                let over_quota = suback
                    .return_codes
                    .iter()
                    .filter(|c| **c == SubscribeReasonCode::QuotaExceeded)
                    .count();
                if over_quota > 0 {
                    tracing::info!(
                        client_id = self.client_id,
                        refused = over_quota,
                        "subscriptions refused: max_subscriptions_per_client reached"
                    );
                    crate::metrics::subscriptions_refused("quota_exceeded", over_quota as u64);
                    for code in &mut suback.return_codes {
                        if *code == SubscribeReasonCode::QuotaExceeded {
                            *code = subscriptions::failure(self.protocol, *code);
                        }
                    }
                }
                self.refused_filters.complete(&mut suback);
                self.acknowledge(Packet::SubAck(suback, properties), batch);
            }
            // Answered here already.
            Packet::PingResp(_) | Packet::ConnAck(..) => {}
            Packet::Disconnect(disconnect, properties) => {
                // The router's words, or the reason code's name (it gave
                // none: "router: " was all the client read).
                let reason = properties
                    .and_then(|p| p.reason_string)
                    .filter(|r| !r.is_empty())
                    .unwrap_or_else(|| format!("{:?}", disconnect.reason_code));
                return Err(End::Violation(
                    disconnect.reason_code,
                    format!("router: {reason}"),
                ));
            }
            // The router's acknowledgement of a publish: then those made
            // here that waited for it.
            ack @ (Packet::PubAck(..) | Packet::PubRec(..)) => {
                self.inbound.completed(&ack);
                let ticket = self.tickets.pop_front().flatten();
                self.acknowledge_after(ack, batch, ticket);
                for (held, outcome) in self.ack_order.router_acknowledged() {
                    self.acknowledge_when(held, None, None, outcome);
                }
            }
            // The router releases its QoS 2 delivery: by the client's id.
            Packet::PubRel(mut rel, properties) => {
                rel.pkid = self.out.client_pkid(rel.pkid);
                self.acknowledge(Packet::PubRel(rel, properties), batch);
            }
            packet => {
                self.inbound.completed(&packet);
                self.acknowledge(packet, batch);
            }
        }
        Ok(())
    }

    /// The connection ended with `end`: the DISCONNECT that tells an MQTT 5
    /// client why (where the broker ended it) goes to the client, and the
    /// one that ends the connection's part of the session (with its
    /// possibly updated expiry) to the router, which keeps the session as
    /// long as that says.
    pub fn end(&mut self, end: &End) {
        let (reason, text) = end.reason();
        tracing::info!(
            client_id = self.client_id,
            connection = self.id,
            reason = text,
            discarded_too_large = self.out.discarded(),
            "client disconnected"
        );
        if let Some(reason_code) = reason
            && self.protocol == Protocol::V5
        {
            let disconnect = |reason_string| {
                Packet::Disconnect(
                    Disconnect { reason_code },
                    Some(DisconnectProperties {
                        session_expiry_interval: None,
                        reason_string,
                        user_properties: Vec::new(),
                        server_reference: None,
                    }),
                )
            };
            // 3.14.2.2.3: no Reason String that would make the packet
            // larger than the client's Maximum Packet Size.
            let mut with_text = BytesMut::new();
            let fits = self
                .protocol
                .write(disconnect(Some(text)), &mut with_text)
                .is_ok_and(|()| with_text.len() <= self.out.max_packet_size());
            if fits {
                self.wbuf.extend_from_slice(&with_text);
            } else {
                self.queue(disconnect(None));
            }
        }
        if self.joined && !matches!(end, End::RouterClosed) {
            self.to_router.push(Packet::Disconnect(
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
        }
    }
}

/// A PUBREC reason code of 0x80 or more.
fn failed(reason: &protocol::PubRecReason) -> bool {
    !matches!(
        reason,
        protocol::PubRecReason::Success | protocol::PubRecReason::NoMatchingSubscribers
    )
}

mod peer;
#[cfg(test)]
mod tests;
