//! Issue #29 item 3: a persistent session resumes on any node. A client
//! that connects to another node with Clean Start 0 gets Session Present 1
//! and the subscriptions it had, whether the node it left is alive (which
//! ends its connection, 0x8E, and discards its copy) or was killed; a
//! clean start anywhere ends the session everywhere. Real etcd, real node
//! processes.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::mqtt::{kept_qos2_ids, publish_complete, publish_until_pubrec, pubrel_with};
use common::raw::{REQUEST_TOPIC, Raw, Recv, now_hlc, v5};
use common::{PATIENCE, Setup, addr, eventually, lines_with, metric};
use rumqttc::v5::mqttbytes::QoS;

const KEPT: &str = "statebroker_kept_sessions";
const HANDED_OVER: &str = "statebroker_cluster_sessions_handed_over_total";
/// Sessions every node keeps for the others' links (Clean Start 0).
const LINK_SESSIONS: f64 = 2.0;

/// Connects `client_id` to `port` with Clean Start `clean` and a Session
/// Expiry Interval of `expiry` s; returns it and Session Present.
async fn connect(port: u16, client_id: &str, clean: bool, expiry: u32) -> (Raw, bool) {
    let (raw, connack) = Raw::connect_with(addr(port), client_id, |c| {
        c.0.clean_start = clean;
        let mut properties = v5::ConnectProperties::new();
        properties.session_expiry_interval = Some(expiry);
        c.0.properties = Some(properties);
    })
    .await;
    assert_eq!(connack.code, v5::ConnectReturnCode::Success, "{connack:?}");
    (raw, connack.session_present)
}

async fn leave(mut client: Raw) {
    client
        .send(v5::Packet::Disconnect(v5::Disconnect::new(
            v5::DisconnectReasonCode::NormalDisconnection,
        )))
        .await;
}

/// The session record of `client_id` in etcd, as text (filters readable).
fn record(setup: &Setup, client_id: &str) -> Option<String> {
    let value = setup
        .etcd
        .get(&format!("/statebroker/S/{client_id}"))
        .unwrap();
    value.map(|v| String::from_utf8_lossy(&v).into_owned())
}

/// `client_id` connected to node 1 with a persistent session and
/// subscribed to `filter` at `qos`, once the session record in etcd has
/// the subscription (it is written just after the SUBACK).
async fn subscribed_in_etcd(setup: &Setup, client_id: &str, filter: &str, qos: QoS) -> Raw {
    let (mut c, _) = connect(setup.ports[0], client_id, false, 300).await;
    c.subscribe(filter, qos).await;
    eventually("the subscription in etcd", || {
        record(setup, client_id).is_some_and(|r| r.contains(filter))
    })
    .await;
    c
}

/// `client_id` connected to node 2 with Clean Start 0 (Session Present 1)
/// once node 1, which had its session, has handed it over.
async fn resumed_on_node_2(setup: &Setup, client_id: &str) -> Raw {
    let (c, present) = connect(setup.ports[1], client_id, false, 300).await;
    assert!(present, "Session Present 1 on another node");
    eventually("node 1 handed the session over", || {
        metric(setup.http[0], HANDED_OVER) == Some(1.0)
    })
    .await;
    c
}

/// The topics `client` receives within a short while (acknowledged).
async fn topics_within(client: &mut Raw, wait: Duration) -> Vec<String> {
    let messages = received_within(client, wait).await;
    messages.into_iter().map(|(topic, _)| topic).collect()
}

/// The topics `client` receives (each acknowledged) until it has `count`
/// of them, or [`PATIENCE`] has passed.
async fn topics_until(client: &mut Raw, count: usize) -> Vec<String> {
    let mut got = Vec::new();
    let deadline = Instant::now() + PATIENCE;
    while got.len() < count && Instant::now() < deadline {
        got.extend(topics_within(client, Duration::from_secs(1)).await);
    }
    got
}

/// The messages (topic, payload) `client` receives until none comes for
/// `wait` (each acknowledged).
async fn received_within(client: &mut Raw, wait: Duration) -> Vec<(String, String)> {
    received_until(client, wait, None).await
}

/// The same, stopping at `deadline` too.
async fn received_until(
    client: &mut Raw,
    wait: Duration,
    deadline: Option<Instant>,
) -> Vec<(String, String)> {
    let mut got = Vec::new();
    loop {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return got;
        }
        match client.recv_within(wait).await {
            Recv::Packet(v5::Packet::Publish(p)) => {
                if p.qos == QoS::AtLeastOnce {
                    client
                        .send(v5::Packet::PubAck(v5::PubAck::new(p.pkid, None)))
                        .await;
                }
                got.push((
                    String::from_utf8_lossy(&p.topic).into_owned(),
                    String::from_utf8_lossy(&p.payload).into_owned(),
                ));
            }
            Recv::Packet(_) => {}
            _ => return got,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_follows_its_client_from_node_to_node() {
    let setup = Setup::three_linked().await;
    let [p1, p3] = [setup.ports[0], setup.ports[2]];
    let (mut c, present) = connect(p1, "mover", false, 300).await;
    assert!(!present, "a new session");
    c.subscribe("s/a", QoS::AtLeastOnce).await;
    leave(c).await;
    // The record is written just after the SUBACK (it does not wait).
    eventually("the subscription in etcd", || {
        record(&setup, "mover").is_some_and(|r| r.contains("s/a"))
    })
    .await;

    // On node 2: the session, with its subscription.
    // Node 1 gives the session up (a message published before that may
    // come twice, see cluster/sessions.rs).
    let mut c = resumed_on_node_2(&setup, "mover").await;
    let (mut publisher, _) = connect(p3, "publisher", true, 0).await;
    publisher
        .publish("s/a", "to node 2", QoS::AtLeastOnce, None)
        .await;
    let p = c.next_publish().await;
    assert_eq!(
        (&p.topic[..], &p.payload[..]),
        (&b"s/a"[..], &b"to node 2"[..])
    );
    c.unsubscribe_many(&["s/a"]).await;
    c.subscribe("s/b", QoS::AtLeastOnce).await;
    leave(c).await;
    eventually("the new subscriptions in etcd", || {
        record(&setup, "mover").is_some_and(|r| r.contains("s/b") && !r.contains("s/a"))
    })
    .await;
    // Node 1 still kept its copy until node 2 took the client.
    eventually("node 1 discarded its copy", || {
        metric(setup.http[0], KEPT) == Some(LINK_SESSIONS)
    })
    .await;

    // Back on node 1: node 2's subscriptions, not node 1's old ones.
    let (mut c, present) = connect(p1, "mover", false, 300).await;
    assert!(present);
    eventually("node 2 handed the session over", || {
        metric(setup.http[1], HANDED_OVER) == Some(1.0)
    })
    .await;
    for topic in ["s/a", "s/b"] {
        publisher
            .publish(topic, topic, QoS::AtLeastOnce, None)
            .await;
    }
    let got = topics_within(&mut c, Duration::from_secs(2)).await;
    assert_eq!(got, ["s/b"], "the subscriptions it had on node 2");
    eventually("node 2 discarded its copy", || {
        metric(setup.http[1], KEPT) == Some(LINK_SESSIONS)
    })
    .await;

    // A clean start on node 3 ends the session everywhere.
    let (c3, present) = connect(p3, "mover", true, 0).await;
    assert!(!present);
    c.expect_disconnect().await;
    leave(c3).await;
    eventually("the session record gone", || {
        record(&setup, "mover").is_none()
    })
    .await;
    let (_c, present) = connect(p1, "mover", false, 300).await;
    assert!(!present, "no session after a clean start elsewhere");
}

/// A node whose owner record of a connected client went (as with its
/// lease: here deleted by the test) keeps its claim when the next write
/// of the session record finds that, so the client's CONNECT on another
/// node still ends the connection here (0x8E) and takes the session.
/// Before 2026-11-30 the claim was dropped: the old connection stayed up,
/// and a session kept after it collected the client's messages into
/// etcd's queue for the next node to give again (10,012 duplicates in a
/// long fault round, after every node's lease ended at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_outlives_its_owner_record_while_the_client_is_connected() {
    let setup = Setup::three_linked().await;
    let mut old = subscribed_in_etcd(&setup, "unowned", "u/1", QoS::AtLeastOnce).await;
    let deleted = setup
        .etcd
        .etcdctl()
        .args(["del", "/statebroker/C/unowned"])
        .output()
        .unwrap();
    assert!(deleted.status.success(), "{deleted:?}");
    // A change of the session: its record's write finds no owner.
    old.subscribe("u/2", QoS::AtLeastOnce).await;
    let node = &setup.nodes[0];
    eventually("the session record's write found no owner", || {
        lines_with(node, "session record not written: no node owns the client") > 0
    })
    .await;
    let (_new, present) = connect(setup.ports[1], "unowned", false, 300).await;
    assert!(present);
    match old.recv_within(PATIENCE).await {
        Recv::Packet(v5::Packet::Disconnect(d)) => {
            assert_eq!(d.reason_code, v5::DisconnectReasonCode::SessionTakenOver)
        }
        other => panic!("expected DISCONNECT 0x8E, got {other:?}"),
    }
}

/// The connection on the old node ends with 0x8E; the new node's
/// connection gets each message once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connected_client_that_moves_takes_its_session_along() {
    let setup = Setup::three_linked().await;
    let mut old = subscribed_in_etcd(&setup, "live", "l/#", QoS::AtLeastOnce).await;
    let (mut new, present) = connect(setup.ports[1], "live", false, 300).await;
    assert!(present);
    match old.recv_within(PATIENCE).await {
        Recv::Packet(v5::Packet::Disconnect(d)) => {
            assert_eq!(d.reason_code, v5::DisconnectReasonCode::SessionTakenOver)
        }
        other => panic!("expected DISCONNECT 0x8E, got {other:?}"),
    }
    eventually("node 1 handed the session over", || {
        metric(setup.http[0], HANDED_OVER) == Some(1.0)
    })
    .await;
    assert_eq!(metric(setup.http[0], KEPT), Some(LINK_SESSIONS));
    let (mut publisher, _) = connect(setup.ports[2], "publisher", true, 0).await;
    for n in 0..20 {
        publisher
            .publish(&format!("l/{n}"), "x", QoS::AtLeastOnce, None)
            .await;
    }
    let got = topics_within(&mut new, Duration::from_secs(2)).await;
    let expected: Vec<String> = (0..20).map(|n| format!("l/{n}")).collect();
    assert_eq!(got, expected, "each once, in order");
}

