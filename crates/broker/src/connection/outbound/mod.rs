//! What goes to the client at QoS 1/2 and is waiting for its
//! acknowledgement.
//!
//! Two sources send publishes to a client, and they share its packet ids:
//!
//! - **the router** numbers its deliveries `1..=`[`router::MAX_ROUTER_PKID`] and
//!   wants their acknowledgements in order; the client sees them in the
//!   session's block of ids ([`PacketIdBlock`]: the router's id plus the
//!   block's base, taken off again by [`Outbound::router_pkid`]). The connection drops some of them
//!   (another client's notifications reached through a wildcard); those are
//!   acknowledged to the router by the connection, in their turn:
//!   [`RouterAcks`];
//! - **direct deliveries** (state store answers and notifications, see
//!   [`crate::sessions`]) use the ids above the router's: [`DirectWindow`].
//!   So do messages another cluster node handed over; a QoS 2 one it had
//!   in flight to the client goes again under the id the client may keep
//!   for it (the old node's block, not this one's), with DUP, and its
//!   PUBREC / PUBREL / PUBCOMP are finished here ([`Outbound::kept_ack`]).
//!
//! [`Outbound`] puts both together within the client's limits: at most
//! Receive Maximum QoS 1/2 publishes unacknowledged from both sources
//! together (MQTT 5 3.3.4; a QoS 2 one until its PUBCOMP), the rest held in
//! order until acknowledgements make room; and no packet over the client's
//! Maximum Packet Size (such a publish is discarded for it, 3.1.2.11.4,
//! counted and logged once). The router's publishes use topic aliases
//! when the client accepts them ([`TopicAliases`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use router::protocol::{Packet, PubRel, PubRelReason};

use crate::codec::{self, Protocol};
use crate::sessions::{Answer, Direct, PacketIdBlock, QueueBound, ToConnection};

/// The first packet id of direct deliveries: above every block of the
/// router's.
pub(crate) const FIRST_DIRECT_PKID: u16 = PacketIdBlock::END;

/// Whether a client's PUBACK for `pkid` is for a direct delivery.
pub(crate) fn is_direct(pkid: u16) -> bool {
    pkid >= FIRST_DIRECT_PKID
}

/// How the maps keyed by packet id hash: FxHash (`rustc-hash`, a multiply
/// for a `u16`) rather than SipHash (about 120 instructions per look-up,
/// three per state store request). SipHash's key stops a client from
/// choosing keys that collide; these maps hold only ids the broker chose
/// (a client's acknowledgement can look one up or remove it, not add
/// one), at most the client's Receive Maximum of them.
type PacketIds = rustc_hash::FxBuildHasher;

/// Everything the connection sends the client at QoS 1/2, and the limits it
/// sends within.
#[derive(Debug)]
pub(crate) struct Outbound {
    router: RouterAcks,
    direct: DirectWindow,
    /// The client's Receive Maximum.
    receive_maximum: usize,
    /// The router's publishes written and not yet completed.
    router_in_flight: usize,
    /// The router's QoS 2 publishes the client has PUBREC'd (in flight
    /// until PUBCOMP).
    router_released: HashSet<u16, PacketIds>,
    /// The QoS of the router's publishes written and not yet PUBACK'd or
    /// PUBREC'd, by packet id: which acknowledgement each wants (4.3).
    router_qos: HashMap<u16, u8, PacketIds>,
    /// The router's QoS 1/2 publishes, encoded, waiting for room.
    held: VecDeque<HeldPublish>,
    max_packet_size: usize,
    /// Publishes discarded as larger than the client accepts.
    discarded: u64,
    client_id: String,
    /// Topic aliases of the router's publishes to this client.
    aliases: TopicAliases,
    /// The ids the client sees for the router's.
    ids: PacketIdBlock,
}

/// A router's publish encoded and waiting for the client's Receive
/// Maximum to have room.
#[derive(Debug)]
struct HeldPublish {
    bytes: Bytes,
    /// The router's packet id.
    pkid: u16,
    /// Its Message Expiry Interval (MQTT 5): since when it waits, the
    /// interval then (seconds), and where the interval is in `bytes`: it
    /// goes reduced by the time it waited, or not at all once expired
    /// ([MQTT-3.3.2-5], [MQTT-3.3.2-6]).
    expiry: Option<(std::time::Instant, u32, usize)>,
}

