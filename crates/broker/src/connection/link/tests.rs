use super::*;
use router::protocol::{Filter, Publish, QoS, RetainForwardRule, Subscribe};

/// A router for these tests: `outgoing` packets waiting per link at
/// most, `journal` its journal.
fn test_router(
    outgoing: u64,
    journal: Option<std::sync::Arc<dyn router::Journal>>,
) -> RouterHandle {
    let config = router::RouterConfig {
        max_connections: 10,
        max_segment_size: 1 << 20,
        max_segment_count: 2,
        max_outgoing_packet_count: outgoing,
        ..router::RouterConfig::default()
    };
    RouterHandle::spawn(0, config, 0, journal)
}

/// `link` subscribed to `t` at `qos`, once the router said so (its
/// SUBACK read).
async fn subscribed_to_t(link: &mut RouterLink, qos: QoS) {
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
    link.send(&mut vec![Packet::Subscribe(subscribe, None)])
        .await
        .unwrap();
    while !matches!(link.next().await, Ok(Some(Notification::DeviceAck(_)))) {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joins_the_router_only_when_something_is_sent() {
    let router = test_router(10, None);
    let (mut link, present) = RouterLink::open(&router, "c", true, 0, None, true)
        .await
        .unwrap();
    assert!(!present);
    link.send(&mut Vec::new()).await.unwrap();
    assert!(!link.is_linked(), "nothing to send: no link");
    assert!(link.next_ready().is_none());
    let mut batch = vec![
        Packet::Publish(Publish::new("t", "x", false), None),
        Packet::Publish(Publish::new("t", "y", false), None),
    ];
    link.send(&mut batch).await.unwrap();
    assert!(link.is_linked());
    assert!(batch.is_empty(), "the batch went out");
    // A persistent session links at once.
    let (link, present) = RouterLink::open(&router, "p", false, 60, None, false)
        .await
        .unwrap();
    assert!(link.is_linked() && !present);
}

/// Every delivery arrives when the link is looked at as the
/// connection's loop does: `next` in a `select!` that another branch
/// often wins (its future dropped while Pending), then what else is
/// ready by `next_ready`. The link is looked at again only once it
/// woke (see `waiting::WhileWaiting::poll_when_woken`): a wake missed
/// would leave deliveries waiting, and the test at its timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_arrive_whatever_took_them_last() {
    const MESSAGES: usize = 2_000;
    let router = test_router(10_000, None);
    let (mut sub, _) = RouterLink::open(&router, "s", false, 60, None, false)
        .await
        .unwrap();
    subscribed_to_t(&mut sub, QoS::AtMostOnce).await;
    let (mut tx, _rx, _) = router.link("p", true, 0, None).await.unwrap();
    let publisher = tokio::spawn(async move {
        let mut sent = 0;
        let mut burst = 1;
        while sent < MESSAGES {
            let n = burst.min(MESSAGES - sent);
            tx.send_all((0..n).map(|_| Packet::Publish(Publish::new("t", "x", false), None)))
                .unwrap();
            sent += n;
            burst = burst % 7 + 1;
            tokio::task::yield_now().await;
        }
        tx
    });
    let received = async {
        let mut received = 0;
        while received < MESSAGES {
            // Another branch that wins now or after a while: the link
            // is looked at between, or waited on.
            let first = tokio::select! {
                n = sub.next() => n.unwrap(),
                () = tokio::task::yield_now(), if received % 2 == 0 => None,
                () = tokio::time::sleep(std::time::Duration::from_millis(1)) => None,
            };
            let (mut forwards, mut unscheduled) = (0, false);
            for n in first
                .into_iter()
                .chain(std::iter::from_fn(|| sub.next_ready()))
            {
                match n {
                    Notification::Forward(_) => forwards += 1,
                    // The router waits for the link to ask for more.
                    Notification::Unschedule => unscheduled = true,
                    _ => {}
                }
            }
            if unscheduled {
                sub.wake().await.unwrap();
            }
            received += forwards;
        }
        received
    };
    let received = tokio::time::timeout(std::time::Duration::from_secs(60), received)
        .await
        .expect("every delivery arrived");
    assert_eq!(received, MESSAGES);
    drop(publisher.await.unwrap());
}

/// What the router gives a session held for a handover stays held
/// while the handed-over messages keep coming ([`RouterLink::hold_on`]),
/// past the first wait, but never past [`MAX_HOLD`] after the hold
/// began; a link that holds nothing is not made to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_lasts_while_the_handover_goes_on() {
    use std::time::Duration;
    use tokio::time::Instant;
    let router = test_router(100, None);
    let (mut sub, _) = RouterLink::open(&router, "s", false, 60, None, false)
        .await
        .unwrap();
    subscribed_to_t(&mut sub, QoS::AtMostOnce).await;
    sub.hold_on(Instant::now(), Duration::from_secs(60));
    assert_eq!(sub.held_until, None, "no hold to make last");

    sub.hold_until(Instant::now() + Duration::from_millis(100));
    let (mut tx, _rx, _) = router.link("p", true, 0, None).await.unwrap();
    tx.send_all([Packet::Publish(Publish::new("t", "x", false), None)])
        .unwrap();
    // A handed-over message comes: the hold lasts a second from now.
    let extended = Instant::now();
    sub.hold_on(extended, Duration::from_secs(1));
    loop {
        match sub.next().await {
            Ok(Some(Notification::Forward(_))) => break,
            Ok(_) => {}
            Err(e) => panic!("{e:?}"),
        }
    }
    assert!(
        extended.elapsed() >= Duration::from_secs(1),
        "held a second after the last handed-over message: {:?}",
        extended.elapsed()
    );

    sub.hold_until(Instant::now() + Duration::from_millis(10));
    let by = sub.hold_ends_by.unwrap();
    sub.hold_on(Instant::now(), MAX_HOLD * 2);
    assert_eq!(sub.held_until, Some(by), "never past MAX_HOLD");
}

