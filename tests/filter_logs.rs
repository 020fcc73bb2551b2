//! What one client's subscriptions hold in the router, read from the
//! router's own accounting (`statebroker_filter_logs`,
//! `statebroker_filter_log_bytes` at `/metrics`): each filter's message log
//! is freed when its last subscription ends (UNSUBSCRIBE or the end of the
//! session), stays within its byte bound whatever the size of the messages,
//! and a client holds at most `router.max_subscriptions_per_client`
//! subscriptions. Resident memory is printed, not asserted (the allocator
//! decides when freed memory goes back).

#[path = "http/client.rs"]
#[allow(dead_code)]
mod client;
mod common;

use std::net::SocketAddr;

use bytes::Bytes;
use common::raw::{Raw, Raw4, v5};
use common::start_broker_with;
use rumqttc::v5::mqttbytes::QoS;
use v5::{SubscribeReasonCode, UnsubAckReason};

/// Gauges are set from the scraped broker just before rendering, and the
/// recorder is process-wide: one scrape at a time in this test binary.
static SCRAPE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The value of `series` at `/metrics`.
async fn metric(http: SocketAddr, series: &str) -> f64 {
    let _one = SCRAPE.lock().await;
    client::metric(http, series).await
}

/// (filter logs, bytes in them).
async fn logs(http: SocketAddr) -> (f64, f64) {
    (
        metric(http, "statebroker_filter_logs").await,
        metric(http, "statebroker_filter_log_bytes").await,
    )
}

fn rss_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    kb >> 10
}

