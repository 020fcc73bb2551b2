//! A data directory on a full filesystem: persisted writes stay
//! unacknowledged, and SIGTERM still stops the broker, saying what was not
//! kept. The filesystem is a 3 MiB tmpfs mounted in a mount namespace of
//! the broker's own (`unshare --user --map-root-user --mount`: no root
//! needed where unprivileged user namespaces are allowed, as on Debian).

mod common;

use std::time::Duration;

use common::raw::{REQUEST_TOPIC, Raw, now_hlc};
use common::{signal, spawn_command};
use statestore::resp3::encode_request;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_the_broker_while_the_disk_is_full() {
    let dir = tempfile::tempdir().unwrap();
    let mount = dir.path().join("fs");
    std::fs::create_dir(&mount).unwrap();
    let script = format!(
        "mount -t tmpfs -o size=3m tmpfs '{m}' && exec '{bin}' --listen 127.0.0.1:0 --no-http --data-dir '{m}/data'",
        m = mount.display(),
        bin = env!("CARGO_BIN_EXE_statebroker"),
    );
    let mut command = tokio::process::Command::new("unshare");
    command.args(["--user", "--map-root-user", "--mount", "sh", "-c", &script]);
    let (mut child, addr, log) = spawn_command(command).await;

    // 60 KB persisted values until the disk takes no more: that SET stays
    // unanswered (its change is not on disk, so it is not acknowledged).
    let value = vec![b'x'; 60_000];
    let mut c = Raw::connect(addr, "filler").await;
    let mut acknowledged = 0;
    for i in 0..1000 {
        let key = format!("k{i}");
        let ts = now_hlc("filler");
        let payload = encode_request(&[b"SET".as_slice(), key.as_bytes(), &value]);
        let properties = [("__ts", ts.as_str()), ("aio-persistence", "true")];
        let answer = tokio::time::timeout(
            Duration::from_secs(5),
            c.request_raw(REQUEST_TOPIC, &payload, &properties),
        )
        .await;
        match answer {
            Ok(r) => {
                assert_eq!(&r.payload[..], b"+OK\r\n", "{key}");
                acknowledged += 1;
            }
            Err(_) => break,
        }
    }
    assert!(
        (1..1000).contains(&acknowledged),
        "a 3 MiB disk fills up: {acknowledged} SETs acknowledged"
    );
    {
        let log = log.lock();
        assert!(
            log.iter()
                .any(|l| l.contains("ERROR") && l.contains("retrying (writes stay unacknowledged)")),
            "the refused writes are logged ({acknowledged} acknowledged):\n{}",
            log.join("\n")
        );
    }

    signal(&child, "TERM");
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("SIGTERM stops a broker whose disk is full")
        .unwrap();
    assert!(status.success(), "{status}");
    let log = log.lock().clone();
    assert!(
        log.iter().any(|l| l.contains("ERROR")
            && l.contains("stopping while the data directory refuses writes")),
        "{}",
        log.join("\n")
    );
}
