//! A session that moved to another node takes along the messages this
//! node had queued for it.
//!
//! The node resumes the session on an internal router link, takes what
//! the router gives it (acknowledging each), ends the session and sends
//! the messages over its link to the new node, which delivers them to the
//! client alone, at most at QoS 1 (see `crate::publisher::HANDOVER`), but
//! for a QoS 2 message this node had sent the client and not had
//! completed: that one goes at QoS 2 under the packet id the client saw
//! (`crate::publisher::HANDOVER_PKID`), so that a client that keeps the
//! id takes it as the same message (MQTT 5 4.3.3). The session's copies
//! in this node's queue in etcd go (a node that read the session's queue
//! later would send them again), a QoS 2 message's before the message is
//! handed over, as before a delivery (see `super::queue`). Then, with messages
//! or without, it sends the mark that it has handed over
//! (`crate::publisher::HANDOVER_DONE`): the client's connection on the
//! new node holds back what its own router gives the session until that
//! mark (3 s at most after the CONNECT or the last handed-over message,
//! 30 s in all; the router's answers to the client are not held),
//! so the older messages come first. A message published
//! while the session moves (from the new node's CONNECT until this node
//! has handed over: etcd's watch, the router's backlog until it says it
//! has given it all, then [`QUIET`] after the last message, [`DRAIN_MAX`]
//! at most) reaches both nodes' copies of the session: it may be
//! delivered twice, never lost.

use router::RouterHandle;
use router::protocol::{Publish, PublishProperties, QoS};

use super::{Peers, Queue};
use crate::sessions::{HANDED_OVER_MAX, OnDone, PacketIdBlock, Sessions, bound_handed_over};

/// A message handed over: `publish` and its `properties`, with the packet
/// id the client saw (`kept`) for a QoS 2 one in flight to it (the User
/// Property `crate::publisher::HANDOVER_PKID`).
fn handed_over(
    publish: Publish,
    mut properties: Option<PublishProperties>,
    kept: Option<u16>,
) -> (Publish, Option<PublishProperties>) {
    if let Some(pkid) = kept.filter(|_| publish.qos == QoS::ExactlyOnce) {
        let user = &mut properties
            .get_or_insert_with(Default::default)
            .user_properties;
        user.push((
            crate::publisher::HANDOVER_PKID.into(),
            pkid.to_string().into(),
        ));
    }
    (publish, properties)
}

/// The parts of the node a handover works with.
pub struct From<'a> {
    pub router: &'a RouterHandle,
    pub sessions: &'a Sessions,
    pub peers: &'a Peers,
    /// The node's queue in etcd: the session's copies there go, a QoS 2
    /// message's before it is handed over (see [`Queue::hand_over`]).
    pub queue: Option<&'a Queue>,
}

