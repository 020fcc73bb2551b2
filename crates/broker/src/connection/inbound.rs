//! What the client publishes: topic aliases, and the acknowledgements of
//! publishes the connection handles itself (state store requests, refused
//! publishes), with MQTT 5's reason codes and QoS 2's packet-id state.
//!
//! Ordinary publishes go to the router, which acknowledges them; the
//! connection only resolves their aliases here, and counts them against the
//! Receive Maximum it announced (MQTT 5 3.3.4: more unacknowledged QoS 1/2
//! publishes than that ends the connection with 0x93).

use std::collections::{HashMap, HashSet, VecDeque};

use bytes::Bytes;
use router::protocol::{
    DisconnectReasonCode, Packet, PubAck, PubAckReason, PubComp, PubCompReason, PubRec,
    PubRecReason, PubRelProperties, Publish,
};

use crate::codec::Protocol;
use crate::sessions::{SharedAcknowledged, Wait};

/// A rule the client broke: the reason code and why.
pub(crate) type Violation = (DisconnectReasonCode, String);

/// What the connection remembers of the client's publishes.
#[derive(Debug)]
pub(crate) struct Inbound {
    topic_alias_max: u16,
    aliases: HashMap<u16, Bytes>,
    /// The session's record of the requests acknowledged here (QoS 2 ones
    /// until PUBREL), shared with its other connections.
    acknowledged: SharedAcknowledged,
    /// How many QoS 1 requests the record keeps.
    remembered: u16,
    /// The Receive Maximum announced in CONNACK (`u16::MAX` for 3.1.1,
    /// which has none).
    receive_maximum: u16,
    /// QoS 1/2 publishes received and not yet completed (PUBACK, PUBCOMP,
    /// or a PUBREC refusing them).
    unacknowledged: u16,
    /// Packet ids of QoS 2 publishes received, wherever handled, until
    /// PUBREL (a retransmission is not another publish).
    qos2_received: HashSet<u16>,
}

impl Inbound {
    /// A client may use topic aliases `1..=topic_alias_max` and have
    /// `receive_maximum` QoS 1/2 publishes unacknowledged; `acknowledged`
    /// is its session's record, which keeps the last `remembered` QoS 1
    /// requests.
    pub fn new(
        topic_alias_max: u16,
        receive_maximum: u16,
        (acknowledged, remembered): (SharedAcknowledged, u16),
    ) -> Inbound {
        Inbound {
            topic_alias_max,
            aliases: HashMap::new(),
            acknowledged,
            remembered,
            receive_maximum,
            unacknowledged: 0,
            qos2_received: HashSet::new(),
        }
    }

    /// Whether a QoS `qos` publish with `pkid` is a QoS 2 one this
    /// connection has already received (and not yet seen released).
    pub fn is_retransmission(&self, qos: u8, pkid: u16) -> bool {
        qos == 2 && self.qos2_received.contains(&pkid)
    }

    /// A QoS `qos` publish with `pkid` arrived: one more unacknowledged
    /// (unless it is QoS 0, or a QoS 2 retransmission), unless that passes
    /// the Receive Maximum.
    pub fn arrived(&mut self, qos: u8, pkid: u16) -> Result<(), Violation> {
        if qos == 0 || self.is_retransmission(qos, pkid) {
            return Ok(());
        }
        if self.unacknowledged >= self.receive_maximum {
            return Err((
                DisconnectReasonCode::ReceiveMaximumExceeded,
                format!(
                    "more than the Receive Maximum of {} QoS 1/2 publishes unacknowledged",
                    self.receive_maximum
                ),
            ));
        }
        self.unacknowledged += 1;
        if qos == 2 {
            self.qos2_received.insert(pkid);
        }
        Ok(())
    }

