//! The direct deliveries' window (state store answers and
//! notifications, messages handed over by another node): their packet
//! ids above the router's, those in flight, those waiting for room.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use bytes::BytesMut;

use super::{FIRST_DIRECT_PKID, PacketIds, is_direct};
use crate::codec::{self, Protocol};
use crate::sessions::{Direct, DirectProperties, QueueBound};

/// Direct deliveries in flight to this client, and those waiting for
/// room.
#[derive(Debug)]
pub(crate) struct DirectWindow {
    /// Sent at QoS 1 (or, under a kept id, 2), not yet acknowledged (a
    /// QoS 2 one: completed), by packet id.
    inflight: HashMap<u16, Direct, PacketIds>,
    /// Kept ids in flight whose PUBREC came (until PUBCOMP).
    released: HashSet<u16, PacketIds>,
    /// Waiting for room under the client's Receive Maximum.
    pending: VecDeque<Direct>,
    /// The last packet id taken (the module's tests move it to the end of
    /// the ring).
    pub(super) last_pkid: u16,
    /// The client's Maximum Packet Size.
    max_packet_size: usize,
    /// Room taken by each message until it is done with.
    bound: Arc<QueueBound>,
}

impl DirectWindow {
    /// A window for a client that accepts packets up to `max_packet_size`.
    pub fn new(max_packet_size: usize, bound: Arc<QueueBound>) -> DirectWindow {
        DirectWindow {
            bound,
            inflight: HashMap::default(),
            released: HashSet::default(),
            pending: VecDeque::new(),
            last_pkid: FIRST_DIRECT_PKID - 1,
            max_packet_size,
        }
    }

    /// Direct deliveries written and not yet acknowledged.
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Whether direct delivery `pkid` is in flight.
    pub fn is_in_flight(&self, pkid: u16) -> bool {
        self.inflight.contains_key(&pkid)
    }

    /// Whether deliveries wait for room.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The client PUBREC'd the handed-over QoS 2 message under kept id
    /// `pkid`: it has it, and its PUBCOMP is to come.
    pub(super) fn released(&mut self, pkid: u16) {
        self.released.insert(pkid);
    }

    /// Whether kept id `pkid` was PUBREC'd and waits for its PUBCOMP.
    pub(super) fn is_released(&self, pkid: u16) -> bool {
        self.released.contains(&pkid)
    }

    /// Kept id `pkid`'s exchange is over (PUBCOMP, or a refusing PUBREC).
    pub(super) fn completed(&mut self, pkid: u16) {
        self.released.remove(&pkid);
    }

    /// The oldest delivery waiting for room.
    pub fn next_pending(&mut self) -> Option<Direct> {
        self.pending.pop_front()
    }

    /// Whether `pkid` is a handed-over QoS 2 message's kept id in flight.
    pub(super) fn is_kept(&self, pkid: u16) -> bool {
        !is_direct(pkid) && self.inflight.contains_key(&pkid)
    }

    /// Encodes `message` into `out` at its QoS, with a packet id of the
    /// direct range (or its kept id, with DUP: see
    /// [`Direct::kept_pkid`]), or (QoS 1/2 without `room`) holds it.
    /// `false`: the message is larger than the client accepts and was
    /// discarded.
    pub fn send(
        &mut self,
        mut message: Direct,
        protocol: Protocol,
        out: &mut BytesMut,
        room: bool,
    ) -> bool {
        let pkid = match (message.qos, message.kept_pkid) {
            (0, _) => 0,
            _ if !room => {
                self.pending.push_back(message);
                return true;
            }
            (2, Some(kept)) if !self.inflight.contains_key(&kept) => kept,
            _ => {
                // QoS 2 goes only under a kept id: one handed over twice
                // under the same id goes as a new message.
                message.qos = message.qos.min(1);
                message.kept_pkid = None;
                self.next_pkid()
            }
        };
        let start = out.len();
        // A handed-over message keeps its stamp (see `cluster::stamps`),
        // which no client gets.
        let unstamped = message
            .handed_over
            .then(|| unstamped(&message.properties))
            .flatten();
        codec::encode_publish(
            protocol,
            &message.topic,
            &message.payload,
            message.qos,
            pkid,
            unstamped.as_ref().unwrap_or(&message.properties),
            out,
        );
        if out.len() - start > self.max_packet_size {
            out.truncate(start);
            finished(&self.bound, &message);
            return false;
        }
        if message.kept_pkid.is_some() {
            // DUP (MQTT 5 3.3.1.1): the client may have had it.
            out[start] |= 0b1000;
        }
        if message.retain {
            out[start] |= 0b0001;
        }
        crate::metrics::sent(message.qos, out.len() - start);
        if pkid == 0 {
            finished(&self.bound, &message);
        } else {
            self.inflight.insert(pkid, message);
        }
        true
    }

