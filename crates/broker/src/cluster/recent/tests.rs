//! The unit tests of [`super::Recent`].

use bytes::Bytes;
use router::SubOptions;

use super::*;

fn publish(topic: &str, qos: QoS) -> Publish {
    Publish {
        dup: false,
        qos,
        pkid: 0,
        retain: false,
        topic: Bytes::copy_from_slice(topic.as_bytes()),
        payload: Bytes::from_static(b"x"),
    }
}

fn session(filters: &[(&str, u8)]) -> SessionRecord {
    SessionRecord {
        expiry: 300,
        disconnected_at_ms: None,
        filters: filters
            .iter()
            .map(|(f, qos)| {
                let options = SubOptions {
                    qos: *qos,
                    id: None,
                    no_local: false,
                    retain_as_published: false,
                };
                ((*f).to_owned(), options)
            })
            .collect(),
        queue_full: None,
    }
}

fn topics(replay: &Replay) -> Vec<String> {
    replay
        .messages
        .iter()
        .map(|m| String::from_utf8_lossy(&m.publish.topic).into_owned())
        .collect()
}

/// `r` notes `publish` with `stamp` (a User Property, as a node has it).
fn note(r: &Recent, stamp: &str, publish: &Publish) {
    let mut properties = PublishProperties::default();
    properties
        .user_properties
        .push((crate::publisher::STAMP.into(), stamp.into()));
    r.note(publish, Some(&properties));
}

fn recent() -> Recent {
    Recent::new(1 << 20, Duration::from_secs(60))
}

/// What `r` gives a session of `t/#` at QoS 1 taken from `dead`, every
/// node live, every QoS 2 publish released, etcd having none.
async fn replay_all(r: &Recent, dead: &str) -> Replay {
    r.replay(
        dead,
        &session(&[("t/#", 1)]),
        &HashSet::new(),
        all_live,
        all_released,
    )
    .await
}

fn all_live(_: &str) -> bool {
    true
}

fn all_released(_: &str) -> bool {
    true
}

/// `a/1/1..=n` from origin a (run 1), `c/1/1..=n` from origin c, on
/// `t/<origin>/<number>`, interleaved.
fn two_origins(r: &Recent, n: u64) {
    for number in 1..=n {
        for origin in ["a/1", "c/1"] {
            let topic = format!("t/{origin}/{number}");
            note(
                r,
                &format!("{origin}/{number}"),
                &publish(&topic, QoS::AtLeastOnce),
            );
        }
    }
}

#[tokio::test]
async fn a_dead_nodes_session_gets_what_each_origin_published_after_the_dead_node_had_it() {
    let r = recent();
    two_origins(&r, 4);
    // Node d had a's publishes up to 2, c's up to 3.
    r.own_link_down("d", "a/1", 2);
    assert!(r.heard(&said("d", "c/1", 3)));
    let replay = replay_all(&r, "d").await;
    assert_eq!(topics(&replay), ["t/a/1/3", "t/a/1/4", "t/c/1/4"]);
    assert!(replay.silent.is_empty());
    // What etcd kept for the session is not given twice.
    let had = HashSet::from(["a/1/3".to_owned()]);
    let replay = r
        .replay("d", &session(&[("t/#", 1)]), &had, all_live, all_released)
        .await;
    assert_eq!(topics(&replay), ["t/a/1/4", "t/c/1/4"]);
}