/// `client_id`'s session moved to node `to`: takes the messages this
/// node's router queued for it (resuming it on an internal link, each
/// acknowledged; `ids`: the packet ids its deliveries took here), ends it
/// here, and sends them to `to` (see the module's
/// documentation), after those handed over to it here earlier that its
/// connection did not acknowledge (kept by `sessions`). Without messages
/// (or a session) it just ends. A QoS 2 message whose copy in etcd this
/// node cannot remove within [`REMOVAL_WAIT`] is not handed over: it
/// stays in etcd (a message twice is what QoS 2 must never do; the
/// copy there comes to the client if the session's next node reads
/// etcd, and goes with the session otherwise).
pub async fn hand_over(node: From<'_>, client_id: &str, to: &str, ids: PacketIdBlock) {
    use router::protocol::Packet;
    let From {
        router,
        sessions,
        peers,
        queue,
    } = node;
    // Its copies in etcd, taken before the link below makes the router give
    // the session up (and the queue forget it).
    let mut copies = queue.map(|q| q.hand_over(client_id)).unwrap_or_default();
    // Session expiry 0: the session ends with this link.
    let Ok((mut tx, mut rx, connack)) = router.link_for_backlog(client_id).await else {
        // Nothing to hand over: the new node's connection need not wait.
        peers.hand_over(to, client_id, Vec::new()).await;
        return;
    };
    let present = matches!(
        Option::<Packet>::from(connack),
        Some(Packet::ConnAck(ack, _)) if ack.session_present
    );
    // A QoS 2 message is handed over once etcd has its copy's removal.
    let mut removal_of = |number| {
        let key = copies.remove(&number)?;
        queue.map(|q| q.remove_waited(key))
    };
    let (drained, mut dropped) = if present {
        drain(&mut tx, &mut rx, ids, &mut removal_of).await
    } else {
        (Vec::new(), 0)
    };
    let drained = without_copies_in_etcd(client_id, drained).await;
    // Taken after the drain: the connection that kept them has ended by
    // then.
    let kept = sessions.take_handed_over(client_id);
    // What to do once the new node has them (their copies in etcd go).
    let done: Vec<OnDone> = kept.iter().filter_map(|m| m.on_done.clone()).collect();
    let mut messages: Vec<_> = kept
        .into_iter()
        .map(|m| {
            let publish = crate::codec::publish(&m.topic, &m.payload, m.qos, 0, m.retain);
            handed_over(publish, Some(m.properties.into_publish()), m.kept_pkid)
        })
        .collect();
    messages.extend(drained);
    dropped += bound_handed_over(&mut messages);
    let disconnect = router::protocol::Disconnect {
        reason_code: router::protocol::DisconnectReasonCode::NormalDisconnection,
    };
    let _ = tx.send_all([Packet::Disconnect(disconnect, None)]);
    if dropped > 0 {
        tracing::warn!(
            client_id,
            dropped,
            kept = HANDED_OVER_MAX,
            "clustering: more messages queued for a session that moved than are handed over: the oldest are dropped"
        );
    }
    let count = messages.len();
    // Without messages too: the new node's connection holds back what its
    // router gives the session until this node says it has handed over.
    let sent = peers.hand_over(to, client_id, messages).await;
    if sent == count {
        done.iter().for_each(OnDone::run);
        // The other copies (QoS 1 messages') go once the new node has the
        // messages: a node that died before would leave them to the next
        // reader of the session's queue (a QoS 1 message twice, rather
        // than lost).
        if let Some(queue) = queue
            && !copies.is_empty()
        {
            queue.remove(copies.into_values().collect());
        }
    }
    crate::metrics::session_handed_over(sent);
    tracing::info!(
        client_id,
        to,
        queued = count,
        sent,
        "clustering: handed the session's queued messages to its new node"
    );
}

/// How long a handover waits for etcd to take the removals of its QoS 2
/// messages' copies there.
pub const REMOVAL_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// A message the drain took, and the removal of its copy in etcd that
/// must be done before it is handed over (a QoS 2 one's).
type Drained = (
    (Publish, Option<PublishProperties>),
    Option<tokio::sync::oneshot::Receiver<()>>,
);

/// The messages of `drained` that may be handed over: each QoS 2 one once
/// etcd has the removal of its copy there (see [`hand_over`]); those
/// whose removal etcd did not take within [`REMOVAL_WAIT`] stay there.
async fn without_copies_in_etcd(
    client_id: &str,
    drained: Vec<Drained>,
) -> Vec<(Publish, Option<PublishProperties>)> {
    let deadline = tokio::time::Instant::now() + REMOVAL_WAIT;
    let mut messages = Vec::with_capacity(drained.len());
    let mut stayed = 0usize;
    for (message, removal) in drained {
        if let Some(removal) = removal
            && !matches!(tokio::time::timeout_at(deadline, removal).await, Ok(Ok(())))
        {
            stayed += 1;
            continue;
        }
        messages.push(message);
    }
    if stayed > 0 {
        tracing::warn!(
            client_id,
            stayed,
            "clustering: QoS 2 messages of a session that moved are not handed over: etcd did not take the removal of their copies in time (they stay there, for the next node that reads the session's queue)"
        );
    }
    messages
}