    /// An acknowledgement goes to the client: a PUBACK, a PUBCOMP or a
    /// refusing PUBREC completes a publish.
    pub fn completed(&mut self, ack: &Packet) {
        let done = match ack {
            Packet::PubAck(..) | Packet::PubComp(..) => true,
            Packet::PubRec(rec, _) => !matches!(rec.reason, PubRecReason::Success),
            _ => false,
        };
        if done {
            self.unacknowledged = self.unacknowledged.saturating_sub(1);
        }
    }

    /// A QoS 1 publish handled here was acknowledged (PUBACK) without a
    /// packet made for it ([`Inbound::completed`]'s count).
    pub fn acknowledged_at_once(&mut self) {
        self.unacknowledged = self.unacknowledged.saturating_sub(1);
    }

    /// Resolves `alias` on `publish`: an empty topic becomes the one the
    /// alias stands for; a topic sets the alias.
    pub fn resolve_alias(&mut self, publish: &mut Publish, alias: u16) -> Result<(), Violation> {
        if alias == 0 || alias > self.topic_alias_max {
            return Err((
                DisconnectReasonCode::TopicAliasInvalid,
                format!("topic alias {alias} out of range"),
            ));
        }
        if !publish.topic.is_empty() {
            self.aliases.insert(alias, publish.topic.clone());
            return Ok(());
        }
        match self.aliases.get(&alias) {
            Some(topic) => {
                publish.topic = topic.clone();
                Ok(())
            }
            None => Err((
                DisconnectReasonCode::ProtocolError,
                format!("unknown topic alias {alias}"),
            )),
        }
    }

    /// Whether a request is one this session ran already (on this
    /// connection or an earlier one): a QoS 2 one acknowledged and not yet
    /// released, or a QoS 1 one sent again (`dup`) with the packet id and
    /// `correlation` data of the last one run with that id. Then: what its
    /// answer waits for; acknowledge it again only.
    pub fn ran_already(
        &self,
        qos: u8,
        pkid: u16,
        dup: bool,
        correlation: Option<&[u8]>,
    ) -> Option<Wait> {
        match (qos, correlation) {
            (2, _) => self.acknowledged.lock().received_waiting(pkid),
            (1, Some(correlation)) if dup => self.acknowledged.lock().resent(pkid, correlation),
            _ => None,
        }
    }

    /// A request with `pkid` and `correlation` data ran; its answer waits
    /// for `wait`. At QoS 2 noted with its packet id; at
    /// QoS 1 remembered only where it can be sent again: in a session that
    /// outlives the connection (the last `remembered`, see
    /// [`crate::sessions::Acknowledged`]).
    pub fn ran(&self, qos: u8, pkid: u16, correlation: Option<&[u8]>, wait: Wait, kept: bool) {
        match (qos, correlation) {
            (2, _) => self.acknowledged.lock().ran_qos2(pkid, wait),
            (1, Some(correlation)) if kept => {
                let remembered = usize::from(self.remembered);
                let mut acknowledged = self.acknowledged.lock();
                acknowledged.ran(pkid, correlation, wait, remembered);
            }
            _ => {}
        }
    }

    /// The acknowledgement of a publish handled here; `accepted: false`
    /// refuses it (MQTT 5: 0x87; 3.1.1 has no negative acknowledgement, so a
    /// refused publish is acknowledged and dropped).
    pub fn ack(
        &mut self,
        protocol: Protocol,
        qos: u8,
        pkid: u16,
        accepted: bool,
    ) -> Option<Packet> {
        let success = accepted || protocol == Protocol::V4;
        match qos {
            1 => {
                let reason = if success {
                    PubAckReason::Success
                } else {
                    PubAckReason::NotAuthorized
                };
                Some(Packet::PubAck(PubAck { pkid, reason }, None))
            }
            2 => {
                let reason = if success {
                    PubRecReason::Success
                } else {
                    PubRecReason::NotAuthorized
                };
                self.acknowledged.lock().received(pkid);
                Some(Packet::PubRec(PubRec { pkid, reason }, None))
            }
            _ => None,
        }
    }