#[tokio::test]
async fn only_what_the_sessions_subscriptions_take_at_their_qos() {
    let r = recent();
    two_origins(&r, 2);
    r.own_link_down("d", "a/1", 0);
    r.heard(&said("d", "c/1", 0));
    let s = session(&[("t/a/#", 1), ("$share/g/t/#", 1), ("t/c/1/2", 0)]);
    let replay = r
        .replay("d", &s, &HashSet::new(), all_live, all_released)
        .await;
    // Not through the shared subscription, nor at QoS 0.
    assert_eq!(topics(&replay), ["t/a/1/1", "t/a/1/2"]);
    let r = recent();
    note(&r, "a/1/1", &publish("t/x", QoS::ExactlyOnce));
    r.own_link_down("d", "a/1", 0);
    let replay = replay_all(&r, "d").await;
    assert_eq!(
        replay.messages[0].publish.qos,
        QoS::AtLeastOnce,
        "the subscription's QoS"
    );
    // A QoS 2 publish the router did not release (yet) is not given.
    let replay = r
        .replay(
            "d",
            &session(&[("t/#", 2)]),
            &HashSet::new(),
            all_live,
            |_| false,
        )
        .await;
    assert!(replay.messages.is_empty());
}

#[tokio::test]
async fn the_dead_nodes_own_publishes_and_other_dead_nodes_are_not_given() {
    let r = recent();
    note(&r, "d/9/1", &publish("t/1", QoS::AtLeastOnce));
    note(&r, "e/9/1", &publish("t/2", QoS::AtLeastOnce));
    note(&r, "a/1/1", &publish("t/3", QoS::AtLeastOnce));
    r.own_link_down("d", "a/1", 0);
    let live = |node: &str| node != "e";
    let replay = r
        .replay(
            "d",
            &session(&[("t/#", 1)]),
            &HashSet::new(),
            live,
            all_released,
        )
        .await;
    assert_eq!(topics(&replay), ["t/3"]);
    assert!(replay.silent.is_empty(), "nothing waited for from e");
}