/// A session that moves from a node that stops (SIGTERM, a rolling
/// restart) to a node where its connection ends at once (here: a second
/// CONNECT, 0x82), and on to a third node: the node it broke on keeps no
/// copy, and when the client comes back there it gets what was published
/// meanwhile once. (Written after the short fault run on CI, 2026-11-30,
/// where a subscriber ended with 0x82 that way got the next 19 s of
/// messages a second time when it came back to that node; that came from
/// elsewhere: a stale word in the log of recent publishes, see
/// `cluster::recent`. The 0x82 itself is mended:
/// `a_routers_delivery_is_not_taken_for_a_kept_one_of_its_number`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_broke_as_it_left_a_stopping_node_leaves_no_copy_behind() {
    let mut setup = Setup::three_linked().await;
    let (mut c, _) = connect(setup.ports[2], "stop-broke", false, 300).await;
    c.subscribe("sb/#", QoS::AtLeastOnce).await;
    eventually("the subscription in etcd", || {
        record(&setup, "stop-broke").is_some_and(|r| r.contains("sb/#"))
    })
    .await;
    let (mut publisher, _) = connect(setup.ports[1], "publisher", true, 0).await;
    setup.nodes[2].term().expect("SIGTERM");
    loop {
        match c.recv_within(PATIENCE).await {
            Recv::Packet(v5::Packet::Disconnect(_)) | Recv::Closed => break,
            Recv::Packet(_) => {}
            Recv::Timeout => panic!("node 3 did not send its client away"),
        }
    }
    let (mut mid, present) = connect(setup.ports[0], "stop-broke", false, 300).await;
    assert!(present);
    mid.send(v5::Packet::Connect(
        v5::Connect {
            keep_alive: 30,
            client_id: "stop-broke".into(),
            clean_start: false,
            properties: None,
        },
        None,
        None,
    ))
    .await;
    loop {
        match mid.recv_within(PATIENCE).await {
            Recv::Packet(v5::Packet::Disconnect(d)) => {
                assert_eq!(d.reason_code, v5::DisconnectReasonCode::ProtocolError);
                break;
            }
            Recv::Packet(_) => {}
            other => panic!("expected DISCONNECT 0x82, got {other:?}"),
        }
    }
    let (mut last, present) = connect(setup.ports[1], "stop-broke", false, 300).await;
    assert!(present);
    for n in 0..20 {
        publisher
            .publish(&format!("sb/{n}"), "x", QoS::AtLeastOnce, None)
            .await;
    }
    let mut got = topics_until(&mut last, 20).await;
    leave(last).await;
    let (mut back, present) = connect(setup.ports[0], "stop-broke", false, 300).await;
    assert!(present);
    got.extend(topics_within(&mut back, Duration::from_secs(3)).await);
    let expected: Vec<String> = (0..20).map(|n| format!("sb/{n}")).collect();
    assert_eq!(got, expected, "each once, in order");
}

/// A killed node's persistent sessions resume on another node, with their
/// subscriptions (issue #29 target: within 3 s of the client reconnecting).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_nodes_sessions_resume_elsewhere() {
    let mut setup = Setup::three_linked().await;
    let _c = subscribed_in_etcd(&setup, "survivor", "k/#", QoS::AtLeastOnce).await;
    setup.nodes[0].kill().unwrap();
    let started = Instant::now();
    let (mut c, present) = connect(setup.ports[1], "survivor", false, 300).await;
    let took = started.elapsed();
    assert!(present, "Session Present 1 after its node died");
    eprintln!("session present on another node after {took:?}");
    let (mut publisher, _) = connect(setup.ports[2], "publisher", true, 0).await;
    publisher.publish("k/1", "x", QoS::AtLeastOnce, None).await;
    let p = c.next_publish().await;
    assert_eq!(&p.topic[..], b"k/1");
}

/// A session record its killed node left, whose client never comes back,
/// goes from etcd once its session would have expired (here by the node
/// that adopted it, as its session ends there); one that has not expired
/// stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ownerless_session_record_goes_when_its_session_expires() {
    let mut setup = Setup::start_with(
        1,
        2,
        &[("STATEBROKER__CLUSTERING__SESSION_REAP_INTERVAL_S", "1")],
    );
    let (mut short, _) = connect(setup.ports[0], "short", false, 3).await;
    short.subscribe("x", QoS::AtLeastOnce).await;
    let (mut long, _) = connect(setup.ports[0], "long", false, 300).await;
    long.subscribe("x", QoS::AtLeastOnce).await;
    eventually("both records in etcd", || {
        record(&setup, "short").is_some_and(|r| r.contains('x'))
            && record(&setup, "long").is_some_and(|r| r.contains('x'))
    })
    .await;
    setup.nodes[0].kill().unwrap();
    let killed = Instant::now();
    eventually("the expired session's record gone", || {
        record(&setup, "short").is_none()
    })
    .await;
    // Not before its owner record went with the node's lease (5 s) and
    // its expiry (3 s) passed.
    assert!(
        killed.elapsed() >= Duration::from_secs(3),
        "{:?}",
        killed.elapsed()
    );
    assert!(
        record(&setup, "long").is_some(),
        "an unexpired session stays"
    );
    let (_c, present) = connect(setup.ports[1], "long", false, 300).await;
    assert!(present);
}

/// `client_id` subscribes to `{prefix}/#` on node 1 and leaves (its
/// session kept there); then `count` messages `{prefix}/0..count` are
/// published at QoS 1 on node 3 until node 1 has them all (forwarded by
/// node 3's link). Returns the publisher and the topics, in order.
async fn queued_on_node_1(
    setup: &Setup,
    client_id: &str,
    prefix: &str,
    count: usize,
) -> (Raw, Vec<String>) {
    let (mut c, _) = connect(setup.ports[0], client_id, false, 300).await;
    c.subscribe(&format!("{prefix}/#"), QoS::AtLeastOnce).await;
    leave(c).await;
    let (mut publisher, _) = connect(setup.ports[2], "publisher", true, 0).await;
    let topics: Vec<String> = (0..count).map(|n| format!("{prefix}/{n}")).collect();
    for topic in &topics {
        publisher.publish(topic, "x", QoS::AtLeastOnce, None).await;
    }
    eventually("node 1 received the messages", || {
        metric(
            setup.http[0],
            "statebroker_messages_received_total{qos=\"1\"}",
        )
        .is_some_and(|n| n >= count as f64)
    })
    .await;
    (publisher, topics)
}

/// What a live node had queued for a session moves with it: a client that
/// left node 1 with messages waiting there gets them on node 2, once, in
/// order, and what is published after the move too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_messages_move_with_the_session_from_a_live_node() {
    let setup = Setup::three_linked().await;
    let (mut publisher, expected) = queued_on_node_1(&setup, "queued", "q", 20).await;
    let mut c = resumed_on_node_2(&setup, "queued").await;
    let got = topics_within(&mut c, Duration::from_secs(3)).await;
    assert_eq!(got, expected, "the queued messages, once, in order");
    assert_eq!(
        metric(
            setup.http[0],
            "statebroker_cluster_messages_handed_over_total"
        ),
        Some(20.0)
    );
    publisher
        .publish("q/after", "x", QoS::AtLeastOnce, None)
        .await;
    let got = topics_within(&mut c, Duration::from_secs(2)).await;
    assert_eq!(got, ["q/after"]);
    assert_eq!(metric(setup.http[0], KEPT), Some(LINK_SESSIONS));
}

/// A backlog of 1,000 messages queued on a live node moves whole: the old
/// node's router gives it in several rounds, and the handover takes all
/// of them. Before, a wake-up of its link that found nothing (one read
/// takes several rounds) ended the handover, and the rest of the backlog
/// was lost with the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_backlog_moves_whole_from_a_live_node() {
    let setup = Setup::three_linked().await;
    let (_publisher, expected) = queued_on_node_1(&setup, "backlog", "b", 1_000).await;
    let mut c = resumed_on_node_2(&setup, "backlog").await;
    let got = topics_until(&mut c, expected.len()).await;
    assert_eq!(got.len(), expected.len(), "the whole backlog");
    assert_eq!(got, expected, "once, in order");
    assert_eq!(
        metric(
            setup.http[0],
            "statebroker_cluster_messages_handed_over_total"
        ),
        Some(1_000.0)
    );
}

/// A session that moves from a live node gets what that node had queued
/// for it before what was published since the move: 100 messages wait on
/// node 1 for a client that comes back on node 2 while a publisher on
/// node 3 goes on publishing; the client gets every message, each
/// publisher's in order. Node 2's connection holds back what its router
/// gives the session until node 1 says it has handed over. Before, the
/// handed-over messages came after newer ones from node 2's router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_session_gets_its_queued_messages_before_newer_ones() {
    moved_session_keeps_the_order("ordered", false).await;
}

/// The same with a client that subscribes (to another topic) as soon as
/// it is back: its SUBACK comes at once, and the deliveries still wait
/// for the handover. Before 2026-11-30 the SUBSCRIBE ended the hold (it
/// held the router's SUBACK too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_session_that_subscribes_at_once_keeps_the_order() {
    moved_session_keeps_the_order("ordered-sub", true).await;
}

/// 100 messages queued on node 1 for `client_id`, a publisher on node 3
/// going on while the client comes back on node 2 (subscribing to
/// another topic at once if `subscribe`): every message comes, none after
/// a newer one.
async fn moved_session_keeps_the_order(client_id: &str, subscribe: bool) {
    let setup = Setup::three_linked().await;
    let (mut publisher, queued) = queued_on_node_1(&setup, client_id, "o", 100).await;
    let total = 300;
    let steady = tokio::spawn(async move {
        for n in queued.len()..total {
            publisher
                .publish(&format!("o/{n}"), "x", QoS::AtLeastOnce, None)
                .await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        publisher
    });
    let (mut c, present) = connect(setup.ports[1], client_id, false, 300).await;
    assert!(present, "Session Present 1 on another node");
    if subscribe {
        let codes = c.subscribe("other/#", QoS::AtLeastOnce).await;
        assert_eq!(codes.len(), 1, "its SUBACK, before the handover");
    }
    eventually("node 1 handed the session over", || {
        metric(setup.http[0], HANDED_OVER) == Some(1.0)
    })
    .await;
    let got = topics_until(&mut c, total).await;
    let _publisher = steady.await.unwrap();
    let mut got = got;
    got.extend(topics_within(&mut c, Duration::from_secs(1)).await);
    // Each message's first arrival, in the order they came.
    let mut seen = std::collections::HashSet::new();
    let first: Vec<usize> = got
        .iter()
        .filter(|t| seen.insert(t.as_str()))
        .map(|t| t.trim_start_matches("o/").parse().unwrap())
        .collect();
    let mut newest = 0;
    let late: Vec<(usize, usize)> = first
        .iter()
        .filter_map(|&n| {
            newest = newest.max(n);
            (n < newest).then_some((n, newest))
        })
        .collect();
    println!(
        "{} messages, {} again (QoS 1 allows it), {} after a newer one",
        first.len(),
        got.len() - first.len(),
        late.len()
    );
    assert_eq!(first.len(), total, "every message");
    assert_eq!(late, Vec::new(), "(message, after) none after a newer one");
}

/// A retained message queued on node 1 for a Retain As Published
/// subscription keeps its RETAIN flag when the session moves to node 2
/// (MQTT 5 3.8.3.1); one for a plain subscription goes with RETAIN 0. The
/// handed-over copy went with RETAIN 0 whatever the option before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_over_message_keeps_retain_as_published() {
    let setup = Setup::three_linked().await;
    let (mut c, _) = connect(setup.ports[0], "rap", false, 300).await;
    let filter = |path: &str, preserve_retain| {
        let mut f = v5::Filter::new(path, QoS::AtLeastOnce);
        f.preserve_retain = preserve_retain;
        f
    };
    let mut subscribe = v5::Subscribe::new_many(
        [filter("rap/kept/#", true), filter("rap/plain/#", false)],
        None,
    );
    subscribe.pkid = 1;
    c.send(v5::Packet::Subscribe(subscribe)).await;
    match c.recv().await {
        Recv::Packet(v5::Packet::SubAck(_)) => {}
        other => panic!("no SUBACK: {other:?}"),
    }
    // The session record follows the SUBACK (a client back on node 2
    // before it would find no session there).
    eventually("the subscriptions in etcd", || {
        record(&setup, "rap").is_some_and(|r| r.contains("rap/plain/#"))
    })
    .await;
    leave(c).await;
    let (mut publisher, _) = connect(setup.ports[0], "rap-publisher", true, 0).await;
    for topic in ["rap/kept/1", "rap/plain/1"] {
        let mut p = v5::Publish::new(topic, QoS::AtLeastOnce, "x", None);
        p.retain = true;
        p.pkid = publisher.pkid();
        publisher.send(v5::Packet::Publish(p)).await;
        match publisher.recv().await {
            Recv::Packet(v5::Packet::PubAck(_)) => {}
            other => panic!("no PUBACK: {other:?}"),
        }
    }
    let mut c = resumed_on_node_2(&setup, "rap").await;
    let mut flags = Vec::new();
    while flags.len() < 2 {
        let p = c.next_publish().await;
        flags.push((String::from_utf8_lossy(&p.topic).into_owned(), p.retain));
    }
    flags.sort();
    assert_eq!(
        flags,
        [
            ("rap/kept/1".to_owned(), true),
            ("rap/plain/1".to_owned(), false)
        ]
    );
}

