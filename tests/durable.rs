//! Restarts of the MQTT side: retained messages and persistent sessions
//! and the messages queued for them come back from the data directory,
//! exactly (see `crates/broker/src/durable/`).

mod common;

use std::path::Path;
use std::time::Duration;

use broker::RunningBroker;
use broker::config::{Mode, PersistenceSettings};
use common::mqtt::{
    ack, filter, goodbye, kept_qos2_ids, next_raw_publish, publish_complete, publish_complete_with,
    session, subscribe_with, subscribe_with_id,
};
use common::raw::{Raw, Recv, v5};
use common::start_broker_with;
use rumqttc::v5::mqttbytes::QoS;
use v5::{Packet, Publish, SubscribeReasonCode};

async fn start(dir: &Path) -> RunningBroker {
    start_broker_with(|s| {
        s.persistence = Some(PersistenceSettings {
            data_dir: dir.to_owned(),
            mode: Mode::Fsync,
            accept_data_loss: false,
        });
    })
    .await
}

async fn restart(broker: RunningBroker, dir: &Path) -> RunningBroker {
    broker.shutdown(Duration::from_secs(2)).await;
    start(dir).await
}

/// Every retained message a new `filter` subscription gets, by topic.
async fn retained_now(addr: std::net::SocketAddr, id: &str, filter: &str) -> Vec<Publish> {
    let mut c = Raw::connect(addr, id).await;
    c.subscribe(filter, QoS::ExactlyOnce).await;
    collect(&mut c).await
}

/// Every PUBLISH that arrives until 300 ms pass without one, acknowledged
/// (QoS 2 completed), sorted by topic.
async fn collect(c: &mut Raw) -> Vec<Publish> {
    let mut got = Vec::new();
    loop {
        match c.recv_within(Duration::from_millis(300)).await {
            Recv::Packet(Packet::Publish(p)) => {
                match p.qos {
                    QoS::AtMostOnce => {}
                    QoS::AtLeastOnce => c.send(Packet::PubAck(v5::PubAck::new(p.pkid, None))).await,
                    QoS::ExactlyOnce => c.send(Packet::PubRec(v5::PubRec::new(p.pkid, None))).await,
                }
                got.push(p);
            }
            Recv::Packet(Packet::PubRel(rel)) => {
                c.send(Packet::PubComp(v5::PubComp::new(rel.pkid, None)))
                    .await
            }
            Recv::Packet(_) => {}
            _ => break,
        }
    }
    got.sort_by(|a, b| a.topic.cmp(&b.topic));
    got
}

/// MQTT 5 3.3.1.3 across a restart: retained messages come back with their
/// QoS, payload and properties, the Message Expiry Interval reduced by the
/// time they waited; a cleared one stays cleared; an expired one is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retained_messages_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let broker = start(dir.path()).await;
    let mut p = Raw::connect(broker.local_addr(), "ret-pub").await;
    let props = v5::PublishProperties {
        message_expiry_interval: Some(600),
        content_type: Some("text/plain".into()),
        user_properties: vec![("unit".into(), "C".into())],
        ..Default::default()
    };
    publish_complete_with(
        &mut p,
        "ret/a",
        b"21.5",
        QoS::AtLeastOnce,
        true,
        Some(props),
    )
    .await;
    publish_complete_with(&mut p, "ret/b", b"b0", QoS::AtMostOnce, true, None).await;
    publish_complete_with(&mut p, "ret/gone", b"x", QoS::AtLeastOnce, true, None).await;
    publish_complete_with(&mut p, "ret/gone", b"", QoS::AtLeastOnce, true, None).await;
    let short = v5::PublishProperties {
        message_expiry_interval: Some(1),
        ..Default::default()
    };
    publish_complete_with(
        &mut p,
        "ret/short",
        b"s",
        QoS::AtLeastOnce,
        true,
        Some(short),
    )
    .await;
    // QoS 2, completed.
    publish_complete(&mut p, "ret/c", b"c2", QoS::ExactlyOnce, true).await;
    drop(p);
    let before = retained_now(broker.local_addr(), "ret-before", "ret/#").await;
    assert_eq!(before.len(), 4, "{before:?}");

    tokio::time::sleep(Duration::from_millis(1100)).await;
    let broker = restart(broker, dir.path()).await;
    let after = retained_now(broker.local_addr(), "ret-after", "ret/#").await;
    let topics: Vec<&[u8]> = after.iter().map(|p| &p.topic[..]).collect();
    assert_eq!(
        topics,
        [&b"ret/a"[..], b"ret/b", b"ret/c"],
        "ret/gone cleared, ret/short expired"
    );
    let a = &after[0];
    assert_eq!(
        (&a.payload[..], a.qos, a.retain),
        (&b"21.5"[..], QoS::AtLeastOnce, true)
    );
    let props = a.properties.as_ref().unwrap();
    assert_eq!(props.content_type.as_deref(), Some("text/plain"));
    assert_eq!(props.user_properties, vec![("unit".into(), "C".into())]);
    let left = props.message_expiry_interval.unwrap();
    assert!(
        (590..600).contains(&left),
        "expiry reduced by the wait: {left}"
    );
    assert_eq!(
        (&after[1].payload[..], after[1].qos),
        (&b"b0"[..], QoS::AtMostOnce)
    );
    assert_eq!(
        (&after[2].payload[..], after[2].qos),
        (&b"c2"[..], QoS::ExactlyOnce)
    );

    // Still retained after a second restart (the restore saved nothing twice
    // and removed nothing it should keep), and clearing persists.
    let mut p = Raw::connect(broker.local_addr(), "ret-pub").await;
    publish_complete_with(&mut p, "ret/b", b"", QoS::AtLeastOnce, true, None).await;
    drop(p);
    let broker = restart(broker, dir.path()).await;
    let again = retained_now(broker.local_addr(), "ret-again", "ret/#").await;
    let topics: Vec<&[u8]> = again.iter().map(|p| &p.topic[..]).collect();
    assert_eq!(topics, [&b"ret/a"[..], b"ret/c"]);
}

