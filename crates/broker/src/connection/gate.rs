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
//! `cluster::confirmations`), and a state store request's until its
//! outcome is out (its ticket, see `store::tickets`), in the same way and
//! the same order.
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

/// What an acknowledgement waits for; `None` in each: nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Waits {
    /// A batch the disk does not have yet.
    pub batch: Option<Batch>,
    /// A forwarding ticket the other nodes have not confirmed (a cluster
    /// node's).
    pub links: Option<u64>,
    /// A request's ticket whose outcome is not out (a cluster node's).
    pub outcome: Option<u64>,
}

impl Waits {
    /// Whether anything is waited for.
    pub fn any(&self) -> bool {
        self.batch.is_some() || self.links.is_some() || self.outcome.is_some()
    }

    /// Both: the later of each.
    fn max(self, other: Waits) -> Waits {
        Waits {
            batch: self.batch.max(other.batch),
            links: self.links.max(other.links),
            outcome: self.outcome.max(other.outcome),
        }
    }
}

/// What waits for the disk.
#[derive(Default)]
pub(crate) struct Gate {
    /// What to wait for; nothing: open.
    waits: Waits,
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
    /// Queues `ack` for the client with `out` unless it must wait: for what
    /// `waits` names (what is not done yet of its own), or behind an
    /// earlier acknowledgement that waits.
    pub fn send(&mut self, ack: Packet, waits: Waits, out: impl FnOnce(Packet)) {
        self.waits = self.waits.max(waits);
        if self.waits.any() {
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

    /// What the gate waits for, while it is closed.
    pub fn waits(&self) -> Waits {
        self.waits
    }

    /// Whether the gate is closed.
    pub fn is_closed(&self) -> bool {
        self.waits.any()
    }

    /// Whether the connection must stop reading until the disk catches up.
    pub fn is_full(&self) -> bool {
        self.held.len() >= MAX_HELD
    }

    /// Opens the gate: what it held, in order.
    pub fn open(&mut self) -> Vec<Held> {
        self.waits = Waits::default();
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

    fn batch(n: u64) -> Waits {
        Waits {
            batch: Batch::new(n),
            ..Waits::default()
        }
    }

    #[test]
    fn holds_until_its_batch_is_done_and_keeps_the_order() {
        let mut gate = Gate::default();
        let mut sent = Vec::new();
        gate.send(ack(1), Waits::default(), |p| sent.push(p));
        assert_eq!(sent.len(), 1, "nothing to wait for");
        assert_eq!(gate.waits(), Waits::default());
        gate.send(ack(3), batch(5), |p| sent.push(p));
        gate.send(Packet::PingResp(PingResp), Waits::default(), |p| {
            sent.push(p)
        });
        assert_eq!(sent.len(), 1, "held, and what follows it too");
        assert_eq!(gate.waits().batch, Batch::new(5));
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
        assert_eq!(gate.waits(), Waits::default());
    }

    #[test]
    fn a_publish_waits_for_the_other_nodes_too() {
        let mut gate = Gate::default();
        let mut sent = Vec::new();
        let links = Waits {
            links: Some(7),
            ..Waits::default()
        };
        gate.send(ack(1), links, |p| sent.push(p));
        gate.send(ack(2), Waits::default(), |p| sent.push(p));
        assert!(sent.is_empty(), "held, and what follows it too");
        assert!(gate.is_closed());
        assert_eq!(gate.waits(), links);
        assert_eq!(gate.open().len(), 2);
        assert!(!gate.is_closed());
    }

    #[test]
    fn a_request_waits_for_its_outcome_and_the_later_of_each() {
        let mut gate = Gate::default();
        let outcome = |n| Waits {
            outcome: Some(n),
            ..Waits::default()
        };
        gate.send(ack(1), outcome(3), |_| panic!("held"));
        gate.send(ack(2), batch(4), |_| panic!("held"));
        gate.send(ack(3), outcome(2), |_| panic!("held"));
        assert_eq!(
            gate.waits(),
            Waits {
                batch: Batch::new(4),
                links: None,
                outcome: Some(3),
            }
        );
        assert_eq!(gate.open().len(), 3);
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
        gate.send(suback, batch(2), |_| panic!("held"));
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
            gate.send(ack(pkid), batch(9), |_| panic!("held"));
        }
        assert!(gate.is_full());
        gate.open();
        assert!(!gate.is_full());
    }
}
