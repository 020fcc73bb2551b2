//! The router's side of the connection: what goes to it (publishes,
//! SUBSCRIBE and UNSUBSCRIBE after the broker's own refusals), and what
//! comes from it (deliveries, its acknowledgements of the client's
//! publishes, SUBACK, UNSUBACK, a DISCONNECT), with the packet ids of its
//! deliveries translated to the session's block.

use router::Notification;
use router::protocol::{
    Packet, SubAck, Subscribe, SubscribeProperties, SubscribeReasonCode, Unsubscribe,
    UnsubscribeProperties,
};

use super::super::end::End;
use super::super::{outbound, subscriptions};
use super::Machine;
use crate::persistence::Batch;
use crate::topics;

impl Machine {
    /// Queues `packet` for the router (the connection joins it with the
    /// next hand-over, if it has not yet).
    pub(super) fn route(&mut self, packet: Packet) {
        self.joined = true;
        self.to_router.push(packet);
    }

    pub(super) fn on_subscribe(
        &mut self,
        subscribe: Subscribe,
        properties: Option<SubscribeProperties>,
    ) {
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
        self.awaiting_router += 1;
        self.route(Packet::Subscribe(
            Subscribe {
                pkid,
                filters: checked.allowed,
            },
            properties,
        ));
    }

    pub(super) fn on_unsubscribe(
        &mut self,
        unsubscribe: Unsubscribe,
        properties: Option<UnsubscribeProperties>,
    ) {
        // The router answers (one reason per filter); without a link it
        // holds no subscription of this connection.
        if self.joined {
            self.awaiting_router += 1;
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
    pub(super) fn translate_acks(&mut self, packet: &mut Packet) -> bool {
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
    pub(super) fn on_router_ack(&mut self, pkid: u16, qos2: bool, ack: Packet) {
        self.route(ack);
        self.out.router_acknowledged(
            pkid,
            qos2,
            &mut self.to_router,
            self.protocol,
            &mut self.wbuf,
        );
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
    pub(super) fn on_router_answer(
        &mut self,
        packet: Packet,
        batch: Option<Batch>,
    ) -> Result<(), End> {
        if matches!(packet, Packet::SubAck(..) | Packet::UnsubAck(..)) && self.awaiting_router > 0 {
            self.awaiting_router -= 1;
            self.resume_reading = self.awaiting_router == 0;
        }
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
}
