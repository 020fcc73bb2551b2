//! A data directory that lost data is refused at start, naming what is
//! missing, unless `--accept-data-loss` says to go on; a torn journal
//! tail after a crash is reported at WARN. The real binary, stopped with
//! SIGTERM (a clean shutdown) or SIGKILL (a crash).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::raw::Raw;
use common::{signal, spawn_broker, write_sequentially};

const KEYS: usize = 20;

/// Writes `KEYS` persisted keys, one request each.
async fn write_keys(addr: std::net::SocketAddr) {
    write_sequentially(addr, "k", KEYS).await;
}

/// How many of the keys are there.
async fn count_keys(addr: std::net::SocketAddr) -> usize {
    let mut c = Raw::connect(addr, "reader").await;
    let mut found = 0;
    for i in 0..KEYS {
        let key = format!("k{i:03}");
        if &c.request(&[b"GET", key.as_bytes()]).await.payload[..] == b"$1\r\nv\r\n" {
            found += 1;
        }
    }
    found
}

/// Starts the broker on `dir`, writes the keys, stops it with SIGTERM and
/// waits for a clean exit.
async fn write_and_stop_cleanly(dir: &Path) {
    let mut broker = spawn_broker(dir, &[]).await;
    write_keys(broker.addr).await;
    signal(&broker.child, "TERM");
    let status = tokio::time::timeout(Duration::from_secs(20), broker.child.wait())
        .await
        .expect("stops on SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");
}

fn journals(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "jnl"))
        .collect()
}

/// Runs the binary on `dir` to its end (it must refuse to start).
async fn refused_start(dir: &Path) -> String {
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_statebroker"))
            .args(["--listen", "127.0.0.1:0", "--no-http", "--data-dir"])
            .arg(dir)
            .env_remove("RUST_LOG")
            .output(),
    )
    .await
    .expect("a refused start ends")
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains(&dir.display().to_string()),
        "names the data directory: {stderr}"
    );
    assert!(stderr.contains("--accept-data-loss"), "{stderr}");
    stderr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_restart_keeps_everything_and_is_not_refused() {
    let dir = tempfile::tempdir().unwrap();
    write_and_stop_cleanly(dir.path()).await;
    for _ in 0..2 {
        let mut broker = spawn_broker(dir.path(), &[]).await;
        assert_eq!(count_keys(broker.addr).await, KEYS);
        signal(&broker.child, "TERM");
        assert!(broker.child.wait().await.unwrap().success());
    }
}

/// A new data directory stopped before anything was written to it: fjall
/// counted its own keyspace registrations in its sequence number, which a
/// restart does not recover; the mark once held them and the next start
/// was refused as a lost journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_directory_stopped_before_any_write_restarts() {
    let dir = tempfile::tempdir().unwrap();
    for round in 0..2 {
        let mut broker = spawn_broker(dir.path(), &[]).await;
        assert_eq!(count_keys(broker.addr).await, 0);
        signal(&broker.child, "TERM");
        let status = tokio::time::timeout(Duration::from_secs(20), broker.child.wait())
            .await
            .expect("stops on SIGTERM")
            .unwrap();
        assert!(status.success(), "round {round}: {status}");
    }
    let broker = spawn_broker(dir.path(), &[]).await;
    write_keys(broker.addr).await;
    assert_eq!(count_keys(broker.addr).await, KEYS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_journal_is_refused_unless_the_loss_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    write_and_stop_cleanly(dir.path()).await;
    for journal in journals(dir.path()) {
        std::fs::remove_file(journal).unwrap();
    }
    let stderr = refused_start(dir.path()).await;
    assert!(stderr.contains("holds no journal file"), "{stderr}");
    // Refused again: nothing was changed by the refusal.
    refused_start(dir.path()).await;

    let mut broker = spawn_broker(dir.path(), &["--accept-data-loss"]).await;
    assert!(
        broker
            .log
            .lock()
            .iter()
            .any(|l| l.contains("WARN") && l.contains("starting with data lost")),
        "the accepted loss is logged at WARN"
    );
    // What is left is served; new writes are kept.
    write_keys(broker.addr).await;
    signal(&broker.child, "TERM");
    assert!(broker.child.wait().await.unwrap().success());
    let broker = spawn_broker(dir.path(), &[]).await;
    assert_eq!(count_keys(broker.addr).await, KEYS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zeroed_journal_is_refused_after_a_clean_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    write_and_stop_cleanly(dir.path()).await;
    for journal in journals(dir.path()) {
        let len = std::fs::metadata(&journal).unwrap().len() as usize;
        std::fs::write(&journal, vec![0u8; len]).unwrap();
    }
    let stderr = refused_start(dir.path()).await;
    assert!(stderr.contains("last clean shutdown"), "{stderr}");

    let broker = spawn_broker(dir.path(), &["--accept-data-loss"]).await;
    assert!(
        count_keys(broker.addr).await < KEYS,
        "the zeroed journal held the keys"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_tail_after_a_crash_is_reported_at_warn() {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = spawn_broker(dir.path(), &[]).await;
    write_keys(broker.addr).await;
    broker.child.start_kill().unwrap();
    broker.child.wait().await.unwrap();
    // The last batch never fully reached the disk: its end is gone.
    let journal = journals(dir.path()).into_iter().max().unwrap();
    let mut bytes = std::fs::read(&journal).unwrap();
    let end = bytes.iter().rposition(|&b| b != 0).unwrap() + 1;
    bytes[end - 6..end].fill(0);
    std::fs::write(&journal, &bytes).unwrap();

    let broker = spawn_broker(dir.path(), &[]).await;
    assert_eq!(count_keys(broker.addr).await, KEYS - 1);
    let log = broker.log.lock().clone();
    assert!(
        log.iter()
            .any(|l| l.contains("WARN") && l.contains("not completely written")),
        "{}",
        log.join("\n")
    );
}

#[tokio::test]
async fn accepting_a_loss_needs_a_data_directory() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_statebroker"))
        .args(["--no-http", "--in-memory", "--accept-data-loss"])
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
}
