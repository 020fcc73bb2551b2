//! The HTTP endpoint: health, readiness and Prometheus metrics that count
//! what clients did, including what was dropped and why; the web view's
//! host checks (`hosts.rs`); the endpoint's bounds (`limits.rs`).

#[path = "../common/mod.rs"]
mod common;

mod client;
mod hosts;
mod limits;
mod policy;

use client::{get, post, send};

use std::time::Duration;

use broker::config::{Mode, PersistenceSettings};
use bytes::Bytes;
use common::mqtt::publish_complete;
use common::raw::{NOTIFY_NAMESPACE, Raw, Recv, v5};
use common::start_broker_with;
use rumqttc::v5::mqttbytes::QoS;

pub(crate) use client::sample;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let broker = start_broker_with(|s| {
        s.http = Some("127.0.0.1:0".parse().unwrap());
        s.persistence = Some(PersistenceSettings {
            data_dir: dir.path().to_owned(),
            mode: Mode::Fsync,
            accept_data_loss: false,
        });
    })
    .await;
    let http = broker.http_addr().expect("HTTP is on");
    assert_eq!(get(http, "/healthz").await, (200, "ok\n".to_owned()));
    assert_eq!(get(http, "/readyz").await, (200, "ready\n".to_owned()));
    assert_eq!(get(http, "/nothing-here").await.0, 404);

    let addr = broker.local_addr();
    let mut c = Raw::connect(addr, "metrics-client").await;
    assert_eq!(
        &c.request(&[b"SET", b"k", b"v"]).await.payload[..],
        b"+OK\r\n"
    );
    let err = c.request(&[b"NOSUCH"]).await;
    assert!(err.payload.starts_with(b"-ERR"));
    publish_complete(&mut c, "m/1", b"x", QoS::AtLeastOnce, false).await;
    publish_complete(&mut c, "kept/1", b"x", QoS::AtLeastOnce, true).await;
    // A subscriber that takes at most 64-byte packets: a larger message is
    // discarded for it, and counted.
    let (mut small, _) = Raw::connect_with(addr, "metrics-small", |c| {
        c.0.properties.as_mut().unwrap().max_packet_size = Some(64);
    })
    .await;
    small.subscribe("big/#", QoS::AtLeastOnce).await;
    let big = v5::Publish::new("big/1", QoS::AtMostOnce, Bytes::from(vec![7u8; 200]), None);
    c.send(v5::Packet::Publish(big)).await;
    assert!(matches!(
        small.recv_within(Duration::from_millis(300)).await,
        Recv::Timeout
    ));

    let (status, metrics) = get(http, "/metrics").await;
    assert_eq!(status, 200);
    for (series, at_least) in [
        ("statebroker_connections_accepted_total", 2.0),
        ("statebroker_connections", 2.0),
        (r#"statebroker_messages_received_total{qos="1"}"#, 3.0),
        (
            r#"statebroker_statestore_requests_total{command="SET",outcome="ok"}"#,
            1.0,
        ),
        (
            r#"statebroker_statestore_requests_total{command="unknown",outcome="error"}"#,
            1.0,
        ),
        (
            r#"statebroker_dropped_messages_total{reason="too_large_for_client"}"#,
            1.0,
        ),
        ("statebroker_statestore_request_duration_seconds_count", 2.0),
        ("statebroker_persistence_commit_duration_seconds_count", 1.0),
    ] {
        let value = sample(&metrics, series);
        assert!(
            value.is_some_and(|v| v >= at_least),
            "{series} = {value:?}, expected at least {at_least}\n{metrics}"
        );
    }
    assert!(metrics.contains("# TYPE statebroker_dropped_messages_total counter"));
    // Durations are histograms (they add up across a cluster's nodes).
    for name in [
        "statebroker_statestore_request_duration_seconds",
        "statebroker_persistence_commit_duration_seconds",
        "statebroker_persistence_batch_writes",
    ] {
        assert!(
            metrics.contains(&format!("# TYPE {name} histogram")),
            "{name}\n{metrics}"
        );
    }
    assert_eq!(
        sample(
            &metrics,
            r#"statebroker_statestore_request_duration_seconds_bucket{le="+Inf"}"#
        ),
        sample(
            &metrics,
            "statebroker_statestore_request_duration_seconds_count"
        ),
    );
    // `cluster` says whether the broker library was built with clustering
    // (`cargo test --workspace` builds it so, for the cluster tests).
    let built = ["false", "true"].map(|cluster| {
        let series = format!(
            r#"statebroker_build_info{{version="{}",cluster="{cluster}"}}"#,
            env!("CARGO_PKG_VERSION")
        );
        sample(&metrics, &series)
    });
    assert!(
        matches!(built, [Some(1.0), None] | [None, Some(1.0)]),
        "{built:?}\n{metrics}"
    );
    // Gauges sampled from this broker at the scrape.
    let sys_topics = broker::sys::messages(&Default::default()).len() as f64;
    for (series, exactly) in [
        ("statebroker_statestore_keys", 1.0),
        ("statebroker_statestore_bytes", 2.0),
        ("statebroker_statestore_watches", 0.0),
        ("statebroker_statestore_answers_waiting", 0.0),
        // metrics-client and metrics-small.
        ("statebroker_sessions", 2.0),
        // The response topic of metrics-client, big/# of metrics-small.
        ("statebroker_subscriptions", 2.0),
        ("statebroker_retained_messages", sys_topics + 1.0),
        ("statebroker_queued_deliveries", 0.0),
        ("statebroker_queued_messages_waiting", 0.0),
    ] {
        assert_eq!(
            sample(&metrics, series),
            Some(exactly),
            "{series}\n{metrics}"
        );
    }
    assert!(sample(&metrics, "statebroker_sent_publish_bytes_total").is_some_and(|v| v > 0.0));
    assert!(sample(&metrics, "statebroker_uptime_seconds").is_some_and(|v| v >= 0.0));

    drop(small);
    drop(c);
    broker.shutdown(Duration::from_secs(2)).await;
    // The endpoint goes with the broker.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(tokio::net::TcpStream::connect(http).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_view_edits_keys_only_when_allowed() {
    let set = serde_json::json!({ "key": "door", "value": "open" });
    // Read-only by default.
    let broker = start_broker_with(|s| s.http = Some("127.0.0.1:0".parse().unwrap())).await;
    let http = broker.http_addr().unwrap();
    let (status, body) = post(http, "/api/set", set.clone()).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("allow_edit"), "{body}");
    assert_eq!(broker.store().with_store(|s| s.len()), 0);
    let summary: serde_json::Value =
        serde_json::from_str(&get(http, "/api/summary").await.1).unwrap();
    assert_eq!(summary["allow_edit"], false);

    let broker = start_broker_with(|s| {
        s.http = Some("127.0.0.1:0".parse().unwrap());
        s.http_allow_edit = true;
    })
    .await;
    let http = broker.http_addr().unwrap();
    let summary: serde_json::Value =
        serde_json::from_str(&get(http, "/api/summary").await.1).unwrap();
    assert_eq!(summary["allow_edit"], true);
    // A watcher hears of the web view's edits, as of any client's.
    let mut watcher = Raw::connect(broker.local_addr(), "edit-watcher").await;
    let own = format!("{NOTIFY_NAMESPACE}/{}/#", hex::encode_upper("edit-watcher"));
    watcher.subscribe(&own, QoS::AtLeastOnce).await;
    assert_eq!(
        &watcher.request(&[b"KEYNOTIFY", b"door"]).await.payload[..],
        b"+OK\r\n"
    );
    let (status, body) = post(http, "/api/set", set).await;
    assert_eq!(
        (status, body.as_str()),
        (200, r#"{"answer":"+OK","ok":true}"#)
    );
    let notice = watcher.next_publish().await;
    assert!(
        notice
            .payload
            .starts_with(b"*4\r\n$6\r\nNOTIFY\r\n$3\r\nSET"),
        "{notice:?}"
    );
    assert_eq!(
        &watcher.request(&[b"GET", b"door"]).await.payload[..],
        b"$4\r\nopen\r\n"
    );
    // With an expiry; a bad request gets the store's own error.
    let (_, body) = post(
        http,
        "/api/set",
        serde_json::json!({ "key": "brief", "value": "x", "px_ms": 60000 }),
    )
    .await;
    assert!(body.contains(r#""ok":true"#), "{body}");
    let expires = broker
        .store()
        .with_store(|s| s.browse(b"brief", 0, 10, None).keys[0].expires_at_ms);
    assert!(expires.is_some());
    let (_, body) = post(
        http,
        "/api/set",
        serde_json::json!({ "key": "", "value": "x" }),
    )
    .await;
    assert_eq!(
        body,
        r#"{"answer":"-ERR the key length is zero","ok":false}"#
    );
    // Not JSON (what a form of another site could send): refused.
    let form = Some(("application/x-www-form-urlencoded", "key=door&value=open"));
    assert_eq!(send(http, "POST", "/api/set", form).await.0, 415);

    let (_, body) = post(http, "/api/del", serde_json::json!({ "key": "door" })).await;
    assert_eq!(body, r#"{"answer":":1","ok":true}"#);
    assert!(
        watcher
            .next_publish()
            .await
            .payload
            .ends_with(b"$6\r\nDELETE\r\n")
    );
    assert_eq!(broker.store().with_store(|s| s.len()), 1);

    // Each connection's protocol, address, listener and in-flight count:
    // a subscriber that does not acknowledge holds two in flight.
    let mut slow = Raw::connect(broker.local_addr(), "edit-slow").await;
    slow.subscribe("t/#", QoS::AtLeastOnce).await;
    for _ in 0..2 {
        publish_complete(&mut watcher, "t/1", b"x", QoS::AtLeastOnce, false).await;
        assert!(matches!(
            slow.recv().await,
            Recv::Packet(v5::Packet::Publish(_))
        ));
    }
    let connection_of = async |client_id: &str| {
        let clients: serde_json::Value =
            serde_json::from_str(&get(http, "/api/clients").await.1).unwrap();
        let found = clients
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["client_id"] == client_id);
        found.unwrap_or_else(|| panic!("{clients}"))["connection"].clone()
    };
    let watching = connection_of("edit-watcher").await;
    assert_eq!(watching["protocol"], "MQTT 5");
    assert!(
        watching["address"]
            .as_str()
            .unwrap()
            .starts_with("127.0.0.1:"),
        "{watching}"
    );
    assert_eq!(watching["listener"], "v5.1");
    assert_eq!(watching["in_flight"], 0, "{watching}");
    assert_eq!(connection_of("edit-slow").await["in_flight"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_faults_are_counted_in_the_metrics() {
    let broker = start_broker_with(|s| {
        s.http = Some("127.0.0.1:0".parse().unwrap());
        s.faults.enabled = true;
    })
    .await;
    let http = broker.http_addr().unwrap();
    let rule = serde_json::json!({ "keys": "boom*", "error": "the quota has been exceeded" });
    assert_eq!(post(http, "/api/faults/rules", rule).await.0, 200);
    let mut c = Raw::connect(broker.local_addr(), "faulty").await;
    assert_eq!(
        &c.request(&[b"GET", b"boom"]).await.payload[..],
        b"-ERR the quota has been exceeded\r\n"
    );
    let (_, metrics) = get(http, "/metrics").await;
    let counted = sample(
        &metrics,
        r#"statebroker_faults_injected_total{kind="error"}"#,
    );
    assert!(counted.is_some_and(|n| n >= 1.0), "{metrics}");
}