impl Outbound {
    pub fn new(
        client_id: &str,
        receive_maximum: u16,
        max_packet_size: usize,
        bound: Arc<QueueBound>,
        client_topic_alias_max: u16,
        ids: PacketIdBlock,
    ) -> Outbound {
        Outbound {
            ids,
            router: RouterAcks::default(),
            direct: DirectWindow::new(max_packet_size, bound),
            receive_maximum: usize::from(receive_maximum.max(1)),
            router_in_flight: 0,
            router_released: HashSet::default(),
            router_qos: HashMap::default(),
            held: VecDeque::new(),
            max_packet_size,
            discarded: 0,
            client_id: client_id.to_owned(),
            aliases: TopicAliases::new(client_topic_alias_max),
        }
    }

    /// The client's Maximum Packet Size.
    pub fn max_packet_size(&self) -> usize {
        self.max_packet_size
    }

    /// The router's packet id for the client's acknowledgement of its
    /// delivery `pkid` (below [`FIRST_DIRECT_PKID`]); `None`: not an id of
    /// this session's block (one a node the session left had used, or
    /// made up).
    pub fn router_pkid(&self, pkid: u16) -> Option<u16> {
        self.ids.to_router(pkid)
    }

    /// The id the client sees for the router's packet id `pkid`.
    pub fn client_pkid(&self, pkid: u16) -> u16 {
        self.ids.to_client(pkid)
    }

    /// QoS 1/2 publishes written and not yet acknowledged, from both sources.
    pub fn in_flight(&self) -> usize {
        self.router_in_flight + self.direct.in_flight()
    }

    /// Whether one more QoS 1/2 publish may go out now.
    fn room(&self) -> bool {
        self.in_flight() < self.receive_maximum
    }

    /// A publish from the router: encoded into `out` (its packet id in the
    /// session's block) unless `withheld` (a notification of another
    /// client's) or too large for the client, and held while the client's
    /// Receive Maximum is reached. Acknowledgements owed to the router go
    /// to `to_router`. Returns the router's packet id of a publish the
    /// client will acknowledge (`None`: sent at QoS 0, or not at all).
    pub fn forward(
        &mut self,
        mut publish: Packet,
        withheld: bool,
        protocol: Protocol,
        out: &mut BytesMut,
        to_router: &mut Vec<Packet>,
    ) -> Option<u16> {
        let start = out.len();
        // A publish held for room goes out after later QoS 0 ones: it may
        // use an alias the client knows, not bring a new one.
        // Only a publish with a Message Expiry Interval has one to find
        // in its bytes if it is held (most have none: no parse for them).
        let expires = matches!(
            &publish,
            Packet::Publish(_, Some(p)) if p.message_expiry_interval.is_some()
        );
        let now = match &mut publish {
            Packet::Publish(p, properties) => {
                if let Some(properties) = properties {
                    crate::publisher::unstamp(properties);
                }
                p.pkid = self.ids.to_client(p.pkid);
                p.qos == router::protocol::QoS::AtMostOnce || (self.held.is_empty() && self.room())
            }
            _ => true,
        };
        let (publish, new_alias) = if withheld {
            (publish, None)
        } else {
            self.aliases.apply(publish, now)
        };
        if let Err(e) = protocol.write(publish, out) {
            tracing::warn!(error = %e, "dropping a publish that cannot be encoded");
        }
        let id = codec::encoded_publish_id(&out[start..]);
        let too_large = out.len() - start > self.max_packet_size;
        if too_large && let Some(topic) = new_alias {
            // The client never learns that alias.
            self.aliases.unassign(&topic);
        }
        self.count_discarded(u64::from(too_large));
        let dropped = withheld || too_large;
        if dropped {
            out.truncate(start);
        } else if let Some((qos, _)) = id {
            crate::metrics::sent(qos, out.len() - start);
        }
        let (qos, pkid) = id.filter(|&(qos, _)| qos > 0)?;
        let pkid = self.ids.to_router(pkid)?;
        self.router.sent(pkid, dropped, to_router);
        if dropped {
            return None;
        }
        self.router_qos.insert(pkid, qos);
        if self.held.is_empty() && self.room() {
            self.router_in_flight += 1;
        } else {
            // In order, after what already waits.
            let bytes = out.split_off(start).freeze();
            self.hold(bytes, pkid, expires && protocol == Protocol::V5);
        }
        Some(pkid)
    }

    /// The client acknowledged the router's publish `pkid`: PUBACK, or
    /// PUBREC (`qos2`: in flight until PUBCOMP). The connection forwards
    /// the acknowledgement itself.
    pub fn router_acknowledged(
        &mut self,
        pkid: u16,
        qos2: bool,
        to_router: &mut Vec<Packet>,
        protocol: Protocol,
        out: &mut BytesMut,
    ) {
        self.router.acknowledged(pkid, to_router);
        // Only a delivery written here and not yet acknowledged changes
        // what is in flight: an acknowledgement of another id (sent again,
        // or made up) adds no entry and frees no room.
        if self.router_qos.remove(&pkid).is_none() {
            return;
        }
        if qos2 {
            self.router_released.insert(pkid);
        } else {
            self.router_in_flight = self.router_in_flight.saturating_sub(1);
            self.fill(protocol, out, to_router);
        }
    }

