use std::{
    collections::{HashMap, VecDeque},
    sync::Arc,
};

use flume::{Receiver, Sender};
use parking_lot::Mutex;
use tracing::{error, warn};

use crate::{
    protocol::Packet,
    router::{FilterIdx, MAX_CHANNEL_CAPACITY},
    Cursor, MessageId, Notification,
};

/// A QoS 1/2 publish in flight: its packet id, the log it was read from and
/// where (`None`: a retained message), and the number the journal keeps it
/// under (statebroker patch 16).
type InFlight = (u16, FilterIdx, Option<Cursor>, Option<MessageId>);

use super::{Forward, IncomingMeter, OutgoingMeter};

const MAX_INFLIGHT: usize = 100;
const MAX_PKID: u16 = MAX_INFLIGHT as u16;

/// What a kept session remembers of the publishes it had sent, so that a
/// reconnecting client gets the unacknowledged ones again with their
/// original packet ids and DUP 1, and no QoS 0 publish twice (MQTT 5 4.4,
/// statebroker patch 11).
#[derive(Debug, Default, Clone)]
pub struct Replay {
    /// Packet id of each QoS 1/2 publish in flight, by its log position.
    pkids: HashMap<(FilterIdx, Cursor), u16>,
    /// Per log, the position up to which publishes had been sent.
    sent_up_to: HashMap<FilterIdx, Cursor>,
    /// The last packet id used.
    last_pkid: u16,
    /// Packet ids in flight may be out of sequence: fresh ids skip them.
    irregular: bool,
}

/// The next packet id: 1..=MAX_PKID in turn; after a reconnect, skipping
/// those still in flight or to be sent again.
fn next_pkid(last_pkid: &mut u16, replay: &Replay, inflight: &VecDeque<InFlight>) -> u16 {
    for _ in 0..MAX_PKID {
        *last_pkid = *last_pkid % MAX_PKID + 1;
        let pkid = *last_pkid;
        let taken = replay.irregular
            && (replay.pkids.values().any(|&p| p == pkid)
                || inflight.iter().any(|(p, ..)| *p == pkid));
        if !taken {
            break;
        }
    }
    *last_pkid
}

/// What to do with a publish read again after a reconnect.
enum Seen {
    /// Not sent before the reconnect.
    New,
    /// A QoS 0 publish sent before: not again.
    Sent,
    /// In flight before: again, with this packet id and DUP.
    Resend(u16),
}

impl Replay {
    /// Records that publishes of log `filter_idx` had been sent up to `cursor`.
    pub fn sent_up_to(&mut self, filter_idx: FilterIdx, cursor: Cursor) {
        self.sent_up_to.insert(filter_idx, cursor);
    }

    fn check(&mut self, filter_idx: FilterIdx, cursor: Option<Cursor>, qos0: bool) -> Seen {
        let Some(cursor) = cursor else {
            return Seen::New;
        };
        let Some(&up_to) = self.sent_up_to.get(&filter_idx) else {
            return Seen::New;
        };
        if cursor >= up_to {
            self.sent_up_to.remove(&filter_idx);
            if self.sent_up_to.is_empty() {
                // Whatever was not read again is gone from the log.
                self.pkids.clear();
            }
            return Seen::New;
        }
        if qos0 {
            return Seen::Sent;
        }
        match self.pkids.remove(&(filter_idx, cursor)) {
            Some(pkid) => Seen::Resend(pkid),
            None => Seen::New,
        }
    }
}

#[derive(Debug)]
pub struct Incoming {
    /// Identifier associated with connected client
    pub(crate) client_id: String,
    /// Recv buffer
    pub(crate) buffer: Arc<Mutex<VecDeque<Packet>>>,
    /// incoming metrics
    pub(crate) meter: IncomingMeter,
}

impl Incoming {
    #[inline]
    pub(crate) fn new(client_id: String) -> Self {
        Self {
            buffer: Arc::new(Mutex::new(VecDeque::with_capacity(MAX_CHANNEL_CAPACITY))),
            meter: Default::default(),
            client_id,
        }
    }