/// How many messages etcd keeps queued for `client_id`'s session.
fn queued_in_etcd(setup: &Setup, client_id: &str) -> u64 {
    let prefix = format!("/statebroker/Q/{}:{client_id}/", client_id.len());
    setup.etcd.count_prefix(&prefix).unwrap()
}

/// [`queued_on_node_1`], once etcd has node 1's copies of the messages.
async fn queued_in_etcd_by_node_1(
    setup: &Setup,
    client_id: &str,
    prefix: &str,
    count: usize,
) -> (Raw, Vec<String>) {
    let queued = queued_on_node_1(setup, client_id, prefix, count).await;
    eventually("the queued messages in etcd", || {
        queued_in_etcd(setup, client_id) == count as u64
    })
    .await;
    queued
}

/// Node 1, paused, comes back and gives its copy of `c`'s session up:
/// nothing reaches `c` again.
async fn nothing_again_once_node_1_is_back(setup: &mut Setup, c: &mut Raw) {
    setup.nodes[0].resume().unwrap();
    eventually("node 1 gave its copy up", || {
        metric(setup.http[0], KEPT) == Some(LINK_SESSIONS)
    })
    .await;
    let again = topics_within(c, Duration::from_secs(2)).await;
    assert_eq!(again, Vec::<String>::new(), "nothing delivered again");
}

/// What a killed node had queued for a session is kept in etcd: its
/// client, back on another node at once (the dead node's ownership not
/// gone yet, its link is), gets the messages there, once, in order, and
/// each message leaves etcd when the client has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_nodes_queued_messages_come_from_etcd() {
    let mut setup = Setup::three_linked().await;
    let (_publisher, expected) = queued_in_etcd_by_node_1(&setup, "orphan", "d", 20).await;
    let fence = "/statebroker/QF/sb1";
    assert!(
        setup.etcd.get(fence).unwrap().is_some(),
        "node 1's queue fence"
    );
    setup.nodes[0].kill().unwrap();
    // Node 2 saw its link to node 1 break (the one from node 1 broke with
    // it).
    eventually("node 2 without its link to node 1", || {
        metric(setup.http[1], "statebroker_cluster_peer_links") == Some(1.0)
    })
    .await;
    let (mut c, present) = connect(setup.ports[1], "orphan", false, 300).await;
    assert!(present, "Session Present 1 after its node died");
    // Node 1's lease lives: node 2 took its fence down before it read the
    // copies (a batch of node 1's in doubt cannot commit after the read).
    assert!(setup.etcd.get(fence).unwrap().is_none(), "node 1's fence");
    let got = topics_within(&mut c, Duration::from_secs(3)).await;
    assert_eq!(got, expected, "the queued messages, once, in order");
    eventually("the delivered messages gone from etcd", || {
        queued_in_etcd(&setup, "orphan") == 0
    })
    .await;
}

/// Node 1, which held `client_id`'s session (subscribed to `{prefix}/#`
/// at `qos`, away), is killed after etcd has its copy of one message
/// (`{prefix}/before`); node 3's client publishes `{prefix}/0..count` at
/// `qos` once nodes 2 and 3 saw their links to node 1 break, before any
/// node takes the session. Returns the topics the client is to get, in
/// order.
async fn published_after_node_1_died(
    setup: &mut Setup,
    client_id: &str,
    prefix: &str,
    qos: QoS,
    count: usize,
) -> Vec<String> {
    let (mut c, _) = connect(setup.ports[0], client_id, false, 300).await;
    c.subscribe(&format!("{prefix}/#"), qos).await;
    leave(c).await;
    let (mut publisher, _) = connect(setup.ports[2], "publisher", true, 0).await;
    let before = format!("{prefix}/before");
    publish_complete(&mut publisher, &before, b"x", qos, false).await;
    eventually("node 1's copy in etcd", || {
        queued_in_etcd(setup, client_id) == 1
    })
    .await;
    setup.nodes[0].kill().unwrap();
    for node in [1, 2] {
        eventually("the links to node 1 broken", || {
            metric(setup.http[node], "statebroker_cluster_peer_links") == Some(1.0)
        })
        .await;
    }
    let mut expected = vec![before];
    for n in 0..count {
        let topic = format!("{prefix}/{n}");
        publish_complete(&mut publisher, &topic, b"x", qos, false).await;
        expected.push(topic);
    }
    expected
}

/// `client_id` back on node 2 (Session Present 1).
async fn back_on_node_2(setup: &Setup, client_id: &str) -> Raw {
    let (c, present) = connect(setup.ports[1], client_id, false, 300).await;
    assert!(present, "Session Present 1 after its node died");
    c
}

/// Issue #29: what is published after a node died, while no node holds
/// its sessions (until their client comes back, or another node adopts
/// them), reaches them: the node that takes one from etcd gives it, after
/// what etcd kept, what the dead node had not had, from its log of recent
/// publishes (`cluster::recent`). Before, it was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_published_while_no_node_holds_a_dead_nodes_session_reaches_it() {
    let mut setup = Setup::three_linked().await;
    let expected =
        published_after_node_1_died(&mut setup, "missed", "m", QoS::AtLeastOnce, 10).await;
    let mut c = back_on_node_2(&setup, "missed").await;
    let got = topics_within(&mut c, Duration::from_secs(3)).await;
    assert_eq!(got, expected, "every message, once, in order");
    eventually("the delivered messages gone from etcd", || {
        queued_in_etcd(&setup, "missed") == 0
    })
    .await;
}

/// The same when another node adopted the session before its client
/// came back (node 1's lease ended meanwhile): the adopting node gave it
/// what node 1 had not had, and kept it in etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_published_before_a_dead_nodes_session_is_adopted_reaches_it() {
    let mut setup = Setup::three_linked().await;
    let expected =
        published_after_node_1_died(&mut setup, "adopted", "a", QoS::AtLeastOnce, 10).await;
    eventually("the session adopted", || {
        owner(&setup, "adopted").is_some_and(|node| node != "sb1")
    })
    .await;
    eventually("the adopting node's copies in etcd", || {
        queued_in_etcd(&setup, "adopted") == expected.len() as u64
    })
    .await;
    let mut c = back_on_node_2(&setup, "adopted").await;
    let got = topics_within(&mut c, Duration::from_secs(3)).await;
    assert_eq!(got, expected, "every message, once, in order");
}

/// The same at QoS 2: each once, at QoS 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_published_at_qos2_while_no_node_holds_a_dead_nodes_session_comes_once() {
    let mut setup = Setup::three_linked().await;
    let expected =
        published_after_node_1_died(&mut setup, "missed2", "m2", QoS::ExactlyOnce, 10).await;
    let mut c = back_on_node_2(&setup, "missed2").await;
    let got: Vec<String> = qos2_within(&mut c)
        .await
        .into_iter()
        .map(|(t, _)| t)
        .collect();
    assert_eq!(got, expected, "every message, once, in order");
}

/// The QoS 2 messages `c` receives (each exchange completed) until none
/// comes for 3 s: topic, and DUP.
async fn qos2_within(c: &mut Raw) -> Vec<(String, bool)> {
    let mut got = Vec::new();
    while let Recv::Packet(packet) = c.recv_within(Duration::from_secs(3)).await {
        match packet {
            v5::Packet::Publish(p) => {
                assert_eq!(p.qos, QoS::ExactlyOnce);
                got.push((String::from_utf8_lossy(&p.topic).into_owned(), p.dup));
                c.send(v5::Packet::PubRec(v5::PubRec::new(p.pkid, None)))
                    .await;
            }
            v5::Packet::PubRel(rel) => {
                c.send(v5::Packet::PubComp(v5::PubComp::new(rel.pkid, None)))
                    .await;
            }
            _ => {}
        }
    }
    got
}

/// `client_id` subscribes to `{prefix}/#` at QoS 2 on node 1 and leaves;
/// `count` QoS 2 messages `{prefix}/0..count` are published on node 3,
/// each exchange completed, until etcd has node 1's copies of them all.
async fn queued_qos2_in_etcd(
    setup: &Setup,
    client_id: &str,
    prefix: &str,
    count: usize,
) -> Vec<String> {
    let (mut c, _) = connect(setup.ports[0], client_id, false, 300).await;
    c.subscribe(&format!("{prefix}/#"), QoS::ExactlyOnce).await;
    leave(c).await;
    let (mut publisher, _) = connect(setup.ports[2], "publisher", true, 0).await;
    let topics: Vec<String> = (0..count).map(|n| format!("{prefix}/{n}")).collect();
    for topic in &topics {
        publish_complete(&mut publisher, topic, b"x", QoS::ExactlyOnce, false).await;
    }
    eventually("node 1's copies of the messages in etcd", || {
        queued_in_etcd(setup, client_id) == count as u64
    })
    .await;
    topics
}

/// Issue #29: QoS 2 messages a killed node had queued for a session are
/// kept in etcd too, and come once, in order, at QoS 2, on the node its
/// client comes back to; each leaves etcd before it is sent. Before, they
/// were lost with the node (etcd kept QoS 1 messages only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_nodes_queued_qos2_messages_come_from_etcd() {
    let mut setup = Setup::three_linked().await;
    let expected = queued_qos2_in_etcd(&setup, "orphan2", "e", 20).await;
    setup.nodes[0].kill().unwrap();
    eventually("node 2 without its link to node 1", || {
        metric(setup.http[1], "statebroker_cluster_peer_links") == Some(1.0)
    })
    .await;
    let (mut c, present) = connect(setup.ports[1], "orphan2", false, 300).await;
    assert!(present, "Session Present 1 after its node died");
    let mut got = Vec::new();
    for (topic, dup) in qos2_within(&mut c).await {
        assert!(!dup, "never sent before");
        got.push(topic);
    }
    assert_eq!(got, expected, "the queued messages, once, in order");
    assert_eq!(queued_in_etcd(&setup, "orphan2"), 0);
}

