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
    broker_with(queue_full, dir, &[]).await
}

/// [`broker`] with more environment variables.
async fn broker_with(
    queue_full: &str,
    dir: &tempfile::TempDir,
    env: &[(&str, &str)],
) -> common::BrokerProcess {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_statebroker"));
    command
        .args(["--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(dir.path())
        .env("STATEBROKER__ROUTER__MAX_SEGMENT_SIZE", "1024")
        .env("STATEBROKER__ROUTER__MAX_SEGMENT_COUNT", "2")
        .env("STATEBROKER__BROKER__QUEUE_FULL", queue_full)
        .envs(env.iter().copied());
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
    subscriber_choosing(addr, None).await
}

/// [`subscriber`] with a CONNECT User Property `queue_full` of `choice`.
async fn subscriber_choosing(addr: SocketAddr, choice: Option<&str>) -> (Raw, v5::ConnAck) {
    Raw::connect_with(addr, "sub", |c| {
        c.0.clean_start = false;
        let mut properties = v5::ConnectProperties::new();
        properties.session_expiry_interval = Some(3600);
        if let Some(choice) = choice {
            properties.user_properties = vec![("queue_full".into(), choice.into())];
        }
        c.0.properties = Some(properties);
    })
    .await
}

/// The CONNACK's User Property `queue_full`.
fn told_queue_full(connack: &v5::ConnAck) -> Option<&str> {
    let properties = connack.properties.as_ref()?;
    properties
        .user_properties
        .iter()
        .find(|(k, _)| k == "queue_full")
        .map(|(_, v)| v.as_str())
}

/// "sub" subscribes at QoS 1 and goes offline; then "pub" publishes
/// [`MESSAGES`] messages of 100 bytes at QoS 1: their PUBACK reasons.
async fn overflow_an_offline_subscriber(broker: &common::BrokerProcess) -> Vec<v5::PubAckReason> {
    let (mut sub, connack) = subscriber(broker.addr).await;
    assert_eq!(connack.code, v5::ConnectReturnCode::Success);
    sub.subscribe(TOPIC, QoS::AtLeastOnce).await;
    go_offline(broker, sub).await;
    publish_all(broker).await
}

/// `sub` disconnects, its session kept.
async fn go_offline(broker: &common::BrokerProcess, mut sub: Raw) {
    let http = http_addr(broker);
    sub.send(v5::Packet::Disconnect(v5::Disconnect::new(
        v5::DisconnectReasonCode::NormalDisconnection,
    )))
    .await;
    drop(sub);
    metric_until(http, "statebroker_connections", |v| v == 0.0).await;
}

/// "pub" publishes [`MESSAGES`] messages of 100 bytes at QoS 1: their
/// PUBACK reasons.
async fn publish_all(broker: &common::BrokerProcess) -> Vec<v5::PubAckReason> {
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

/// How many of `reasons` were accepted (all first) and refused (the rest).
fn accepted_then_refused(reasons: &[v5::PubAckReason]) -> (usize, usize) {
    let accepted = reasons
        .iter()
        .take_while(|r| **r == v5::PubAckReason::Success)
        .count();
    let refused = reasons[accepted..]
        .iter()
        .take_while(|r| **r == v5::PubAckReason::QuotaExceeded)
        .count();
    assert_eq!(accepted + refused, reasons.len(), "{reasons:?}");
    (accepted, refused)
}

/// Issue #33 item 8, per session: where the broker drops the oldest, a
/// session that chose `queue_full = refuse` in CONNECT (allowed by
/// `[broker] allow_session_refuse`) is told so in CONNACK, keeps its
/// choice across a restart of the broker, and publishes that would push
/// out what it has not had are refused; a session that chose nothing
/// (the same broker, next round) loses the oldest and holds nobody up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_chooses_refuse_for_itself_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let allow = [("STATEBROKER__BROKER__ALLOW_SESSION_REFUSE", "true")];
    let broker = broker_with("drop_oldest", &dir, &allow).await;
    let (mut sub, connack) = subscriber_choosing(broker.addr, Some("refuse")).await;
    assert_eq!(connack.code, v5::ConnectReturnCode::Success);
    assert_eq!(told_queue_full(&connack), Some("refuse"));
    sub.subscribe(TOPIC, QoS::AtLeastOnce).await;
    go_offline(&broker, sub).await;
    let mut broker = broker;
    broker.child.kill().await.unwrap();
    drop(broker);

    let broker = broker_with("drop_oldest", &dir, &allow).await;
    let (accepted, refused) = accepted_then_refused(&publish_all(&broker).await);
    assert!(
        (5..MESSAGES / 2).contains(&accepted) && refused > 0,
        "{accepted} accepted, {refused} refused"
    );
    // What was accepted all reaches the session; it comes back choosing
    // nothing, so from now on it drops the oldest.
    let (mut sub, connack) = subscriber(broker.addr).await;
    assert!(connack.session_present);
    assert_eq!(told_queue_full(&connack), None, "told only when asked");
    let mut received = Vec::new();
    while received.len() < accepted {
        received.push(index(&sub.next_publish().await));
    }
    assert_eq!(received, (0..accepted).collect::<Vec<_>>());
    go_offline(&broker, sub).await;
    let (accepted, refused) = accepted_then_refused(&publish_all(&broker).await);
    assert_eq!((accepted, refused), (MESSAGES, 0));
}

/// A session may always choose `drop_oldest`, even where the broker
/// refuses; `refuse` where the broker drops the oldest only if
/// `allow_session_refuse` (the CONNACK says what is in force, the log
/// why); any other value is refused with CONNACK 0x83 and a Reason String.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_session_may_choose() {
    let dir = tempfile::tempdir().unwrap();
    let refusing = broker("refuse", &dir).await;
    let (mut sub, connack) = subscriber_choosing(refusing.addr, Some("drop_oldest")).await;
    assert_eq!(told_queue_full(&connack), Some("drop_oldest"));
    sub.subscribe(TOPIC, QoS::AtLeastOnce).await;
    go_offline(&refusing, sub).await;
    let (accepted, refused) = accepted_then_refused(&publish_all(&refusing).await);
    assert_eq!(
        (accepted, refused),
        (MESSAGES, 0),
        "the broker refuses, not for this session"
    );

    let dir = tempfile::tempdir().unwrap();
    let broker = broker("drop_oldest", &dir).await;
    let (mut sub, connack) = subscriber_choosing(broker.addr, Some("refuse")).await;
    assert_eq!(connack.code, v5::ConnectReturnCode::Success);
    assert_eq!(
        told_queue_full(&connack),
        Some("drop_oldest"),
        "not allowed"
    );
    sub.subscribe(TOPIC, QoS::AtLeastOnce).await;
    go_offline(&broker, sub).await;
    let (accepted, refused) = accepted_then_refused(&publish_all(&broker).await);
    assert_eq!((accepted, refused), (MESSAGES, 0));
    let log = broker.log.lock().join("\n");
    assert!(
        log.lines()
            .any(|l| l.contains("allow_session_refuse") && l.contains("client_id=\"sub\"")),
        "{log}"
    );

    let (_, connack) = subscriber_choosing(broker.addr, Some("later")).await;
    assert_eq!(
        connack.code,
        v5::ConnectReturnCode::ImplementationSpecificError
    );
    let reason = connack.properties.and_then(|p| p.reason_string);
    assert!(
        reason
            .as_deref()
            .is_some_and(|r| r.contains("queue_full") && r.contains("refuse")),
        "{reason:?}"
    );
}