/// How long a handover goes on taking what the router gives after the
/// router said it had given the whole backlog. What reaches the session here
/// while the client is on its new node reaches the new node's copy too
/// (every publish goes to every node), and would come to the client
/// twice: a handover that waited for 300 ms without one never ended
/// while publishes to the client kept coming faster than that (nothing
/// was handed over, and a node stopped with SIGTERM waited for it until
/// its grace ran out); one that took them for 2 s gave about 40 of them
/// twice at 20 a second.
const DRAIN_MAX: std::time::Duration = std::time::Duration::from_millis(500);

/// Once the router has given the backlog, the drain ends when it has
/// given nothing for this long: a message another node sent to both
/// nodes' copies of the session may reach this one a moment after it
/// reached the new node's router, before the session was there.
const QUIET: std::time::Duration = std::time::Duration::from_millis(100);

/// How long the drain waits for the router's next message, or for its
/// word that it has given the whole backlog (router patch 48,
/// `Notification::CaughtUp`), before it takes the router for stalled.
/// Before that word, the drain waited 1 s for a first message and ended
/// 100 ms after the last, or 500 ms after its start: a session without
/// messages cost a stopping node 1 s, and a backlog the router took
/// longer than that to give was cut, the rest lost with the session.
const STALL: std::time::Duration = std::time::Duration::from_secs(2);

/// How long the drain takes the backlog at most (a router that never
/// catches up: publishes for the session coming faster than it drains).
const BACKLOG_MAX: std::time::Duration = std::time::Duration::from_secs(5);

/// Takes what the router gives a resumed session's link, acknowledging
/// each message: the whole backlog (until the router says so; see
/// [`STALL`]), then until it has given nothing for [`QUIET`], for
/// [`DRAIN_MAX`] at most (a QoS 2 one sent again, DUP, was in flight to
/// the client: with the id the client saw, in `ids`); returns the
/// messages, oldest first (the newest [`HANDED_OVER_MAX`]), and how many
/// older ones were dropped.
async fn drain(
    tx: &mut router::local::LinkTx,
    rx: &mut router::local::LinkRx,
    ids: PacketIdBlock,
    removal_of: &mut (
             dyn FnMut(router::MessageId) -> Option<tokio::sync::oneshot::Receiver<()>> + Send
         ),
) -> (Vec<Drained>, usize) {
    use router::protocol::{
        Packet, PubAck, PubAckReason, PubComp, PubCompReason, PubRec, PubRecReason,
    };
    let mut messages = std::collections::VecDeque::new();
    let mut dropped = 0usize;
    let started = tokio::time::Instant::now();
    // Set when the router has given the whole backlog: DRAIN_MAX after.
    let mut deadline: Option<tokio::time::Instant> = None;
    loop {
        let now = tokio::time::Instant::now();
        let until = match deadline {
            Some(deadline) => (now + QUIET).min(deadline),
            None => (now + STALL).min(started + BACKLOG_MAX),
        };
        let next = tokio::time::timeout_at(until, rx.next());
        let notification = match next.await {
            Ok(Ok(Some(notification))) => notification,
            // A wake-up that found the link's buffer empty (the router
            // wakes once per push, and one read may take several pushes):
            // not the end (before, it ended the drain, the rest of the
            // backlog lost with the session).
            Ok(Ok(None)) => continue,
            _ => break,
        };
        if matches!(notification, router::Notification::CaughtUp) {
            deadline = Some(tokio::time::Instant::now() + DRAIN_MAX);
            continue;
        }
        if matches!(notification, router::Notification::Unschedule) {
            if rx.wake().await.is_err() {
                break;
            }
            continue;
        }
        // A QoS 2 message leaves etcd before it is handed over, as before
        // it is sent (see `super::queue`).
        let removal = match &notification {
            router::Notification::Forward(f) if f.publish.qos == QoS::ExactlyOnce => {
                f.queued.and_then(&mut *removal_of)
            }
            _ => None,
        };
        let answer = match Option::<Packet>::from(notification) {
            Some(Packet::Publish(publish, properties)) => {
                let pkid = publish.pkid;
                let answer = match publish.qos {
                    QoS::AtMostOnce => None,
                    QoS::AtLeastOnce => Some(Packet::PubAck(
                        PubAck {
                            pkid,
                            reason: PubAckReason::Success,
                        },
                        None,
                    )),
                    QoS::ExactlyOnce => Some(Packet::PubRec(
                        PubRec {
                            pkid,
                            reason: PubRecReason::Success,
                        },
                        None,
                    )),
                };
                let kept =
                    (publish.qos == QoS::ExactlyOnce && publish.dup).then(|| ids.to_client(pkid));
                messages.push_back((handed_over(publish, properties, kept), removal));
                if messages.len() > HANDED_OVER_MAX {
                    messages.pop_front();
                    dropped += 1;
                }
                answer
            }
            Some(Packet::PubRel(rel, _)) => Some(Packet::PubComp(
                PubComp {
                    pkid: rel.pkid,
                    reason: PubCompReason::Success,
                },
                None,
            )),
            _ => None,
        };
        if let Some(answer) = answer
            && tx.send_all([answer]).is_err()
        {
            break;
        }
    }
    (messages.into(), dropped)
}

