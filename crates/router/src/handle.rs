//! A running router, and how links to it are made (statebroker).
//!
//! The router runs on its own thread and does routing, subscriptions, QoS
//! bookkeeping, sessions, retained messages and shared subscriptions. Its
//! users talk to it through links ([`crate::local`]), one per client
//! connection plus the broker's own; [`RouterHandle`] makes them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use flume::Sender;

use crate::local::{LinkBuilder, LinkError, LinkRx, LinkTx};
use crate::protocol::ConnectReturnCode;
use crate::router::Event;
use crate::{
    ConnectionId, Journal, LogCounts, Notification, Restore, RestoredSession, Router, RouterConfig,
    Subscriptions,
};

/// The router numbers the publishes it sends one connection `1..=100`
/// (its `MAX_INFLIGHT`) and waits for acknowledgements before it sends
/// more: packet ids above it are free for the broker's own deliveries to
/// that connection.
pub const MAX_ROUTER_PKID: u16 = 100;

/// The router did not register a link (it is full, it refused the client
/// id, or it keeps `max_kept_sessions` sessions already).
#[derive(Debug, Clone, thiserror::Error)]
#[error("router refused the link: {why}")]
pub struct LinkRefused {
    why: String,
    sessions_quota: bool,
}

impl LinkRefused {
    fn new(why: String) -> LinkRefused {
        LinkRefused {
            why,
            sessions_quota: false,
        }
    }

    /// The link would have kept one more session than the router's
    /// `max_kept_sessions` (patch 22): MQTT 5 calls this "quota exceeded".
    pub fn sessions_quota(&self) -> bool {
        self.sessions_quota
    }
}

impl From<LinkError> for LinkRefused {
    fn from(e: LinkError) -> LinkRefused {
        LinkRefused {
            sessions_quota: matches!(e, LinkError::Refused(ConnectReturnCode::QuotaExceeded)),
            why: e.to_string(),
        }
    }
}

/// A registered link: what to send, what to receive, and the router's CONNACK.
pub type Link = (LinkTx, LinkRx, Notification);

/// A handle to a running router; clones share it.
#[derive(Clone)]
pub struct RouterHandle {
    tx: Sender<(ConnectionId, Event)>,
    /// Retained messages the router holds (patch 14).
    retained: Arc<AtomicUsize>,
    /// Who subscribes to what (patch 16).
    subscriptions: Arc<Subscriptions>,
    /// The message logs held and their bytes (patch 20).
    logs: Arc<LogCounts>,
    /// The shared subscriptions with members here (patch 28).
    groups: tokio::sync::watch::Receiver<std::collections::BTreeSet<String>>,
    /// `true` once the router's thread has ended (patch 44).
    stopped: tokio::sync::watch::Receiver<bool>,
}

impl RouterHandle {
    /// Starts a router on its own thread. `extra_links` is room for links
    /// besides `config.max_connections` (the broker's own). With a
    /// `journal`, what a restart must not lose is saved there (see
    /// [`Journal`]).
    pub fn spawn(
        id: usize,
        mut config: RouterConfig,
        extra_links: usize,
        journal: Option<Arc<dyn Journal>>,
    ) -> RouterHandle {
        config.max_connections += extra_links;
        let mut router = Router::new(id, config);
        if let Some(journal) = journal {
            router.set_journal(journal);
        }
        let retained = router.retained_count();
        let subscriptions = router.subscriptions();
        let logs = router.log_counts();
        let groups = router.shared_groups();
        let (stopped_tx, stopped) = tokio::sync::watch::channel(false);
        RouterHandle {
            tx: router.spawn(stopped_tx),
            retained,
            subscriptions,
            logs,
            groups,
            stopped,
        }
    }

    /// Whether the router's thread still runs (it ends only by a bug: a
    /// panic, or an error it cannot go on from; patch 44).
    pub fn is_running(&self) -> bool {
        !*self.stopped.borrow()
    }

    /// Becomes `true` when the router's thread ends.
    pub fn stopped(&self) -> tokio::sync::watch::Receiver<bool> {
        self.stopped.clone()
    }

    /// How many sessions the router keeps beyond their connection now
    /// (connected or not; patch 22).
    pub fn kept_sessions(&self) -> usize {
        self.subscriptions.kept_sessions()
    }

    /// How many retained messages the router holds now.
    pub fn retained_messages(&self) -> usize {
        self.retained.load(Ordering::Relaxed)
    }

    /// The message logs the router holds now (one per filter some
    /// subscription uses, and the private logs of restored sessions) and
    /// the bytes of topic and payload in them.
    pub fn filter_logs(&self) -> &LogCounts {
        &self.logs
    }

    /// The shared subscriptions (`$share/g/filter`) with members connected
    /// here, as they change (patch 28).
    pub fn shared_groups(
        &self,
    ) -> tokio::sync::watch::Receiver<std::collections::BTreeSet<String>> {
        self.groups.clone()
    }

    /// Who subscribes to what, by client id (see [`Subscriptions`]).
    pub fn subscriptions(&self) -> &Arc<Subscriptions> {
        &self.subscriptions
    }

    /// Gives the router back what the journal kept (see [`Restore`]);
    /// returns once the router has it. Call before any client connects.
    pub async fn restore(&self, restore: Restore) -> Result<(), LinkRefused> {
        let (done, restored) = flume::bounded(1);
        let gone = || LinkRefused::new("the router is not running".to_owned());
        self.tx
            .send_async((0, Event::Restore(restore, done)))
            .await
            .map_err(|_| gone())?;
        restored.recv_async().await.map_err(|_| gone())
    }