    #[inline]
    pub(crate) fn buffer(&self) -> Arc<Mutex<VecDeque<Packet>>> {
        self.buffer.clone()
    }

    #[inline]
    pub(crate) fn exchange(&mut self, mut v: VecDeque<Packet>) -> VecDeque<Packet> {
        std::mem::swap(&mut v, &mut self.buffer.lock());
        v
    }
}

#[derive(Debug)]
pub struct Outgoing {
    /// Identifier associated with connected client
    pub(crate) client_id: String,
    /// Send buffer
    pub(crate) data_buffer: Arc<Mutex<VecDeque<Notification>>>,
    /// Handle which is given to router to allow router to communicate with this connection
    pub(crate) handle: Sender<()>,
    /// The buffer to keep track of inflight packets.
    inflight_buffer: VecDeque<InFlight>,
    /// PubRels waiting for PubComp
    pub(crate) unacked_pubrels: VecDeque<u16>,
    /// Last packet id
    last_pkid: u16,
    /// Publishes to send again after a reconnect (statebroker patch 11).
    replay: Replay,
    /// Metrics of outgoing messages of this connection
    pub(crate) meter: OutgoingMeter,
}

impl Outgoing {
    #[inline]
    pub(crate) fn new(client_id: String) -> (Self, Receiver<()>) {
        let (handle, rx) = flume::bounded(MAX_CHANNEL_CAPACITY);
        let data_buffer = VecDeque::with_capacity(MAX_CHANNEL_CAPACITY);
        let inflight_buffer = VecDeque::with_capacity(MAX_INFLIGHT);
        let unacked_pubrels = VecDeque::with_capacity(MAX_INFLIGHT);

        // Ensure that there won't be any new allocations
        assert!(MAX_INFLIGHT <= inflight_buffer.capacity());
        assert!(MAX_CHANNEL_CAPACITY <= data_buffer.capacity());

        let outgoing = Self {
            client_id,
            data_buffer: Arc::new(Mutex::new(data_buffer)),
            inflight_buffer,
            unacked_pubrels,
            handle,
            last_pkid: 0,
            replay: Replay::default(),
            meter: Default::default(),
        };

        (outgoing, rx)
    }

    #[inline]
    pub(crate) fn buffer(&self) -> Arc<Mutex<VecDeque<Notification>>> {
        self.data_buffer.clone()
    }

    pub fn free_slots(&self) -> usize {
        MAX_INFLIGHT - self.inflight_buffer.len()
    }

    pub fn push_notification(&mut self, notification: Notification) -> usize {
        let mut buffer = self.data_buffer.lock();
        buffer.push_back(notification);
        buffer.len()
    }

    /// Push packets to the outgoing buffer. Each publish goes out at its own
    /// QoS (statebroker: the smaller of the publish's and the
    /// subscription's, set by the caller); only QoS 1 and 2 publishes take a
    /// packet id and an inflight slot. Saved messages sent at QoS 0 are
    /// delivered as they go: their numbers are added to `delivered`
    /// (statebroker patch 16).
    pub fn push_forwards(
        &mut self,
        publishes: impl Iterator<Item = Forward>,
        _qos: u8,
        filter_idx: usize,
        delivered: &mut Vec<MessageId>,
    ) -> (usize, usize) {
        let mut buffer = self.data_buffer.lock();

        for mut p in publishes {
            let qos0 = p.publish.qos == crate::protocol::QoS::AtMostOnce;
            let seen = if self.replay.sent_up_to.is_empty() {
                Seen::New
            } else {
                self.replay.check(filter_idx, p.cursor, qos0)
            };
            self.meter.publish_count += 1;
            // A delivery's DUP is its own: set on what is sent again, never
            // the publisher's (statebroker patch 45, [MQTT-3.3.1-3]; on QoS
            // 0 it would be malformed, [MQTT-3.3.1-2]).
            p.publish.dup = false;
            if qos0 {
                if matches!(seen, Seen::Sent) {
                    continue;
                }
                p.publish.pkid = 0;
                delivered.extend(p.queued);
                buffer.push_back(Notification::Forward(p));
                continue;
            }

            // Index and pkid of current outgoing packet
            let pkid = match seen {
                Seen::Resend(pkid) => {
                    p.publish.dup = true;
                    pkid
                }
                _ => next_pkid(&mut self.last_pkid, &self.replay, &self.inflight_buffer),
            };
            p.publish.pkid = pkid;

            self.inflight_buffer
                .push_back((pkid, filter_idx, p.cursor, p.queued));

            self.meter.total_size += p.publish.topic.len() + p.publish.payload.len();
            buffer.push_back(Notification::Forward(p));
        }

        let buffer_count = buffer.len();
        let inflight_count = self.inflight_buffer.len();

        if inflight_count > MAX_INFLIGHT {
            warn!(
                "More inflight publishes than max allowed, inflight count = {}, max allowed = {}",
                inflight_count, MAX_INFLIGHT
            );
        }

        (buffer_count, inflight_count)
    }

