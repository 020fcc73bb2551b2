//! The `statebroker` binary itself: start-up, configuration errors, signals.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::raw::{Raw, disconnect_reason, v5};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Starts the binary on a free loopback port and returns it with its address.
async fn start(extra: &[&str]) -> (Child, std::net::SocketAddr) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_statebroker"))
        .args(["--listen", "127.0.0.1:0"])
        .args(extra)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(rest) = line.split("addr=").nth(1) {
                return rest.split_whitespace().next().unwrap().parse().unwrap();
            }
        }
        panic!("the broker exited before listening");
    })
    .await
    .expect("the broker logs its address");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, addr)
}

#[tokio::test]
async fn serves_and_stops_cleanly_on_sigterm() {
    let (mut child, addr) = start(&[]).await;
    let mut client = Raw::connect(addr, "before-shutdown").await;
    assert_eq!(
        &client.request(&[b"SET", b"k", b"v"]).await.payload[..],
        b"+OK\r\n"
    );
    let pid = child.id().unwrap().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let d = client.expect_disconnect().await;
    assert_eq!(
        disconnect_reason(&d),
        Some(v5::DisconnectReasonCode::ServerShuttingDown)
    );
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status}");
}

#[tokio::test]
async fn a_bad_config_stops_the_start_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "[statestore]\nscan_page_size = \"lots\"\n").unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_statebroker"))
        .arg("--config")
        .arg(&path)
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("statestore.scan_page_size"), "{stderr}");
}

#[tokio::test]
async fn help_explains_the_options() {
    let output = Command::new(env!("CARGO_BIN_EXE_statebroker"))
        .arg("--help")
        .output()
        .await
        .unwrap();
    assert!(output.status.success());
    let help = String::from_utf8_lossy(&output.stdout);
    for needle in [
        "--config",
        "--listen",
        "0.0.0.0:1883",
        "RUST_LOG",
        "STATEBROKER__",
    ] {
        assert!(help.contains(needle), "--help lacks {needle}");
    }
}