    fn next_pkid(&mut self) -> u16 {
        let mut pkid = self.last_pkid;
        loop {
            pkid = if pkid == u16::MAX {
                FIRST_DIRECT_PKID
            } else {
                pkid + 1
            };
            if !self.inflight.contains_key(&pkid) {
                break;
            }
        }
        self.last_pkid = pkid;
        pkid
    }

    /// The client acknowledged direct delivery `pkid`; `false` if it was
    /// not one in flight.
    pub fn acknowledged(&mut self, pkid: u16) -> bool {
        match self.inflight.remove(&pkid) {
            Some(done) => {
                finished(&self.bound, &done);
                true
            }
            None => false,
        }
    }

    /// Everything sent and not acknowledged, in the order it was sent
    /// (handed-over QoS 2 ones under their kept ids first: they came
    /// first), then everything still waiting. A kept id's message the
    /// client has PUBREC'd is not among them: the client has it (its
    /// PUBREL is not sent again, as a node that hands a session over does
    /// not pass on the router's).
    pub fn take_unacknowledged(&mut self) -> Vec<Direct> {
        for pkid in self.released.drain() {
            if let Some(done) = self.inflight.remove(&pkid) {
                // PUBREC'd: the client has it.
                finished(&self.bound, &done);
            }
        }
        // Ids go out in turn around FIRST_DIRECT_PKID..=u16::MAX: the
        // oldest in flight is the first after the last one used.
        // (`last_pkid` is FIRST_DIRECT_PKID - 1 before the first.)
        let ring = i32::from(u16::MAX - FIRST_DIRECT_PKID) + 1;
        let last = i32::from(self.last_pkid) - i32::from(FIRST_DIRECT_PKID);
        let age = |pkid: u16| {
            (i32::from(pkid) - i32::from(FIRST_DIRECT_PKID) - last - 1).rem_euclid(ring)
        };
        let mut sent: Vec<(u16, Direct)> = self.inflight.drain().collect();
        sent.sort_unstable_by_key(|(pkid, _)| (is_direct(*pkid), age(*pkid)));
        let mut all: Vec<Direct> = sent.into_iter().map(|(_, m)| m).collect();
        all.extend(self.pending.drain(..));
        all
    }
}

/// `message` needs no room in the connection's queue any more, nor a copy
/// anywhere: its room in `bound` is freed and its [`Direct::done`] runs.
fn finished(bound: &QueueBound, message: &Direct) {
    bound.release(message.size());
    message.done();
}

/// `properties` without their [`crate::publisher::STAMP`], if they have
/// one.
fn unstamped(properties: &DirectProperties) -> Option<DirectProperties> {
    let DirectProperties::Publish(p) = properties else {
        return None;
    };
    let stamped = p
        .user_properties
        .iter()
        .any(|(k, _)| k == crate::publisher::STAMP);
    stamped.then(|| {
        let mut p = p.clone();
        crate::publisher::unstamp(&mut p);
        DirectProperties::Publish(p)
    })
}
