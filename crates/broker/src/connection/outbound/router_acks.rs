//! The router's QoS 1/2 deliveries to one client not acknowledged yet,
//! and the acknowledgements the connection owes the router for those it
//! withheld from the client (see the module above).

use std::collections::VecDeque;

use router::protocol::{Packet, PubAck, PubAckReason};

/// QoS 1/2 publishes from the router not yet acknowledged by the client, in
/// the order they were sent.
#[derive(Debug, Default)]
pub(crate) struct RouterAcks {
    /// `(packet id, dropped here)`.
    inflight: VecDeque<(u16, bool)>,
}

impl RouterAcks {
    /// The router's publish `pkid` was sent to the client, or (`dropped`)
    /// withheld from it. Acknowledgements owed to the router go to `to_router`.
    pub fn sent(&mut self, pkid: u16, dropped: bool, to_router: &mut Vec<Packet>) {
        self.inflight.push_back((pkid, dropped));
        self.acknowledge_dropped(to_router);
    }

    /// The client acknowledged `pkid` (PUBACK, or PUBREC at QoS 2); the
    /// connection forwards that acknowledgement itself.
    pub fn acknowledged(&mut self, pkid: u16, to_router: &mut Vec<Packet>) {
        if let Some(at) = self
            .inflight
            .iter()
            .position(|&(id, dropped)| id == pkid && !dropped)
        {
            self.inflight.remove(at);
        }
        self.acknowledge_dropped(to_router);
    }

    /// The router's publish `pkid`, sent (held for room), is not going to
    /// the client after all (it expired while held): done with, as a
    /// dropped one.
    pub fn drop_sent(&mut self, pkid: u16, to_router: &mut Vec<Packet>) {
        if let Some(entry) = self
            .inflight
            .iter_mut()
            .find(|(id, dropped)| *id == pkid && !*dropped)
        {
            entry.1 = true;
        }
        self.acknowledge_dropped(to_router);
    }

    /// Acknowledges to the router the dropped publishes now at the front:
    /// rumqttd, like MQTT, expects acknowledgements in order.
    fn acknowledge_dropped(&mut self, to_router: &mut Vec<Packet>) {
        while let Some(&(pkid, true)) = self.inflight.front() {
            self.inflight.pop_front();
            to_router.push(Packet::PubAck(
                PubAck {
                    pkid,
                    reason: PubAckReason::Success,
                },
                None,
            ));
        }
    }
}
