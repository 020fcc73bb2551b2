//! Issue #29 item 4: a will is published when its client's node dies
//! (after the will delay, once, on every node), and not when the client
//! left normally or resumed its session on another node in time. Real
//! etcd, real node processes killed.

mod common;

use std::time::{Duration, Instant};

use common::raw::{Raw, Recv, v5};
use common::{Setup, addr, eventually, metric};
use rumqttc::v5::mqttbytes::QoS;

const PUBLISHED: &str = "statebroker_cluster_dead_node_wills_total";
/// The nodes' membership lease (the default).
const LEASE: Duration = Duration::from_secs(5);

/// Connects `client_id` to `port` with a will on `will/<client_id>`
/// delayed `delay` s, a session kept 60 s, Clean Start `clean`.
async fn with_will(port: u16, client_id: &str, delay: u32, clean: bool) -> Raw {
    let topic = format!("will/{client_id}");
    let (raw, connack) = Raw::connect_with(addr(port), client_id, |c| {
        c.0.clean_start = clean;
        let mut properties = v5::ConnectProperties::new();
        properties.session_expiry_interval = Some(60);
        c.0.properties = Some(properties);
        let will_properties = v5::LastWillProperties {
            delay_interval: Some(delay),
            payload_format_indicator: None,
            message_expiry_interval: None,
            content_type: None,
            response_topic: None,
            correlation_data: None,
            user_properties: Vec::new(),
        };
        c.1 = Some(v5::LastWill::new(
            topic,
            "gone",
            QoS::AtLeastOnce,
            false,
            Some(will_properties),
        ));
    })
    .await;
    assert_eq!(connack.code, v5::ConnectReturnCode::Success);
    raw
}

fn will_record(setup: &Setup, client_id: &str) -> Option<Vec<u8>> {
    setup
        .etcd
        .get(&format!("/statebroker/W/{client_id}"))
        .unwrap()
}

