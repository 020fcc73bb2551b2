//! Hostile and careless clients against a broker process: whatever they do,
//! the broker's resident memory (read from `/proc`) stays bounded and it
//! keeps serving the others.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::raw::{Raw, Recv, v5};
use common::spawn_broker;
use rumqttc::v5::mqttbytes::QoS;

/// Resident memory of a process, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb * 1024
}

/// One round of churn: `clients` clean sessions, each subscribing to a
/// filter of its own, publishing `payload` to it, receiving it, and leaving.
async fn churn_round(addr: std::net::SocketAddr, round: usize, clients: usize, payload: &Bytes) {
    for i in 0..clients {
        let id = format!("churn-{round}-{i}");
        let topic = format!("churn/{round}/{i}");
        let mut c = Raw::connect(addr, &id).await;
        c.subscribe(&topic, QoS::AtMostOnce).await;
        c.publish(&topic, payload.clone(), QoS::AtMostOnce, None)
            .await;
        let p = c.next_publish().await;
        assert_eq!(p.payload.len(), payload.len());
        c.send(v5::Packet::Disconnect(v5::Disconnect::new(
            v5::DisconnectReasonCode::NormalDisconnection,
        )))
        .await;
        assert!(matches!(c.recv().await, Recv::Closed));
    }
}

/// Clients that come, subscribe to a filter nobody else uses, publish, and
/// go: what they leave behind (the filter's message log, the router's
/// records of the client id) is freed, so the broker's memory stops
/// growing. Each round leaves 300 logs holding a 64 KiB message; unfreed,
/// six rounds grow the broker by well over 100 MiB.
#[tokio::test]
async fn churned_clients_and_filters_leave_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let broker = spawn_broker(dir.path(), &[]).await;
    let pid = broker.child.id().unwrap();
    let payload = Bytes::from(vec![b'x'; 64 * 1024]);
    for round in 0..2 {
        churn_round(broker.addr, round, 300, &payload).await;
    }
    let warm = rss(pid);
    for round in 2..8 {
        churn_round(broker.addr, round, 300, &payload).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after = rss(pid);
    let growth = after.saturating_sub(warm);
    eprintln!(
        "rss after 2 rounds {} MiB, after 8 rounds {} MiB",
        warm >> 20,
        after >> 20
    );
    assert!(
        growth < 40 << 20,
        "the broker grew by {} MiB over 6 rounds of churn",
        growth >> 20
    );
    // Still serving.
    let mut c = Raw::connect(broker.addr, "after-churn").await;
    let r = c.request(&[b"GET", b"k"]).await;
    assert_eq!(&r.payload[..], b"$-1\r\n");
}

/// A client that asks for large values and never acknowledges the answers
/// cannot make the broker hold them without bound: once its queue passes
/// `max_queued_bytes` it is disconnected with 0x97, and others are served.
#[tokio::test]
async fn a_client_that_never_acknowledges_is_bounded() {
    let broker = common::start_broker_with(|s| s.broker.max_queued_bytes = 1 << 20).await;
    let addr = broker.local_addr();
    let mut writer = Raw::connect(addr, "big-writer").await;
    let value = vec![b'v'; 256 * 1024];
    let set = writer.request(&[b"SET", b"big", &value]).await;
    assert_eq!(&set.payload[..], b"+OK\r\n");

    let mut greedy = Raw::connect(addr, "greedy").await;
    greedy.ensure_response_subscription().await;
    let ts = common::raw::now_hlc("greedy");
    for n in 0..20u64 {
        let properties = greedy.request_properties(&n.to_be_bytes(), &[("__ts", &ts)]);
        let payload = statestore::resp3::encode_request(&[&b"GET"[..], b"big"]);
        let mut publish = v5::Publish::new(
            common::raw::REQUEST_TOPIC,
            QoS::AtLeastOnce,
            payload,
            Some(properties),
        );
        publish.pkid = greedy.pkid();
        greedy.send(v5::Packet::Publish(publish)).await;
    }
    // Reads everything, acknowledges nothing.
    let mut answers = 0;
    let reason = loop {
        match greedy.recv().await {
            Recv::Packet(v5::Packet::Publish(_)) => answers += 1,
            Recv::Packet(v5::Packet::Disconnect(d)) => break d.reason_code,
            Recv::Packet(_) => {}
            other => panic!("expected a DISCONNECT, got {other:?} after {answers} answers"),
        }
    };
    assert_eq!(reason, v5::DisconnectReasonCode::QuotaExceeded);
    assert!(
        answers <= 4,
        "{answers} answers of 256 KiB within a 1 MiB bound"
    );
    let r = writer.request(&[b"GET", b"small"]).await;
    assert_eq!(&r.payload[..], b"$-1\r\n");
}