    /// The QoS of the delivery `pkid` that the client may acknowledge now:
    /// 1, or 2 (also after its PUBREC, until PUBCOMP); `None` for a packet
    /// id not in flight here (the router may still know it: a PUBREL it
    /// resent after a reconnect). `pkid` is a direct delivery's, or the
    /// router's (translated from the client's, see
    /// [`Outbound::router_pkid`]); a kept id is asked with
    /// [`Outbound::is_kept`].
    pub fn delivery_qos(&self, pkid: u16) -> Option<u8> {
        if is_direct(pkid) {
            // The broker's own deliveries go at QoS 1 only.
            return self.direct.is_in_flight(pkid).then_some(1);
        }
        if self.router_released.contains(&pkid) {
            return Some(2);
        }
        self.router_qos.get(&pkid).copied()
    }

    /// Whether `pkid` (as the client saw it) is the kept id of a
    /// handed-over QoS 2 message in flight (see
    /// [`crate::sessions::Direct::kept_pkid`]).
    pub fn is_kept(&self, pkid: u16) -> bool {
        self.direct.is_kept(pkid)
    }

    /// The client completed the router's QoS 2 publish `pkid` (PUBCOMP).
    pub fn router_completed(
        &mut self,
        pkid: u16,
        protocol: Protocol,
        out: &mut BytesMut,
        to_router: &mut Vec<Packet>,
    ) {
        if self.router_released.remove(&pkid) {
            self.router_in_flight = self.router_in_flight.saturating_sub(1);
            self.fill(protocol, out, to_router);
        }
    }

    /// A direct delivery.
    pub fn deliver(&mut self, mut message: Direct, protocol: Protocol, out: &mut BytesMut) {
        // A kept id in this session's block, or among the direct ones,
        // would be taken for another delivery's: then it goes as a new
        // message (QoS 1, a new id).
        if message
            .kept_pkid
            .is_some_and(|id| id == 0 || is_direct(id) || self.ids.to_router(id).is_some())
        {
            message.kept_pkid = None;
            message.qos = message.qos.min(1);
        }
        // In order: nothing overtakes what already waits.
        let room = self.held.is_empty() && !self.direct.has_pending() && self.room();
        let sent = self.direct.send(message, protocol, out, room);
        self.count_discarded(u64::from(!sent));
    }

    /// A state store answer for this client, taken on its answer route
    /// (see [`crate::sessions::Answer`]): encoded into `out` as
    /// [`Self::deliver`] would encode its message, or held as that message
    /// while the client's Receive Maximum is reached. `kept`: the session
    /// outlives the connection (what is unacknowledged at its end is sent
    /// again later; see [`DirectWindow::send_answer`]).
    /// (By reference: what is held is taken out of it.)
    pub fn answer(
        &mut self,
        answer: &mut Answer,
        kept: bool,
        protocol: Protocol,
        out: &mut BytesMut,
    ) {
        let room = self.held.is_empty() && !self.direct.has_pending() && self.room();
        let sent = self.direct.send_answer(answer, kept, protocol, out, room);
        self.count_discarded(u64::from(!sent));
    }

    /// The client's PUBREC or PUBCOMP of a handed-over QoS 2 message sent
    /// under its kept packet id (see [`crate::sessions::Direct::kept_pkid`]):
    /// a PUBREC is answered with a PUBREL into `out` (unless it refused the
    /// message, 0x80 or more: done), a PUBCOMP completes it. `false`: not
    /// such an acknowledgement (the router's, or a direct delivery's).
    pub fn kept_ack(
        &mut self,
        packet: &Packet,
        protocol: Protocol,
        out: &mut BytesMut,
        to_router: &mut Vec<Packet>,
    ) -> bool {
        let done = match packet {
            Packet::PubRec(rec, _) if self.direct.is_kept(rec.pkid) => {
                use router::protocol::PubRecReason;
                let accepted = matches!(
                    rec.reason,
                    PubRecReason::Success | PubRecReason::NoMatchingSubscribers
                );
                if accepted {
                    self.direct.released(rec.pkid);
                    let rel = PubRel {
                        pkid: rec.pkid,
                        reason: PubRelReason::Success,
                    };
                    if let Err(e) = protocol.write(Packet::PubRel(rel, None), out) {
                        tracing::warn!(error = %e, "a PUBREL cannot be encoded");
                    }
                    return true;
                }
                rec.pkid
            }
            Packet::PubComp(comp, _) if self.direct.is_released(comp.pkid) => comp.pkid,
            _ => return false,
        };
        self.direct.completed(done);
        if self.direct.acknowledged(done) {
            self.fill(protocol, out, to_router);
        }
        true
    }

