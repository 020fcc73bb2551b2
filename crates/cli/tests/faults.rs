//! `statebroker-cli faults ...` against a broker started in the test with
//! `[faults] enabled` and its HTTP endpoint: every action, what the broker
//! does after it, and the exit statuses.

use std::net::SocketAddr;
use std::process::Output;
use std::time::Duration;

use broker::{Broker, RunningBroker, Settings};
use tokio::process::Command;

async fn broker(faults: bool) -> RunningBroker {
    let mut settings = Settings::listening_on("127.0.0.1:0".parse().unwrap());
    settings.http = Some("127.0.0.1:0".parse().unwrap());
    settings.faults.enabled = faults;
    Broker::start(settings).await.expect("broker starts")
}

async fn cli(broker: &RunningBroker, args: &[&str]) -> Output {
    let addr: SocketAddr = broker.local_addr();
    Command::new(env!("CARGO_BIN_EXE_statebroker-cli"))
        .args(["-h", &addr.ip().to_string(), "-p", &addr.port().to_string()])
        .args(["--timeout", "5"])
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .unwrap()
}

/// `faults --http ADDR ACTION...`
async fn faults(broker: &RunningBroker, action: &[&str]) -> Output {
    let http = broker.http_addr().unwrap().to_string();
    let mut args = vec!["faults", "--http", &http];
    args.extend_from_slice(action);
    cli(broker, &args).await
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_action_changes_what_the_broker_does() {
    let broker = broker(true).await;
    let add = faults(
        &broker,
        &[
            "add",
            "--commands",
            "GET",
            "--keys",
            "boom*",
            "--error",
            "the quota has been exceeded",
        ],
    )
    .await;
    assert!(add.status.success(), "{add:?}");
    let status: serde_json::Value = serde_json::from_slice(&add.stdout).unwrap();
    assert_eq!(status["rules"][0]["keys"], "boom*");
    // The rule answers for the broker.
    let get = cli(&broker, &["get", "boom1"]).await;
    assert_eq!(get.status.code(), Some(1));
    assert_eq!(text(&get.stderr).trim(), "ERR the quota has been exceeded");
    assert_eq!(cli(&broker, &["get", "fine"]).await.status.code(), Some(0));

    // A wrong rule: exit 1, the field named.
    let wrong = faults(&broker, &["add", "--keys", "x", "--drop-response", "later"]).await;
    assert_eq!(wrong.status.code(), Some(1));
    assert!(text(&wrong.stderr).contains("drop_response"), "{wrong:?}");

    // set FILE replaces, clear removes.
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        file.path(),
        r#"[{"keys": "slow*", "delay_ms": "300..300"}]"#,
    )
    .unwrap();
    let set = faults(&broker, &["set", file.path().to_str().unwrap()]).await;
    assert!(set.status.success(), "{set:?}");
    let started = std::time::Instant::now();
    assert_eq!(cli(&broker, &["get", "slow"]).await.status.code(), Some(0));
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert!(faults(&broker, &["clear"]).await.status.success());
    let status: serde_json::Value =
        serde_json::from_slice(&faults(&broker, &["status"]).await.stdout).unwrap();
    assert_eq!(status["rules"], serde_json::json!([]));
    assert_eq!(status["injected"]["error"], 1);
    assert_eq!(status["injected"]["delay"], 1);

    // The clock: two minutes behind makes a client's SET "too far in the future".
    assert!(
        faults(&broker, &["clock", "-120000"])
            .await
            .status
            .success()
    );
    let skewed = cli(&broker, &["set", "k", "v"]).await;
    assert!(
        text(&skewed.stderr).contains("timestamp is too far in the future"),
        "{skewed:?}"
    );
    assert!(faults(&broker, &["clock", "0"]).await.status.success());
    assert!(cli(&broker, &["set", "k", "v"]).await.status.success());

    // Expire: the key goes; a missing key is exit 1.
    assert!(faults(&broker, &["expire", "k"]).await.status.success());
    assert_eq!(text(&cli(&broker, &["get", "k"]).await.stdout), "");
    let missing = faults(&broker, &["expire", "k"]).await;
    assert_eq!(missing.status.code(), Some(1));
    assert!(text(&missing.stderr).contains("no key k"), "{missing:?}");

    // Refuse: new connections get "server busy" (the CLI says so, exit 2).
    assert!(faults(&broker, &["refuse", "5000"]).await.status.success());
    let refused = cli(&broker, &["get", "k"]).await;
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    assert!(faults(&broker, &["refuse", "0"]).await.status.success());
    assert_eq!(cli(&broker, &["get", "k"]).await.status.code(), Some(0));

    // Disconnect: a watching CLI is dropped with the reason.
    let addr = broker.local_addr();
    let mut watch = Command::new(env!("CARGO_BIN_EXE_statebroker-cli"))
        .args([
            "-p",
            &addr.port().to_string(),
            "-h",
            "127.0.0.1",
            "-i",
            "watcher-7",
            "watch",
            "k",
        ])
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut connected = false;
    for _ in 0..100 {
        let out = faults(
            &broker,
            &["disconnect", "watcher-7", "--reason-code", "0x98"],
        )
        .await;
        if out.status.success() {
            connected = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(connected, "the watcher connected and was disconnected");
    let ended = tokio::time::timeout(Duration::from_secs(5), watch.wait()).await;
    assert!(ended.is_ok(), "watch ended when disconnected");
    let nobody = faults(&broker, &["disconnect", "nobody"]).await;
    assert_eq!(nobody.status.code(), Some(1));
    assert!(text(&nobody.stderr).contains("not connected"), "{nobody:?}");
}

/// `stall-disk`: a persisted SET is not answered while the disk stalls,
/// and is there once it ends; without a data directory there is no disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_disk_holds_persisted_sets() {
    let no_disk = broker(true).await;
    let out = faults(&no_disk, &["stall-disk", "1000"]).await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(text(&out.stderr).contains("no data directory"), "{out:?}");

    let dir = tempfile::tempdir().unwrap();
    let mut settings = Settings::listening_on("127.0.0.1:0".parse().unwrap());
    settings.http = Some("127.0.0.1:0".parse().unwrap());
    settings.faults.enabled = true;
    settings.persistence = Some(broker::config::PersistenceSettings {
        data_dir: dir.path().to_owned(),
        mode: broker::config::Mode::Fsync,
        accept_data_loss: false,
    });
    let broker = Broker::start(settings).await.expect("broker starts");
    assert!(
        faults(&broker, &["stall-disk", "60000"])
            .await
            .status
            .success()
    );
    let port = broker.local_addr().port().to_string();
    let late = Command::new(env!("CARGO_BIN_EXE_statebroker-cli"))
        .args(["-h", "127.0.0.1", "-p", &port, "--timeout", "1"])
        .args(["set", "--persist", "k", "v"])
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    assert_eq!(late.status.code(), Some(2), "no answer in time: {late:?}");
    assert!(faults(&broker, &["stall-disk", "0"]).await.status.success());
    let got = cli(&broker, &["get", "k"]).await;
    assert_eq!(text(&got.stdout).trim(), "v", "{got:?}");
    let status: serde_json::Value =
        serde_json::from_slice(&faults(&broker, &["status"]).await.stdout).unwrap();
    assert_eq!(status["injected"]["disk_stall"], 1, "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_without_faults_says_so() {
    let broker = broker(false).await;
    let out = faults(&broker, &["refuse", "1000"]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("faults are off"), "{out:?}");
    // Nothing answers at all: exit 2.
    let out = cli(&broker, &["faults", "--http", "127.0.0.1:1", "status"]).await;
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}
