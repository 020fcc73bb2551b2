//! How long a restart takes with many kept sessions (issue #33 item 7).
//!
//! Writes N persistent session records into a fresh data directory through
//! the broker's own journal (no network: `broker::bench::save_sessions`),
//! each as an IoT device leaves it: Session Expiry Interval one day,
//! disconnected a moment ago, subscribed at QoS 1 to its own command topic
//! `devices/<id>/cmd` and to the fleet's `fleet/+/config`. Then times
//! `Broker::start` on that directory, until it listens (the broker refuses
//! nothing before: it has no listener yet), with `max_kept_sessions` above
//! N. `tests/restart_sessions.rs` checks that these records are byte for
//! byte what clients doing the same over MQTT leave.
//!
//! ```text
//! cargo run --release -p broker --example restart_sessions -- 200000
//! RUST_LOG=info cargo run ...   # the broker's own figures (read, decode, router)
//! ```

use std::time::{Duration, Instant};

use broker::config::{Mode, PersistenceSettings, Settings};
use router::{SessionRecord, SubOptions};

/// The record a device `i` leaves.
fn device(i: usize, now_ms: u64) -> (String, SessionRecord) {
    let id = format!("device-{i:07}");
    let qos1 = SubOptions {
        qos: 1,
        ..SubOptions::default()
    };
    let filters = vec![
        (format!("devices/{id}/cmd"), qos1),
        ("fleet/+/config".to_owned(), qos1),
    ];
    let record = SessionRecord {
        expiry: 86_400,
        disconnected_at_ms: Some(now_ms),
        filters,
        queue_full: None,
    };
    (id, record)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .try_init();
    let n: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("the number of sessions"))
        .unwrap_or(200_000);
    let dir = tempfile::tempdir().unwrap();
    let persistence = PersistenceSettings {
        data_dir: dir.path().join("data"),
        mode: Mode::Fsync,
        // A start that found less than the last clean shutdown left is
        // refused: this run must not need `accept_data_loss`.
        accept_data_loss: false,
    };
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let started = Instant::now();
    let saved =
        broker::bench::save_sessions(&persistence, (0..n).map(|i| device(i, now_ms))).unwrap();
    println!(
        "saved {saved} sessions in {:.2} s",
        started.elapsed().as_secs_f64()
    );

    let mut settings = Settings::listening_on("127.0.0.1:0".parse().unwrap());
    settings.persistence = Some(persistence);
    settings.broker.max_kept_sessions = n + 1;
    let started = Instant::now();
    let running = broker::Broker::start(settings).await.unwrap();
    let ready = started.elapsed();
    let kept = broker::bench::kept_sessions(&running);
    println!(
        "restart with {n} sessions: listening after {:.2} s, {kept} sessions kept",
        ready.as_secs_f64()
    );
    assert_eq!(kept, n, "every saved session is back");
    println!("resident memory: {}", rss());
    // A QoS 1 publish every session's fleet/+/config takes: its PUBACK
    // waits for a copy saved for each.
    let started = Instant::now();
    publish_qos1(running.local_addr(), &["fleet/all/config".to_owned()]).await;
    println!(
        "a QoS 1 publish to fleet/all/config acknowledged after {:.2} s",
        started.elapsed().as_secs_f64()
    );
    // Commands to 100 devices, one after the other: each a topic the
    // router has not seen yet.
    let commands: Vec<String> = (0..100)
        .map(|i| format!("devices/{}/cmd", device(i * (n / 100).max(1), 0).0))
        .collect();
    let started = Instant::now();
    publish_qos1(running.local_addr(), &commands).await;
    println!(
        "100 QoS 1 commands to devices acknowledged after {:.2} s",
        started.elapsed().as_secs_f64()
    );
    let started = Instant::now();
    running.shutdown(Duration::from_secs(5)).await;
    println!("shut down in {:.2} s", started.elapsed().as_secs_f64());
}

/// The process's resident memory, as /proc says.
fn rss() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .map(|l| l["VmRSS:".len()..].trim().to_owned())
        })
        .unwrap_or_default()
}

/// Connects (MQTT 3.1.1, clean session) and publishes one message at QoS 1
/// on each of `topics`, each after the PUBACK of the one before.
async fn publish_qos1(addr: std::net::SocketAddr, topics: &[String]) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let id = b"restart-bench";
    let mut connect = vec![0x10, (10 + 2 + id.len()) as u8, 0, 4];
    connect.extend_from_slice(b"MQTT\x04\x02\x00\x3c");
    connect.extend_from_slice(&(id.len() as u16).to_be_bytes());
    connect.extend_from_slice(id);
    stream.write_all(&connect).await.unwrap();
    let mut connack = [0u8; 4];
    stream.read_exact(&mut connack).await.unwrap();
    assert_eq!(connack, [0x20, 2, 0, 0], "CONNACK");
    for topic in topics {
        publish_one(&mut stream, topic).await;
    }
}

async fn publish_one(stream: &mut tokio::net::TcpStream, topic: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let payload = b"v2";
    let mut publish = vec![0x32, (2 + topic.len() + 2 + payload.len()) as u8];
    publish.extend_from_slice(&(topic.len() as u16).to_be_bytes());
    publish.extend_from_slice(topic.as_bytes());
    publish.extend_from_slice(&[0, 1]);
    publish.extend_from_slice(payload);
    stream.write_all(&publish).await.unwrap();
    let mut puback = [0u8; 4];
    stream.read_exact(&mut puback).await.unwrap();
    assert_eq!(puback, [0x40, 2, 0, 1], "PUBACK");
}