    /// What a kept session must remember of this connection's deliveries
    /// (`sent_up_to` is filled in by the caller, from its data requests).
    pub fn replay_state(&self) -> Replay {
        let pkids = self
            .inflight_buffer
            .iter()
            .filter(|(_, idx, ..)| *idx != usize::MAX)
            .filter_map(|(pkid, idx, cursor, _)| cursor.map(|c| ((*idx, c), *pkid)))
            .collect();
        Replay {
            pkids,
            sent_up_to: HashMap::new(),
            last_pkid: self.last_pkid,
            irregular: true,
        }
    }

    /// Resumes a kept session's deliveries.
    pub fn resume(&mut self, replay: Replay) {
        self.last_pkid = replay.last_pkid;
        self.replay = replay;
    }

    // Returns (unsolicited, outoforder) flags
    // Return: Out of order or unsolicited acks
    /// `Some`: the acknowledgement was in order; with the number the journal
    /// keeps the acknowledged message under, if it does (statebroker
    /// patch 16).
    pub fn register_ack(&mut self, pkid: u16) -> Option<Option<MessageId>> {
        let (head, _filter_idx, _cursor, queued) = self.inflight_buffer.pop_front()?;
        if self.inflight_buffer.is_empty() && self.replay.sent_up_to.is_empty() {
            self.replay.irregular = false;
        }

        // We don't support out of order acks
        if pkid != head {
            error!(pkid, head, "out of order ack.");
            return None;
        }

        Some(queued)
    }

    pub fn register_pubrec(&mut self, pkid: u16) {
        // NOTE: we can return true of false
        // to indicate whether this is duplicate or not
        self.unacked_pubrels.push_back(pkid);
    }

    // OASIS standards don't specify anything about ordering of PubComp
    // https://docs.oasis-open.org/mqtt/mqtt/v5.0/os/mqtt-v5.0-os.html#_Toc3901240
    // But we don't support out of order / unsolicited pubcomps
    // to be consistent with the behaviour with other acks
    pub fn register_pubcomp(&mut self, pkid: u16) -> Option<()> {
        let id = self.unacked_pubrels.pop_front()?;

        // out of order acks
        if pkid != id {
            error!(pkid, id, "out of order ack.");
            return None;
        }

        Some(())
    }

    /// The log at `filter_idx` was freed: publishes of it still in flight
    /// keep their place for acknowledgement order, but no longer point at
    /// a log whose index may be reused (statebroker patch 8).
    pub fn forget_filter(&mut self, filter_idx: FilterIdx) {
        self.replay.sent_up_to.remove(&filter_idx);
        self.replay.pkids.retain(|(idx, _), _| *idx != filter_idx);
        for (_, idx, cursor, _) in self.inflight_buffer.iter_mut() {
            if *idx == filter_idx {
                *idx = usize::MAX;
                *cursor = None;
            }
        }
    }