    /// Replaces the session the router keeps for `client_id` (its client
    /// not connected here) with `session`, or discards it (`None`; a
    /// connected client's session then ends with its connection). Returns
    /// whether it was done: a replacement is not made while the client is
    /// connected here, nor beyond `max_kept_sessions` (patch 26).
    pub async fn replace_session(
        &self,
        client_id: &str,
        session: Option<RestoredSession>,
    ) -> Result<bool, LinkRefused> {
        self.replace_session_then(client_id, session, || {}).await
    }

    /// [`RouterHandle::replace_session`], calling `queued` once the
    /// replacement is in the router's queue, before the router takes it:
    /// what any link sends after that comes after it (patch 26).
    pub async fn replace_session_then(
        &self,
        client_id: &str,
        session: Option<RestoredSession>,
        queued: impl FnOnce(),
    ) -> Result<bool, LinkRefused> {
        let (done, replaced) = flume::bounded(1);
        let gone = || LinkRefused::new("the router is not running".to_owned());
        self.tx
            .send_async((0, Event::Replace(client_id.to_owned(), session, done)))
            .await
            .map_err(|_| gone())?;
        queued();
        replaced.recv_async().await.map_err(|_| gone())
    }

    /// Registers a connection with the router and returns its link and the
    /// router's CONNACK.
    /// `clean_start`: discard a session the router keeps for `client_id`;
    /// `session_expiry`: seconds the router keeps this session after the
    /// link ends (0: not at all, `u32::MAX`: for ever); `queue_full`: what
    /// a publish does when it would push out of a log what this session
    /// has not had (`None`: the router's setting).
    pub async fn link(
        &self,
        client_id: &str,
        clean_start: bool,
        session_expiry: u32,
        queue_full: Option<crate::QueueFull>,
    ) -> Result<Link, LinkRefused> {
        LinkBuilder::new(client_id, self.tx.clone())
            .clean_session(clean_start)
            .session_expiry(session_expiry)
            .queue_full(queue_full)
            // A publish to a topic nobody subscribes to is fine (rumqttd
            // would otherwise disconnect the publisher).
            .dynamic_filters(true)
            // No broker-side topic aliases: delivery checks need topics.
            .topic_alias_max(0)
            .build_async()
            .await
            .map_err(LinkRefused::from)
    }

