//! The direct deliveries' window (state store answers and
//! notifications, messages handed over by another node): their packet
//! ids above the router's, those in flight, those waiting for room.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use super::{FIRST_DIRECT_PKID, PacketIds, is_direct};
use crate::codec::{self, Protocol};
use crate::sessions::{Answer, Direct, DirectProperties, QueueBound};

/// Direct deliveries in flight to this client, and those waiting for
/// room.
#[derive(Debug)]
pub(crate) struct DirectWindow {
    /// Sent at QoS 1 (or, under a kept id, 2), not yet acknowledged (a
    /// QoS 2 one: completed), by packet id.
    inflight: HashMap<u16, Sent, PacketIds>,
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
        if !self.fits(out, start, message.qos) {
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
        if pkid == 0 {
            finished(&self.bound, &message);
        } else {
            self.inflight.insert(pkid, Sent::Message(Box::new(message)));
        }
        true
    }

    /// Encodes `answer` into `out` as [`Self::send`] would encode its
    /// message ([`Answer::into_direct`]), or (at QoS 1 without `room`)
    /// holds that message. In flight it is kept, if the session is `kept`
    /// beyond the connection, as the PUBLISH encoded (one copy of the
    /// bytes written), not as a message: the message is made again from
    /// those bytes only if the connection ends first
    /// ([`Self::take_unacknowledged`]). A session that ends with its
    /// connection gets nothing again (MQTT 5 3.1.2.11.2), so only the
    /// answer's size is kept. `false`: larger than the client accepts,
    /// discarded. (By reference, not moved in: a held answer's parts are
    /// taken out, [`Answer::take_direct`].)
    pub fn send_answer(
        &mut self,
        answer: &mut Answer,
        kept: bool,
        protocol: Protocol,
        out: &mut BytesMut,
        room: bool,
    ) -> bool {
        // Only MQTT 5 has the properties to make it again from.
        if (answer.qos > 0 && !room) || protocol != Protocol::V5 {
            return self.send(answer.take_direct(), protocol, out, room);
        }
        let pkid = if answer.qos == 0 { 0 } else { self.next_pkid() };
        let start = out.len();
        codec::encode_publish(
            protocol,
            &answer.topic,
            &answer.payload,
            answer.qos,
            pkid,
            &answer.properties(),
            out,
        );
        let size = answer.size();
        if !self.fits(out, start, answer.qos) {
            self.bound.release(size);
            return false;
        }
        if pkid == 0 {
            self.bound.release(size);
        } else {
            let packet = kept.then(|| Bytes::copy_from_slice(&out[start..]));
            self.inflight.insert(pkid, Sent::Answer { packet, size });
        }
        true
    }

    /// Whether the PUBLISH at `qos` just encoded into `out` (from `start`)
    /// is within the client's Maximum Packet Size: then counted as sent;
    /// else taken back out, for the caller to discard.
    fn fits(&self, out: &mut BytesMut, start: usize, qos: u8) -> bool {
        let len = out.len() - start;
        if len > self.max_packet_size {
            out.truncate(start);
            return false;
        }
        crate::metrics::sent(qos, len);
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
                done.finished(&self.bound);
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
                done.finished(&self.bound);
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
        let mut sent: Vec<(u16, Sent)> = self.inflight.drain().collect();
        sent.sort_unstable_by_key(|(pkid, _)| (is_direct(*pkid), age(*pkid)));
        let mut all: Vec<Direct> = sent
            .into_iter()
            .filter_map(|(_, sent)| sent.into_direct(self.max_packet_size))
            .collect();
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

/// A direct delivery in flight. (A message boxed: an answer's entry is
/// moved in and out of the map with each request, at its variant's size
/// or the largest.)
#[derive(Debug)]
enum Sent {
    Message(Box<Direct>),
    /// A state store answer, as the PUBLISH encoded (`None`: the session
    /// ends with the connection; see [`DirectWindow::send_answer`]), and
    /// its size in the bound.
    Answer {
        packet: Option<Bytes>,
        size: usize,
    },
}

impl Sent {
    /// The client acknowledged it (see [`finished`]).
    fn finished(self, bound: &QueueBound) {
        match self {
            Sent::Message(message) => finished(bound, &message),
            Sent::Answer { size, .. } => bound.release(size),
        }
    }

    /// The message, for the session to get later. An answer is read back
    /// from its PUBLISH by the decoder that reads the clients' (it wrote
    /// it: it reads; `None`, logged, if it ever did not). `None` for an
    /// answer of a session that ends with the connection.
    fn into_direct(self, max_packet_size: usize) -> Option<Direct> {
        let packet = match self {
            Sent::Message(message) => return Some(*message),
            Sent::Answer { packet, .. } => packet?,
        };
        let mut buf = BytesMut::from(&packet[..]);
        match Protocol::V5.read(&mut buf, max_packet_size.max(packet.len())) {
            Ok(Some(crate::codec::Incoming {
                packet: router::protocol::Packet::Publish(publish, properties),
                ..
            })) => Some(Direct {
                topic: publish.topic,
                payload: publish.payload,
                properties: properties.unwrap_or_default().into(),
                qos: publish.qos as u8,
                handed_over: false,
                retain: false,
                kept_pkid: None,
                on_done: None,
            }),
            other => {
                tracing::error!(?other, "an answer in flight could not be read back: lost");
                None
            }
        }
    }
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
