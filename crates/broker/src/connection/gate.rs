//! Waiting for the disk: a change that a crash must not take back (a
//! retained message, a persistent session's subscriptions) is durable
//! before the connection acts on it (see [`crate::durable`]).
//!
//! While the gate is closed, the connection hands the router nothing: the
//! publish or SUBSCRIBE that closed it, and what the client sends after it,
//! wait in the link's batch (the connection stops reading when that holds
//! a few hundred packets), so the router's PUBACK or SUBACK comes only
//! after the disk has the change. The acknowledgements the connection
//! makes itself wait too (UNSUBACK here; those of later publishes behind
//! the router's, see `inbound::AckOrder`). Deliveries to the client go on.
//! Retained publishes that follow each other share a group commit.

use std::sync::Arc;

use router::protocol::Packet;

use crate::durable::Durable;

/// What waits for the disk.
pub(crate) struct Gate {
    durable: Option<Arc<Durable>>,
    /// The persistence sequence number to wait for; 0: open.
    seq: u64,
    held: Vec<Packet>,
}

impl Gate {
    /// An open gate; without `durable` (no data directory) it never closes.
    pub fn new(durable: Option<Arc<Durable>>) -> Gate {
        Gate {
            durable,
            seq: 0,
            held: Vec::new(),
        }
    }

    /// The disk, if there is one.
    pub fn durable(&self) -> Option<&Durable> {
        self.durable.as_deref()
    }

    /// Closes the gate until batch `seq` is durable (0: nothing to wait for).
    pub fn close(&mut self, seq: u64) {
        if seq > 0 && self.durable.as_ref().is_some_and(|d| !d.is_durable(seq)) {
            self.seq = self.seq.max(seq);
        }
    }

    /// Whether the connection must wait.
    pub fn is_closed(&self) -> bool {
        self.seq > 0
    }

    /// Holds `packet` for the client while the gate is closed; gives it
    /// back when the gate is open.
    pub fn hold(&mut self, packet: Packet) -> Option<Packet> {
        if self.is_closed() {
            self.held.push(packet);
            None
        } else {
            Some(packet)
        }
    }

    /// Resolves when what the gate waits for is durable (never while open).
    pub async fn durable_now(&self) {
        match &self.durable {
            Some(durable) if self.seq > 0 => durable.wait(self.seq).await,
            _ => std::future::pending().await,
        }
    }

    /// Opens the gate: the packets held for the client.
    pub fn open(&mut self) -> Vec<Packet> {
        self.seq = 0;
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Mode, PersistenceSettings};
    use crate::persistence::{Persistence, Put, Space};
    use router::protocol::PingResp;

    #[test]
    fn without_a_disk_it_never_closes() {
        let mut gate = Gate::new(None);
        gate.close(7);
        assert!(!gate.is_closed());
        assert!(gate.hold(Packet::PingResp(PingResp)).is_some());
    }

    #[tokio::test]
    async fn holds_until_durable() {
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
        // A batch not submitted yet cannot be durable.
        gate.close(seq + 3);
        assert!(gate.is_closed());
        assert!(gate.hold(Packet::PingResp(PingResp)).is_none());
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
        assert_eq!(gate.open().len(), 1, "what was held comes out at open");
        assert!(!gate.is_closed());
        gate.close(0);
        assert!(!gate.is_closed(), "0: nothing to wait for");
    }
}
