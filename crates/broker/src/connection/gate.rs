//! Acknowledgements that wait for the disk.
//!
//! The router saves what a restart must not lose (a retained message, a
//! copy of a publish for persistent sessions, a persistent session's
//! subscriptions; see [`router::Journal`]) as it applies it, and hands the
//! acknowledgement the change asked for (PUBACK, PUBREC, SUBACK, UNSUBACK)
//! back with the journal's receipt. Until the receipt is durable, the gate
//! holds that acknowledgement, and every acknowledgement after it (the
//! client must see them in order, MQTT 4.6): so an acknowledgement still
//! means "on disk". Deliveries to the client go on meanwhile, but for
//! those of a subscription whose SUBACK waits: the router sends a new
//! subscription's retained messages at once, and they must not overtake
//! its SUBACK; so while a SUBACK waits, what the router sends waits behind
//! it (in order: the router wants its deliveries acknowledged in the order
//! it sent them).
//!
//! While it holds [`MAX_HELD`] acknowledgements the connection stops
//! reading: however fast a client sends and however slow the disk, what
//! waits stays bounded.

use std::sync::Arc;

use router::protocol::Packet;
use router::{Notification, Receipt};

use crate::durable::Durable;

/// Acknowledgements a connection may hold for the disk before it stops
/// reading.
pub(crate) const MAX_HELD: usize = 256;

/// What waits for the disk.
pub(crate) struct Gate {
    durable: Option<Arc<Durable>>,
    /// The receipt to wait for; `None`: open.
    waiting_for: Option<Receipt>,
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
    /// An open gate; without `durable` (no data directory) it never closes.
    pub fn new(durable: Option<Arc<Durable>>) -> Gate {
        Gate {
            durable,
            waiting_for: None,
            held: Vec::new(),
            holds_suback: false,
        }
    }

    /// Queues `ack` for the client with `out` unless it must wait: its own
    /// `receipt` is not durable yet, or an earlier acknowledgement waits.
    pub fn send(&mut self, ack: Packet, receipt: Option<Receipt>, out: impl FnOnce(Packet)) {
        if let (Some(receipt), Some(durable)) = (receipt, &self.durable)
            && !durable.is_durable(receipt)
        {
            self.waiting_for = self.waiting_for.max(Some(receipt));
        }
        if self.waiting_for.is_some() {
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

    /// Whether the connection must stop reading until the disk catches up.
    pub fn is_full(&self) -> bool {
        self.held.len() >= MAX_HELD
    }

    /// Resolves when what the gate waits for is durable (never while open).
    pub async fn durable_now(&self) {
        match (&self.durable, self.waiting_for) {
            (Some(durable), Some(receipt)) => durable.wait(receipt).await,
            _ => std::future::pending().await,
        }
    }

    /// Opens the gate: what it held, in order.
    pub fn open(&mut self) -> Vec<Held> {
        self.waiting_for = None;
        self.holds_suback = false;
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Mode, PersistenceSettings};
    use crate::persistence::{Persistence, Put, Space};
    use router::protocol::{PingResp, PubAck, PubAckReason};

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
    fn without_a_disk_it_never_closes() {
        let mut gate = Gate::new(None);
        let mut sent = Vec::new();
        gate.send(ack(1), Receipt::new(7), |p| sent.push(p));
        assert_eq!(sent.len(), 1);
        assert!(!gate.is_full());
    }

    #[tokio::test]
    async fn holds_until_durable_and_keeps_the_order() {
        let dir = tempfile::tempdir().unwrap();
        let (persistence, _) = Persistence::open(&PersistenceSettings {
            data_dir: dir.path().to_owned(),
            mode: Mode::Fsync,
        })
        .unwrap();
        let persistence = Arc::new(persistence);
        let mut gate = Gate::new(Some(Durable::new(Arc::clone(&persistence))));
        let put = |n: u8| Put {
            space: Space::Retained,
            key: vec![n],
            value: Some(vec![n]),
        };
        let seq = persistence.put(vec![put(1)]);
        let mut sent = Vec::new();
        // A batch not submitted yet cannot be durable.
        gate.send(ack(1), Receipt::new(seq + 3), |p| sent.push(p));
        gate.send(Packet::PingResp(PingResp), None, |p| sent.push(p));
        assert!(sent.is_empty(), "held, and what follows it too");
        let wait = std::time::Duration::from_millis(200);
        let waited = tokio::time::timeout(wait, gate.durable_now()).await;
        assert!(waited.is_err(), "not durable: the gate stays closed");
        for n in 2..5 {
            persistence.put(vec![put(n)]);
        }
        let wait = std::time::Duration::from_secs(10);
        tokio::time::timeout(wait, gate.durable_now())
            .await
            .expect("durable once written");
        let released = gate.open();
        assert!(matches!(
            released[..],
            [
                Held::Ack(Packet::PubAck(..)),
                Held::Ack(Packet::PingResp(_))
            ]
        ));
        gate.send(ack(2), Receipt::new(seq), |p| sent.push(p));
        assert_eq!(sent.len(), 1, "durable already: at once");
    }
}
