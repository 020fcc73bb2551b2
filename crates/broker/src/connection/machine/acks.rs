//! Acknowledgements to the client, and what the connection waits for:
//! acknowledgements leave in the order the publishes came
//! (`inbound::AckOrder`), each held while what it acknowledges is not on
//! disk, not confirmed by the other nodes, or (a cluster node's request)
//! without its outcome (`gate.rs`), or to leave with its answer
//! (`hold.rs`); reading stops while too many wait.

use router::protocol::Packet;
use tokio::sync::watch;

use super::super::end::End;
use super::super::gate::{Held, Waits};
use super::{Machine, puback_bytes};
use crate::persistence::Batch;

impl Machine {
    /// Queues an acknowledgement for the client, behind those that wait
    /// for the disk (`batch`: what this one waits for itself).
    pub(super) fn acknowledge(&mut self, ack: Packet, batch: Option<Batch>) {
        self.acknowledge_after(ack, batch, None);
    }

    /// [`Machine::acknowledge`], waiting also for forwarding `ticket`.
    pub(super) fn acknowledge_after(
        &mut self,
        ack: Packet,
        batch: Option<Batch>,
        ticket: Option<u64>,
    ) {
        self.acknowledge_when(ack, batch, ticket, None);
    }

    /// [`Machine::acknowledge_after`], waiting also for the outcome of the
    /// request with ticket `outcome` (a cluster node's, see
    /// `store::tickets`).
    pub(in crate::connection) fn acknowledge_when(
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
    pub(super) fn outcome_out(&self, number: u64) -> bool {
        self.outcomes.as_ref().is_none_or(|t| t.is_done(number))
    }

    /// The tickets' progress to wait on (a cluster node's).
    pub fn outcomes_done(&self) -> Option<watch::Receiver<u64>> {
        self.outcomes.as_ref().map(|t| t.done())
    }

    /// Whether reading stops: until the disk catches up, while too many
    /// acknowledgements or answers wait for it; until the router answers
    /// the (UN)SUBSCRIBEs handed to it (see `Machine::awaiting_router`).
    pub fn reading_paused(&self) -> bool {
        self.gate.is_full() || self.awaited_full().is_some() || self.awaiting_router > 0
    }

    /// When too many answers wait for the disk, the batch to wait for.
    pub(super) fn awaited_full(&self) -> Option<Batch> {
        if self.awaited.may_be_full() {
            self.awaited.full(self.position())
        } else {
            None
        }
    }

    /// The earliest batch the connection waits on the answered position
    /// for: acknowledgements the gate holds for the disk, those held for
    /// answers that will not come (requests sent again, see `hold.rs`),
    /// and reading stopped at the bound. (The other acknowledgements held
    /// for their answers are woken by the answer, or by the store's
    /// `AnswersOut`.)
    pub fn waiting_for(&self) -> Option<Batch> {
        // Pairwise rather than an array's `flatten().min()`: asked at
        // every turn, that cost ~50 instructions a request.
        let held = earliest(self.gate.waits().batch, self.ack_hold.watched());
        earliest(held, self.awaited_full())
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
    pub(super) fn confirmed(&self, ticket: u64) -> bool {
        self.forwarded
            .as_ref()
            .is_none_or(|c| *c.borrow() >= ticket)
    }

    /// What the connection's loop waits for besides its client and the
    /// router: the earliest batch of the disk's ([`Machine::waiting_for`]),
    /// and the gate's forwarding ticket (see
    /// `Shared::forwarding_confirmed`) and request ticket (see
    /// `store::tickets`), a cluster node's.
    pub fn waits(&self) -> Waits {
        Waits {
            batch: self.waiting_for(),
            ..self.gate.waits()
        }
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

    /// Acknowledges a publish handled here (not by the router).
    pub(in crate::connection) fn ack(&mut self, qos: u8, pkid: u16, accepted: bool) {
        self.ack_when(qos, pkid, accepted, None);
    }

    /// Acknowledges a publish not routed here once the other nodes have
    /// its forwarded copy (`ticket`).
    pub(super) fn ack_forwarded(&mut self, qos: u8, pkid: u16, ticket: Option<u64>) {
        if let Some(ack) = self.inbound.ack(self.protocol, qos, pkid, true) {
            self.inbound.completed(&ack);
            if let Some((ack, outcome)) = self.ack_order.local(ack, None) {
                self.acknowledge_when(ack, None, ticket, outcome);
            }
        }
    }

    /// [`Machine::ack`], held until the request with ticket `outcome` has
    /// its outcome out (a cluster node's, see `store::tickets`).
    pub(in crate::connection) fn ack_when(
        &mut self,
        qos: u8,
        pkid: u16,
        accepted: bool,
        outcome: Option<u64>,
    ) {
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
}

/// The earlier of two batches waited for, either of which may be none.
fn earliest(a: Option<Batch>, b: Option<Batch>) -> Option<Batch> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        _ => a.or(b),
    }
}
