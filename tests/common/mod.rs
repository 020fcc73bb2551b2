//! Shared helpers of the end-to-end tests: a broker on a free loopback port,
//! official SDK clients, and a small raw MQTT client on rumqttd's codecs for
//! what the SDK never sends.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub mod mqtt;
pub mod raw;
mod sdk;
pub mod tls;

pub use sdk::*;

/// A `statebroker` process started by a test.
pub struct BrokerProcess {
    pub child: tokio::process::Child,
    pub addr: SocketAddr,
    /// Its log lines so far.
    pub log: Arc<parking_lot::Mutex<Vec<String>>>,
}

/// Starts the `statebroker` binary on a free loopback port with its data in
/// `data_dir` (its address read from its log).
pub async fn spawn_broker(data_dir: &std::path::Path, extra: &[&str]) -> BrokerProcess {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_statebroker"));
    command
        .args(["--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(data_dir)
        .args(extra);
    let (child, addr, log) = spawn_command(command).await;
    BrokerProcess { child, addr, log }
}

/// Runs `command` (the `statebroker` binary with its arguments) and reads
/// the address of its first listener from its log; its log lines keep
/// coming into the returned list.
#[allow(dead_code)] // not every test binary uses every helper
pub async fn spawn_command(
    mut command: tokio::process::Command,
) -> (
    tokio::process::Child,
    SocketAddr,
    Arc<parking_lot::Mutex<Vec<String>>>,
) {
    use tokio::io::{AsyncBufReadExt, BufReader};
    // The broker's own filter, unless the test sets RUST_LOG itself.
    if !command.as_std().get_envs().any(|(k, _)| k == "RUST_LOG") {
        command.env_remove("RUST_LOG");
    }
    let mut child = command
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let log = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let addr = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            log.lock().push(line.clone());
            if line.contains("listening")
                && let Some(rest) = line.split("addr=").nth(1)
            {
                return rest.split_whitespace().next().unwrap().parse().unwrap();
            }
        }
        panic!("the broker exited before listening: {:?}", log.lock());
    })
    .await
    .expect("the broker logs its address");
    let sink = Arc::clone(&log);
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            sink.lock().push(line);
        }
    });
    (child, addr, log)
}

/// Waits for `cond` to hold, polling.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Sends signal `name` (TERM, HUP, ...) to `child`.
#[allow(dead_code)] // not every test binary uses every helper
pub fn signal(child: &tokio::process::Child, name: &str) {
    let pid = child.id().unwrap().to_string();
    assert!(
        std::process::Command::new("kill")
            .args([&format!("-{name}"), &pid])
            .status()
            .unwrap()
            .success()
    );
}

/// Writes `n` persisted keys `{prefix}000`, `{prefix}001`, ... with value
/// `v`, one request at a time (each its own batch on disk), and returns
/// their versions.
#[allow(dead_code)]
pub async fn write_sequentially(addr: SocketAddr, prefix: &str, n: usize) -> Vec<String> {
    use raw::{REQUEST_TOPIC, Raw, now_hlc, user_property};
    use statestore::resp3::encode_request;
    let mut c = Raw::connect(addr, "sequential").await;
    let mut versions = Vec::new();
    for i in 0..n {
        let key = format!("{prefix}{i:03}");
        let ts = now_hlc("sequential");
        let r = c
            .request_raw(
                REQUEST_TOPIC,
                &encode_request(&[b"SET".as_slice(), key.as_bytes(), b"v"]),
                &[("__ts", &ts), ("aio-persistence", "true")],
            )
            .await;
        assert_eq!(&r.payload[..], b"+OK\r\n", "{key}");
        versions.push(user_property(&r, "__ts").unwrap().to_owned());
    }
    versions
}