    /// The cursor of the first unacknowledged delivery read from the log at
    /// `filter_idx`: where a reconnecting session reads again (statebroker
    /// patch 23).
    pub fn first_unacked(&self, filter_idx: FilterIdx) -> Option<Cursor> {
        self.inflight_buffer
            .iter()
            .find(|(_, idx, cursor, _)| *idx == filter_idx && cursor.is_some())
            .and_then(|(_, _, cursor, _)| *cursor)
    }

    // Here we are assuming that the first unique filter_idx we find while iterating will have the
    // least corresponding cursor because of the way we insert into the inflight_buffer
    pub fn retransmission_map(&self) -> HashMap<FilterIdx, Cursor> {
        let mut o = HashMap::new();
        for (_, filter_idx, cursor, _) in self.inflight_buffer.iter() {
            // if cursor in None, it means it was a retained publish
            if !o.contains_key(filter_idx) && cursor.is_some() {
                o.insert(*filter_idx, cursor.unwrap());
            }
        }

        o
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn retransmission_map_is_calculated_accurately() {
        let (mut outgoing, _) = Outgoing::new("retransmission-test".to_string());
        let mut result = HashMap::new();

        result.insert(0, (0, 8));
        result.insert(1, (0, 1));
        result.insert(2, (1, 1));
        result.insert(3, (1, 0));

        let buf = vec![
            (1, 0, Some((0, 8)), None),
            (1, 0, Some((0, 10)), None),
            (1, 1, Some((0, 1)), None),
            (3, 1, Some((0, 4)), None),
            (2, 2, Some((1, 1)), None),
            (1, 2, Some((2, 6)), None),
            (1, 2, Some((2, 1)), None),
            (1, 3, Some((1, 0)), None),
            (1, 3, Some((1, 1)), None),
            (1, 3, Some((1, 3)), None),
            (1, 3, Some((1, 3)), None),
        ];

        outgoing.inflight_buffer.extend(buf);
        assert_eq!(outgoing.retransmission_map(), result);
    }

    // use super::{Outgoing, MAX_INFLIGHT};
    // use crate::protocol::{Publish, QoS};
    // use crate::router::Forward;
    // use crate::Notification;
    //
    // fn publishes(count: usize) -> impl Iterator<Item = Forward> {
    //     (1..=count).map(|v| {
    //         let publish = Publish {
    //             dup: false,
    //             retain: false,
    //             pkid: 0,
    //             qos: QoS::AtLeastOnce,
    //             topic: "hello/world".into(),
    //             payload: vec![1, 2, 3].into(),
    //         };
    //
    //         Forward {
    //             cursor: (0, v as u64),
    //             publish,
    //             size: 0,
    //         }
    //     })
    // }
    //
    // #[test]
    // fn inflight_ring_buffer_pushes_correctly() {
    //     let count = MAX_INFLIGHT as usize;
    //     let (mut outgoing, _rx) = Outgoing::new("hello".to_owned());
    //     outgoing.push_forwards(publishes(count), 1, 3);
    //
    //     // Index 1 = (0, 1), Index 99 = (0, 99), Index 0 = (0, 100)
    //     assert_eq!(outgoing.inflight_buffer[0].unwrap().1, (0, count as u64));
    //     for i in 1..count {
    //         assert_eq!(outgoing.inflight_buffer[i].unwrap().1, (0, i as u64));
    //     }
    //
    //     // Outgoing publish pkids are as expected
    //     for (i, o) in outgoing.data_buffer.lock().iter().enumerate() {
    //         let pkid = match &o {
    //             Notification::Forward(f) => f.publish.pkid,
    //             _ => unreachable!(),
    //         };
    //
    //         assert_eq!(pkid, i as u16 + 1);
    //     }
    // }
    //
    // #[test]
    // fn inflight_ring_buffer_pops_correctly() {
    //     let (mut outgoing, _rx) = Outgoing::new("hello".to_owned());
    //     outgoing.push_forwards(publishes(MAX_INFLIGHT as usize), 1, 3);
    //
    //     for pkid in 1..=MAX_INFLIGHT {
    //         let (unsolicited, outoforder) = outgoing.register_ack(pkid);
    //         assert_eq!(unsolicited, false);
    //         assert_eq!(outoforder, false);
    //     }
    // }
}