    /// The client acknowledged direct delivery `pkid`.
    // Inline: on every request's path (out of line, it cost ~200
    // instructions a request more, callgrind).
    #[inline]
    pub fn direct_acknowledged(
        &mut self,
        pkid: u16,
        protocol: Protocol,
        out: &mut BytesMut,
        to_router: &mut Vec<Packet>,
    ) {
        if self.direct.acknowledged(pkid) {
            self.fill(protocol, out, to_router);
        }
    }

    /// Sends what waited, while there is room: the router's first (they
    /// are older and the router wants them acknowledged in order).
    /// One held past its Message Expiry Interval is not sent: the router
    /// is told it is done with (`to_router`), in order.
    fn fill(&mut self, protocol: Protocol, out: &mut BytesMut, to_router: &mut Vec<Packet>) {
        while self.room() {
            if let Some(held) = self.held.pop_front() {
                self.send_held(held, out, to_router);
            } else if let Some(message) = self.direct.next_pending() {
                let sent = self.direct.send(message, protocol, out, true);
                self.count_discarded(u64::from(!sent));
            } else {
                break;
            }
        }
    }

    /// Holds the router's publish `pkid`, encoded as `bytes`, until there
    /// is room; `expires`: it has a Message Expiry Interval (MQTT 5).
    /// Out of line, as [`Self::send_held`]: the paths that take the
    /// router's publishes and the client's acknowledgements stay small.
    #[inline(never)]
    fn hold(&mut self, bytes: Bytes, pkid: u16, expires: bool) {
        let expiry = expires
            .then(|| codec::encoded_message_expiry(&bytes))
            .flatten()
            .map(|(at, secs)| (std::time::Instant::now(), secs, at));
        self.held.push_back(HeldPublish {
            bytes,
            pkid,
            expiry,
        });
    }

    /// Sends `held` now that there is room: with its Message Expiry
    /// Interval reduced by the time it waited, or, expired, not at all
    /// (the router told it is done with, in order).
    #[inline(never)]
    fn send_held(&mut self, held: HeldPublish, out: &mut BytesMut, to_router: &mut Vec<Packet>) {
        let start = out.len();
        if let Some((since, secs, at)) = held.expiry {
            let waited = since.elapsed().as_secs();
            let Some(left) = u64::from(secs).checked_sub(waited).filter(|&left| left > 0) else {
                self.router_qos.remove(&held.pkid);
                self.router.drop_sent(held.pkid, to_router);
                crate::metrics::dropped(crate::metrics::DropReason::Expired, 1);
                return;
            };
            out.extend_from_slice(&held.bytes);
            let left = u32::try_from(left).unwrap_or(secs);
            out[start + at..start + at + 4].copy_from_slice(&left.to_be_bytes());
        } else {
            out.extend_from_slice(&held.bytes);
        }
        self.router_in_flight += 1;
    }

    /// At the end of the connection: the QoS 1 direct deliveries not
    /// acknowledged, those still waiting, and those not yet taken from
    /// `rx`, for a persistent session to get later.
    pub fn hand_back(&mut self, inbox: &mut super::inbox::Inbox) -> Vec<Direct> {
        let mut all = self.direct.take_unacknowledged();
        while let Some(message) = inbox.try_recv() {
            if let ToConnection::Deliver(message) = message {
                all.push(*message);
            }
        }
        all.retain(|m| m.qos > 0);
        all
    }

    /// Publishes discarded as larger than the client accepts.
    pub fn discarded(&self) -> u64 {
        self.discarded
    }

    fn count_discarded(&mut self, n: u64) {
        if n > 0 {
            crate::metrics::dropped(crate::metrics::DropReason::TooLarge, n);
        }
        if n > 0 && self.discarded == 0 {
            tracing::warn!(
                client_id = self.client_id,
                max = self.max_packet_size,
                "a publish larger than the client's Maximum Packet Size was discarded for it"
            );
        }
        self.discarded += n;
    }
}

mod aliases;
mod direct;
mod router_acks;

pub(crate) use aliases::TopicAliases;
pub(crate) use direct::DirectWindow;
pub(crate) use router_acks::RouterAcks;

#[cfg(test)]
mod tests;
