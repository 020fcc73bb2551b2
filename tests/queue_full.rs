//! Issue #33 item 8: an offline persistent subscriber whose filter's log
//! (2 KiB here: `[router] max_segment_size` 1024 × `max_segment_count` 2)
//! overflows. With `[broker] queue_full = "drop_oldest"` (the default) the
//! oldest messages go, and the loss is counted and logged with the
//! subscriber's client id; with `"refuse"` the publisher gets PUBACK 0x97
//! once the log is full, and every publish acknowledged with 0x00 reaches
//! the subscriber.

#[path = "http/client.rs"]
#[allow(dead_code)]
mod client;
mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::raw::{Raw, Recv, v5};
use rumqttc::v5::mqttbytes::QoS;

const TOPIC: &str = "q/t";
const MESSAGES: usize = 100;

/// A broker with 2 KiB filter logs and `queue_full`; its MQTT and HTTP
/// addresses, and the process.
async fn broker(queue_full: &str, dir: &tempfile::TempDir) -> common::BrokerProcess {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_statebroker"));
    command
        .args(["--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(dir.path())
        .env("STATEBROKER__ROUTER__MAX_SEGMENT_SIZE", "1024")
        .env("STATEBROKER__ROUTER__MAX_SEGMENT_COUNT", "2")
        .env("STATEBROKER__BROKER__QUEUE_FULL", queue_full);
    let (child, addr, log) = common::spawn_command(command).await;
    common::BrokerProcess { child, addr, log }
}

fn http_addr(broker: &common::BrokerProcess) -> SocketAddr {
    let log = broker.log.lock();
    let line = log.iter().find(|l| l.contains("HTTP endpoint")).unwrap();
    let rest = line.split("addr=").nth(1).unwrap();
    rest.split_whitespace().next().unwrap().parse().unwrap()
}

/// The value of `series` at `/metrics` (0 when absent).
async fn metric(http: SocketAddr, series: &str) -> f64 {
    client::metric(http, series).await
}

/// Polls `series` until `cond` holds (60 s at most); returns its value.
async fn metric_until(http: SocketAddr, series: &str, cond: impl Fn(f64) -> bool) -> f64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let value = metric(http, series).await;
        if cond(value) {
            return value;
        }
        assert!(tokio::time::Instant::now() < deadline, "{series} = {value}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Connects "sub" resuming (or starting) a session kept for an hour.
async fn subscriber(addr: SocketAddr) -> (Raw, v5::ConnAck) {
    Raw::connect_with(addr, "sub", |c| {
        c.0.clean_start = false;
        let mut properties = v5::ConnectProperties::new();
        properties.session_expiry_interval = Some(3600);
        c.0.properties = Some(properties);
    })
    .await
}

/// "sub" subscribes at QoS 1 and goes offline; then "pub" publishes
/// [`MESSAGES`] messages of 100 bytes at QoS 1: their PUBACK reasons.
async fn overflow_an_offline_subscriber(broker: &common::BrokerProcess) -> Vec<v5::PubAckReason> {
    let http = http_addr(broker);
    let (mut sub, connack) = subscriber(broker.addr).await;
    assert_eq!(connack.code, v5::ConnectReturnCode::Success);
    sub.subscribe(TOPIC, QoS::AtLeastOnce).await;
    sub.send(v5::Packet::Disconnect(v5::Disconnect::new(
        v5::DisconnectReasonCode::NormalDisconnection,
    )))
    .await;
    drop(sub);
    metric_until(http, "statebroker_connections", |v| v == 0.0).await;

    let mut publisher = Raw::connect(broker.addr, "pub").await;
    let mut reasons = Vec::new();
    for i in 0..MESSAGES {
        let payload = format!("{i:04}{}", "x".repeat(96));
        let reason = publisher
            .publish(TOPIC, payload.into_bytes(), QoS::AtLeastOnce, None)
            .await
            .unwrap();
        reasons.push(reason);
    }
    reasons
}

/// The index in a received message's payload.
fn index(p: &v5::Publish) -> usize {
    std::str::from_utf8(&p.payload[..4])
        .unwrap()
        .parse()
        .unwrap()
}

/// The default: every publish is acknowledged with 0x00, the offline
/// subscriber gets only the newest that the log kept, and what it lost is
/// counted exactly and logged with its client id. Before: the loss was
/// counted nowhere (the metric did not exist; a WARN line per read said
/// "cursor jumped", without a count).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_oldest_counts_and_logs_what_an_offline_subscriber_lost() {
    let dir = tempfile::tempdir().unwrap();
    let broker = broker("drop_oldest", &dir).await;
    let http = http_addr(&broker);
    let reasons = overflow_an_offline_subscriber(&broker).await;
    assert!(reasons.iter().all(|r| *r == v5::PubAckReason::Success));

    let (mut sub, connack) = subscriber(broker.addr).await;
    assert!(connack.session_present);
    let first = sub.next_publish().await;
    let series = "statebroker_dropped_messages_total{reason=\"filter_log_evicted\"}";
    let dropped = metric_until(http, series, |v| v > 0.0).await as usize;
    assert_eq!(
        index(&first),
        dropped,
        "the first kept follows the lost ones"
    );
    assert!(
        (MESSAGES / 2..MESSAGES).contains(&dropped),
        "{dropped} of {MESSAGES} lost in a 2 KiB log"
    );
    let mut received = vec![index(&first)];
    while received.len() < MESSAGES - dropped {
        received.push(index(&sub.next_publish().await));
    }
    assert_eq!(received, (dropped..MESSAGES).collect::<Vec<_>>());
    sub.no_publish_within(Duration::from_millis(500)).await;
    let log = broker.log.lock().join("\n");
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("messages dropped before delivery")
            && l.contains("client_id=\"sub\"")
            && l.contains(&format!("dropped={dropped}"))),
        "{log}"
    );
}

