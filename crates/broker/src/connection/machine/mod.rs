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
//!   answers (`hold.rs`): `machine/acks.rs`;
//! - what goes to the router and what comes from it: `machine/router_side.rs`;
//! - how the connection ends (`end.rs`).

use std::sync::Arc;

use bytes::BytesMut;
use router::protocol::{
    self, Disconnect, DisconnectProperties, DisconnectReasonCode, Packet, PingResp, Publish,
    PublishProperties,
};
use tokio::sync::watch;

use super::end::End;
use super::gate::Gate;
use super::hold::{AckHold, Awaited};
use super::inbound::{self, AckOrder, Inbound};
use super::outbound::{self, Outbound};
use super::subscriptions::PendingRefusals;

mod acks;
mod request;
mod router_side;

use crate::authorization::Principal;
use crate::codec::{Incoming, Protocol};
use crate::persistence::Position;
use crate::request_publish::RequestPublish;
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
    /// The stamps of the QoS 2 PUBRELs in `to_router` the router delivers
    /// (a cluster node's, see `cluster::stamps`): told once they are in
    /// the router's queue ([`crate::shared::Shared::qos2_sent`]).
    pub released_stamps: Vec<String>,
    /// Requests a fault delays, to start.
    pub later: Vec<Delayed>,
    /// The router asked to be told when this connection can take more.
    pub unscheduled: bool,
    /// SUBSCRIBEs and UNSUBSCRIBEs handed to the router and not answered
    /// yet: the connection reads no other packet of the client's until the
    /// router has answered them. A state store request read with one could
    /// otherwise be answered, or notify, before the router knows the
    /// filter (its answer, or its notification, went nowhere: `SUBSCRIBE`
    /// and a request in one write lost the answer).
    awaiting_router: u32,
    /// The router answered the last of them: what was read meanwhile is
    /// served now (the driver takes it).
    pub resume_reading: bool,
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
            released_stamps: Vec::new(),
            later: Vec::new(),
            unscheduled: false,
            awaiting_router: 0,
            resume_reading: false,
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

    /// A packet from the client.
    pub fn on_packet(&mut self, mut incoming: Incoming) -> Result<(), End> {
        // What a client may not send, though the decoder reads it (it
        // reads stored messages too). Here rather than in the socket: a
        // check there moved every decoded packet once more (~200
        // instructions a request).
        crate::codec::check_from_client(&incoming.packet)?;
        let header = (incoming.qos, incoming.pkid, incoming.dup);
        // 4.3.3: a handed-over QoS 2 message (under the id the client saw
        // on the node it left) is acknowledged with PUBREC. Asked before
        // the ids are translated to the router's: a kept id and a router
        // id are of different blocks (a PUBACK of the router's QoS 1
        // delivery whose router id was a kept one's number ended the
        // connection with 0x82 until 2026-11-30).
        if let Packet::PubAck(ack, _) = &incoming.packet
            && self.out.is_kept(ack.pkid)
        {
            return Err(puback_of_qos2(ack.pkid));
        }
        // A handed-over QoS 2 message's flow is finished here.
        if self.out.kept_ack(
            &incoming.packet,
            self.protocol,
            &mut self.wbuf,
            &mut self.to_router,
        ) {
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
                let deliver = self.shared.qos2_released(
                    &self.client_id,
                    pubrel.pkid,
                    &mut self.released_stamps,
                );
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
                Err(puback_of_qos2(ack.pkid))
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
                self.out.direct_acknowledged(
                    ack.pkid,
                    self.protocol,
                    &mut self.wbuf,
                    &mut self.to_router,
                );
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
                self.out.router_completed(
                    comp.pkid,
                    self.protocol,
                    &mut self.wbuf,
                    &mut self.to_router,
                );
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
        // The state store's request topic, the most frequent one, is known
        // valid: compared first, it skips the checks (~150 instructions a
        // request).
        let topic = if *publish.topic == *topics::REQUEST_TOPIC.as_bytes() {
            topics::REQUEST_TOPIC
        } else {
            match protocol::mqtt_str(&publish.topic) {
                Some(t) if !t.is_empty() && protocol::valid_topic(t) => t,
                _ => {
                    return Err(End::Violation(
                        DisconnectReasonCode::TopicNameInvalid,
                        "invalid topic name".into(),
                    ));
                }
            }
        };
        let retransmitted = self.inbound.is_retransmission(qos, pkid);
        self.publish_arrived(qos, pkid, publish.payload.len())?;
        if let Some(dialect) = binding::dialect(topic, self.legacy_2023) {
            let request = RequestPublish::decoded(&publish, properties.as_ref(), (qos, pkid, dup));
            return self.on_request(request, dialect);
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
        // other nodes); a retransmission it knows by its packet id (the
        // client's DUP is not passed on: router patch 45).
        self.route(Packet::Publish(publish, properties));
        if qos > 0 {
            self.ack_order.routed();
            if self.forwarded.is_some() {
                self.tickets.push_back(ticket);
            }
        }
        Ok(())
    }

    /// A state store request read straight from the bytes (see
    /// [`crate::request_publish`]): what [`Machine::on_packet`] and
    /// `on_publish` do for a PUBLISH on the request topic, without the
    /// checks that such a one passed by being read so.
    pub fn on_request_read(&mut self, request: RequestPublish<'_>) -> Result<(), End> {
        self.publish_arrived(request.qos, request.pkid, request.payload.len())?;
        self.on_request(request, statestore::Dialect::V1)
    }

    /// A PUBLISH of `qos` with `pkid` and a payload of `len` bytes came,
    /// however it was read: counted, and one more unacknowledged under
    /// the Receive Maximum (which it may not pass).
    fn publish_arrived(&mut self, qos: u8, pkid: u16, len: usize) -> Result<(), End> {
        crate::metrics::received(qos, len);
        self.inbound
            .arrived(qos, pkid)
            .map_err(|(code, why)| End::Violation(code, why))
    }

    /// What the broker tells this connection.
    pub fn on_broker(&mut self, message: ToConnection) -> Result<(), End> {
        match message {
            ToConnection::Deliver(direct) => {
                let before = self.wbuf.len();
                self.out.deliver(*direct, self.protocol, &mut self.wbuf);
                if self.wbuf.len() == before {
                    // It wrote nothing (it waits for the client's Receive
                    // Maximum, or was too large for the client), and it
                    // may be the answer held acknowledgements wait for,
                    // which the store will not say is out: they go now.
                    self.ack_hold.end();
                }
                Ok(())
            }
            ToConnection::TakenOver => Err(End::TakenOver),
            ToConnection::Overflow => Err(End::Overflow),
            ToConnection::Disconnect(code) => Err(End::Fault(code)),
            ToConnection::SendAway => Err(End::NotServing),
            // The driver's: it ends the link's hold (see
            // `link::RouterLink::hold_until`).
            ToConnection::HandoverDone => Ok(()),
            // Nothing to take: the driver's loop looks at what the write
            // buffer holds back after every turn (see `hold.rs`).
            ToConnection::AnswersOut => Ok(()),
        }
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
            self.to_router
                .push(super::link::goodbye(self.session_expiry));
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

/// 4.3.3: a QoS 2 delivery (`pkid`) is acknowledged with PUBREC, then
/// PUBCOMP; a PUBACK of one ends the connection.
fn puback_of_qos2(pkid: u16) -> End {
    End::Violation(
        DisconnectReasonCode::ProtocolError,
        format!("PUBACK for QoS 2 delivery {pkid} (4.3.3: PUBREC, then PUBCOMP)"),
    )
}

mod peer;
#[cfg(test)]
mod tests;