    /// PUBREL `pkid`: a QoS 2 publish with that id is a new one from now
    /// on. Returns the PUBCOMP if the publish was handled here (else it is
    /// the router's to answer).
    pub fn release(&mut self, pkid: u16) -> Option<Packet> {
        self.qos2_received.remove(&pkid);
        self.acknowledged.lock().release(pkid).then(|| {
            Packet::PubComp(
                PubComp {
                    pkid,
                    reason: PubCompReason::Success,
                },
                None,
            )
        })
    }
}

/// MQTT 4.6 (3.1.1 and 5): PUBACKs and PUBRECs go out in the order the
/// PUBLISHes arrived. The router acknowledges what it routes, later; an
/// acknowledgement made here (a state store request, a refused publish)
/// waits behind the router's acknowledgements still owed before it.
#[derive(Debug, Default)]
pub(crate) struct AckOrder {
    /// Router acknowledgements owed so far, and received so far.
    owed: u64,
    received: u64,
    /// Acknowledgements made here, each with the router acknowledgements
    /// owed before it and the request ticket it waits for (see
    /// `store::tickets`).
    held: VecDeque<(u64, Packet, Option<u64>)>,
}

impl AckOrder {
    /// A QoS 1/2 publish went to the router (which will acknowledge it).
    pub fn routed(&mut self) {
        self.owed += 1;
    }

    /// Whether an acknowledgement made now goes at once: the router owes
    /// none before it, and none made here waits.
    pub fn is_clear(&self) -> bool {
        self.received >= self.owed && self.held.is_empty()
    }

    /// An acknowledgement made here, waiting for request ticket `outcome`:
    /// to send now, or `None` while the router owes acknowledgements of
    /// earlier publishes.
    pub fn local(&mut self, ack: Packet, outcome: Option<u64>) -> Option<(Packet, Option<u64>)> {
        if self.received >= self.owed && self.held.is_empty() {
            return Some((ack, outcome));
        }
        self.held.push_back((self.owed, ack, outcome));
        None
    }

    /// The router acknowledged a publish (sent before this call's result):
    /// the acknowledgements made here that waited only for it.
    pub fn router_acknowledged(&mut self) -> Vec<(Packet, Option<u64>)> {
        self.received += 1;
        let mut ready = Vec::new();
        while self
            .held
            .front()
            .is_some_and(|(before, _, _)| *before <= self.received)
        {
            ready.extend(
                self.held
                    .pop_front()
                    .map(|(_, ack, outcome)| (ack, outcome)),
            );
        }
        ready
    }
}

/// The PUBCOMP for a PUBREL whose packet id nothing waits for: MQTT 5's
/// "packet identifier not found" (3.1.1 clients just see PUBCOMP).
pub(crate) fn unknown_pubrel(pkid: u16) -> Packet {
    Packet::PubComp(
        PubComp {
            pkid,
            reason: PubCompReason::PacketIdentifierNotFound,
        },
        None,
    )
}

