//! The `$SYS` topics: the broker's statistics under mosquitto's names,
//! retained, refreshed every `sys_interval`, readable and never writable
//! by clients, and out of reach of `#`.

mod common;

use std::time::Duration;

use common::raw::{Raw, v5};
use common::start_broker_with;
use rumqttc::v5::mqttbytes::QoS;

/// Reads publishes until `topic` carries `want`; panics after 5 s.
async fn wait_for(c: &mut Raw, topic: &str, want: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut last = None;
    while tokio::time::Instant::now() < deadline {
        let p = c.next_publish().await;
        if p.topic == topic.as_bytes() {
            if p.payload == want.as_bytes() {
                return;
            }
            last = Some(String::from_utf8_lossy(&p.payload).into_owned());
        }
    }
    panic!("{topic} never became {want} (last {last:?})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sys_topics_are_published_readable_and_not_writable() {
    let broker = start_broker_with(|s| s.broker.sys_interval = 1).await;
    let addr = broker.local_addr();

    // A `#` subscriber sees none of them (MQTT 5 4.7.2).
    let mut everything = Raw::connect(addr, "everything").await;
    assert_eq!(
        everything.subscribe("#", QoS::AtMostOnce).await,
        vec![v5::SubscribeReasonCode::Success(QoS::AtMostOnce)]
    );

    let mut sys = Raw::connect(addr, "sys-reader").await;
    assert_eq!(
        sys.subscribe("$SYS/#", QoS::AtLeastOnce).await,
        vec![v5::SubscribeReasonCode::Success(QoS::AtLeastOnce)]
    );
    // Retained: the first ones arrive at once, at QoS 0.
    let first = sys.next_publish().await;
    assert!(first.retain && first.qos == QoS::AtMostOnce, "{first:?}");
    assert!(first.topic.starts_with(b"$SYS/broker/"), "{first:?}");

    let mut writer = Raw::connect(addr, "sys-writer").await;
    for key in [&b"a"[..], b"b"] {
        assert_eq!(
            &writer.request(&[b"SET", key, b"v"]).await.payload[..],
            b"+OK\r\n"
        );
    }
    wait_for(&mut sys, "$SYS/broker/store/keys", "2").await;
    wait_for(&mut sys, "$SYS/broker/clients/connected", "3").await;
    wait_for(
        &mut sys,
        "$SYS/broker/version",
        &format!("statebroker {}", env!("CARGO_PKG_VERSION")),
    )
    .await;

    // Not writable: MQTT 5 gets 0x87, and nobody receives it.
    assert_eq!(
        writer
            .publish("$SYS/broker/store/keys", "999", QoS::AtLeastOnce, None)
            .await,
        Some(v5::PubAckReason::NotAuthorized)
    );
    let deadline = tokio::time::Instant::now() + Duration::from_millis(1200);
    while tokio::time::Instant::now() < deadline {
        let p = sys.next_publish().await;
        assert_ne!(&p.payload[..], b"999", "a client wrote into $SYS: {p:?}");
    }
    // Other `$` topics stay refused for subscribing.
    assert_eq!(
        sys.subscribe("$SYSTEM/#", QoS::AtMostOnce).await,
        vec![v5::SubscribeReasonCode::NotAuthorized]
    );
    // Only the writer's responses reached `#`.
    let mut seen = 0;
    while let common::raw::Recv::Packet(packet) =
        everything.recv_within(Duration::from_millis(300)).await
    {
        if let v5::Packet::Publish(p) = packet {
            assert!(!p.topic.starts_with(b"$"), "`#` matched {:?}", p.topic);
            seen += 1;
        }
    }
    assert!(seen >= 2, "the responses reach `#`: {seen}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sys_interval_zero_publishes_nothing() {
    let broker = start_broker_with(|s| s.broker.sys_interval = 0).await;
    let mut sys = Raw::connect(broker.local_addr(), "sys-reader").await;
    sys.subscribe("$SYS/#", QoS::AtMostOnce).await;
    sys.no_publish_within(Duration::from_millis(1500)).await;
}