/// The wills `client` receives within `wait`.
async fn wills_within(client: &mut Raw, wait: Duration) -> Vec<String> {
    let mut topics = Vec::new();
    loop {
        match client.recv_within(wait).await {
            Recv::Packet(v5::Packet::Publish(p)) => {
                client
                    .send(v5::Packet::PubAck(v5::PubAck::new(p.pkid, None)))
                    .await;
                topics.push(String::from_utf8_lossy(&p.topic).into_owned());
            }
            Recv::Packet(_) => {}
            _ => return topics,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_will_goes_out_once_when_its_clients_node_is_killed() {
    let mut setup = Setup::three_linked().await;
    let mut on_2 = Raw::connect(addr(setup.ports[1]), "watcher-2").await;
    on_2.subscribe("will/#", QoS::AtLeastOnce).await;
    let mut on_3 = Raw::connect(addr(setup.ports[2]), "watcher-3").await;
    on_3.subscribe("will/#", QoS::AtLeastOnce).await;
    let _dying = with_will(setup.ports[0], "dying", 2, true).await;
    eventually("the will in etcd", || {
        will_record(&setup, "dying").is_some()
    })
    .await;
    // A client that leaves normally takes its record with it.
    let polite = with_will(setup.ports[0], "polite", 0, true).await;
    eventually("the polite will in etcd", || {
        will_record(&setup, "polite").is_some()
    })
    .await;
    let mut polite = polite;
    polite
        .send(v5::Packet::Disconnect(v5::Disconnect::new(
            v5::DisconnectReasonCode::NormalDisconnection,
        )))
        .await;
    eventually("the polite will gone from etcd", || {
        will_record(&setup, "polite").is_none()
    })
    .await;

    setup.nodes[0].kill().unwrap();
    let killed = Instant::now();
    let first = on_2.next_publish().await;
    let took = killed.elapsed();
    assert_eq!(&first.topic[..], b"will/dying");
    assert_eq!(&first.payload[..], b"gone");
    eprintln!("will published {took:?} after its node was killed (lease {LEASE:?} + delay 2 s)");
    assert!(took >= Duration::from_secs(2), "not before its delay");
    let p = on_3.next_publish().await;
    assert_eq!(&p.topic[..], b"will/dying");
    // Once: both surviving nodes found the record, one published it.
    for rx in [&mut on_2, &mut on_3] {
        let more = wills_within(rx, LEASE).await;
        assert!(more.is_empty(), "more wills: {more:?}");
    }
    let published: f64 = [1, 2]
        .iter()
        .map(|&n| metric(setup.http[n], PUBLISHED).unwrap_or(0.0))
        .sum();
    assert_eq!(published, 1.0, "one node published it");
    assert!(will_record(&setup, "dying").is_none());
}

/// A client that resumes its session on another node before its will's
/// delay is up gets no will published (its claim replaced the record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_will_when_the_client_comes_back_on_another_node_in_time() {
    let mut setup = Setup::three_linked().await;
    let mut watcher = Raw::connect(addr(setup.ports[2]), "watcher").await;
    watcher.subscribe("will/#", QoS::AtLeastOnce).await;
    let _first = with_will(setup.ports[0], "returner", 1, false).await;
    eventually("the will in etcd", || {
        will_record(&setup, "returner").is_some()
    })
    .await;
    let before = will_record(&setup, "returner");
    setup.nodes[0].kill().unwrap();
    let _again = with_will(setup.ports[1], "returner", 1, false).await;
    eventually("the will record now node 2's", || {
        will_record(&setup, "returner").is_some_and(|r| Some(&r) != before.as_ref())
    })
    .await;
    // Past node 1's lease, a scan and the delay (1 s): the record left as
    // it was would have been published by now (see the test above).
    let got = wills_within(&mut watcher, LEASE + Duration::from_secs(4)).await;
    assert!(got.is_empty(), "{got:?}");
}

/// A client whose node stays alive and that resumes its session on
/// another node within its will's delay gets no will either: after its
/// connection dropped, or taken over by the new one ([MQTT-3.1.3-9],
/// [MQTT-3.1.4-3]); one taken over by a Clean Start 1 CONNECT ended its
/// session, so its will goes out at once. Before, the old node did not
/// hear of the other node's CONNECT and published the will after its
/// delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_delayed_will_when_the_session_goes_on_on_another_node() {
    let setup = Setup::three_linked().await;
    let mut watcher = Raw::connect(addr(setup.ports[2]), "watcher").await;
    watcher.subscribe("will/#", QoS::AtLeastOnce).await;
    let dropped = with_will(setup.ports[0], "dropped", 3, false).await;
    let mut taken = with_will(setup.ports[0], "taken", 3, false).await;
    let mut ended = with_will(setup.ports[0], "ended", 3, false).await;
    for client in ["dropped", "taken", "ended"] {
        eventually("the will in etcd", || will_record(&setup, client).is_some()).await;
    }
    drop(dropped);
    let _back = with_will(setup.ports[1], "dropped", 3, false).await;
    let _new = with_will(setup.ports[1], "taken", 3, false).await;
    let _clean = with_will(setup.ports[1], "ended", 3, true).await;
    for old in [&mut taken, &mut ended] {
        let d = old.expect_disconnect().await;
        assert_eq!(
            common::raw::disconnect_reason(&d),
            Some(v5::DisconnectReasonCode::SessionTakenOver)
        );
    }
    // The delay (3 s) and more: only the will of the session that ended.
    let got = wills_within(&mut watcher, Duration::from_secs(5)).await;
    assert_eq!(got, ["will/ended"], "{}", setup.nodes[0].log_tail(30));
}

/// A node stopped normally (SIGTERM) publishes no will of its clients, as
/// a single node does not, and removes their will records first: no other
/// node publishes them either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_will_when_its_node_stops_normally() {
    let mut setup = Setup::three_linked().await;
    let mut watcher = Raw::connect(addr(setup.ports[2]), "watcher").await;
    watcher.subscribe("will/#", QoS::AtLeastOnce).await;
    let _client = with_will(setup.ports[0], "stopped", 0, true).await;
    eventually("the will in etcd", || {
        will_record(&setup, "stopped").is_some()
    })
    .await;
    let status = setup.nodes[0].stop(Duration::from_secs(20)).unwrap();
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    assert!(
        will_record(&setup, "stopped").is_none(),
        "removed before it exited"
    );
    // Past its lease and a scan: nothing.
    let got = wills_within(&mut watcher, LEASE + Duration::from_secs(3)).await;
    assert!(got.is_empty(), "{got:?}");
}

/// A retained will is kept in etcd as a client's retained publish is, on
/// its client's node and on the node that publishes it for a dead one: a
/// node that starts afresh serves it. Before, wills were not written
/// there (a probe: a node restarted without its data directory served 7
/// retained messages where the others served 10, the 3 missing all
/// wills).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retained_will_is_kept_in_etcd() {
    let mut setup = Setup::three_linked().await;
    let retained_will = |client_id: &str| {
        let topic = format!("will/{client_id}");
        move |c: &mut (v5::Connect, Option<v5::LastWill>, Option<v5::Login>)| {
            c.1 = Some(v5::LastWill::new(
                topic,
                "gone",
                QoS::AtLeastOnce,
                true,
                None,
            ));
        }
    };
    // Its connection broken: its own node publishes it.
    let (broken, _) =
        Raw::connect_with(addr(setup.ports[0]), "broken", retained_will("broken")).await;
    drop(broken);
    // Its node killed: another node publishes it.
    let (_dead, _) = Raw::connect_with(addr(setup.ports[1]), "dead", retained_will("dead")).await;
    eventually("the will record of the dead node's client", || {
        will_record(&setup, "dead").is_some()
    })
    .await;
    setup.nodes[1].kill().unwrap();
    for client_id in ["broken", "dead"] {
        eventually(&format!("{client_id}'s retained will in etcd"), || {
            setup
                .etcd
                .get(&format!("/statebroker/R/will/{client_id}"))
                .unwrap()
                .is_some()
        })
        .await;
    }
}