#[cfg(test)]
mod tests {
    use router::Notification;
    use router::protocol::{Filter, Packet, Publish, QoS, RetainForwardRule, Subscribe};

    use super::*;

    /// The drain takes a session's whole backlog: more messages than the
    /// router sends before it waits for acknowledgements, which it pushes
    /// in several rounds (each round wakes the link; a read may take
    /// several rounds, and the wake-ups left find the buffer empty). Before,
    /// such a wake-up ended the drain, and the rest of the backlog was lost
    /// with the session.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_drain_takes_the_whole_backlog() {
        let config = router::RouterConfig {
            max_connections: 10,
            max_segment_size: 1 << 20,
            max_segment_count: 4,
            max_outgoing_packet_count: 200,
            ..router::RouterConfig::default()
        };
        let router = RouterHandle::spawn(0, config, 0, None);
        let (mut tx, mut rx, _) = router.link("s", false, 60, None).await.unwrap();
        let subscribe = Subscribe {
            pkid: 1,
            filters: vec![Filter {
                path: "t".into(),
                qos: QoS::AtLeastOnce,
                nolocal: false,
                preserve_retain: false,
                retain_forward_rule: RetainForwardRule::OnEverySubscribe,
            }],
        };
        tx.send_all([Packet::Subscribe(subscribe, None)]).unwrap();
        while !matches!(rx.next().await, Ok(Some(Notification::DeviceAck(_)))) {}
        drop((tx, rx));

        let total = 1_000;
        let (mut pub_tx, mut pub_rx, _) = router.link("p", true, 0, None).await.unwrap();
        for n in 0..total {
            let mut publish = Publish::new("t".to_owned(), n.to_string(), false);
            publish.qos = QoS::AtLeastOnce;
            publish.pkid = n as u16 % 60_000 + 1;
            pub_tx.send_all([Packet::Publish(publish, None)]).unwrap();
        }
        let mut acked = 0;
        while acked < total {
            match pub_rx.next().await.unwrap() {
                Some(Notification::DeviceAck(_)) => acked += 1,
                Some(Notification::Unschedule) => pub_rx.wake().await.unwrap(),
                _ => {}
            }
        }

        let (mut tx, mut rx, _) = router.link_for_backlog("s").await.unwrap();
        let (messages, dropped) =
            drain(&mut tx, &mut rx, PacketIdBlock::new(0), &mut |_| None).await;
        let payloads: Vec<String> = messages
            .iter()
            .map(|((p, _), _)| String::from_utf8(p.payload.to_vec()).unwrap())
            .collect();
        let expected: Vec<String> = (0..total).map(|n| n.to_string()).collect();
        assert_eq!(dropped, 0);
        assert_eq!(payloads.len(), total, "the whole backlog");
        assert_eq!(payloads, expected, "in order");
    }
}
