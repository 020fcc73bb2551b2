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