/// The QoS 2 messages `c` receives until it has `count` of them (none
/// acknowledged): packet id and topic of each.
async fn unacknowledged_qos2(c: &mut Raw, count: usize) -> Vec<(u16, String)> {
    let mut got = Vec::new();
    while got.len() < count {
        let p = common::mqtt::next_raw_publish(c).await;
        assert_eq!(p.qos, QoS::ExactlyOnce, "{p:?}");
        got.push((p.pkid, String::from_utf8_lossy(&p.topic).into_owned()));
    }
    got
}

/// The QoS 2 messages `c` gets again (DUP) until `count` exchanges are
/// complete (each PUBREC'd, each PUBREL for one of them, PUBCOMP'd):
/// packet id and topic of each, in order.
async fn sent_again_and_completed(c: &mut Raw, count: usize) -> Vec<(u16, String)> {
    sent_again(c, count, true).await.0
}

/// The QoS 2 messages `c` gets again (DUP), each PUBREC'd, until `count`
/// of them came (`complete`: until `count` exchanges are complete, each
/// PUBREL answered with PUBCOMP): packet id and topic of each, in order,
/// and the PUBRELs left unanswered.
async fn sent_again(c: &mut Raw, count: usize, complete: bool) -> (Vec<(u16, String)>, Vec<u16>) {
    let (mut again, mut released) = (Vec::new(), Vec::new());
    let mut completed = 0;
    while if complete {
        completed < count
    } else {
        again.len() < count
    } {
        match c.recv().await {
            Recv::Packet(v5::Packet::Publish(p)) => {
                assert_eq!((p.qos, p.dup), (QoS::ExactlyOnce, true), "{p:?}");
                again.push((p.pkid, String::from_utf8_lossy(&p.topic).into_owned()));
                c.send(v5::Packet::PubRec(v5::PubRec::new(p.pkid, None)))
                    .await;
            }
            Recv::Packet(v5::Packet::PubRel(rel)) => {
                assert!(again.iter().any(|(id, _)| *id == rel.pkid), "{rel:?}");
                if !complete {
                    released.push(rel.pkid);
                    continue;
                }
                c.send(v5::Packet::PubComp(v5::PubComp::new(rel.pkid, None)))
                    .await;
                completed += 1;
            }
            Recv::Packet(_) => {}
            other => panic!("expected PUBLISH or PUBREL, got {other:?} after {again:?}"),
        }
    }
    (again, released)
}

/// Issue #29, QoS 2 exactly once across nodes: a QoS 2 message whose
/// copy is in etcd stays there while its exchange is open, marked with
/// the packet id it went out under; a node killed then leaves it to the
/// next, which sends it again under that id with DUP (a client that had
/// it takes it as the same message, MQTT 5 4.3.3; one whose PUBLISH was
/// lost, as here, where the client never answered, gets it). Before, the
/// copy left etcd before the PUBLISH, and the next node sent nothing: a
/// message the client never got was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qos2_message_in_flight_at_a_killed_node_comes_again_under_its_id() {
    let mut setup = Setup::three_linked().await;
    let expected = queued_qos2_in_etcd(&setup, "twice", "t", 10).await;
    let (mut c, present) = connect(setup.ports[0], "twice", false, 300).await;
    assert!(present);
    let sent = unacknowledged_qos2(&mut c, expected.len()).await;
    let topics: Vec<_> = sent.iter().map(|(_, topic)| topic.clone()).collect();
    assert_eq!(topics, expected);
    assert_eq!(
        queued_in_etcd(&setup, "twice"),
        10,
        "the copies stay in etcd while the exchanges are open (no PUBREC sent)"
    );
    setup.nodes[0].kill().unwrap();
    eventually("node 2 without its link to node 1", || {
        metric(setup.http[1], "statebroker_cluster_peer_links") == Some(1.0)
    })
    .await;
    drop(c);
    let (mut c, present) = connect(setup.ports[1], "twice", false, 300).await;
    assert!(present);
    let again = sent_again_and_completed(&mut c, sent.len()).await;
    assert_eq!(
        again, sent,
        "the same messages under the same ids, in order"
    );
    assert_eq!(queued_in_etcd(&setup, "twice"), 0, "no copy left");
    c.no_publish_within(Duration::from_secs(2)).await;
}

/// A QoS 2 message's copy marked in flight leaves etcd before its PUBREL
/// goes (the client forgets the packet id at the PUBREL, and a copy the
/// next node sent again after it would be a new message): with etcd
/// paused, the client's PUBRECs get no PUBREL; once it is back, the
/// PUBRELs come and no copy is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qos2_messages_pubrel_waits_until_its_copy_left_etcd() {
    let mut setup = Setup::three_linked().await;
    let expected = queued_qos2_in_etcd(&setup, "released", "r", 3).await;
    let (mut c, present) = connect(setup.ports[0], "released", false, 300).await;
    assert!(present);
    let sent = unacknowledged_qos2(&mut c, expected.len()).await;
    assert_eq!(queued_in_etcd(&setup, "released"), 3, "marked in flight");
    setup.etcd.pause(0).unwrap();
    for (pkid, _) in &sent {
        c.send(v5::Packet::PubRec(v5::PubRec::new(*pkid, None)))
            .await;
    }
    let early = c.recv_within(Duration::from_millis(1500)).await;
    setup.etcd.resume(0).unwrap();
    assert!(
        matches!(early, Recv::Timeout),
        "no PUBREL while etcd cannot remove the copies: {early:?}"
    );
    let mut released = Vec::new();
    while released.len() < sent.len() {
        match c.recv().await {
            Recv::Packet(v5::Packet::PubRel(rel)) => {
                released.push(rel.pkid);
                c.send(v5::Packet::PubComp(v5::PubComp::new(rel.pkid, None)))
                    .await;
            }
            Recv::Packet(_) => {}
            other => panic!("expected PUBREL, got {other:?}"),
        }
    }
    let ids: Vec<_> = sent.iter().map(|(pkid, _)| *pkid).collect();
    assert_eq!(released, ids, "in order");
    assert_eq!(queued_in_etcd(&setup, "released"), 0, "no copy left");
}

/// A QoS 2 message whose copy is in etcd leaves etcd before a live node
/// hands it over with its session: once the client has the handed-over
/// messages (not acknowledged), etcd keeps none of them; so a node that
/// reads the session's queue later (the new node dead too) cannot send
/// one again. Before, the old node forgot its copies when its router gave
/// the session up, and all 50 stayed in etcd until the session ended (in
/// a long fault round, a node that read the queue 42 s later sent 1,074
/// messages again: 686 QoS 1, 388 QoS 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qos2_message_leaves_etcd_before_it_is_handed_over() {
    let setup = Setup::three_linked().await;
    let expected = queued_qos2_in_etcd(&setup, "handed2", "h", 50).await;
    let (mut c, present) = connect(setup.ports[1], "handed2", false, 300).await;
    assert!(present);
    let mut got = Vec::new();
    while got.len() < expected.len() {
        let p = common::mqtt::next_raw_publish(&mut c).await;
        got.push(String::from_utf8_lossy(&p.topic).into_owned());
    }
    assert_eq!(got, expected, "handed over, in order");
    assert_eq!(
        queued_in_etcd(&setup, "handed2"),
        0,
        "no copy left in etcd once the client has the messages"
    );
}

/// A node paused past its lease comes back to find its client's session
/// on another node, which took the queued messages from etcd: it does not
/// hand them over again (no duplicates).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_node_does_not_hand_over_what_etcd_gave() {
    let mut setup = Setup::three_linked().await;
    let (_publisher, expected) = queued_in_etcd_by_node_1(&setup, "sleeper", "s", 10).await;
    setup.nodes[0].pause().unwrap();
    // Gone with its lease (and the session adopted by another node, from
    // etcd's queue: see `a_killed_nodes_offline_session_is_adopted_once_its_lease_ends`).
    eventually("node 1's ownership gone with its lease", || {
        owner(&setup, "sleeper").as_deref() != Some("sb1")
    })
    .await;
    let (mut c, present) = connect(setup.ports[1], "sleeper", false, 300).await;
    assert!(present);
    let got = topics_within(&mut c, Duration::from_secs(3)).await;
    assert_eq!(got, expected, "the queued messages, once, in order");
    nothing_again_once_node_1_is_back(&mut setup, &mut c).await;
    assert_eq!(metric(setup.http[0], HANDED_OVER).unwrap_or(0.0), 0.0);
}

/// A node that dies with its links up (paused here, as a machine that
/// died: its sockets stay open) looks alive to the node its client comes
/// back to, which waits for its handover. Once its lease has ended, the
/// messages it kept in etcd come from there, once, in order; when it
/// comes back, the handover it then makes is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_nodes_queue_comes_from_etcd_once_it_leaves() {
    let mut setup = Setup::three_linked().await;
    let (_publisher, expected) = queued_in_etcd_by_node_1(&setup, "silent", "m", 10).await;
    setup.nodes[0].pause().unwrap();
    let (mut c, present) = connect(setup.ports[1], "silent", false, 300).await;
    assert!(present);
    // They come once node 1's lease (5 s) has ended.
    let got = topics_until(&mut c, expected.len()).await;
    assert_eq!(got, expected, "the queued messages, once, in order");
    eventually("their copies gone from etcd", || {
        queued_in_etcd(&setup, "silent") == 0
    })
    .await;
    nothing_again_once_node_1_is_back(&mut setup, &mut c).await;
}

/// A message etcd gave for a node that left stays in etcd until the
/// client acknowledges it: those the client did not acknowledge before
/// its connection broke come again on its next connection, and leave etcd
/// only then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_etcd_gave_leaves_etcd_when_acknowledged() {
    let mut setup = Setup::three_linked().await;
    let (_publisher, expected) = queued_in_etcd_by_node_1(&setup, "unacked", "u", 5).await;
    setup.nodes[0].pause().unwrap();
    let (mut c, present) = connect(setup.ports[1], "unacked", false, 300).await;
    assert!(present);
    // They come once node 1's lease has ended: none acknowledged yet.
    let mut got = Vec::new();
    let deadline = Instant::now() + PATIENCE;
    while got.len() < expected.len() && Instant::now() < deadline {
        if let Recv::Packet(v5::Packet::Publish(p)) = c.recv_within(Duration::from_secs(1)).await {
            got.push((String::from_utf8_lossy(&p.topic).into_owned(), p.pkid));
        }
    }
    let topics: Vec<_> = got.iter().map(|(t, _)| t.clone()).collect();
    assert_eq!(topics, expected, "the queued messages, once, in order");
    // Two acknowledged: their copies go, the others' stay.
    for (_, pkid) in &got[..2] {
        c.send(v5::Packet::PubAck(v5::PubAck::new(*pkid, None)))
            .await;
    }
    eventually("the acknowledged copies gone from etcd", || {
        queued_in_etcd(&setup, "unacked") == 3
    })
    .await;
    // The connection breaks; the others come on the next one.
    drop(c);
    let (mut c, present) = connect(setup.ports[1], "unacked", false, 300).await;
    assert!(present);
    let again = topics_until(&mut c, 3).await;
    assert_eq!(again, expected[2..], "the unacknowledged ones, again");
    eventually("their copies gone from etcd", || {
        queued_in_etcd(&setup, "unacked") == 0
    })
    .await;
    nothing_again_once_node_1_is_back(&mut setup, &mut c).await;
}

