//! A state store request on a cluster node is acknowledged (PUBACK) once
//! its outcome is out, not when the node reads it: a node that dies before
//! etcd has the request leaves it unacknowledged, and its client, resuming
//! its session on another node, sends it again; it runs once.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::raw::{REQUEST_TOPIC, Raw, Recv, now_hlc, v5};
use common::{PATIENCE, Setup, addr, ask, client, eventually, text};
use rumqttc::v5::mqttbytes::QoS;

/// Connects `client_id` to `port` with Clean Start `clean` and a session
/// kept 300 s; returns it and Session Present. A node that cannot read
/// the session from etcd yet refuses the CONNECT (0x88): tried again.
async fn connect(port: u16, client_id: &str, clean: bool) -> (Raw, bool) {
    let start = std::time::Instant::now();
    loop {
        let (raw, connack) = Raw::connect_with(addr(port), client_id, |c| {
            c.0.clean_start = clean;
            let mut properties = v5::ConnectProperties::new();
            properties.session_expiry_interval = Some(300);
            c.0.properties = Some(properties);
        })
        .await;
        match connack.code {
            v5::ConnectReturnCode::Success => return (raw, connack.session_present),
            v5::ConnectReturnCode::ServerUnavailable if start.elapsed() < PATIENCE => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            _ => panic!("{connack:?}"),
        }
    }
}

/// Waits for the PUBACK of `pkid` and the answer with `correlation`
/// (acknowledging it); returns the answer's payload as text.
async fn acknowledged_and_answered(c: &mut Raw, pkid: u16, correlation: &[u8]) -> String {
    let mut acked = false;
    let mut answer = None;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !(acked && answer.is_some()) {
        let wait = deadline.saturating_duration_since(tokio::time::Instant::now());
        match c.recv_within(wait).await {
            Recv::Packet(v5::Packet::PubAck(ack)) if ack.pkid == pkid => {
                assert_eq!(ack.reason, v5::PubAckReason::Success);
                acked = true;
            }
            Recv::Packet(v5::Packet::Publish(p)) => {
                if p.qos == QoS::AtLeastOnce {
                    c.send(v5::Packet::PubAck(v5::PubAck::new(p.pkid, None)))
                        .await;
                }
                let theirs = p
                    .properties
                    .as_ref()
                    .and_then(|p| p.correlation_data.as_deref());
                if theirs == Some(correlation) {
                    answer = Some(String::from_utf8_lossy(&p.payload).into_owned());
                }
            }
            Recv::Packet(_) => {}
            other => panic!("acknowledged: {acked}, answered: {answer:?}; then {other:?}"),
        }
    }
    answer.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_node_dies_before_etcd_has_it_is_sent_again_and_runs_once() {
    let mut setup = Setup::start(3, 2);
    let [p1, p2] = [setup.ports[0], setup.ports[1]];
    // A watcher on node 2 sees every change of the key.
    let mut watcher = client(p2, "watcher").await;
    assert_eq!(
        text(&ask(&mut watcher, &["KEYNOTIFY", "door"]).await),
        "+OK"
    );
    let mut notes = watcher.notifications().expect("notifications");

    // A persistent session on node 1, subscribed to its response topic,
    // and that subscription in etcd.
    let (mut c, _) = connect(p1, "requester", true).await;
    c.ensure_response_subscription().await;
    let record = "/statebroker/S/requester";
    let response_topic = c.response_topic.clone();
    eventually("the session's subscription in etcd", || {
        setup
            .etcd
            .get(record)
            .unwrap()
            .is_some_and(|r| String::from_utf8_lossy(&r).contains(&response_topic))
    })
    .await;
    // An answered request: acknowledged with its answer.
    let answered = c.request(&[b"SET".as_slice(), b"door", b"shut"]).await;
    assert_eq!(&answered.payload[..], b"+OK\r\n");

    // etcd stops answering (every member paused): a request waits, and
    // is not acknowledged meanwhile.
    for member in 0..setup.etcd.len() {
        setup.etcd.pause(member).unwrap();
    }
    let pkid = c.pkid();
    let correlation = b"open-the-door";
    let properties = c.request_properties(
        correlation,
        &[("__ts", &now_hlc("requester")), ("__protVer", "1.0")],
    );
    let payload = statestore::resp3::encode_request(&[b"SET".as_slice(), b"door", b"open"]);
    let mut publish = v5::Publish::new(
        REQUEST_TOPIC,
        QoS::AtLeastOnce,
        Bytes::from(payload),
        Some(properties),
    );
    publish.pkid = pkid;
    c.send(v5::Packet::Publish(publish.clone())).await;
    match c.recv_within(Duration::from_secs(1)).await {
        Recv::Timeout => {}
        other => panic!("nothing comes while etcd cannot commit: {other:?}"),
    }
    // Its node dies; etcd comes back.
    setup.nodes[0].kill().unwrap();
    for member in 0..setup.etcd.len() {
        setup.etcd.resume(member).unwrap();
    }
    drop(c);

    // The client resumes its session on node 2 and sends the request again
    // (MQTT 4.4: DUP, the same packet id): acknowledged and answered once.
    let (mut c, present) = connect(p2, "requester", false).await;
    assert!(present, "the session resumed on node 2");
    publish.dup = true;
    c.send(v5::Packet::Publish(publish)).await;
    assert_eq!(
        acknowledged_and_answered(&mut c, pkid, correlation).await,
        "+OK\r\n"
    );
    assert_eq!(text(&ask(&mut watcher, &["GET", "door"]).await), "$open");

    // One change each: "shut", then "open" once (the first attempt, had
    // etcd taken it before the node died, is found by its request id).
    let mut seen = Vec::new();
    while let Ok(Some(note)) = tokio::time::timeout(Duration::from_secs(2), notes.recv()).await {
        seen.push(note.value.map(|v| String::from_utf8_lossy(&v).into_owned()));
    }
    assert_eq!(
        seen,
        [Some("shut".to_owned()), Some("open".to_owned())],
        "each SET changed the key once"
    );
}