    /// Resumes `client_id`'s session on a link that ends it (session
    /// expiry 0) and is told, with `Notification::CaughtUp`, once the
    /// router has given it everything the session had waiting (statebroker
    /// patch 48): a session handed over to another node is taken whole
    /// without guessing from the time.
    pub async fn link_for_backlog(&self, client_id: &str) -> Result<Link, LinkRefused> {
        LinkBuilder::new(client_id, self.tx.clone())
            .clean_session(false)
            .session_expiry(0)
            .dynamic_filters(true)
            .topic_alias_max(0)
            .tell_caught_up(true)
            .build_async()
            .await
            .map_err(LinkRefused::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::{LinkRx, LinkTx};
    use crate::protocol::{
        Filter, Packet, PubAck, PubAckReason, Publish, QoS, RetainForwardRule, Subscribe,
    };

    fn router() -> RouterHandle {
        router_with(None)
    }

    /// [`router`] with `journal`.
    fn router_with(journal: Option<Arc<dyn crate::Journal>>) -> RouterHandle {
        let config = RouterConfig {
            max_connections: 10,
            max_outgoing_packet_count: 200,
            max_segment_size: 1 << 20,
            max_segment_count: 4,
            ..RouterConfig::default()
        };
        RouterHandle::spawn(0, config, 0, journal)
    }

    /// The router's thread is watched (patch 44): a running router says
    /// so, and a thread spawned the same way that panics is seen stopped
    /// (its guard sets the flag as it unwinds).
    #[tokio::test]
    async fn a_router_thread_that_panics_is_seen_stopped() {
        let router = router();
        assert!(router.is_running());
        assert!(!*router.stopped().borrow());
        let (tx, mut stopped) = tokio::sync::watch::channel(false);
        crate::router::spawn_watched("panics".into(), tx, || panic!("a bug (on purpose)"));
        tokio::time::timeout(std::time::Duration::from_secs(10), stopped.wait_for(|s| *s))
            .await
            .expect("seen stopped")
            .unwrap();
    }

    /// Collects forwarded publishes' packet ids until `count` arrived or
    /// nothing more comes for a while.
    async fn forwarded(rx: &mut LinkRx, count: usize) -> Vec<u16> {
        let mut pkids = Vec::new();
        while pkids.len() < count {
            let next = tokio::time::timeout(std::time::Duration::from_millis(300), rx.next());
            match next.await {
                Ok(Ok(Some(Notification::Forward(f)))) => pkids.push(f.publish.pkid),
                Ok(Ok(Some(Notification::Unschedule))) => rx.wake().await.unwrap(),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => panic!("{e}"),
                Err(_) => break,
            }
        }
        pkids
    }

    /// A SUBSCRIBE to `t` at `qos`.
    fn subscribe_to_t(qos: QoS) -> Packet {
        let subscribe = Subscribe {
            pkid: 1,
            filters: vec![Filter {
                path: "t".into(),
                qos,
                nolocal: false,
                preserve_retain: false,
                retain_forward_rule: RetainForwardRule::OnEverySubscribe,
            }],
        };
        Packet::Subscribe(subscribe, None)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_router_numbers_deliveries_within_its_range() {
        let router = router();
        let (mut sub_tx, mut sub_rx, _) = router.link("sub", true, 0, None).await.unwrap();
        sub_tx.send_all([subscribe_to_t(QoS::AtLeastOnce)]).unwrap();
        // The SUBACK.
        loop {
            if let Ok(Some(Notification::DeviceAck(_))) = sub_rx.next().await {
                break;
            }
        }
        let (mut pub_tx, _pub_rx, _) = router.link("pub", true, 0, None).await.unwrap();
        let total = usize::from(MAX_ROUTER_PKID) + 50;
        let publishes = (0..total).map(|n| {
            let mut publish = Publish::new("t", "x", false);
            publish.qos = QoS::AtLeastOnce;
            publish.pkid = (n % 60000 + 1) as u16;
            Packet::Publish(publish, None)
        });
        pub_tx.send_all(publishes).unwrap();
        let first = forwarded(&mut sub_rx, total).await;
        assert_eq!(
            first,
            (1..=MAX_ROUTER_PKID).collect::<Vec<_>>(),
            "the router sends 1..=MAX_ROUTER_PKID before it waits for acknowledgements"
        );
        // Acknowledge them all: the rest come, numbered from 1 again.
        let acks = first.into_iter().map(|pkid| {
            let ack = PubAck {
                pkid,
                reason: PubAckReason::Success,
            };
            Packet::PubAck(ack, None)
        });
        sub_tx.send_all(acks).unwrap();
        let rest = forwarded(&mut sub_rx, 50).await;
        assert_eq!(rest.len(), 50);
        assert!(
            rest.iter().all(|&p| (1..=MAX_ROUTER_PKID).contains(&p)),
            "{rest:?}"
        );
    }

    /// A link subscribed to `path` at QoS 0, its SUBACK received.
    async fn subscribed(router: &RouterHandle, client_id: &str, path: &str) -> (LinkTx, LinkRx) {
        let (mut tx, mut rx, _) = router.link(client_id, true, 0, None).await.unwrap();
        let filter = Filter {
            path: path.into(),
            qos: QoS::AtMostOnce,
            nolocal: false,
            preserve_retain: false,
            retain_forward_rule: RetainForwardRule::OnEverySubscribe,
        };
        let subscribe = Subscribe {
            pkid: 1,
            filters: vec![filter],
        };
        tx.send_all([Packet::Subscribe(subscribe, None)]).unwrap();
        loop {
            if let Ok(Some(Notification::DeviceAck(_))) = rx.next().await {
                return (tx, rx);
            }
        }
    }

    /// The payloads forwarded to `rx` until nothing comes for a while;
    /// each must be without a [`crate::NOT_FOR_GROUP`] mark.
    async fn payloads(rx: &mut LinkRx) -> Vec<String> {
        let mut got = Vec::new();
        loop {
            let next = tokio::time::timeout(std::time::Duration::from_millis(300), rx.next());
            match next.await {
                Ok(Ok(Some(Notification::Forward(f)))) => {
                    let marks = f.properties.iter().flat_map(|p| &p.user_properties);
                    assert!(
                        marks.clone().all(|(k, _)| k != crate::NOT_FOR_GROUP),
                        "delivered with its marks: {:?}",
                        f.properties
                    );
                    got.push(String::from_utf8_lossy(&f.publish.payload).into_owned());
                }
                Ok(Ok(Some(Notification::Unschedule))) => rx.wake().await.unwrap(),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => panic!("{e}"),
                Err(_) => return got,
            }
        }
    }

    /// Patch 28: a publish marked not for a shared subscription passes it
    /// over (and the others get it, unmarked); the groups with members
    /// here are watched as they come and go.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_publish_marked_not_for_a_group_passes_it_over() {
        let router = router();
        let mut groups = router.shared_groups();
        let (g_tx, mut g_rx) = subscribed(&router, "g", "$share/g/t").await;
        let (_h_tx, mut h_rx) = subscribed(&router, "h", "$share/h/t").await;
        let (_plain_tx, mut plain_rx) = subscribed(&router, "plain", "t").await;
        let both = ["$share/g/t".to_owned(), "$share/h/t".to_owned()];
        let joined = groups.wait_for(|g| g.iter().eq(both.iter()));
        tokio::time::timeout(std::time::Duration::from_secs(10), joined)
            .await
            .expect("both groups watched")
            .unwrap();

        let (mut pub_tx, _pub_rx, _) = router.link("pub", true, 0, None).await.unwrap();
        let mark = crate::protocol::PublishProperties {
            user_properties: vec![
                (crate::NOT_FOR_GROUP.into(), "$share/g/t".into()),
                ("kept".into(), "yes".into()),
            ],
            ..Default::default()
        };
        pub_tx
            .send_all([
                Packet::Publish(Publish::new("t", "1", false), Some(mark)),
                Packet::Publish(Publish::new("t", "2", false), None),
            ])
            .unwrap();
        assert_eq!(payloads(&mut g_rx).await, ["2"]);
        assert_eq!(payloads(&mut h_rx).await, ["1", "2"]);
        assert_eq!(payloads(&mut plain_rx).await, ["1", "2"]);

        let mut g_tx = g_tx;
        let disconnect = crate::protocol::Disconnect {
            reason_code: crate::protocol::DisconnectReasonCode::NormalDisconnection,
        };
        g_tx.send_all([Packet::Disconnect(disconnect, None)])
            .unwrap();
        let left = groups.wait_for(|g| g.iter().eq(both[1..].iter()));
        tokio::time::timeout(std::time::Duration::from_secs(10), left)
            .await
            .expect("the group ends with its last member")
            .unwrap();
    }

    /// A QoS 2 publish of `payload` on `t` with packet id `pkid`.
    fn qos2(pkid: u16, payload: &'static str) -> Packet {
        let mut publish = Publish::new("t", payload, false);
        publish.qos = QoS::ExactlyOnce;
        publish.pkid = pkid;
        Packet::Publish(publish, None)
    }

    /// The PUBREL of `pkid`, marked [`crate::DISCARD`] if `discard`.
    fn pubrel(pkid: u16, discard: bool) -> Packet {
        use crate::protocol::{PubRel, PubRelProperties, PubRelReason};
        let mark = discard.then(|| PubRelProperties {
            reason_string: None,
            user_properties: vec![(crate::DISCARD.into(), String::new())],
        });
        let pubrel = PubRel {
            pkid,
            reason: PubRelReason::Success,
        };
        Packet::PubRel(pubrel, mark)
    }

    /// The next `count` PUBCOMPs `rx` gets: packet ids and reasons.
    async fn pubcomps(rx: &mut LinkRx, count: usize) -> Vec<(u16, crate::protocol::PubCompReason)> {
        let mut completed = Vec::new();
        while completed.len() < count {
            let next = tokio::time::timeout(std::time::Duration::from_secs(10), rx.next());
            match next.await.expect("PUBCOMPs in time").unwrap() {
                Some(Notification::DeviceAck(crate::router::Ack::PubComp(c))) => {
                    completed.push((c.pkid, c.reason))
                }
                Some(Notification::Unschedule) => rx.wake().await.unwrap(),
                _ => {}
            }
        }
        completed
    }

    /// Patch 37: routing a publish, its acknowledgement and its delivery
    /// creates no tracing span at the broker's default level for the
    /// router (WARN): spans per event, per batch and per publish were
    /// formatted for every message (43% of a fan-in's instructions).
    /// Spans are counted process-wide; no other test of this crate sets a
    /// subscriber, and none creates a span at WARN.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn routing_a_publish_creates_no_span_at_warn() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tracing::span::{Attributes, Id, Record};
        use tracing::{Event, Level, Metadata};

        static SPANS: AtomicUsize = AtomicUsize::new(0);
        /// Enables WARN and ERROR; counts the spans it is asked to make.
        struct Spans;
        impl tracing::Subscriber for Spans {
            fn enabled(&self, metadata: &Metadata<'_>) -> bool {
                *metadata.level() <= Level::WARN
            }
            fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
                Some(tracing::level_filters::LevelFilter::WARN)
            }
            fn new_span(&self, _: &Attributes<'_>) -> Id {
                SPANS.fetch_add(1, Ordering::SeqCst);
                Id::from_u64(1)
            }
            fn record(&self, _: &Id, _: &Record<'_>) {}
            fn record_follows_from(&self, _: &Id, _: &Id) {}
            fn event(&self, _: &Event<'_>) {}
            fn enter(&self, _: &Id) {}
            fn exit(&self, _: &Id) {}
        }
        tracing::subscriber::set_global_default(Spans).expect("the only subscriber");

        let router = router();
        let (_sub_tx, mut sub_rx) = subscribed(&router, "sub", "t").await;
        let (mut pub_tx, mut pub_rx, _) = router.link("pub", true, 0, None).await.unwrap();
        let mut publish = Publish::new("t", "counted", false);
        publish.qos = QoS::AtLeastOnce;
        publish.pkid = 1;
        pub_tx.send_all([Packet::Publish(publish, None)]).unwrap();
        assert_eq!(payloads(&mut sub_rx).await, ["counted"]);
        loop {
            match pub_rx.next().await.unwrap() {
                Some(Notification::DeviceAck(crate::router::Ack::PubAck(_))) => break,
                Some(Notification::Unschedule) => pub_rx.wake().await.unwrap(),
                _ => {}
            }
        }
        assert_eq!(SPANS.load(Ordering::SeqCst), 0, "spans made at WARN");
    }

    /// Patch 42: a client's PUBLISH with a Subscription Identifier
    /// ([MQTT-3.3.4-6]) ends its link with DISCONNECT 0x82 Protocol Error
    /// (it was 0x81); a PUBLISH without one just before it is routed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_publish_with_a_subscription_identifier_is_a_protocol_error() {
        use crate::protocol::{DisconnectReasonCode, PublishProperties};
        let router = router();
        let (_sub_tx, mut sub_rx) = subscribed(&router, "sub", "t").await;
        let (mut pub_tx, mut pub_rx, _) = router.link("pub", true, 0, None).await.unwrap();
        let properties = PublishProperties {
            subscription_identifiers: vec![3],
            ..PublishProperties::default()
        };
        pub_tx
            .send_all([
                Packet::Publish(Publish::new("t", "fine", false), None),
                Packet::Publish(Publish::new("t", "with id", false), Some(properties)),
            ])
            .unwrap();
        assert_eq!(payloads(&mut sub_rx).await, ["fine"]);
        loop {
            match pub_rx.next().await.unwrap() {
                Some(Notification::Disconnect(disconnect, _)) => {
                    assert_eq!(disconnect.reason_code, DisconnectReasonCode::ProtocolError);
                    break;
                }
                Some(Notification::Unschedule) => pub_rx.wake().await.unwrap(),
                _ => {}
            }
        }
    }

    /// Patch 35: a PUBREL marked [`crate::DISCARD`] completes its QoS 2
    /// publish (PUBCOMP "success") and delivers nothing; one without the
    /// mark releases its publish as before.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pubrel_marked_discard_delivers_nothing() {
        use crate::protocol::PubCompReason;
        let router = router();
        let (_sub_tx, mut sub_rx) = subscribed(&router, "sub", "t").await;
        let (mut pub_tx, mut pub_rx, _) = router.link("pub", true, 0, None).await.unwrap();
        pub_tx
            .send_all([
                qos2(1, "had already"),
                qos2(2, "new"),
                pubrel(1, true),
                pubrel(2, false),
            ])
            .unwrap();
        // Released in order: the discarded one would come first.
        assert_eq!(payloads(&mut sub_rx).await, ["new"]);
        assert_eq!(
            pubcomps(&mut pub_rx, 2).await,
            [(1, PubCompReason::Success), (2, PubCompReason::Success)]
        );
    }

