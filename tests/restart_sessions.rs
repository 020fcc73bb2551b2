//! Issue #33 item 7: a restart with many kept sessions. The benchmark
//! (`crates/broker/examples/restart_sessions.rs`) writes session records
//! straight into the data directory; here, that those records are what
//! clients leave over MQTT, and that thousands of them all come back, each
//! with its subscriptions, and queue what is published for them.

mod common;

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use broker::RunningBroker;
use broker::bench::{SessionRecord, SubOptions};
use broker::config::{Mode, PersistenceSettings, Settings};
use common::mqtt::{goodbye, session};
use common::raw::Raw;
use common::start_broker_with;
use rumqttc::v5::mqttbytes::QoS;

const FLEET: &str = "fleet/+/config";

fn persistence(dir: &Path) -> PersistenceSettings {
    PersistenceSettings {
        data_dir: dir.to_owned(),
        mode: Mode::Fsync,
        accept_data_loss: false,
    }
}

async fn start(dir: &Path) -> RunningBroker {
    start_broker_with(|s: &mut Settings| {
        s.persistence = Some(persistence(dir));
        s.broker.max_kept_sessions = 0;
    })
    .await
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// The record the benchmark writes for device `id`.
fn device(id: &str, disconnected_at_ms: u64) -> (String, SessionRecord) {
    let qos1 = SubOptions {
        qos: 1,
        ..SubOptions::default()
    };
    let record = SessionRecord {
        expiry: 86_400,
        disconnected_at_ms: Some(disconnected_at_ms),
        filters: vec![
            (format!("devices/{id}/cmd"), qos1),
            (FLEET.to_owned(), qos1),
        ],
        queue_full: None,
    };
    (id.to_owned(), record)
}

fn id(i: usize) -> String {
    format!("device-{i:07}")
}

/// Devices connecting over MQTT with a one-day session, subscribing to
/// their command topic and the fleet's at QoS 1, and leaving, save the
/// very bytes the benchmark saves (but for when they left).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_benchmarks_records_are_what_clients_leave() {
    let dir = tempfile::tempdir().unwrap();
    let (real, seeded) = (dir.path().join("real"), dir.path().join("seeded"));
    let broker = start(&real).await;
    let ids: Vec<String> = (0..3).map(id).collect();
    for id in &ids {
        let (mut c, ack) =
            Raw::connect_with(broker.local_addr(), id, session(true, Some(86_400))).await;
        assert_eq!(ack.code, common::raw::v5::ConnectReturnCode::Success);
        let cmd = format!("devices/{id}/cmd");
        c.subscribe_many(&[cmd.as_str(), FLEET], QoS::AtLeastOnce)
            .await;
        goodbye(c, None).await;
    }
    // The record of a session's end is saved on the router's thread.
    tokio::time::sleep(Duration::from_millis(300)).await;
    broker.shutdown(Duration::from_secs(5)).await;
    let real = broker::bench::saved_sessions(&persistence(&real)).unwrap();
    broker::bench::save_sessions(&persistence(&seeded), ids.iter().map(|i| device(i, 0))).unwrap();
    let seeded = broker::bench::saved_sessions(&persistence(&seeded)).unwrap();
    assert_eq!(real.len(), ids.len());
    assert_eq!(seeded.len(), ids.len());
    for ((real_id, real), (seeded_id, seeded)) in real.iter().zip(&seeded) {
        assert_eq!(real_id, seeded_id);
        // [1][expiry u32][disconnected at u64][filters...]
        assert_eq!(real.len(), seeded.len());
        assert_eq!(real[..5], seeded[..5], "version and expiry");
        assert_ne!(real[5..13], [0xff; 8], "saved as disconnected");
        assert_eq!(real[13..], seeded[13..], "the subscriptions");
    }
}

/// 5,000 saved sessions all come back with their subscriptions; a message
/// published after the restart on a device's command topic and on the
/// fleet's is queued for the device, which gets both when it resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_sessions_come_back_with_their_subscriptions() {
    const N: usize = 5_000;
    let dir = tempfile::tempdir().unwrap();
    let now = now_ms();
    let saved = broker::bench::save_sessions(
        &persistence(dir.path()),
        (0..N).map(|i| device(&id(i), now)),
    )
    .unwrap();
    assert_eq!(saved, N);
    let broker = start(dir.path()).await;
    assert_eq!(broker::bench::kept_sessions(&broker), N);
    let clients = broker::bench::clients(&broker);
    let devices: Vec<_> = clients
        .iter()
        .filter(|(c, _, _)| c.starts_with("device-"))
        .collect();
    assert_eq!(devices.len(), N);
    for (client, filters, kept) in devices {
        assert!(kept, "{client}");
        assert_eq!(
            filters,
            &vec![format!("devices/{client}/cmd"), FLEET.to_owned()],
            "{client}"
        );
    }
    let addr = broker.local_addr();
    let target = id(4_321);
    let mut publisher = Raw::connect(addr, "operator").await;
    let cmd = format!("devices/{target}/cmd");
    assert!(
        publisher
            .publish(&cmd, "reboot", QoS::AtLeastOnce, None)
            .await
            .is_some()
    );
    assert!(
        publisher
            .publish("fleet/all/config", "v2", QoS::AtLeastOnce, None)
            .await
            .is_some()
    );
    let (mut device, ack) = Raw::connect_with(addr, &target, session(false, Some(86_400))).await;
    assert!(ack.session_present);
    let first = device.next_publish().await;
    assert_eq!(first.topic, cmd.as_bytes());
    assert_eq!(first.payload, "reboot");
    let second = device.next_publish().await;
    assert_eq!(second.topic, "fleet/all/config".as_bytes());
    assert_eq!(second.payload, "v2");
    goodbye(device, None).await;
    broker.shutdown(Duration::from_secs(5)).await;
}