/// A state store request the client sends again (DUP) after its session
/// moved to another node runs once: the new node finds the key's last
/// write is that request's and answers with it (issue #28 item 5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_resent_after_a_move_runs_once() {
    let setup = Setup::three_linked().await;
    let request = |raw: &Raw, dup: bool| {
        let payload = statestore::resp3::encode_request(&[&b"SET"[..], b"once", b"v", b"NX"]);
        let ts = now_hlc("resender");
        let properties =
            raw.request_properties(b"request-1", &[("__ts", &ts), ("__protVer", "1.0")]);
        let mut publish =
            v5::Publish::new(REQUEST_TOPIC, QoS::AtLeastOnce, payload, Some(properties));
        publish.pkid = 77;
        publish.dup = dup;
        v5::Packet::Publish(publish)
    };
    let (mut c, _) = connect(setup.ports[0], "resender", false, 300).await;
    c.ensure_response_subscription().await;
    c.send(request(&c, false)).await;
    let first = c.next_publish().await;
    assert_eq!(&first.payload[..], b"+OK\r\n", "the first SET NX sets");
    leave(c).await;
    eventually("the response subscription in etcd", || {
        record(&setup, "resender").is_some_and(|r| r.contains("statestore/response"))
    })
    .await;
    // As if its PUBACK had been lost: sent again on another node.
    let (mut c, present) = connect(setup.ports[1], "resender", false, 300).await;
    assert!(present);
    c.send(request(&c, true)).await;
    let again = c.next_publish().await;
    assert_eq!(
        &again.payload[..],
        &first.payload[..],
        "answered as the first time, not run again"
    );
    // The same SET NX as a new request (not DUP) is run: the key exists.
    c.send(request(&c, false)).await;
    let new = c.next_publish().await;
    assert_ne!(&new.payload[..], &first.payload[..], "a new request runs");
}

/// QoS 1 publishers, each on its node, publishing `<prefix>/<name>` with
/// payloads numbered from 0, each waiting for its PUBACK (and `pause`)
/// before the next, until stopped.
struct Steady {
    stop: Arc<AtomicBool>,
    next: Vec<Arc<AtomicU64>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Steady {
    async fn start(publishers: &[(&str, u16)], prefix: &str, pause: Duration) -> Steady {
        Steady::start_at(publishers, prefix, pause, QoS::AtLeastOnce).await
    }

    /// Publishers at `qos` (1 or 2), each exchange completed before the
    /// next.
    async fn start_at(
        publishers: &[(&str, u16)],
        prefix: &str,
        pause: Duration,
        qos: QoS,
    ) -> Steady {
        let stop = Arc::new(AtomicBool::new(false));
        let (mut next, mut tasks) = (Vec::new(), Vec::new());
        for &(name, port) in publishers {
            let (mut raw, _) = connect(port, name, true, 0).await;
            let counter = Arc::new(AtomicU64::new(0));
            next.push(Arc::clone(&counter));
            let (stop, topic) = (Arc::clone(&stop), format!("{prefix}/{name}"));
            tasks.push(tokio::spawn(async move {
                while !stop.load(Ordering::Acquire) {
                    // Counted before it goes: one in flight is not
                    // "published after" a moment that came while it was.
                    let n = counter.fetch_add(1, Ordering::AcqRel);
                    if qos == QoS::ExactlyOnce {
                        let mut publish = v5::Publish::new(&topic, qos, n.to_string(), None);
                        publish.pkid = raw.pkid();
                        let pkid = publish.pkid;
                        publish_until_pubrec(&mut raw, publish).await;
                        pubrel_with(&mut raw, pkid, None).await;
                    } else {
                        let ack = raw.publish(&topic, n.to_string(), qos, None).await;
                        assert_eq!(ack, Some(v5::PubAckReason::Success));
                    }
                    tokio::time::sleep(pause).await;
                }
            }));
        }
        Steady { stop, next, tasks }
    }

    /// The number each publisher publishes next (all before it were
    /// acknowledged once it is stopped).
    fn next(&self) -> Vec<u64> {
        self.next
            .iter()
            .map(|n| n.load(Ordering::Acquire))
            .collect()
    }

    /// Stops them; how many each had acknowledged.
    async fn stop(mut self) -> Vec<u64> {
        self.stop.store(true, Ordering::Release);
        for task in &mut self.tasks {
            task.await.unwrap();
        }
        self.next()
    }
}

/// Under load: a persistent subscriber whose node is SIGKILLed resumes its
/// session on another node, and gets every message published after that
/// (QoS 1, from publishers on the two other nodes), once, in each
/// publisher's order. What the dead node had queued comes from etcd first:
/// a message it had sent may come again (its acknowledgement's removal
/// from etcd died with the node; QoS 1 allows it), none out of order.
/// (What was published while no node held its session, between the kill
/// and the reconnection, may be missing: only the dead node subscribed to
/// it. So may what reached that node less than an etcd round trip before
/// it died.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscribers_session_survives_its_node_killed_under_load() {
    let mut setup = Setup::three_linked().await;
    let mut s = subscribed_in_etcd(&setup, "steady", "f/#", QoS::AtLeastOnce).await;
    let publishers = [("p2", setup.ports[1]), ("p3", setup.ports[2])];
    let steady = Steady::start(&publishers, "f", Duration::ZERO).await;
    let wait = Duration::from_secs(2);
    let deadline = |secs| Some(Instant::now() + Duration::from_secs(secs));
    let mut got = received_until(&mut s, wait, deadline(2)).await;
    let killed_at = got.len();
    setup.nodes[0].kill().unwrap();
    drop(s);
    let (mut s, present) = connect(setup.ports[1], "steady", false, 300).await;
    assert!(present, "the session on node 2");
    let resumed_at = steady.next();
    got.extend(received_until(&mut s, wait, deadline(3)).await);
    let ended_at = steady.stop().await;
    got.extend(received_within(&mut s, Duration::from_secs(3)).await);
    for (i, name) in ["p2", "p3"].iter().enumerate() {
        let topic = format!("f/{name}");
        let of = |got: &[(String, String)]| -> Vec<u64> {
            got.iter()
                .filter(|(t, _)| *t == topic)
                .map(|(_, p)| p.parse().unwrap())
                .collect()
        };
        let (before, moved) = (of(&got[..killed_at]), of(&got[killed_at..]));
        for seqs in [&before, &moved] {
            assert!(
                seqs.windows(2).all(|w| w[0] < w[1]),
                "{name}: once and in order on each node: {:?} (the last before the move: {:?}; the first after: {:?})",
                seqs.windows(2).filter(|w| w[0] >= w[1]).collect::<Vec<_>>(),
                &before[before.len().saturating_sub(8)..],
                &moved[..moved.len().min(30)]
            );
        }
        let again: Vec<u64> = moved
            .iter()
            .copied()
            .filter(|n| before.contains(n))
            .collect();
        let last_before = before.last().copied();
        assert!(
            moved
                .iter()
                .filter(|n| !again.contains(n))
                .all(|&n| last_before.is_none_or(|last| n > last)),
            "{name}: what node 2 delivered is, but for what it delivered again, newer than what node 1 had"
        );
        let seqs: Vec<u64> = before
            .iter()
            .copied()
            .chain(moved.iter().copied().filter(|n| !again.contains(n)))
            .collect();
        let after: Vec<u64> = seqs
            .iter()
            .copied()
            .filter(|&n| n >= resumed_at[i])
            .collect();
        let expected: Vec<u64> = (resumed_at[i]..ended_at[i]).collect();
        assert_eq!(
            after.len(),
            expected.len(),
            "{name}: every message published after the session resumed ({} missing)",
            expected.len().saturating_sub(after.len())
        );
        let missing = (0..ended_at[i]).filter(|n| !seqs.contains(n)).count();
        eprintln!(
            "{name}: {} received ({} again after the move, {missing} missing), {} published after the resumption, {} published in all",
            seqs.len(),
            again.len(),
            expected.len(),
            ended_at[i]
        );
    }
}

/// A QoS 2 packet id the client still keeps (its PUBREL never came) is
/// not used for a new message by the node its session moves to, whether
/// the node it left was killed or is alive (issue #29: QoS 2 exactly once
/// across nodes; a client that keeps the id would take the new message
/// for the old one and drop it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qos2_packet_ids_the_client_keeps_are_not_reused_after_a_move() {
    let mut setup = Setup::three_linked().await;
    let mut c = subscribed_in_etcd(&setup, "keeper", "k2/#", QoS::ExactlyOnce).await;
    let (mut publisher, _) = connect(setup.ports[2], "publisher", true, 0).await;
    let mut kept = Vec::new();
    for (step, n) in [
        ("node 1", 0),
        ("node 2 (node 1 killed)", 1),
        ("node 3 (node 2 alive)", 2),
    ] {
        if n == 1 {
            setup.nodes[0].kill().unwrap();
        }
        if n > 0 {
            let present;
            (c, present) = connect(setup.ports[n], "keeper", false, 300).await;
            assert!(present, "{step}: Session Present 1");
        }
        for m in 0..3 {
            let topic = format!("k2/{n}/{m}");
            publish_complete(&mut publisher, &topic, b"x", QoS::ExactlyOnce, false).await;
        }
        let ids = kept_qos2_ids(&mut c, 3).await;
        eprintln!("{step}: QoS 2 packet ids {ids:?}");
        for id in &ids {
            assert!(!kept.contains(id), "{step}: id {id} reused, kept {kept:?}");
        }
        kept.extend(ids);
    }
}

/// `client_id` subscribed to `f/#` at QoS 2 on node 1, which sent it
/// three QoS 2 messages (`f/0` to `f/2`, from a publisher on node 3) it
/// has not acknowledged, then connected to node 2 (Session Present 1):
/// its connection to node 1 (still open), to node 2, the publisher, and
/// (packet id, topic) of each message as the client saw it on node 1.
async fn moved_with_qos2_in_flight(
    setup: &Setup,
    client_id: &str,
) -> (Raw, Raw, Raw, Vec<(u16, String)>) {
    let mut old = subscribed_in_etcd(setup, client_id, "f/#", QoS::ExactlyOnce).await;
    let (mut publisher, _) = connect(setup.ports[2], "publisher", true, 0).await;
    for m in 0..3 {
        let topic = format!("f/{m}");
        publish_complete(&mut publisher, &topic, b"x", QoS::ExactlyOnce, false).await;
    }
    let seen = unacknowledged_qos2(&mut old, 3).await;
    let (new, present) = connect(setup.ports[1], client_id, false, 300).await;
    assert!(present);
    (old, new, publisher, seen)
}