/// MQTT 5 4.1 across a restart: a session with an expiry keeps its
/// subscriptions (with QoS, options and identifier): the client finds
/// Session Present 1 and receives what is published for it; the retained
/// messages it had when it subscribed are not sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persistent_session_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let broker = start(dir.path()).await;
    let addr = broker.local_addr();
    let mut p = Raw::connect(addr, "ps-pub").await;
    publish_complete(&mut p, "ps/retained", b"r", QoS::AtLeastOnce, true).await;
    drop(p);
    let (mut c, connack) = Raw::connect_with(addr, "ps-sub", session(true, Some(3600))).await;
    assert!(!connack.session_present);
    let codes = subscribe_with(
        &mut c,
        filter("ps/+", QoS::AtLeastOnce, |f| f.nolocal = true),
    )
    .await;
    assert_eq!(codes, [SubscribeReasonCode::Success(QoS::AtLeastOnce)]);
    let r = next_raw_publish(&mut c).await;
    assert_eq!(&r.topic[..], b"ps/retained");
    ack(&mut c, &r).await;
    let with_id = filter("ids/#", QoS::ExactlyOnce, |_| {});
    subscribe_with_id(&mut c, with_id, Some(42)).await;
    // Also one to drop before the restart.
    subscribe_with(&mut c, filter("dropped/#", QoS::AtLeastOnce, |_| {})).await;
    let pkid = c.pkid();
    let mut unsubscribe = v5::Unsubscribe::new("dropped/#", None);
    unsubscribe.pkid = pkid;
    c.send(Packet::Unsubscribe(unsubscribe)).await;
    assert!(matches!(c.recv().await, Recv::Packet(Packet::UnsubAck(_))));
    goodbye(c, None).await;

    let broker = restart(broker, dir.path()).await;
    let addr = broker.local_addr();
    let mut p = Raw::connect(addr, "ps-pub").await;
    publish_complete(&mut p, "ps/1", b"while away", QoS::AtLeastOnce, false).await;
    publish_complete(&mut p, "dropped/1", b"not for it", QoS::AtLeastOnce, false).await;
    publish_complete(&mut p, "ids/x", b"with id", QoS::ExactlyOnce, false).await;
    let (mut c, connack) = Raw::connect_with(addr, "ps-sub", session(false, Some(3600))).await;
    assert!(connack.session_present, "the session came back");
    // Two subscriptions: the router serves them in its own order.
    let got = collect(&mut c).await;
    assert_eq!(got.len(), 2, "{got:?}");
    let (with_id, away) = (&got[0], &got[1]);
    assert_eq!(
        (&away.topic[..], &away.payload[..], away.qos),
        (&b"ps/1"[..], &b"while away"[..], QoS::AtLeastOnce)
    );
    assert_eq!(
        (&with_id.topic[..], with_id.qos),
        (&b"ids/x"[..], QoS::ExactlyOnce)
    );
    assert_eq!(
        with_id
            .properties
            .as_ref()
            .unwrap()
            .subscription_identifiers,
        vec![42]
    );
    // No Local came back too: its own publish is not delivered to it.
    publish_complete(&mut c, "ps/own", b"mine", QoS::AtLeastOnce, false).await;
    c.no_publish_within(Duration::from_millis(300)).await;
}