/// A PUBREL's properties on their way to the router: the User Property
/// [`router::DISCARD`] is the broker's alone (router patch 35), removed
/// from what the client sent, and set when the publish is to be
/// discarded (a cluster node's copy of a message it had).
pub(crate) fn mark_discard(properties: &mut Option<PubRelProperties>, discard: bool) {
    if let Some(p) = properties.as_mut() {
        p.user_properties.retain(|(k, _)| k != router::DISCARD);
    }
    if discard {
        properties
            .get_or_insert_with(|| PubRelProperties {
                reason_string: None,
                user_properties: Vec::new(),
            })
            .user_properties
            .push((router::DISCARD.to_owned(), String::new()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persistence::Batch;
    use std::sync::Arc;

    /// Waits for batch `n` (0: for nothing).
    fn b(n: u64) -> Wait {
        Batch::new(n)
    }

    fn publish(topic: &str) -> Publish {
        Publish::new(topic.to_owned(), "x".to_owned(), false)
    }

    #[test]
    fn topic_aliases() {
        let mut inbound = Inbound::new(10, u16::MAX, (Default::default(), 10));
        let mut p = publish("a/b");
        inbound.resolve_alias(&mut p, 3).unwrap();
        let mut aliased = publish("");
        inbound.resolve_alias(&mut aliased, 3).unwrap();
        assert_eq!(&aliased.topic[..], b"a/b");
        // An alias can be set again to another topic.
        inbound.resolve_alias(&mut publish("c"), 3).unwrap();
        let mut aliased = publish("");
        inbound.resolve_alias(&mut aliased, 3).unwrap();
        assert_eq!(&aliased.topic[..], b"c");
        let code = |r: Result<(), Violation>| r.unwrap_err().0;
        assert_eq!(
            code(inbound.resolve_alias(&mut publish("x"), 11)),
            DisconnectReasonCode::TopicAliasInvalid
        );
        assert_eq!(
            code(inbound.resolve_alias(&mut publish("x"), 0)),
            DisconnectReasonCode::TopicAliasInvalid
        );
        assert_eq!(
            code(inbound.resolve_alias(&mut publish(""), 4)),
            DisconnectReasonCode::ProtocolError
        );
    }

    #[test]
    fn acknowledgements_per_protocol_and_qos() {
        let mut inbound = Inbound::new(0, u16::MAX, (Default::default(), 10));
        assert!(inbound.ack(Protocol::V5, 0, 0, true).is_none());
        match inbound.ack(Protocol::V5, 1, 7, false) {
            Some(Packet::PubAck(ack, None)) => {
                assert_eq!((ack.pkid, ack.reason), (7, PubAckReason::NotAuthorized))
            }
            other => panic!("{other:?}"),
        }
        match inbound.ack(Protocol::V4, 1, 7, false) {
            Some(Packet::PubAck(ack, None)) => assert_eq!(ack.reason, PubAckReason::Success),
            other => panic!("{other:?}"),
        }
        match inbound.ack(Protocol::V5, 2, 9, false) {
            Some(Packet::PubRec(rec, None)) => {
                assert_eq!((rec.pkid, rec.reason), (9, PubRecReason::NotAuthorized))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn local_acknowledgements_wait_for_the_routers_before_them() {
        let ack = |pkid| {
            Packet::PubAck(
                PubAck {
                    pkid,
                    reason: PubAckReason::Success,
                },
                None,
            )
        };
        let pkid = |p: &Packet| match p {
            Packet::PubAck(a, _) => a.pkid,
            other => panic!("{other:?}"),
        };
        let mut order = AckOrder::default();
        assert!(order.local(ack(1), None).is_some(), "nothing owed: at once");
        order.routed(); // 2 goes to the router
        assert!(order.local(ack(3), Some(1)).is_none());
        order.routed(); // 4
        assert!(order.local(ack(5), None).is_none());
        let mut released = || {
            order
                .router_acknowledged()
                .iter()
                .map(|(ack, outcome)| (pkid(ack), *outcome))
                .collect::<Vec<_>>()
        };
        assert_eq!(released(), [(3, Some(1))], "with its request's ticket");
        assert_eq!(released(), [(5, None)]);
        assert!(order.local(ack(6), None).is_some(), "all caught up");
    }

    #[test]
    fn receive_maximum() {
        let mut inbound = Inbound::new(0, 2, (Default::default(), 10));
        inbound.arrived(0, 0).unwrap();
        inbound.arrived(1, 1).unwrap();
        inbound.arrived(2, 2).unwrap();
        inbound.arrived(2, 2).unwrap(); // a retransmission
        let (code, _) = inbound.arrived(1, 3).unwrap_err();
        assert_eq!(code, DisconnectReasonCode::ReceiveMaximumExceeded);
        assert!(inbound.arrived(0, 0).is_ok(), "QoS 0 never counts");
        let rec = |reason| Packet::PubRec(PubRec { pkid: 2, reason }, None);
        inbound.completed(&rec(PubRecReason::Success));
        assert!(inbound.arrived(1, 3).is_err(), "QoS 2 counts until PUBCOMP");
        inbound.completed(&rec(PubRecReason::NotAuthorized));
        inbound.arrived(1, 3).unwrap();
        let comp = Packet::PubComp(
            PubComp {
                pkid: 2,
                reason: PubCompReason::Success,
            },
            None,
        );
        inbound.completed(&comp);
        inbound.arrived(1, 4).unwrap();
        assert!(inbound.release(2).is_none(), "the router's to answer");
        assert!(inbound.arrived(2, 2).is_err(), "released: a new publish");
    }

    #[test]
    fn qos_2_state_by_packet_id() {
        let mut inbound = Inbound::new(0, u16::MAX, (Default::default(), 10));
        assert_eq!(inbound.ran_already(2, 5, false, None), None);
        inbound.ack(Protocol::V5, 2, 5, true);
        assert_eq!(
            inbound.ran_already(2, 5, true, None),
            Some(b(0)),
            "retransmitted before PUBREL"
        );
        assert!(inbound.release(6).is_none(), "not ours: the router's");
        match inbound.release(5) {
            Some(Packet::PubComp(comp, None)) => assert_eq!(comp.pkid, 5),
            other => panic!("{other:?}"),
        }
        assert_eq!(inbound.ran_already(2, 5, true, None), None, "released");
        assert!(inbound.release(5).is_none());
    }

    #[test]
    fn a_session_knows_its_requests_across_connections() {
        let session = crate::sessions::SharedAcknowledged::default();
        let mut old = Inbound::new(0, u16::MAX, (Arc::clone(&session), 10));
        old.ran(1, 7, Some(b"c"), b(4), true);
        old.ran(1, 8, Some(b"c"), b(0), false); // a session that ends: not kept
        old.ran(1, 9, None, b(0), true); // no correlation data: nothing to match
        old.ack(Protocol::V5, 2, 5, true);
        let mut new = Inbound::new(0, u16::MAX, (session, 10));
        assert_eq!(new.ran_already(1, 7, true, Some(b"c")), Some(b(4)));
        assert_eq!(
            new.ran_already(1, 7, false, Some(b"c")),
            None,
            "not resent: new"
        );
        assert_eq!(new.ran_already(1, 7, true, Some(b"d")), None);
        assert_eq!(new.ran_already(1, 8, true, Some(b"c")), None);
        assert_eq!(new.ran_already(1, 9, true, None), None);
        assert_eq!(new.ran_already(2, 5, true, None), Some(b(0)));
        assert!(new.release(5).is_some(), "PUBCOMP from the new connection");
    }

    /// Only the broker marks a PUBREL for discard: a client's mark goes,
    /// with nothing else of its properties.
    #[test]
    fn a_pubrel_is_marked_discard_by_the_broker_alone() {
        let client = |extra: &[(&str, &str)]| {
            Some(PubRelProperties {
                reason_string: Some("why".into()),
                user_properties: extra
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            })
        };
        let mut sent = client(&[(router::DISCARD, ""), ("kept", "1")]);
        mark_discard(&mut sent, false);
        assert_eq!(sent, client(&[("kept", "1")]));
        mark_discard(&mut sent, true);
        assert_eq!(sent, client(&[("kept", "1"), (router::DISCARD, "")]));
        let mut none = None;
        mark_discard(&mut none, false);
        assert_eq!(none, None);
        mark_discard(&mut none, true);
        assert_eq!(
            none.map(|p| p.user_properties),
            Some(vec![(router::DISCARD.to_owned(), String::new())])
        );
    }
}