/// A QoS 2 message a live node had sent the client, which the client has
/// not acknowledged (it may have it, and keeps its id until the PUBREL),
/// moves with the session under the id the client saw, QoS 2 and DUP: a
/// client that keeps the id takes it as the same message (MQTT 5 4.3.3),
/// and the new node finishes the flow (PUBREL, PUBCOMP). Before, such a
/// message came again at QoS 1 under a new id: a second delivery (issue
/// #29: QoS 2 exactly once across nodes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qos2_message_in_flight_moves_under_the_id_the_client_saw() {
    let setup = Setup::three_linked().await;
    let (_on_node_1, mut c, mut publisher, seen) =
        moved_with_qos2_in_flight(&setup, "inflight").await;
    let again = sent_again_and_completed(&mut c, 3).await;
    assert_eq!(again, seen, "the same messages under the same ids");
    assert_eq!(
        unacknowledged_within(&mut c, Duration::from_secs(2)).await,
        Vec::<String>::new()
    );
    // A new message goes on under an id of the node's own.
    publish_complete(&mut publisher, "f/new", b"x", QoS::ExactlyOnce, false).await;
    let ids = kept_qos2_ids(&mut c, 1).await;
    assert!(seen.iter().all(|(id, _)| *id != ids[0]), "{ids:?} {seen:?}");
}

/// The QoS 2 messages sent again under the ids the client saw on node 1
/// stay open (PUBREC'd, not completed) while node 2's router delivers
/// at QoS 1: its ids, translated from node 2's block, have the same
/// numbers as the kept ones (both the router's first). Each PUBACK is of
/// node 2's delivery, not of a kept QoS 2 message: until 2026-11-30 the
/// node took the first for a PUBACK of a QoS 2 delivery and ended the
/// connection (0x82), and the subscriber, moved from a stopping node at
/// a rolling restart, went to a third node (the short fault run, CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routers_delivery_is_not_taken_for_a_kept_one_of_its_number() {
    let setup = Setup::three_linked().await;
    let (_on_node_1, mut c, mut publisher, seen) =
        moved_with_qos2_in_flight(&setup, "kept-ids").await;
    // Sent again under the ids seen, PUBREC'd, their PUBCOMPs held back.
    let (again, mut released) = sent_again(&mut c, 3, false).await;
    assert_eq!(again, seen);
    for m in 0..3 {
        let topic = format!("f/q{m}");
        publish_complete(&mut publisher, &topic, b"x", QoS::AtLeastOnce, false).await;
    }
    let mut q1 = Vec::new();
    let deadline = Instant::now() + PATIENCE;
    while q1.len() < 3 && Instant::now() < deadline {
        match c.recv_within(Duration::from_secs(1)).await {
            Recv::Packet(v5::Packet::Publish(p)) if p.qos == QoS::AtLeastOnce => {
                q1.push(p.pkid);
                c.send(v5::Packet::PubAck(v5::PubAck::new(p.pkid, None)))
                    .await;
            }
            Recv::Packet(v5::Packet::PubRel(rel)) => released.push(rel.pkid),
            Recv::Packet(v5::Packet::Disconnect(d)) => panic!("disconnected: {d:?}"),
            Recv::Packet(_) | Recv::Timeout => {}
            Recv::Closed => panic!("connection closed after {q1:?}"),
        }
    }
    assert_eq!(q1.len(), 3, "node 2's QoS 1 deliveries, each PUBACK'd");
    // The kept ones complete after, and the connection goes on.
    for id in released {
        c.send(v5::Packet::PubComp(v5::PubComp::new(id, None)))
            .await;
    }
    publish_complete(&mut publisher, "f/after", b"x", QoS::AtLeastOnce, false).await;
    loop {
        match c.recv_within(PATIENCE).await {
            Recv::Packet(v5::Packet::Publish(p)) => {
                assert_eq!(&p.topic[..], b"f/after", "{p:?}");
                break;
            }
            Recv::Packet(v5::Packet::PubRel(_)) => {}
            other => panic!("expected the next PUBLISH, got {other:?}"),
        }
    }
}

/// A node that takes a session from etcd writes the packet id block it
/// takes into the session record before its CONNACK. Before, the record
/// kept the old block until the node's own record followed its claim: a
/// node that died in between (or, here, is paused right after the
/// CONNACK and then killed) left the old block, and the next node took
/// the same block again, whose QoS 2 ids the client may still keep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_sessions_block_is_in_etcd_before_its_connack() {
    let mut setup = Setup::three_linked().await;
    let mut old = subscribed_in_etcd(&setup, "blocky", "bk/#", QoS::ExactlyOnce).await;
    let block = |setup: &Setup| {
        let value = setup.etcd.get("/statebroker/S/blocky").unwrap().unwrap();
        (value[0], value[1])
    };
    assert_eq!(block(&setup), (0, 0), "node 1's block");
    let (_c2, present) = connect(setup.ports[1], "blocky", false, 300).await;
    setup.nodes[1].pause().unwrap();
    assert!(present);
    assert_eq!(block(&setup), (0, 1), "node 2's block, at its CONNACK");
    setup.nodes[1].kill().unwrap();
    let (mut c, present) = connect(setup.ports[2], "blocky", false, 300).await;
    assert!(present);
    // Node 1 lets its connection go once it sees a claim after its own:
    // node 2's, if it was written before the pause, else node 3's (node
    // 2 may have been paused between its CONNACK and its claim). Until
    // then node 1 still delivers to its connection, and hands what is in
    // flight there over to node 3 under node 1's ids (CI, 2026-12-01: a
    // publish on node 1 before it saw node 3's claim came to node 3's
    // client as id 1). So: after node 1 let go, published on node 3.
    match old.recv_within(PATIENCE).await {
        Recv::Packet(v5::Packet::Disconnect(d)) => {
            assert_eq!(d.reason_code, v5::DisconnectReasonCode::SessionTakenOver)
        }
        other => panic!("expected DISCONNECT 0x8E on node 1, got {other:?}"),
    }
    let (mut publisher, _) = connect(setup.ports[2], "publisher", true, 0).await;
    publish_complete(&mut publisher, "bk/1", b"x", QoS::ExactlyOnce, false).await;
    let ids = kept_qos2_ids(&mut c, 1).await;
    assert!((201..=300).contains(&ids[0]), "node 3's block: {ids:?}");
}

/// The publishes `client` receives until none comes for `wait`, not
/// acknowledged.
async fn unacknowledged_within(client: &mut Raw, wait: Duration) -> Vec<String> {
    let mut got = Vec::new();
    while let Recv::Packet(packet) = client.recv_within(wait).await {
        if let v5::Packet::Publish(p) = packet {
            got.push(String::from_utf8_lossy(&p.topic).into_owned());
        }
    }
    got
}

/// Messages a live node handed over to a session that moved, which its
/// client leaves the new node without acknowledging, stay that
/// session's: they come at its next connection, and no other subscriber
/// of their topic gets them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handed_over_messages_stay_with_their_session() {
    let setup = Setup::three_linked().await;
    let (mut other, _) = connect(setup.ports[1], "other", true, 0).await;
    other.subscribe("h/#", QoS::AtLeastOnce).await;
    let (_publisher, expected) = queued_on_node_1(&setup, "handed", "h", 5).await;
    assert_eq!(
        topics_within(&mut other, Duration::from_secs(2)).await,
        expected
    );
    let mut c = resumed_on_node_2(&setup, "handed").await;
    let got = unacknowledged_within(&mut c, Duration::from_secs(3)).await;
    assert_eq!(got, expected, "handed over, not acknowledged");
    leave(c).await;
    other.no_publish_within(Duration::from_secs(2)).await;
    let (mut c, present) = connect(setup.ports[1], "handed", false, 300).await;
    assert!(present);
    assert_eq!(
        topics_within(&mut c, Duration::from_secs(2)).await,
        expected,
        "at the session's next connection"
    );
}

/// Messages handed over to a session's new node, which its client leaves
/// without acknowledging, are kept in etcd by that node too: killed, it
/// leaves them to the next node the client comes to, once each and in
/// order, and they leave etcd as the client has them. Before 2026-11-30
/// they lived in the new node's memory alone (the old node removes its
/// own copies once the new node has the messages): lost with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handed_over_messages_outlive_the_node_they_were_handed_to() {
    let mut setup = Setup::three_linked().await;
    let (_publisher, expected) = queued_in_etcd_by_node_1(&setup, "carried", "c", 5).await;
    let mut c = resumed_on_node_2(&setup, "carried").await;
    let got = unacknowledged_within(&mut c, Duration::from_secs(3)).await;
    assert_eq!(got, expected, "handed over, not acknowledged");
    leave(c).await;
    // Node 1's copies go, node 2's come.
    eventually("node 2's copies in etcd, node 1's gone", || {
        queued_in_etcd(&setup, "carried") == 5
            && setup
                .etcd
                .count_prefix("/statebroker/Q/7:carried/sb1/")
                .unwrap()
                == 0
    })
    .await;
    setup.nodes[1].kill().unwrap();
    let (mut c, present) = connect(setup.ports[2], "carried", false, 300).await;
    assert!(present);
    assert_eq!(
        topics_until(&mut c, expected.len()).await,
        expected,
        "from node 2's copies in etcd"
    );
    eventually("the copies gone once the client has them", || {
        queued_in_etcd(&setup, "carried") == 0
    })
    .await;
    assert_eq!(
        topics_within(&mut c, Duration::from_secs(1)).await,
        Vec::<String>::new()
    );
}

/// Messages a live node hands over to a session whose client has already
/// left the new node wait there for its next connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handed_over_messages_wait_for_a_client_that_left() {
    let setup = Setup::three_linked().await;
    let (_publisher, expected) = queued_on_node_1(&setup, "brief", "w", 5).await;
    // In and out of node 2 before node 1 has handed anything over (it
    // waits for etcd's watch and 100 ms of quiet).
    let (c, present) = connect(setup.ports[1], "brief", false, 300).await;
    assert!(present);
    leave(c).await;
    eventually("node 1 handed the 5 messages over", || {
        metric(
            setup.http[0],
            "statebroker_cluster_messages_handed_over_total",
        ) == Some(5.0)
    })
    .await;
    let (mut c, present) = connect(setup.ports[1], "brief", false, 300).await;
    assert!(present);
    assert_eq!(
        topics_within(&mut c, Duration::from_secs(2)).await,
        expected
    );
}