/// A session's expiry keeps counting while the broker is down; a session
/// that ends with its connection is never saved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_expire_across_a_restart_and_clean_ones_are_not_kept() {
    let dir = tempfile::tempdir().unwrap();
    let broker = start(dir.path()).await;
    let addr = broker.local_addr();
    for (id, expiry) in [("short", 1), ("clean", 0), ("long", 600)] {
        let (mut c, _) = Raw::connect_with(addr, id, session(true, Some(expiry))).await;
        subscribe_with(&mut c, filter("x/#", QoS::AtLeastOnce, |_| {})).await;
        goodbye(c, None).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let broker = restart(broker, dir.path()).await;
    let addr = broker.local_addr();
    for (id, present) in [("short", false), ("clean", false), ("long", true)] {
        let (c, connack) = Raw::connect_with(addr, id, session(false, Some(600))).await;
        assert_eq!(connack.session_present, present, "{id}");
        goodbye(c, Some(0)).await;
    }
    // Ended at DISCONNECT with expiry 0: gone after a restart too.
    let broker = restart(broker, dir.path()).await;
    let (_c, connack) =
        Raw::connect_with(broker.local_addr(), "long", session(false, Some(600))).await;
    assert!(!connack.session_present);
}

/// A retained Last Will is a retained message like any other: it survives
/// a restart, with its QoS (2 here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retained_will_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let broker = start(dir.path()).await;
    let addr = broker.local_addr();
    let (c, _) = Raw::connect_with(addr, "will-ret", |c| {
        c.1 = Some(v5::LastWill::new(
            "will/ret",
            "offline",
            QoS::ExactlyOnce,
            true,
            None,
        ));
    })
    .await;
    drop(c); // no DISCONNECT: the will goes out
    let mut seen = Vec::new();
    for _ in 0..50 {
        seen = retained_now(addr, "will-watch", "will/#").await;
        if !seen.is_empty() {
            break;
        }
    }
    assert_eq!(seen.len(), 1, "the will is retained");
    assert_eq!(seen[0].qos, QoS::ExactlyOnce);
    let broker = restart(broker, dir.path()).await;
    let after = retained_now(broker.local_addr(), "will-after", "will/#").await;
    assert_eq!(after.len(), 1, "{after:?}");
    assert_eq!(
        (&after[0].topic[..], &after[0].payload[..], after[0].qos),
        (&b"will/ret"[..], &b"offline"[..], QoS::ExactlyOnce)
    );
}

/// The topic, payload and QoS of each message.
fn summary(got: &[Publish]) -> Vec<(String, String, QoS)> {
    got.iter()
        .map(|p| {
            (
                String::from_utf8_lossy(&p.topic).into_owned(),
                String::from_utf8_lossy(&p.payload).into_owned(),
                p.qos,
            )
        })
        .collect()
}

/// MQTT 5 4.1: the messages queued for a persistent session survive a
/// restart: each comes back once, on its own topic, at the QoS and with
/// the subscription identifier of the subscription it matches, its
/// properties kept and its Message Expiry Interval reduced; nothing the
/// client had acknowledged comes back; another client's restored messages
/// never reach a `#` subscriber.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_queued_for_a_session_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let broker = start(dir.path()).await;
    let addr = broker.local_addr();
    let (mut c, _) = Raw::connect_with(addr, "q-sub", session(true, Some(3600))).await;
    subscribe_with_id(&mut c, filter("q/#", QoS::ExactlyOnce, |_| {}), Some(7)).await;
    subscribe_with(&mut c, filter("one/x", QoS::AtLeastOnce, |_| {})).await;
    let (mut other, _) = Raw::connect_with(addr, "q-other", session(true, Some(3600))).await;
    subscribe_with(&mut other, filter("#", QoS::AtLeastOnce, |_| {})).await;
    let mut p = Raw::connect(addr, "q-pub").await;
    // Delivered and acknowledged before the restart: never again.
    publish_complete(&mut p, "q/online", b"seen", QoS::AtLeastOnce, false).await;
    assert_eq!(summary(&collect(&mut c).await).len(), 1);
    assert_eq!(summary(&collect(&mut other).await).len(), 1);
    goodbye(c, None).await;
    goodbye(other, None).await;

    let properties = v5::PublishProperties {
        message_expiry_interval: Some(100),
        content_type: Some("text/plain".into()),
        user_properties: vec![("k".into(), "v".into())],
        ..v5::PublishProperties::default()
    };
    publish_complete(&mut p, "q/a", b"a1", QoS::AtLeastOnce, false).await;
    publish_complete_with(
        &mut p,
        "q/b",
        b"b2",
        QoS::ExactlyOnce,
        false,
        Some(properties),
    )
    .await;
    publish_complete(&mut p, "one/x", b"x2", QoS::ExactlyOnce, false).await;
    drop(p);

    let broker = restart(broker, dir.path()).await;
    let addr = broker.local_addr();
    let (mut c, connack) = Raw::connect_with(addr, "q-sub", session(false, Some(3600))).await;
    assert!(connack.session_present);
    let got = collect(&mut c).await;
    assert_eq!(
        summary(&got),
        [
            ("one/x".into(), "x2".into(), QoS::AtLeastOnce),
            ("q/a".into(), "a1".into(), QoS::AtLeastOnce),
            ("q/b".into(), "b2".into(), QoS::ExactlyOnce),
        ]
    );
    let ids = |p: &Publish| {
        p.properties
            .as_ref()
            .map(|p| p.subscription_identifiers.clone())
            .unwrap_or_default()
    };
    assert_eq!(ids(&got[0]), Vec::<usize>::new());
    assert_eq!(ids(&got[1]), vec![7]);
    let b = got[2].properties.as_ref().unwrap();
    assert_eq!(b.content_type.as_deref(), Some("text/plain"));
    assert_eq!(b.user_properties, vec![("k".to_owned(), "v".to_owned())]);
    assert!(
        b.message_expiry_interval
            .is_some_and(|s| (90..=100).contains(&s)),
        "{:?}",
        b.message_expiry_interval
    );
    goodbye(c, None).await;
    let (mut other, connack) = Raw::connect_with(addr, "q-other", session(false, Some(3600))).await;
    assert!(connack.session_present);
    assert_eq!(
        summary(&collect(&mut other).await),
        [
            ("one/x".into(), "x2".into(), QoS::AtLeastOnce),
            ("q/a".into(), "a1".into(), QoS::AtLeastOnce),
            ("q/b".into(), "b2".into(), QoS::AtLeastOnce),
        ],
        "its own copies, and nothing of q-sub's"
    );
    goodbye(other, None).await;

    // All acknowledged: nothing comes back after another restart.
    let broker = restart(broker, dir.path()).await;
    let addr = broker.local_addr();
    for id in ["q-sub", "q-other"] {
        let (mut c, connack) = Raw::connect_with(addr, id, session(false, Some(3600))).await;
        assert!(connack.session_present);
        assert_eq!(summary(&collect(&mut c).await), [], "{id}");
    }
}