    /// Patch 35: what the journal saved of a discarded QoS 2 publish for
    /// a kept session is forgotten, as a delivered one's is.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_discarded_publish_is_forgotten_by_the_journal() {
        use crate::{Journal, Message, MessageId, Receipt, SessionRecord};

        /// Saves every queued message as number 7; records deliveries.
        #[derive(Default)]
        struct Recording(parking_lot::Mutex<Vec<(String, MessageId)>>);
        impl Journal for Recording {
            fn session(&self, _: &str, _: Option<&SessionRecord>) -> Option<Receipt> {
                None
            }
            fn retained(&self, _: &str, _: Option<&Message>) -> Option<Receipt> {
                None
            }
            fn queued(&self, _: &[&str], _: &Message) -> Option<(MessageId, Option<Receipt>)> {
                Some((MessageId(7), None))
            }
            fn delivered(&self, client: &str, message: MessageId) {
                self.0.lock().push((client.to_owned(), message));
            }
        }

        let journal = Arc::new(Recording::default());
        let router = router_with(Some(journal.clone() as Arc<dyn Journal>));
        // A kept session (expiry above 0) subscribed to `t`.
        let (mut sub_tx, mut sub_rx, _) = router.link("sub", true, 60, None).await.unwrap();
        sub_tx.send_all([subscribe_to_t(QoS::AtLeastOnce)]).unwrap();
        while !matches!(sub_rx.next().await, Ok(Some(Notification::DeviceAck(_)))) {}
        let (mut pub_tx, mut pub_rx, _) = router.link("pub", true, 0, None).await.unwrap();
        pub_tx
            .send_all([qos2(1, "had already"), pubrel(1, true)])
            .unwrap();
        assert_eq!(pubcomps(&mut pub_rx, 1).await.len(), 1);
        assert_eq!(*journal.0.lock(), [("sub".to_owned(), MessageId(7))]);
        assert_eq!(forwarded(&mut sub_rx, 1).await, [] as [u16; 0]);
    }

    /// Patch 22: beyond `max_kept_sessions`, a link that would keep a
    /// session for a client id that has none is refused "quota exceeded";
    /// a client id that has one resumes, clean sessions are not counted,
    /// and a session that ends frees room.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kept_sessions_are_bounded() {
        let config = RouterConfig {
            max_connections: 10,
            max_outgoing_packet_count: 200,
            max_segment_size: 1 << 20,
            max_segment_count: 4,
            max_kept_sessions: 2,
            ..RouterConfig::default()
        };
        let router = RouterHandle::spawn(0, config, 0, None);
        let (a, _a_rx, _) = router.link("a", true, 60, None).await.unwrap();
        let (_b, _b_rx, _) = router.link("b", true, u32::MAX, None).await.unwrap();
        assert_eq!(router.kept_sessions(), 2);
        let refused = router
            .link("c", true, 60, None)
            .await
            .err()
            .expect("refused");
        assert!(refused.sessions_quota(), "{refused}");
        assert_eq!(router.kept_sessions(), 2, "nothing of c kept");
        let (_clean, _clean_rx, _) = router.link("clean", true, 0, None).await.unwrap();
        // a leaves and comes back: its session is resumed, at the bound.
        drop(a);
        let (_a, _a_rx, connack) = router.link("a", false, 60, None).await.unwrap();
        let resumed = matches!(
            Option::<Packet>::from(connack),
            Some(Packet::ConnAck(ack, _)) if ack.session_present
        );
        assert!(resumed, "a resumes at the bound");
        // a starts clean and keeps nothing: room for c.
        let (_a, _a_rx, _) = router.link("a", true, 0, None).await.unwrap();
        assert_eq!(router.kept_sessions(), 1);
        router.link("c", true, 60, None).await.unwrap();
        assert_eq!(router.kept_sessions(), 2);
    }

    /// A DISCONNECT keeping the session 60 s: the router takes it before
    /// any later event.
    fn leave(mut tx: LinkTx) {
        let disconnect = crate::protocol::Disconnect {
            reason_code: crate::protocol::DisconnectReasonCode::NormalDisconnection,
        };
        let properties = crate::protocol::DisconnectProperties {
            session_expiry_interval: Some(60),
            reason_string: None,
            user_properties: Vec::new(),
            server_reference: None,
        };
        tx.send_all([Packet::Disconnect(disconnect, Some(properties))])
            .unwrap();
    }

    /// Another node's copy of r's session: subscribed to `u` at QoS 1.
    fn r_elsewhere() -> RestoredSession {
        RestoredSession {
            client_id: "r".into(),
            filters: vec![(
                "u".into(),
                crate::SubOptions {
                    qos: 1,
                    ..Default::default()
                },
            )],
            expires_in: Some(std::time::Duration::from_secs(60)),
            queue_full: None,
            waiting: Vec::new(),
        }
    }

    /// Patch 26: a kept session is replaced by another node's copy (its
    /// subscriptions, not the old ones, route to it when its client comes
    /// back) or discarded; a connected client's session is not replaced,
    /// and one discarded ends with its connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kept_session_is_replaced_or_discarded() {
        let router = router();
        let subscriptions = Arc::clone(router.subscriptions());
        let (mut tx, mut rx, _) = router.link("r", true, 60, None).await.unwrap();
        tx.send_all([subscribe_to_t(QoS::AtLeastOnce)]).unwrap();
        while !matches!(rx.next().await, Ok(Some(Notification::DeviceAck(_)))) {}
        leave(tx);
        let elsewhere = r_elsewhere();
        assert!(router
            .replace_session("r", Some(elsewhere.clone()))
            .await
            .unwrap());
        assert_eq!(subscriptions.filters("r"), ["u"]);
        assert_eq!(router.kept_sessions(), 1);
        let (mut pub_tx, _pub_rx, _) = router.link("pub", true, 0, None).await.unwrap();
        let (_r_tx, mut r_rx, connack) = router.link("r", false, 60, None).await.unwrap();
        assert!(matches!(
            Option::<Packet>::from(connack),
            Some(Packet::ConnAck(ack, _)) if ack.session_present
        ));
        for topic in ["t", "u"] {
            let mut publish = Publish::new(topic, topic, false);
            publish.qos = QoS::AtLeastOnce;
            publish.pkid = 1;
            pub_tx.send_all([Packet::Publish(publish, None)]).unwrap();
        }
        // (Each publish's payload is its topic.)
        let topics = payloads(&mut r_rx).await;
        assert_eq!(topics, ["u"], "the replacement's subscriptions only");
        // Connected: not replaced; discarded, it ends with the connection.
        assert!(!router.replace_session("r", Some(elsewhere)).await.unwrap());
        assert!(router.replace_session("r", None).await.unwrap());
        assert_eq!(router.kept_sessions(), 1, "until the connection ends");
        // (The broker's DISCONNECT states the session's expiry: too late.)
        leave(_r_tx);
        while router.kept_sessions() != 0 || subscriptions.knows("r") {
            tokio::task::yield_now().await;
        }
        // Without a connection: gone at once.
        let (tx, _rx, _) = router.link("k", true, 60, None).await.unwrap();
        leave(tx);
        assert!(router.replace_session("k", None).await.unwrap());
        assert_eq!(router.kept_sessions(), 0);
    }

    /// Patch 26: what a link sends once a replacement is queued
    /// (`replace_session_then`) reaches the replacement.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn what_comes_after_a_queued_replacement_reaches_it() {
        let router = router();
        let (tx, _rx, _) = router.link("r", true, 60, None).await.unwrap();
        leave(tx);
        let (mut pub_tx, _pub_rx, _) = router.link("pub", true, 0, None).await.unwrap();
        let mut publish = Publish::new("u", "after", false);
        publish.qos = QoS::AtLeastOnce;
        publish.pkid = 1;
        let replaced = router
            .replace_session_then("r", Some(r_elsewhere()), || {
                pub_tx.send_all([Packet::Publish(publish, None)]).unwrap();
            })
            .await
            .unwrap();
        assert!(replaced);
        let (_r_tx, mut r_rx, _) = router.link("r", false, 60, None).await.unwrap();
        assert_eq!(payloads(&mut r_rx).await, ["after"]);
    }

    /// Patch 26: a resumed session's subscriptions are the connection's: an
    /// UNSUBSCRIBE removes them (it answered "no subscription existed" and
    /// the messages kept coming).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_resumed_subscription_can_be_unsubscribed() {
        let router = router();
        let (mut tx, mut rx, _) = router.link("r", true, 60, None).await.unwrap();
        tx.send_all([subscribe_to_t(QoS::AtLeastOnce)]).unwrap();
        while !matches!(rx.next().await, Ok(Some(Notification::DeviceAck(_)))) {}
        let disconnect = crate::protocol::Disconnect {
            reason_code: crate::protocol::DisconnectReasonCode::NormalDisconnection,
        };
        tx.send_all([Packet::Disconnect(disconnect, None)]).unwrap();
        let (mut tx, mut rx, _) = router.link("r", false, 60, None).await.unwrap();
        let unsubscribe = crate::protocol::Unsubscribe {
            pkid: 2,
            filters: vec!["t".into()],
        };
        tx.send_all([Packet::Unsubscribe(unsubscribe, None)])
            .unwrap();
        let reasons = loop {
            match rx.next().await {
                Ok(Some(Notification::DeviceAck(crate::router::Ack::UnsubAck(ack)))) => {
                    break ack.reasons;
                }
                Ok(Some(Notification::Unschedule)) => rx.wake().await.unwrap(),
                Ok(Some(_)) => {}
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(reasons, [crate::protocol::UnsubAckReason::Success]);
        assert!(router.subscriptions().filters("r").is_empty());
        let (mut pub_tx, _pub_rx, _) = router.link("pub", true, 0, None).await.unwrap();
        let mut publish = Publish::new("t", "x", false);
        publish.qos = QoS::AtLeastOnce;
        publish.pkid = 1;
        pub_tx.send_all([Packet::Publish(publish, None)]).unwrap();
        assert!(forwarded(&mut rx, 1).await.is_empty(), "unsubscribed");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn try_next_takes_what_is_ready_and_never_waits() {
        let router = router();
        let (mut tx, mut rx, _) = router.link("c", true, 0, None).await.unwrap();
        assert!(rx.try_next().unwrap().is_none(), "nothing yet");
        tx.send_all([Packet::PingReq(crate::protocol::PingReq)])
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            match rx.try_next().unwrap() {
                Some(Notification::DeviceAck(_)) => break,
                Some(_) => {}
                None => {
                    assert!(std::time::Instant::now() < deadline, "no PINGRESP");
                    tokio::task::yield_now().await;
                }
            }
        }
    }

    /// MQTT 5 4.4 [MQTT-4.4.0-1]: a resumed session's PUBRELs come right
    /// after the CONNACK, not with the next message for the client
    /// (statebroker patch 21).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_resumed_session_gets_its_pubrels_at_once() {
        use crate::protocol::{PubRec, PubRel};
        let router = router();
        let (mut sub_tx, mut sub_rx, _) = router.link("sub", false, 60, None).await.unwrap();
        sub_tx.send_all([subscribe_to_t(QoS::ExactlyOnce)]).unwrap();
        let (mut pub_tx, _pub_rx, _) = router.link("pub", true, 0, None).await.unwrap();
        let mut publish = Publish::new("t", "y", false);
        publish.qos = QoS::ExactlyOnce;
        publish.pkid = 1;
        // The router forwards a QoS 2 publish once it is released.
        let release = PubRel {
            pkid: 1,
            reason: crate::protocol::PubRelReason::Success,
        };
        pub_tx
            .send_all([
                Packet::Publish(publish, None),
                Packet::PubRel(release, None),
            ])
            .unwrap();
        let pkid = loop {
            match sub_rx.next().await.unwrap() {
                Some(Notification::Forward(f)) => break f.publish.pkid,
                Some(Notification::Unschedule) => sub_rx.wake().await.unwrap(),
                _ => {}
            }
        };
        let pubrec = PubRec {
            pkid,
            reason: crate::protocol::PubRecReason::Success,
        };
        sub_tx.send_all([Packet::PubRec(pubrec, None)]).unwrap();
        loop {
            let next = sub_rx.next().await.unwrap();
            if let Some(Notification::DeviceAck(crate::Ack::PubRel(rel))) = next {
                assert_eq!(rel.pkid, pkid);
                break;
            }
        }
        // The client id links again, resuming the session: nothing else
        // is published.
        let (_tx, mut rx, _) = router.link("sub", false, 60, None).await.unwrap();
        let next = tokio::time::timeout(std::time::Duration::from_secs(2), rx.next());
        match next.await {
            Ok(Ok(Some(Notification::DeviceAck(crate::Ack::PubRel(rel))))) => {
                assert_eq!(rel.pkid, pkid)
            }
            other => panic!("expected the PUBREL at once, got {other:?}"),
        }
    }

    /// Patch 48: a link built for a session's backlog gets everything the
    /// session had waiting (more than the router sends before it waits
    /// for acknowledgements), then `CaughtUp` once; what comes after
    /// still comes; an empty session's link is told at once, and a link
    /// that did not ask is never told.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_backlog_link_is_told_when_it_has_the_whole_backlog() {
        use std::time::Duration;
        let router = router();
        let (mut sub_tx, mut sub_rx, _) = router.link("sub", false, 60, None).await.unwrap();
        sub_tx.send_all([subscribe_to_t(QoS::AtLeastOnce)]).unwrap();
        loop {
            if let Ok(Some(Notification::DeviceAck(_))) = sub_rx.next().await {
                break;
            }
        }
        let (empty_tx, _empty_rx, _) = router.link("empty", false, 60, None).await.unwrap();
        drop((sub_tx, sub_rx, empty_tx));
        let (mut pub_tx, mut pub_rx, _) = router.link("pub", true, 0, None).await.unwrap();
        let total = usize::from(MAX_ROUTER_PKID) * 2 + 30;
        let publishes = (0..total).map(|n| {
            let mut publish = Publish::new("t".to_string(), n.to_string(), false);
            publish.qos = QoS::AtLeastOnce;
            publish.pkid = (n + 1) as u16;
            Packet::Publish(publish, None)
        });
        pub_tx.send_all(publishes).unwrap();
        // The publisher's PUBACKs: every publish is in the log.
        let mut acked = 0;
        while acked < total {
            match pub_rx.next().await.unwrap() {
                Some(Notification::DeviceAck(_)) => acked += 1,
                Some(Notification::Unschedule) => pub_rx.wake().await.unwrap(),
                other => panic!("{other:?}"),
            }
        }

        let (mut tx, mut rx, _) = router.link_for_backlog("sub").await.unwrap();
        let mut payloads = Vec::new();
        loop {
            let next = tokio::time::timeout(Duration::from_secs(10), rx.next());
            match next.await.expect("the backlog, then CaughtUp").unwrap() {
                Some(Notification::Forward(f)) => {
                    payloads.push(String::from_utf8(f.publish.payload.to_vec()).unwrap());
                    let ack = PubAck {
                        pkid: f.publish.pkid,
                        reason: PubAckReason::Success,
                    };
                    tx.send_all([Packet::PubAck(ack, None)]).unwrap();
                }
                Some(Notification::Unschedule) => rx.wake().await.unwrap(),
                Some(Notification::CaughtUp) => break,
                _ => {}
            }
        }
        let expected: Vec<String> = (0..total).map(|n| n.to_string()).collect();
        assert_eq!(
            payloads, expected,
            "the whole backlog, in order, before CaughtUp"
        );
        // A later publish still comes, and CaughtUp is not told again.
        let mut publish = Publish::new("t", "later", false);
        publish.qos = QoS::AtLeastOnce;
        publish.pkid = 1;
        pub_tx.send_all([Packet::Publish(publish, None)]).unwrap();
        loop {
            let next = tokio::time::timeout(Duration::from_secs(10), rx.next());
            match next.await.expect("the later publish").unwrap() {
                Some(Notification::Forward(f)) => {
                    assert_eq!(&f.publish.payload[..], b"later");
                    break;
                }
                Some(Notification::CaughtUp) => panic!("told twice"),
                _ => {}
            }
        }

        // An empty session: told at once.
        let (_tx, mut rx, _) = router.link_for_backlog("empty").await.unwrap();
        let next = tokio::time::timeout(Duration::from_secs(10), rx.next());
        match next.await.expect("CaughtUp").unwrap() {
            Some(Notification::CaughtUp) => {}
            other => panic!("expected CaughtUp, got {other:?}"),
        }
        // The publisher's link never asked: acknowledgements only.
        while let Ok(next) = tokio::time::timeout(Duration::from_millis(200), pub_rx.next()).await {
            let next = next.unwrap();
            assert!(
                !matches!(next, Some(Notification::CaughtUp)),
                "told unasked"
            );
        }
    }

    /// Patch 25: a kept session's own `queue_full` wins over the router's.
    /// One that chose `Refuse` is not overrun where the router drops the
    /// oldest: a publish that would push out of the log what it has not had
    /// is answered "quota exceeded"; one that chose `DropOldest` loses the
    /// oldest where the router refuses, and the publisher is never refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_session_that_chose_refuse_is_not_overrun() {
        use crate::protocol::{Disconnect, DisconnectReasonCode};
        use crate::{Ack, QueueFull};
        let cases = [
            (QueueFull::DropOldest, Some(QueueFull::Refuse), true),
            (QueueFull::DropOldest, None, false),
            (QueueFull::Refuse, Some(QueueFull::DropOldest), false),
            (QueueFull::Refuse, None, true),
        ];
        for (default, choice, refuses) in cases {
            // Filter logs of 2 KiB: about 18 publishes of 100 bytes.
            let config = RouterConfig {
                max_connections: 10,
                max_outgoing_packet_count: 200,
                max_segment_size: 1024,
                max_segment_count: 2,
                queue_full: default,
                ..RouterConfig::default()
            };
            let router = RouterHandle::spawn(0, config, 0, None);
            let (mut sub_tx, mut sub_rx, _) = router.link("sub", false, 60, choice).await.unwrap();
            sub_tx.send_all([subscribe_to_t(QoS::AtLeastOnce)]).unwrap();
            loop {
                if let Ok(Some(Notification::DeviceAck(Ack::SubAck(_)))) = sub_rx.next().await {
                    break;
                }
            }
            // Offline, its session kept.
            let disconnect = Disconnect {
                reason_code: DisconnectReasonCode::NormalDisconnection,
            };
            sub_tx
                .send_all([Packet::Disconnect(disconnect, None)])
                .unwrap();
            let (mut pub_tx, mut pub_rx, _) = router.link("pub", true, 0, None).await.unwrap();
            const PAYLOAD: &str = "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789";
            let total = 100;
            let publishes = (1..=total).map(|pkid| {
                let mut publish = Publish::new("t", PAYLOAD, false);
                publish.qos = QoS::AtLeastOnce;
                publish.pkid = pkid;
                Packet::Publish(publish, None)
            });
            pub_tx.send_all(publishes).unwrap();
            let mut reasons = Vec::new();
            while reasons.len() < usize::from(total) {
                match pub_rx.next().await.unwrap() {
                    Some(Notification::DeviceAck(Ack::PubAck(ack))) => reasons.push(ack.reason),
                    Some(Notification::Unschedule) => pub_rx.wake().await.unwrap(),
                    _ => {}
                }
            }
            let refused = reasons
                .iter()
                .filter(|r| **r == PubAckReason::QuotaExceeded)
                .count();
            let accepted = reasons
                .iter()
                .take_while(|r| **r == PubAckReason::Success)
                .count();
            if refuses {
                assert!(
                    (5..40).contains(&accepted) && refused == usize::from(total) - accepted,
                    "{default:?}, {choice:?}: the log's worth accepted, the rest refused: {reasons:?}"
                );
            } else {
                assert_eq!(refused, 0, "{default:?}, {choice:?}: {reasons:?}");
            }
        }
    }
}