/// `queue_full = "refuse"`: once the offline subscriber's log is full the
/// publisher gets PUBACK 0x97 "quota exceeded" (counted), and the
/// subscriber gets every message acknowledged with 0x00, none lost. Once
/// it has read them, publishes are taken again. Before: every PUBACK was
/// 0x00 and the oldest were lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuse_answers_quota_exceeded_and_loses_nothing_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let broker = broker("refuse", &dir).await;
    let http = http_addr(&broker);
    let reasons = overflow_an_offline_subscriber(&broker).await;
    let accepted = reasons
        .iter()
        .take_while(|r| **r == v5::PubAckReason::Success)
        .count();
    assert!(
        (5..MESSAGES / 2).contains(&accepted),
        "{accepted} accepted in a 2 KiB log: {reasons:?}"
    );
    assert!(
        reasons[accepted..]
            .iter()
            .all(|r| *r == v5::PubAckReason::QuotaExceeded),
        "{reasons:?}"
    );
    let refused = MESSAGES - accepted;
    metric_until(http, "statebroker_publishes_refused_total", |v| {
        v == refused as f64
    })
    .await;

    let (mut sub, connack) = subscriber(broker.addr).await;
    assert!(connack.session_present);
    let mut received = Vec::new();
    while received.len() < accepted {
        received.push(index(&sub.next_publish().await));
    }
    assert_eq!(received, (0..accepted).collect::<Vec<_>>());
    sub.no_publish_within(Duration::from_millis(500)).await;
    let series = "statebroker_dropped_messages_total{reason=\"filter_log_evicted\"}";
    assert_eq!(metric(http, series).await, 0.0);

    // Read and acknowledged: the publisher is served again.
    let mut publisher = Raw::connect(broker.addr, "pub2").await;
    let reason = publisher
        .publish(TOPIC, &b"9999 after"[..], QoS::AtLeastOnce, None)
        .await;
    assert_eq!(reason, Some(v5::PubAckReason::Success));
    match sub.recv_within(common::TIMEOUT).await {
        Recv::Packet(v5::Packet::Publish(p)) => assert_eq!(&p.payload[..], b"9999 after"),
        other => panic!("expected the new message, got {other:?}"),
    }
    let log = broker.log.lock().join("\n");
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("publishes refused")
            && l.contains("kept_session=\"sub\"")),
        "{log}"
    );
}
