//! A data directory on a full filesystem: persisted writes stay
//! unacknowledged, and SIGTERM still stops the broker, saying what was not
//! kept. The filesystem is a 3 MiB tmpfs mounted in a mount namespace of
//! the broker's own (`unshare --user --map-root-user --mount`: no root
//! needed where unprivileged user namespaces are allowed, as on Debian).

mod common;

/// `n` bytes that do not compress: fjall compresses its tables, and a
/// disk filled with one repeated byte has room again as soon as the
/// journal is written out as a table.
fn incompressible(n: usize) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

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
    let mut c = Raw::connect(addr, "filler").await;
    let (acknowledged, _) = fill(&mut c).await;
    let acknowledged = acknowledged.len();
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

/// The address of the HTTP endpoint, from the broker's log.
fn http_addr(log: &parking_lot::Mutex<Vec<String>>) -> std::net::SocketAddr {
    let log = log.lock();
    let line = log
        .iter()
        .find(|l| l.contains("HTTP endpoint"))
        .expect("the HTTP endpoint is logged");
    let rest = line.split("addr=").nth(1).unwrap();
    rest.split_whitespace().next().unwrap().parse().unwrap()
}

/// GET `path` from the HTTP endpoint: the status code and the body.
async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    s.write_all(request.as_bytes()).await.unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).await.unwrap();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    (status, body)
}

/// The value of the metric line `series` (0 when absent).
fn metric(body: &str, series: &str) -> f64 {
    body.lines()
        .find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok())?
        })
        .unwrap_or(0.0)
}

/// Polls `/readyz` and `/metrics` until the readiness status is `status`
/// and the gauge `statebroker_disk_refusing_writes` is `gauge`.
async fn wait_for_readiness(http: std::net::SocketAddr, status: u16, gauge: f64) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (code, body) = http_get(http, "/readyz").await;
        let (_, metrics) = http_get(http, "/metrics").await;
        let value = metric(&metrics, "statebroker_disk_refusing_writes");
        if code == status && value == gauge {
            return body;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "/readyz {code} {body:?}, gauge {value}; waited for {status} and {gauge}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Issue #33 item 2: once the full disk has room again, the broker writes
/// again without a restart (fjall poisons its database at the first failed
/// write; the writer closes it and opens the directory again), answers the
/// SET that waited, and has lost nothing it acknowledged. While the disk
/// refuses writes `/readyz` answers 503 with the reason and the gauge
/// `statebroker_disk_refusing_writes` is 1.
///
/// The tmpfs lives in the broker's mount namespace: the script that mounts
/// it keeps 1 MiB of it taken by a filler file and removes it when the
/// test creates `free` (outside the tmpfs); after SIGTERM it copies the
/// data directory out, and a second broker reads the copy back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_is_written_again_once_space_returns() {
    let dir = tempfile::tempdir().unwrap();
    let mount = dir.path().join("fs");
    let free = dir.path().join("free");
    let copy = dir.path().join("copy");
    std::fs::create_dir(&mount).unwrap();
    let script = format!(
        "mount -t tmpfs -o size=3m tmpfs '{m}' || exit 1
         dd if=/dev/zero of='{m}/filler' bs=1024 count=1024 2>/dev/null || exit 1
         (i=0; while [ ! -e '{free}' ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done; rm -f '{m}/filler') &
         '{bin}' --listen 127.0.0.1:0 --http 127.0.0.1:0 --data-dir '{m}/data' &
         broker=$!
         trap 'kill -TERM $broker' TERM
         wait $broker
         wait $broker
         status=$?
         cp -r '{m}/data' '{copy}'
         exit $status",
        m = mount.display(),
        free = free.display(),
        copy = copy.display(),
        bin = env!("CARGO_BIN_EXE_statebroker"),
    );
    let mut command = tokio::process::Command::new("unshare");
    command.args(["--user", "--map-root-user", "--mount", "sh", "-c", &script]);
    let (mut child, addr, log) = spawn_command(command).await;
    let http = http_addr(&log);
    wait_for_readiness(http, 200, 0.0).await;

    let mut c = Raw::connect(addr, "filler").await;
    let (mut acknowledged, waiting) = fill(&mut c).await;
    let waiting = waiting.expect("a 2 MiB disk fills up");
    assert!(!acknowledged.is_empty());

    let body = wait_for_readiness(http, 503, 1.0).await;
    assert!(body.contains("refuses writes"), "{body}");

    // Space returns: the SET that waited is answered, the broker is ready.
    std::fs::write(&free, b"").unwrap();
    let late = tokio::time::timeout(Duration::from_secs(60), c.next_publish())
        .await
        .expect("the waiting SET is answered once the disk has room");
    assert_eq!(&late.payload[..], b"+OK\r\n");
    acknowledged.push(waiting);
    wait_for_readiness(http, 200, 0.0).await;
    let r = c
        .request_raw(
            REQUEST_TOPIC,
            &encode_request(&[b"SET".as_slice(), b"after", b"v"]),
            &[("__ts", &now_hlc("filler")), ("aio-persistence", "true")],
        )
        .await;
    assert_eq!(&r.payload[..], b"+OK\r\n");
    {
        let log = log.lock();
        assert!(
            log.iter()
                .any(|l| l.contains("opened the data directory again")),
            "{}",
            log.join("\n")
        );
        assert!(log.iter().any(|l| l.contains("takes writes again")));
    }

    signal(&child, "TERM");
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("SIGTERM stops the broker")
        .unwrap();
    assert!(status.success(), "{status}");

    // Everything acknowledged is in the directory.
    let broker = common::spawn_broker(&copy, &[]).await;
    let mut reader = Raw::connect(broker.addr, "reader").await;
    for key in &acknowledged {
        let r = reader.request(&[b"GET", key.as_bytes()]).await;
        assert!(
            r.payload.starts_with(b"$60000\r\n"),
            "{key} was acknowledged and is lost: {:?}",
            String::from_utf8_lossy(&r.payload[..r.payload.len().min(20)])
        );
    }
    let r = reader.request(&[b"GET", b"after"]).await;
    assert_eq!(&r.payload[..], b"$1\r\nv\r\n");
}

/// 60 KB persisted values until the disk takes no more: the keys
/// acknowledged, and the one whose SET stays unanswered (its change is not
/// on disk, so it is not acknowledged), if the disk filled up within 1,000.
async fn fill(c: &mut Raw) -> (Vec<String>, Option<String>) {
    let value = incompressible(60_000);
    let mut acknowledged = Vec::new();
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
                acknowledged.push(key);
            }
            Err(_) => return (acknowledged, Some(key)),
        }
    }
    (acknowledged, None)
}