/// A QoS 2 delivery whose copy the cluster's queue must first mark in
/// flight in etcd waits until it says so, and what the router gives
/// after it waits behind it; then both come, in order, and the
/// PUBREL of one waits the same way (for its copy to go).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qos2_delivery_and_its_pubrel_wait_for_the_queue() {
    use crate::sessions::Sending;
    use router::protocol::{PubRec, PubRecReason, PubRel, PubRelReason};
    use router::{Journal, Message, MessageId, Receipt, SessionRecord};
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Numbers the messages it is told of 1, 2, ...
    #[derive(Default)]
    struct Numbering(AtomicU64);
    impl Journal for Numbering {
        fn session(&self, _: &str, _: Option<&SessionRecord>) -> Option<Receipt> {
            None
        }
        fn retained(&self, _: &str, _: Option<&Message>) -> Option<Receipt> {
            None
        }
        fn queued(&self, _: &[&str], _: &Message) -> Option<(MessageId, Option<Receipt>)> {
            Some((MessageId(self.0.fetch_add(1, Ordering::Relaxed) + 1), None))
        }
        fn delivered(&self, _: &str, _: MessageId) {}
    }

    let router = test_router(
        100,
        Some(std::sync::Arc::new(Numbering::default()) as std::sync::Arc<dyn Journal>),
    );
    let (mut sub, _) = RouterLink::open(&router, "s", false, 60, None, false)
        .await
        .unwrap();
    let (marked, heard) = tokio::sync::oneshot::channel();
    let heard = parking_lot::Mutex::new(Some(heard));
    let (gone, released) = tokio::sync::oneshot::channel();
    let released = parking_lot::Mutex::new(Some(released));
    let asked = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let seen = std::sync::Arc::clone(&asked);
    sub.ask_before_sending(Some(std::sync::Arc::new(
        move |client: &str, sending: Sending<'_>| {
            let (what, wait) = match sending {
                Sending::Publish { number, .. } => {
                    (format!("publish {}", number.0), number == MessageId(1))
                }
                Sending::PubRel(pkid) => (format!("pubrel {pkid}"), true),
            };
            seen.lock().push((client.to_owned(), what.clone()));
            match (wait, what.starts_with("pubrel")) {
                (false, _) => None,
                (true, false) => heard.lock().take(),
                (true, true) => released.lock().take(),
            }
        },
    )));
    subscribed_to_t(&mut sub, QoS::ExactlyOnce).await;
    let (mut tx, _rx, _) = router.link("p", true, 0, None).await.unwrap();
    for (pkid, payload) in [(1, "one"), (2, "two")] {
        let mut publish = Publish::new("t", payload, false);
        publish.qos = QoS::ExactlyOnce;
        publish.pkid = pkid;
        let pubrel = PubRel {
            pkid,
            reason: PubRelReason::Success,
        };
        tx.send_all([Packet::Publish(publish, None), Packet::PubRel(pubrel, None)])
            .unwrap();
    }
    let forwarded = |n: Notification| match n {
        Notification::Forward(f) => Some((f.publish.payload, f.publish.pkid)),
        _ => None,
    };
    // Until the first one's copy is gone, neither comes.
    let early = tokio::time::timeout(std::time::Duration::from_millis(500), async {
        loop {
            if let Ok(Some(n)) = sub.next().await
                && let Some(payload) = forwarded(n)
            {
                return payload;
            }
        }
    })
    .await;
    assert!(early.is_err(), "nothing before the mark: {early:?}");
    assert!(sub.next_ready().is_none());
    assert_eq!(
        *asked.lock(),
        [
            ("s".to_owned(), "publish 1".to_owned()),
            ("s".to_owned(), "publish 2".to_owned())
        ],
        "each asked once, in order"
    );
    marked.send(()).unwrap();
    let mut got = Vec::new();
    while got.len() < 2 {
        if let Some(delivery) = sub.next().await.unwrap().and_then(forwarded) {
            got.push(delivery);
        }
    }
    let payloads: Vec<_> = got.iter().map(|(payload, _)| payload.clone()).collect();
    assert_eq!(payloads, ["one", "two"]);
    // The client has the first: its PUBREL waits for the copy to go.
    let pkid = got[0].1;
    let pubrec = PubRec {
        pkid,
        reason: PubRecReason::Success,
    };
    sub.send(&mut vec![Packet::PubRec(pubrec, None)])
        .await
        .unwrap();
    let pubrel = |n: Notification| matches!(n, Notification::DeviceAck(router::Ack::PubRel(_)));
    let early = tokio::time::timeout(std::time::Duration::from_millis(500), async {
        while !sub.next().await.unwrap().is_some_and(pubrel) {}
    })
    .await;
    assert!(early.is_err(), "no PUBREL before the copy is gone");
    assert_eq!(
        asked.lock().last(),
        Some(&("s".to_owned(), format!("pubrel {pkid}")))
    );
    gone.send(()).unwrap();
    while !sub.next().await.unwrap().is_some_and(pubrel) {}
}

/// `close_with` returns once the router has closed the link, not at a
/// wake-up that finds nothing to read: the router wakes the link once
/// per push, and one read may take several pushes. Before, such a
/// wake-up ended the wait (199 times in the mqtt5, delivery,
/// protocol_edge and durable tests), and the socket closed before the
/// router had ended the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_waits_for_the_router_to_close_the_link() {
    use futures_util::FutureExt;
    let router = test_router(1000, None);
    for round in 0..20 {
        let (mut link, _) = RouterLink::open(&router, "c", true, 0, None, false)
            .await
            .unwrap();
        subscribed_to_t(&mut link, QoS::AtMostOnce).await;
        // Several pushes to the link (the pauses let the router push
        // each batch on its own), none read.
        let (mut tx, _rx, _) = router.link("p", true, 0, None).await.unwrap();
        for _ in 0..5 {
            let batch = (0..10).map(|_| Packet::Publish(Publish::new("t", "x", false), None));
            tx.send_all(batch).unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        link.close_with(&mut vec![goodbye(0)], std::time::Duration::from_secs(30))
            .await;
        assert!(
            matches!(link.next().now_or_never(), Some(Err(_))),
            "round {round}: the router closed the link"
        );
    }
}
