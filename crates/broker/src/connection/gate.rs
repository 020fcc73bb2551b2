//! Acknowledgements that wait for the disk.
//!
//! The router saves what a restart must not lose (a retained message, a
//! copy of a publish for persistent sessions, a persistent session's
//! subscriptions; see [`router::Journal`]) as it applies it, and hands the
//! acknowledgement the change asked for (PUBACK, PUBREC, SUBACK, UNSUBACK)
//! back with the journal's receipt (a [`Batch`]). Until it is durable, the gate
//! holds that acknowledgement, and every acknowledgement after it (the
//! client must see them in order, MQTT 4.6): so an acknowledgement still
//! means "on disk". Deliveries to the client go on meanwhile, but for
//! those of a subscription whose SUBACK waits: the router sends a new
//! subscription's retained messages at once, and they must not overtake
//! its SUBACK; so while a SUBACK waits, what the router sends waits behind
//! it (in order: the router wants its deliveries acknowledged in the order
//! it sent them).
//!
//! On a cluster node a publish's acknowledgement also waits until the
//! other nodes have it (a forwarding ticket, see
//! `cluster::confirmations`), in the same way and the same order.
//!
//! While it holds [`MAX_HELD`] acknowledgements the connection stops
//! reading: however fast a client sends and however slow the disk, what
//! waits stays bounded.

use router::Notification;
use router::protocol::Packet;

use crate::persistence::Batch;

/// Acknowledgements a connection may hold for the disk before it stops
/// reading.
pub(crate) const MAX_HELD: usize = 256;

/// What waits for the disk.
#[derive(Default)]
pub(crate) struct Gate {
    /// The batch to wait for; `None`: open (as far as the disk goes).
    waiting_for: Option<Batch>,
    /// The forwarding ticket to wait for (a cluster node's).
    waiting_for_links: Option<u64>,
    held: Vec<Held>,
    /// A SUBACK is among what is held.
    holds_suback: bool,
}

/// Something held: an acknowledgement for the client, or (behind a
/// SUBACK) a notification from the router to handle once the gate opens.
pub(crate) enum Held {
    Ack(Packet),
    Router(Notification),
}

impl Gate {
    /// Queues `ack` for the client with `out` unless it must wait: for its
    /// own batch `not_done` (one the disk does not have yet) or forwarding
    /// ticket `links_not_done` (one the other nodes have not confirmed), or
    /// behind an earlier acknowledgement that waits.
    pub fn send(
        &mut self,
        ack: Packet,
        (not_done, links_not_done): (Option<Batch>, Option<u64>),
        out: impl FnOnce(Packet),
    ) {
        self.waiting_for = self.waiting_for.max(not_done);
        self.waiting_for_links = self.waiting_for_links.max(links_not_done);
        if self.waiting_for.is_some() || self.waiting_for_links.is_some() {
            self.holds_suback |= matches!(ack, Packet::SubAck(..));
            self.held.push(Held::Ack(ack));
        } else {
            out(ack);
        }
    }

    /// Holds `notification` from the router while a SUBACK waits (see the
    /// module's documentation); gives it back otherwise.
    pub fn defer(&mut self, notification: Notification) -> Option<Notification> {
        if self.holds_suback {
            self.held.push(Held::Router(notification));
            None
        } else {
            Some(notification)
        }
    }

    /// The batch the gate waits for, while it is closed.
    pub fn waiting_for(&self) -> Option<Batch> {
        self.waiting_for
    }

    /// The forwarding ticket the gate waits for, while it is closed.
    pub fn waiting_for_links(&self) -> Option<u64> {
        self.waiting_for_links
    }

    /// Whether the gate is closed.
    pub fn is_closed(&self) -> bool {
        self.waiting_for.is_some() || self.waiting_for_links.is_some()
    }

    /// Whether the connection must stop reading until the disk catches up.
    pub fn is_full(&self) -> bool {
        self.held.len() >= MAX_HELD
    }

    /// Opens the gate: what it held, in order.
    pub fn open(&mut self) -> Vec<Held> {
        self.waiting_for = None;
        self.waiting_for_links = None;
        self.holds_suback = false;
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use router::protocol::{PingResp, PubAck, PubAckReason, SubAck};

    fn ack(pkid: u16) -> Packet {
        Packet::PubAck(
            PubAck {
                pkid,
                reason: PubAckReason::Success,
            },
            None,
        )
    }

    #[test]
    fn holds_until_its_batch_is_done_and_keeps_the_order() {
        let mut gate = Gate::default();
        let mut sent = Vec::new();
        gate.send(ack(1), (None, None), |p| sent.push(p));
        assert_eq!(sent.len(), 1, "nothing to wait for");
        assert_eq!(gate.waiting_for(), None);
        gate.send(ack(3), (Batch::new(5), None), |p| sent.push(p));
        gate.send(Packet::PingResp(PingResp), (None, None), |p| sent.push(p));
        assert_eq!(sent.len(), 1, "held, and what follows it too");
        assert_eq!(gate.waiting_for(), Batch::new(5));
        assert!(
            gate.defer(Notification::Unschedule).is_some(),
            "no SUBACK held"
        );
        let released = gate.open();
        assert!(matches!(
            released[..],
            [
                Held::Ack(Packet::PubAck(..)),
                Held::Ack(Packet::PingResp(_))
            ]
        ));
        assert_eq!(gate.waiting_for(), None);
    }

    #[test]
    fn a_publish_waits_for_the_other_nodes_too() {
        let mut gate = Gate::default();
        let mut sent = Vec::new();
        gate.send(ack(1), (None, Some(7)), |p| sent.push(p));
        gate.send(ack(2), (None, None), |p| sent.push(p));
        assert!(sent.is_empty(), "held, and what follows it too");
        assert!(gate.is_closed());
        assert_eq!(gate.waiting_for_links(), Some(7));
        assert_eq!(gate.waiting_for(), None);
        assert_eq!(gate.open().len(), 2);
        assert!(!gate.is_closed());
    }

    #[test]
    fn what_the_router_sends_waits_behind_a_suback() {
        let mut gate = Gate::default();
        let suback = Packet::SubAck(
            SubAck {
                pkid: 1,
                return_codes: Vec::new(),
            },
            None,
        );
        gate.send(suback, (Batch::new(2), None), |_| panic!("held"));
        assert!(gate.defer(Notification::Unschedule).is_none(), "behind it");
        let released = gate.open();
        assert!(matches!(
            released[..],
            [
                Held::Ack(Packet::SubAck(..)),
                Held::Router(Notification::Unschedule)
            ]
        ));
        assert!(gate.defer(Notification::Unschedule).is_some(), "open again");
    }

    #[test]
    fn reading_stops_while_full() {
        let mut gate = Gate::default();
        for pkid in 1..=MAX_HELD as u16 {
            assert!(!gate.is_full());
            gate.send(ack(pkid), (Batch::new(9), None), |_| panic!("held"));
        }
        assert!(gate.is_full());
        gate.open();
        assert!(!gate.is_full());
    }
}