/// A node restarted from its data directory gives up the sessions its
/// clients took to another node while it was down: it keeps no copy,
/// queues nothing for them in etcd, and the client's next move brings no
/// message twice. Before, the restored copy collected every message of
/// the client (written to etcd under the restarted node) and the next
/// node handed them all over again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_from_its_data_directory_drops_sessions_that_moved() {
    let dir = std::env::temp_dir().join(format!("sb-restart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut setup = Setup::start(1, 1);
    let data_dir = format!("--data-dir={}", dir.display());
    setup.add_node_with(&[], &[0], &[data_dir]);
    setup.all_linked().await;
    let (restarted, stays) = (1, 0);
    // The subscriber's session on the node with a data directory.
    let (mut c, _) = connect(setup.ports[restarted], "mover", false, 300).await;
    c.subscribe("moved/#", QoS::AtLeastOnce).await;
    eventually("the subscription in etcd", || {
        record(&setup, "mover").is_some_and(|r| r.contains("moved/#"))
    })
    .await;
    // Its node stops cleanly (the session is in its data directory); the
    // client goes on on the other node.
    setup.nodes[restarted]
        .stop(Duration::from_secs(10))
        .expect("stops");
    drop(c);
    let (mut c, present) = connect(setup.ports[stays], "mover", false, 300).await;
    assert!(present, "Session Present 1 on the other node");
    setup.restart_node(restarted).await;
    // Only the link to the other node is kept there.
    assert_eq!(metric(setup.http[restarted], KEPT), Some(1.0));
    let (mut publisher, _) = connect(setup.ports[stays], "pub", true, 0).await;
    for i in 0..10 {
        let topic = format!("moved/{i}");
        publisher.publish(&topic, "x", QoS::AtLeastOnce, None).await;
    }
    assert_eq!(topics_until(&mut c, 10).await.len(), 10);
    assert_eq!(
        queued_in_etcd(&setup, "mover"),
        0,
        "nothing queued by the restarted node"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A subscriber's node stopped normally (SIGTERM, as in a rolling
/// restart) while publishers on the other nodes go on: every message a
/// publisher had acknowledged reaches the subscriber, which went on on
/// another node (some may come twice: QoS 1). Before, the node ended the
/// other nodes' links with its clients, the node the subscriber came to
/// found it unlinked and read its queue in etcd, where the last messages
/// (queued less than `queue::LINGER` before) were not yet: 4 to 9 lost
/// per publisher in a rolling restart. The stopping node now keeps its
/// links until the session was handed over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_loses_nothing_when_its_node_stops_normally() {
    let mut setup = Setup::three_linked().await;
    let mut s = subscribed_in_etcd(&setup, "rolling", "r/#", QoS::AtLeastOnce).await;
    // A steady stream from each, as a device's.
    let publishers = [("q2", setup.ports[1]), ("q3", setup.ports[2])];
    let steady = Steady::start(&publishers, "r", Duration::from_millis(10)).await;
    let wait = Duration::from_secs(2);
    let deadline = |secs| Some(Instant::now() + Duration::from_secs(secs));
    let mut got = received_until(&mut s, wait, deadline(2)).await;
    setup.nodes[0].term().unwrap();
    // The subscriber takes what comes until its node sends it away, then
    // goes on on node 2, as a client does.
    got.extend(received_until(&mut s, wait, deadline(10)).await);
    drop(s);
    let (mut s, present) = connect(setup.ports[1], "rolling", false, 300).await;
    assert!(present, "the session on node 2");
    got.extend(received_until(&mut s, wait, deadline(3)).await);
    let acknowledged = steady.stop().await;
    got.extend(received_within(&mut s, Duration::from_secs(3)).await);
    let stopped = setup.nodes[0].stop(PATIENCE).expect("node 1 stops");
    assert!(
        stopped.is_some_and(|s| s.success()),
        "node 1 exits by itself: {stopped:?}"
    );
    for (i, name) in ["q2", "q3"].iter().enumerate() {
        let topic = format!("r/{name}");
        let seqs: std::collections::BTreeSet<u64> = got
            .iter()
            .filter(|(t, _)| *t == topic)
            .map(|(_, p)| p.parse().unwrap())
            .collect();
        let missing: Vec<u64> = (0..acknowledged[i]).filter(|n| !seqs.contains(n)).collect();
        eprintln!(
            "{name}: {} acknowledged, {} received, missing {missing:?}",
            acknowledged[i],
            seqs.len()
        );
        assert!(
            missing.is_empty(),
            "{name}: acknowledged and never received: {missing:?}"
        );
    }
}

/// Every node lost its lease (etcd without a quorum past two lease
/// TTLs): a subscriber sent away from node 1 resumes on node 2. Node 1,
/// registered again, keeps no copy of its session: before, its copy
/// (whose claim went with the lease) stayed in its router, collected
/// every message published to the client and wrote it to etcd's queue
/// under node 1 (6,178 after a 15 s quorum loss in a probe), for the
/// next node the client moved to to give again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_back_from_a_lost_lease_keeps_no_copy_of_a_session_that_moved() {
    let mut setup = Setup::start_with(1, 2, &[("STATEBROKER__CLUSTERING__LEASE_TTL_MS", "2000")]);
    setup.all_linked().await;
    let mut c = subscribed_in_etcd(&setup, "drifter", "drift/#", QoS::AtLeastOnce).await;
    setup.etcd.pause(0).unwrap();
    for &http in &setup.http {
        eventually("the node lost its lease", || {
            metric(http, "statebroker_cluster_lease_losses_total").is_some_and(|n| n >= 1.0)
        })
        .await;
    }
    setup.etcd.resume(0).unwrap();
    // Sent away from node 1 (0x9C), the client goes to node 2.
    drop(topics_within(&mut c, Duration::from_secs(1)).await);
    drop(c);
    let (mut c, present) = loop {
        let (raw, connack) = Raw::connect_with(addr(setup.ports[1]), "drifter", |c| {
            c.0.clean_start = false;
            let mut properties = v5::ConnectProperties::new();
            properties.session_expiry_interval = Some(300);
            c.0.properties = Some(properties);
        })
        .await;
        if connack.code == v5::ConnectReturnCode::Success {
            break (raw, connack.session_present);
        }
        // Node 2 registers again and waits for node 1's link meanwhile.
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(present, "the session on node 2");
    setup.all_linked().await;
    let (mut publisher, _) = connect(setup.ports[1], "pub", true, 0).await;
    for i in 0..10 {
        publisher
            .publish(&format!("drift/{i}"), "x", QoS::AtLeastOnce, None)
            .await;
    }
    // Each comes; some may come twice: node 1, back, adopted its copy of
    // the session again (it was the record's writer), and hands over what
    // reached it while the session moved (the move window, see
    // docs/cluster.md).
    let mut got = std::collections::BTreeSet::new();
    let deadline = Instant::now() + PATIENCE;
    while got.len() < 10 && Instant::now() < deadline {
        got.extend(topics_within(&mut c, Duration::from_secs(1)).await);
    }
    assert_eq!(got.len(), 10, "{got:?}");
    eventually("node 1 keeps no copy of the session", || {
        metric(setup.http[0], KEPT) == Some(1.0)
    })
    .await;
    // Well past the queue's 100 ms: a copy would have written them.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        queued_in_etcd(&setup, "drifter"),
        0,
        "nothing queued by node 1"
    );
}

/// A client that moves while messages keep coming to it (every 20 ms,
/// from a publisher on a third node): its old node hands the session
/// over, and every acknowledged message reaches the client. Before, the
/// handover took what the old node's router gave until 300 ms passed
/// without a message, which never happened while the publisher went
/// on: nothing was handed over (found by a probe: a node stopped with
/// SIGTERM waited its whole grace for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_moves_under_steady_traffic_is_handed_over() {
    let setup = Setup::three_linked().await;
    let mut old = subscribed_in_etcd(&setup, "busy", "b/#", QoS::AtLeastOnce).await;
    let steady = Steady::start(
        &[("steady-pub", setup.ports[2])],
        "b",
        Duration::from_millis(20),
    )
    .await;
    let mut got = received_until(
        &mut old,
        Duration::from_secs(2),
        Some(Instant::now() + Duration::from_secs(1)),
    )
    .await;
    // Moves without acknowledging what the old node sends meanwhile.
    let (mut new, present) = connect(setup.ports[1], "busy", false, 300).await;
    assert!(present);
    drop(old);
    eventually("node 1 handed the session over", || {
        metric(setup.http[0], HANDED_OVER) == Some(1.0)
    })
    .await;
    got.extend(
        received_until(
            &mut new,
            Duration::from_secs(2),
            Some(Instant::now() + Duration::from_secs(2)),
        )
        .await,
    );
    let acknowledged = steady.stop().await[0];
    got.extend(received_within(&mut new, Duration::from_secs(2)).await);
    let seqs: std::collections::BTreeSet<u64> =
        got.iter().map(|(_, p)| p.parse().unwrap()).collect();
    let missing: Vec<u64> = (0..acknowledged).filter(|n| !seqs.contains(n)).collect();
    assert!(
        missing.is_empty(),
        "acknowledged and never received: {missing:?}"
    );
}

/// A node stopped normally (SIGTERM) waits for the clients connected then
/// to come back elsewhere, not for one that was away already: with an
/// offline persistent session it exits at once (here: within 4 s, its
/// grace being 5 s), its messages queued in etcd for the client's next
/// node. Before, it waited its whole grace for that session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_stopped_with_an_offline_session_does_not_wait_for_it() {
    let mut setup = Setup::three_linked().await;
    let (_publisher, expected) = queued_in_etcd_by_node_1(&setup, "away", "a", 5).await;
    let stopped = setup.nodes[0].stop(Duration::from_secs(4)).unwrap();
    assert!(
        stopped.is_some_and(|s| s.success()),
        "node 1 exits by itself within 4 s: {stopped:?}"
    );
    let (mut c, present) = connect(setup.ports[1], "away", false, 300).await;
    assert!(present);
    assert_eq!(
        topics_within(&mut c, Duration::from_secs(3)).await,
        expected
    );
}

/// The node an owner record in etcd names for `client_id` (`None`: no
/// node owns it).
fn owner(setup: &Setup, client_id: &str) -> Option<String> {
    let value = setup
        .etcd
        .get(&format!("/statebroker/C/{client_id}"))
        .unwrap()?;
    let value = String::from_utf8_lossy(&value).into_owned();
    value.split('\n').next().map(str::to_owned)
}

/// `client_id` subscribed to `filter` at `qos` on node 1 and left, its
/// session kept there.
async fn away_from_node_1(setup: &Setup, client_id: &str, filter: &str, qos: QoS) {
    let c = subscribed_in_etcd(setup, client_id, filter, qos).await;
    leave(c).await;
    eventually("the session kept on node 1", || {
        owner(setup, client_id).as_deref() == Some("sb1")
    })
    .await;
}

/// The index of the node (2 or 3) that adopted `client_id`'s session
/// from node 1.
fn adopter(setup: &Setup, client_id: &str) -> usize {
    let node = owner(setup, client_id).expect("adopted");
    ["sb2", "sb3"].iter().position(|n| *n == node).unwrap() + 1
}

/// `client_id` left node 1 with a persistent session subscribed to
/// `w/#`; once node 1 is gone (`stop_node_1`) another node adopts the
/// session; returns that node's index.
async fn adopted_after(
    setup: &mut Setup,
    client_id: &str,
    stop_node_1: impl FnOnce(&mut Setup),
) -> usize {
    away_from_node_1(setup, client_id, "w/#", QoS::AtLeastOnce).await;
    stop_node_1(setup);
    eventually("another node adopted the session", || {
        owner(setup, client_id).is_some_and(|node| node != "sb1")
    })
    .await;
    adopter(setup, client_id)
}

