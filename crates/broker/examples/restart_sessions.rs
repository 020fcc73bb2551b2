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
        // fjall's flushes after the last write take sequence numbers the
        // clean-shutdown mark counts and a start does not find again: with
        // more than a memtable of sessions the start is refused as if the
        // journal were lost (fixed on its own branch). Accepting it changes
        // nothing else.
        accept_data_loss: true,
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
    let started = Instant::now();
    running.shutdown(Duration::from_secs(5)).await;
    println!("shut down in {:.2} s", started.elapsed().as_secs_f64());
}
