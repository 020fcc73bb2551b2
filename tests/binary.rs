//! The `statebroker` binary itself: start-up, configuration errors, signals.

mod common;

use std::time::Duration;

use common::raw::{Raw, disconnect_reason, v5};
use common::spawn_broker as start;
use tokio::process::Command;

#[tokio::test]
async fn serves_and_stops_cleanly_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let common::BrokerProcess {
        mut child, addr, ..
    } = start(dir.path(), &[]).await;
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