#[tokio::test(start_paused = true)]
async fn an_origin_that_says_nothing_is_waited_for_then_left_out() {
    let r = Arc::new(recent());
    two_origins(&r, 2);
    r.own_link_down("d", "a/1", 1);
    let started = Instant::now();
    let replay = replay_all(&r, "d").await;
    assert_eq!(started.elapsed(), PATIENCE);
    assert_eq!(topics(&replay), ["t/a/1/2"]);
    assert_eq!(replay.silent, ["c/1"]);
    // Its word coming meanwhile ends the wait.
    let waiting = {
        let r = Arc::clone(&r);
        tokio::spawn(async move { replay_all(&r, "e").await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    r.own_link_down("e", "a/1", 2);
    r.heard(&said("e", "c/1", 1));
    let replay = waiting.await.unwrap();
    assert_eq!(topics(&replay), ["t/c/1/2"]);
    assert!(replay.silent.is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_word_from_an_earlier_break_is_not_taken() {
    let r = recent();
    two_origins(&r, 3);
    r.heard(&said("d", "c/1", 1));
    tokio::time::sleep(FRESH + Duration::from_secs(1)).await;
    // This node's own link to d breaks later: c's word was for an earlier
    // break of c's.
    r.own_link_down("d", "a/1", 3);
    let replay = replay_all(&r, "d").await;
    assert_eq!(replay.silent, ["c/1"]);
    r.heard(&said("d", "c/1", 2));
    let replay = replay_all(&r, "d").await;
    assert_eq!(topics(&replay), ["t/c/1/3"]);
}

#[tokio::test(start_paused = true)]
async fn a_word_from_before_the_link_came_up_is_not_taken() {
    let r = recent();
    two_origins(&r, 3);
    // d stopped: the words of that break.
    r.own_link_down("d", "a/1", 1);
    r.heard(&said("d", "c/1", 1));
    tokio::time::sleep(Duration::from_secs(1)).await;
    // d started again, this node linked to it, and d died: its session
    // is taken before any word of this break.
    r.link_up("d");
    let replay = replay_all(&r, "d").await;
    assert!(replay.messages.is_empty(), "{:?}", topics(&replay));
    let mut silent = replay.silent.clone();
    silent.sort();
    assert_eq!(silent, ["a/1", "c/1"]);
    // The words of this break.
    r.own_link_down("d", "a/1", 3);
    r.heard(&said("d", "c/1", 2));
    let replay = replay_all(&r, "d").await;
    assert_eq!(topics(&replay), ["t/c/1/3"]);
}

#[tokio::test]
async fn what_came_after_the_look_is_found_by_its_place() {
    let r = recent();
    note(&r, "a/1/1", &publish("t/1", QoS::AtLeastOnce));
    r.own_link_down("d", "a/1", 0);
    let s = session(&[("t/#", 1)]);
    let replay = r
        .replay("d", &s, &HashSet::new(), all_live, all_released)
        .await;
    assert_eq!(topics(&replay), ["t/1"]);
    note(&r, "a/1/2", &publish("t/2", QoS::AtLeastOnce));
    let late = r.since(replay.upto, "d", &s, all_live);
    let late: Vec<_> = late.iter().map(|(stamp, _)| stamp.as_str()).collect();
    assert_eq!(late, ["a/1/2"]);
}

#[test]
fn the_log_is_bounded_in_bytes_and_keeps_no_qos_0() {
    let r = Recent::new(10 * (ENTRY_OVERHEAD + 16), Duration::from_secs(60));
    note(&r, "a/1/1", &publish("t/0", QoS::AtMostOnce));
    assert_eq!(r.len().0, 0, "QoS 0 is not kept");
    for n in 1..=100 {
        note(&r, &format!("a/1/{n}"), &publish("t/1", QoS::AtLeastOnce));
    }
    let (entries, bytes) = r.len();
    assert!((8..=10).contains(&entries), "{entries}");
    assert!(bytes <= 10 * (ENTRY_OVERHEAD + 16), "{bytes}");
    let off = Recent::new(0, Duration::from_secs(60));
    note(&off, "a/1/1", &publish("t/1", QoS::AtLeastOnce));
    assert_eq!(off.len().0, 0, "0 bytes: none kept");
}

#[tokio::test(start_paused = true)]
async fn the_log_forgets_what_is_older_than_its_age() {
    let r = Recent::new(1 << 20, Duration::from_secs(10));
    note(&r, "a/1/1", &publish("t/1", QoS::AtLeastOnce));
    tokio::time::sleep(Duration::from_secs(11)).await;
    note(&r, "a/1/2", &publish("t/2", QoS::AtLeastOnce));
    assert_eq!(r.len().0, 1);
}

#[test]
fn a_word_reads_back_or_is_refused() {
    let word = said("node 1", "node 2/abc", 42);
    assert_eq!(parse_said(&word), Some(("node 1", "node 2/abc", 42)));
    for bad in ["", "x\na/1\nd", "1\n\nd", "1\na/1\n", "1\na/1"] {
        assert_eq!(parse_said(bad), None, "{bad:?}");
    }
}

/// Whether a node is live is asked with the log unlocked: the peers hold
/// their links' lock while they note a link's end here (the opposite
/// order; a node deadlocked, see `Recent::live_nodes`).
#[tokio::test]
async fn liveness_is_asked_with_the_log_unlocked() {
    let r = recent();
    r.own_link_down("b", "a/1", 0);
    r.own_link_down("b", "c/1", 0);
    note(&r, "a/1/1", &publish("t/1", QoS::AtLeastOnce));
    note(&r, "c/1/1", &publish("t/2", QoS::AtLeastOnce));
    let asked = std::sync::atomic::AtomicUsize::new(0);
    let live = |_: &str| {
        assert!(r.state.try_lock().is_some(), "asked under the log's lock");
        asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        true
    };
    let session = session(&[("t/#", 1)]);
    let replay = r
        .replay("b", &session, &HashSet::new(), live, all_released)
        .await;
    assert_eq!(topics(&replay), ["t/1", "t/2"]);
    assert_eq!(r.since(0, "b", &session, live).len(), 2);
    // Once per node, not per entry.
    assert_eq!(asked.load(std::sync::atomic::Ordering::Relaxed), 4);
}