/// Waits until the logs are `expected` (the router applies packets on its
/// own thread).
async fn logs_become(http: SocketAddr, expected: (f64, f64), what: &str) {
    let deadline = tokio::time::Instant::now() + common::TIMEOUT;
    loop {
        let now = logs(http).await;
        if now == expected {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: (logs, bytes) = {now:?}, expected {expected:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

const FILTERS: usize = 40;
const PAYLOAD: usize = 512 * 1024;

/// A client subscribes to `FILTERS` filters of its own and a publisher sends
/// a 512 KiB message to each, read by the subscriber; the logs hold them.
async fn fill(addr: SocketAddr, http: SocketAddr, round: usize, base: (f64, f64)) -> Raw {
    let filters: Vec<String> = (0..FILTERS).map(|i| format!("hog/{i}")).collect();
    let mut hog = Raw::connect(addr, "hog").await;
    let names: Vec<&str> = filters.iter().map(String::as_str).collect();
    let codes = hog.subscribe_many(&names, QoS::AtMostOnce).await;
    assert_eq!(
        codes,
        vec![SubscribeReasonCode::Success(QoS::AtMostOnce); FILTERS]
    );
    let mut publisher = Raw::connect(addr, "hog-publisher").await;
    let payload = Bytes::from(vec![b'm'; PAYLOAD]);
    for filter in &filters {
        publisher
            .publish(filter, payload.clone(), QoS::AtLeastOnce, None)
            .await;
    }
    for _ in 0..FILTERS {
        assert_eq!(hog.next_publish().await.payload.len(), PAYLOAD);
    }
    common::mqtt::goodbye(publisher, None).await;
    // Each entry counts its topic and payload, and 4.
    let entry = |i: usize| (4 + format!("hog/{i}").len() + PAYLOAD) as f64;
    let bytes: f64 = (0..FILTERS).map(entry).sum();
    logs_become(
        http,
        (base.0 + FILTERS as f64, base.1 + bytes),
        &format!("round {round}: subscribed and published"),
    )
    .await;
    eprintln!(
        "round {round}: {FILTERS} filters of {} KiB held, test process RSS {} MiB",
        PAYLOAD >> 10,
        rss_mib()
    );
    hog
}

/// The red-team report of issue #33 item 6: a client that unsubscribed
/// every filter kept their logs until it disconnected. Each round fills
/// the logs, then empties them by UNSUBSCRIBE (round 0, 2) or by the end
/// of the clean session (round 1, 3); each time the router holds exactly
/// what it held before, and rounds do not add up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsubscribe_and_disconnect_free_the_filter_logs() {
    let broker = start_broker_with(|s| s.http = Some("127.0.0.1:0".parse().unwrap())).await;
    let (addr, http) = (broker.local_addr(), broker.http_addr().unwrap());
    let base = logs(http).await;
    for round in 0..4 {
        let mut hog = fill(addr, http, round, base).await;
        if round % 2 == 0 {
            let filters: Vec<String> = (0..FILTERS).map(|i| format!("hog/{i}")).collect();
            let names: Vec<&str> = filters.iter().map(String::as_str).collect();
            let reasons = hog.unsubscribe_many(&names).await;
            assert_eq!(reasons, vec![UnsubAckReason::Success; FILTERS]);
            logs_become(http, base, &format!("round {round}: unsubscribed")).await;
            eprintln!(
                "round {round}: unsubscribed, test process RSS {} MiB",
                rss_mib()
            );
        }
        common::mqtt::goodbye(hog, None).await;
        logs_become(http, base, &format!("round {round}: disconnected")).await;
        eprintln!(
            "round {round}: disconnected, test process RSS {} MiB",
            rss_mib()
        );
    }
}

/// A log keeps at most `max_segment_size × max_segment_count` bytes (1 MiB
/// by default) whatever the size of its messages: with messages larger
/// than a segment (256 KiB) it used to keep one per segment, four of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_log_keeps_its_byte_bound_with_large_messages() {
    let broker = start_broker_with(|s| s.http = Some("127.0.0.1:0".parse().unwrap())).await;
    let (addr, http) = (broker.local_addr(), broker.http_addr().unwrap());
    let base = logs(http).await;
    let mut sub = Raw::connect(addr, "big-sub").await;
    sub.subscribe("big", QoS::AtMostOnce).await;
    let mut publisher = Raw::connect(addr, "big-publisher").await;
    let payload = Bytes::from(vec![b'b'; PAYLOAD]);
    for _ in 0..8 {
        publisher
            .publish("big", payload.clone(), QoS::AtLeastOnce, None)
            .await;
        assert_eq!(sub.next_publish().await.payload.len(), PAYLOAD);
    }
    let (count, bytes) = logs(http).await;
    assert_eq!(count, base.0 + 1.0);
    let bound = 1024.0 * 1024.0;
    assert!(
        bytes - base.1 <= bound,
        "the log of `big` holds {} bytes, over its bound of {bound}",
        bytes - base.1
    );
    assert!(bytes - base.1 >= PAYLOAD as f64, "the newest message stays");
}

/// `router.max_subscriptions_per_client`: a SUBSCRIBE for a new filter
/// beyond it is refused for that filter (MQTT 5: 0x97 quota exceeded;
/// 3.1.1: 0x80), logged and counted; subscribing again to a filter held is
/// not a new one, and an UNSUBSCRIBE gives room back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_beyond_the_quota_are_refused() {
    let default = broker::Settings::listening_on("127.0.0.1:0".parse().unwrap());
    assert_eq!(default.router.max_subscriptions_per_client, 10_000);
    let broker = start_broker_with(|s| {
        s.http = Some("127.0.0.1:0".parse().unwrap());
        s.router.max_subscriptions_per_client = 3;
    })
    .await;
    let (addr, http) = (broker.local_addr(), broker.http_addr().unwrap());
    let refused = r#"statebroker_subscriptions_refused_total{reason="quota_exceeded"}"#;
    let before = metric(http, refused).await;

    let granted = SubscribeReasonCode::Success(QoS::AtMostOnce);
    let quota = SubscribeReasonCode::QuotaExceeded;
    let mut five = Raw::connect(addr, "five").await;
    let codes = five
        .subscribe_many(&["q/1", "q/2", "q/3", "q/4", "q/5"], QoS::AtMostOnce)
        .await;
    assert_eq!(codes, vec![granted, granted, granted, quota, quota]);
    // Held already: its options change, no new subscription.
    assert_eq!(five.subscribe("q/2", QoS::AtMostOnce).await, vec![granted]);
    assert_eq!(five.subscribe("q/6", QoS::AtMostOnce).await, vec![quota]);
    assert_eq!(
        five.unsubscribe_many(&["q/1"]).await,
        vec![UnsubAckReason::Success]
    );
    assert_eq!(five.subscribe("q/6", QoS::AtMostOnce).await, vec![granted]);
    // The refused filters deliver nothing, the granted ones do.
    let mut publisher = Raw::connect(addr, "q-publisher").await;
    publisher
        .publish("q/4", Bytes::from_static(b"no"), QoS::AtLeastOnce, None)
        .await;
    publisher
        .publish("q/6", Bytes::from_static(b"yes"), QoS::AtLeastOnce, None)
        .await;
    assert_eq!(&five.next_publish().await.payload[..], b"yes");

    // MQTT 3.1.1 has one failure code.
    use rumqttc::mqttbytes::v4;
    let mut four = Raw4::connect(addr, "four").await;
    let filters = ["f/1", "f/2", "f/3", "f/4"].map(|f| v4::SubscribeFilter {
        path: f.into(),
        qos: rumqttc::mqttbytes::QoS::AtMostOnce,
    });
    let mut subscribe = v4::Subscribe::new_many(filters);
    subscribe.pkid = four.pkid();
    four.send(v4::Packet::Subscribe(subscribe)).await;
    match four.recv().await {
        Some(v4::Packet::SubAck(ack)) => assert_eq!(
            ack.return_codes,
            vec![
                v4::SubscribeReasonCode::Success(rumqttc::mqttbytes::QoS::AtMostOnce),
                v4::SubscribeReasonCode::Success(rumqttc::mqttbytes::QoS::AtMostOnce),
                v4::SubscribeReasonCode::Success(rumqttc::mqttbytes::QoS::AtMostOnce),
                v4::SubscribeReasonCode::Failure,
            ]
        ),
        other => panic!("expected SUBACK, got {other:?}"),
    }

    // 2 + 1 for the MQTT 5 client, 1 for the 3.1.1 one.
    assert!(
        metric(http, refused).await - before >= 4.0,
        "refusals are counted"
    );
}