/// 10 QoS 1 messages `w/0..10` published on node `on`; their topics.
async fn published_on(setup: &Setup, on: usize) -> Vec<String> {
    let (mut publisher, _) = connect(setup.ports[on], "publisher", true, 0).await;
    let topics: Vec<String> = (0..10).map(|n| format!("w/{n}")).collect();
    for topic in &topics {
        publisher.publish(topic, "x", QoS::AtLeastOnce, None).await;
    }
    topics
}

/// A node stopped normally with the persistent session of a client that
/// is away: another node adopts the session, and what is published while
/// the client is still away waits for it. Here the client comes back to
/// the third node, which takes the session and the messages from the
/// adopter. Before, no node held the session's subscriptions until its
/// client came back: all 10 were lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_nodes_offline_session_keeps_its_messages_until_its_client_is_back() {
    let mut setup = Setup::three_linked().await;
    let adopter = adopted_after(&mut setup, "away", |setup| {
        let started = Instant::now();
        let stopped = setup.nodes[0].stop(Duration::from_secs(10)).unwrap();
        assert!(stopped.is_some_and(|s| s.success()), "{stopped:?}");
        // The figure, not an assertion: the session has nothing queued,
        // and its handover ends once node 1's router says so (router
        // patch 48); before, it waited 1 s for a first message.
        println!(
            "node 1 stopped in {:.2} s, its offline session offered",
            started.elapsed().as_secs_f64()
        );
    })
    .await;
    let other = 3 - adopter;
    let expected = published_on(&setup, adopter).await;
    let (mut c, present) = connect(setup.ports[other], "away", false, 300).await;
    assert!(present, "Session Present 1");
    assert_eq!(
        topics_until(&mut c, 10).await,
        expected,
        "each once, in order"
    );
    let again = topics_within(&mut c, Duration::from_secs(1)).await;
    assert_eq!(again, Vec::<String>::new());
}

/// The same for a killed node, once its lease has ended: the client comes
/// back to the adopter itself, and gets what came meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_nodes_offline_session_is_adopted_once_its_lease_ends() {
    let mut setup = Setup::three_linked().await;
    let adopter = adopted_after(&mut setup, "away", |setup| {
        setup.nodes[0].kill().unwrap();
    })
    .await;
    let expected = published_on(&setup, 3 - adopter).await;
    let (mut c, present) = connect(setup.ports[adopter], "away", false, 300).await;
    assert!(present, "Session Present 1");
    assert_eq!(
        topics_until(&mut c, 10).await,
        expected,
        "each once, in order"
    );
}

/// Many sessions of a killed node are adopted several at once (16): each
/// adoption takes about four etcd round trips, and what is published for
/// a session before its adoption is lost for it. Here 64 clients away
/// from node 1; every session adopted, a sample of 8 gets what was
/// published after. Prints how long the adoptions took, from the first to
/// the last (on 2 cores with CI running beside: 0.61 s one at a time,
/// 0.17-0.31 s 16 at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_nodes_many_offline_sessions_are_all_adopted() {
    const N: usize = 64;
    let mut setup = Setup::three_linked().await;
    for i in 0..N {
        let (mut c, _) = connect(setup.ports[0], &format!("many{i}"), false, 300).await;
        c.subscribe(&format!("many/{i}"), QoS::AtLeastOnce).await;
        leave(c).await;
    }
    let count = |prefix: &str| setup.etcd.count_prefix(prefix).unwrap();
    eventually("every session in etcd, owned by node 1", || {
        count("/statebroker/S/many") == N as u64 && count("/statebroker/C/many") == N as u64
    })
    .await;
    setup.nodes[0].kill().unwrap();
    let adopted = || {
        [1, 2]
            .iter()
            .filter_map(|&n| metric(setup.http[n], "statebroker_cluster_sessions_adopted_total"))
            .sum::<f64>() as usize
    };
    let start = Instant::now();
    let mut first = None;
    loop {
        let done = adopted();
        if done > 0 {
            first.get_or_insert_with(Instant::now);
        }
        if done >= N {
            break;
        }
        assert!(start.elapsed() < PATIENCE, "{done} of {N} sessions adopted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = first.map(|f| f.elapsed()).unwrap_or_default();
    eprintln!("{N} sessions adopted within {took:?} of the first");
    assert_eq!(adopted(), N, "each once");
    let (mut publisher, _) = connect(setup.ports[1], "publisher", true, 0).await;
    for i in 0..N {
        publisher
            .publish(&format!("many/{i}"), "x", QoS::AtLeastOnce, None)
            .await;
    }
    for i in (0..N).step_by(N / 8) {
        let client_id = format!("many{i}");
        let (mut c, present) = connect(setup.ports[1], &client_id, false, 300).await;
        assert!(present, "{client_id}: Session Present 1");
        assert_eq!(topics_until(&mut c, 1).await, [format!("many/{i}")]);
    }
}

/// A node stopped normally offers the sessions it keeps for clients that
/// are away to the other nodes while its links are up: one adopts each
/// and gets the messages queued there (handed over, at QoS 1 at most, as
/// when a client moves). Here 5 QoS 2 messages, which etcd does not keep:
/// before the offer (the sessions adopted from etcd once the node had
/// left), they were lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_node_hands_its_offline_sessions_over() {
    let mut setup = Setup::three_linked().await;
    away_from_node_1(&setup, "away", "q2/#", QoS::ExactlyOnce).await;
    let (mut publisher, _) = connect(setup.ports[2], "publisher", true, 0).await;
    let expected: Vec<String> = (0..5).map(|n| format!("q2/{n}")).collect();
    for topic in &expected {
        publish_complete(&mut publisher, topic, b"x", QoS::ExactlyOnce, false).await;
    }
    eventually("node 1 received the messages", || {
        metric(
            setup.http[0],
            "statebroker_messages_received_total{qos=\"2\"}",
        )
        .is_some_and(|n| n >= 5.0)
    })
    .await;
    let stopped = setup.nodes[0].stop(Duration::from_secs(10)).unwrap();
    assert!(stopped.is_some_and(|s| s.success()), "{stopped:?}");
    let (mut c, present) = connect(setup.ports[adopter(&setup, "away")], "away", false, 300).await;
    assert!(present, "Session Present 1");
    assert_eq!(
        topics_until(&mut c, 5).await,
        expected,
        "each once, in order"
    );
}

/// What a QoS 2 subscriber got: each PUBLISH (payload, packet id, DUP) in
/// order, and the packet ids it PUBREC'd whose PUBREL has not come.
#[derive(Default)]
struct Got {
    publishes: Vec<(String, u16, bool)>,
    open: std::collections::HashSet<u16>,
}

impl Got {
    /// Takes what `client` receives, acknowledged as its QoS asks
    /// (PUBACK; PUBREC, then PUBCOMP for the PUBREL), until none comes
    /// for `quiet`, or `until`.
    async fn take(&mut self, client: &mut Raw, quiet: Duration, until: Option<Instant>) {
        while until.is_none_or(|t| Instant::now() < t) {
            match client.recv_within(quiet).await {
                Recv::Packet(v5::Packet::Publish(p)) => {
                    match p.qos {
                        QoS::AtLeastOnce => {
                            client
                                .send(v5::Packet::PubAck(v5::PubAck::new(p.pkid, None)))
                                .await;
                        }
                        QoS::ExactlyOnce => {
                            self.open.insert(p.pkid);
                            client
                                .send(v5::Packet::PubRec(v5::PubRec::new(p.pkid, None)))
                                .await;
                        }
                        QoS::AtMostOnce => {}
                    }
                    let payload = String::from_utf8_lossy(&p.payload).into_owned();
                    self.publishes.push((payload, p.pkid, p.dup));
                }
                Recv::Packet(v5::Packet::PubRel(rel)) => {
                    self.open.remove(&rel.pkid);
                    client
                        .send(v5::Packet::PubComp(v5::PubComp::new(rel.pkid, None)))
                        .await;
                }
                Recv::Packet(_) => {}
                _ => return,
            }
        }
    }
}

/// Issue #29, QoS 2 exactly once across nodes: a persistent QoS 2
/// subscriber leaves node 1 and is back on node 2 at once while a
/// publisher on node 3 sends a QoS 2 message every 10 ms. Each message
/// comes once: node 1 hands over what it queued meanwhile, and node 2
/// drops what its own router gave the session already (see
/// `cluster/stamps/`). A message node 1 had sent without its exchange
/// completed comes again under the id the client saw, with DUP: the same
/// message to the client (MQTT 5 4.3.3). Before, everything published
/// while the session moved (up to half a second of traffic) came twice,
/// from node 2's router and in node 1's handover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qos2_subscriber_that_moves_gets_each_message_once() {
    let setup = Setup::three_linked().await;
    let mut old = subscribed_in_etcd(&setup, "once", "o/#", QoS::ExactlyOnce).await;
    let steady = Steady::start_at(
        &[("once-pub", setup.ports[2])],
        "o",
        Duration::from_millis(10),
        QoS::ExactlyOnce,
    )
    .await;
    let mut on_old = Got::default();
    let until = Instant::now() + Duration::from_secs(1);
    on_old
        .take(&mut old, Duration::from_secs(2), Some(until))
        .await;
    drop(old);
    let (mut new, present) = connect(setup.ports[1], "once", false, 300).await;
    assert!(present);
    eventually("node 1 handed the session over", || {
        metric(setup.http[0], HANDED_OVER) == Some(1.0)
    })
    .await;
    let mut on_new = Got::default();
    let until = Instant::now() + Duration::from_secs(2);
    on_new
        .take(&mut new, Duration::from_secs(2), Some(until))
        .await;
    let acknowledged = steady.stop().await[0];
    on_new.take(&mut new, Duration::from_secs(2), None).await;
    let mut times = std::collections::BTreeMap::<u64, usize>::new();
    let again = on_new
        .publishes
        .iter()
        .filter(|(_, pkid, dup)| !(*dup && on_old.open.contains(pkid)));
    for (payload, _, _) in on_old.publishes.iter().chain(again) {
        *times.entry(payload.parse().unwrap()).or_default() += 1;
    }
    let missing: Vec<u64> = (0..acknowledged)
        .filter(|n| !times.contains_key(n))
        .collect();
    let twice: Vec<(u64, usize)> = times.into_iter().filter(|(_, n)| *n > 1).collect();
    assert!(
        missing.is_empty(),
        "acknowledged, never received: {missing:?}"
    );
    let seen = |n: u64| {
        let on = |got: &Got| -> Vec<(u16, bool)> {
            got.publishes
                .iter()
                .filter(|(p, _, _)| p.parse() == Ok(n))
                .map(|(_, pkid, dup)| (*pkid, *dup))
                .collect()
        };
        format!("{n}: old {:?}, new {:?}", on(&on_old), on(&on_new))
    };
    assert!(
        twice.is_empty(),
        "received more than once (of {acknowledged}): {:?}; open on node 1: {:?}",
        twice.iter().map(|(n, _)| seen(*n)).collect::<Vec<_>>(),
        on_old.open
    );
    let dropped = metric(
        setup.http[1],
        "statebroker_cluster_handover_duplicates_dropped_total",
    );
    eprintln!("{acknowledged} messages; node 2 dropped {dropped:?} handed-over copies it had");
}