/// MQTT 5 3.1.2.4 across a restart: a session kept without subscriptions
/// comes back, and one that a clean start discarded stays discarded, also
/// when that connection never needed the router (it idled).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discarded_session_stays_discarded_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let broker = start(dir.path()).await;
    let addr = broker.local_addr();
    for id in ["empty-kept", "empty-discarded"] {
        let (c, connack) = Raw::connect_with(addr, id, session(false, Some(3600))).await;
        assert!(!connack.session_present);
        goodbye(c, None).await;
    }
    let (c, connack) = Raw::connect_with(addr, "empty-discarded", session(true, None)).await;
    assert!(!connack.session_present);
    goodbye(c, None).await;

    let broker = restart(broker, dir.path()).await;
    let addr = broker.local_addr();
    let (c, connack) = Raw::connect_with(addr, "empty-kept", session(false, Some(3600))).await;
    assert!(connack.session_present, "kept without subscriptions");
    goodbye(c, Some(0)).await;
    let (c, connack) = Raw::connect_with(addr, "empty-discarded", session(false, Some(3600))).await;
    assert!(!connack.session_present, "the clean start discarded it");
    goodbye(c, Some(0)).await;
}

/// QoS 2 packet ids a client keeps across a restart (its PUBRELs were
/// owed when the broker stopped, and are not sent again) are not used for
/// new messages after it: each run on a data directory numbers the
/// router's deliveries in a block of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qos2_packet_ids_the_client_keeps_are_not_reused_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = start(dir.path()).await;
    let (mut c, _) =
        Raw::connect_with(broker.local_addr(), "keeper", session(true, Some(3600))).await;
    subscribe_with(&mut c, filter("k2/#", QoS::ExactlyOnce, |_| {})).await;
    let mut kept: Vec<u16> = Vec::new();
    for run in 0..3 {
        if run > 0 {
            drop(c);
            broker = restart(broker, dir.path()).await;
            let connack;
            (c, connack) =
                Raw::connect_with(broker.local_addr(), "keeper", session(false, Some(3600))).await;
            assert!(connack.session_present, "run {run}: the session came back");
        }
        let mut p = Raw::connect(broker.local_addr(), "publisher").await;
        for m in 0..3 {
            let topic = format!("k2/{run}/{m}");
            publish_complete(&mut p, &topic, b"x", QoS::ExactlyOnce, false).await;
        }
        let ids = kept_qos2_ids(&mut c, 3).await;
        eprintln!("run {run}: QoS 2 packet ids {ids:?}");
        for id in &ids {
            assert!(
                !kept.contains(id),
                "run {run}: id {id} reused, kept {kept:?}"
            );
        }
        kept.extend(ids);
    }
}
