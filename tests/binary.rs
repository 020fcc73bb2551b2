//! The `statebroker` binary itself: start-up, configuration errors, signals.

mod common;

use std::time::Duration;

use common::raw::{Raw, disconnect_reason, v5};
use common::signal;
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
    signal(&child, "TERM");
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

/// The files a configuration names are part of it: a policy, password
/// file or certificate that does not load stops the start as a bad value
/// does (exit 2, the setting named), before the data directory is opened,
/// and a file that is not a policy is not copied into the message.
#[tokio::test]
async fn a_named_file_that_does_not_load_stops_the_start_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let passwd = dir.path().join("passwd");
    let hashed = broker::passwords::set_user("", "alice", b"s3cret").unwrap();
    std::fs::write(&passwd, &hashed).unwrap();
    let config = dir.path().join("mixed-up.toml");
    // The password file named as the policy, and a missing certificate.
    std::fs::write(
        &config,
        format!(
            "[broker]\nauthorization = {:?}\n\n[v5.1]\nname = \"tls\"\nlisten = \"127.0.0.1:0\"\nnext_connection_delay_ms = 0\n[v5.1.connections]\nconnection_timeout_ms = 1000\nmax_payload_size = 1024\nmax_inflight_count = 10\n[v5.1.tls]\ncertpath = \"missing.pem\"\nkeypath = \"missing.key\"\n",
            passwd.display().to_string()
        ),
    )
    .unwrap();
    let data = dir.path().join("data");
    let output = Command::new(env!("CARGO_BIN_EXE_statebroker"))
        .arg("--config")
        .arg(&config)
        .arg("--data-dir")
        .arg(&data)
        .env_remove("RUST_LOG")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("[broker] authorization = "), "{stderr}");
    assert!(stderr.contains("not a policy"), "{stderr}");
    assert!(stderr.contains("tls"), "{stderr}");
    let hash = hashed.trim().split_once(':').unwrap().1;
    assert!(
        !stderr.contains(&hash[10..]),
        "a hash in the message: {stderr}"
    );
    assert!(!data.exists(), "the data directory was opened");
}

/// Two brokers on one machine: the second one's HTTP endpoint (by default
/// 127.0.0.1:9883, here the configured `[http] listen`) finds the port
/// taken. It refuses to start, and says how to pick another port or turn
/// the endpoint off.
#[tokio::test]
async fn a_taken_http_port_stops_the_start_saying_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    // The first broker's endpoint, as far as the second can tell.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let config = dir.path().join("second.toml");
    std::fs::write(&config, format!("[http]\nlisten = \"{addr}\"\n")).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_statebroker"))
        .args(["--listen", "127.0.0.1:0", "--config"])
        .arg(&config)
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .env_remove("RUST_LOG")
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    let line = stderr
        .lines()
        .find(|l| l.contains("cannot start"))
        .unwrap_or_else(|| panic!("no line says why: {stderr}"));
    assert!(line.contains(" ERROR "), "{line}");
    for needle in [
        &addr.to_string()[..],
        "in use",
        "--http ADDR",
        "[http] listen",
        "--no-http",
    ] {
        assert!(line.contains(needle), "{needle:?} missing from: {line}");
    }
    drop(taken);
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
    // The passwd examples, one command a line (wrapped into one before).
    let output = Command::new(env!("CARGO_BIN_EXE_statebroker"))
        .args(["passwd", "--help"])
        .output()
        .await
        .unwrap();
    let help = String::from_utf8_lossy(&output.stdout);
    for example in [
        "  statebroker passwd /etc/statebroker/passwd alice\n",
        "  statebroker passwd users alice --delete\n",
    ] {
        assert!(help.contains(example), "{help}");
    }
}

/// Lines at a level that normal use must never produce.
fn noisy(log: &[String]) -> Vec<&String> {
    log.iter()
        .filter(|l| {
            [" ERROR ", " WARN ", " DEBUG ", " TRACE "]
                .iter()
                .any(|lvl| l.contains(lvl))
        })
        .collect()
}

#[tokio::test]
async fn normal_use_logs_no_error_and_no_storage_debug() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("persist-all.toml");
    std::fs::write(&config, "[persistence]\nkeys = [\"all\"]\n").unwrap();
    let args = ["--config", config.to_str().unwrap()];
    let data = dir.path().join("data");
    let mut broker = start(&data, &args).await;
    let mut five = Raw::connect(broker.addr, "five").await;
    assert_eq!(
        &five.request(&[b"SET", b"k", b"v"]).await.payload[..],
        b"+OK\r\n"
    );
    common::mqtt::goodbye(five, None).await;
    // Each way a client leaves, many times: the router's stray events
    // after a DISCONNECT (rumqttd patch 12) come with some of them only.
    const ROUNDS: usize = 15;
    for _ in 0..ROUNDS {
        use rumqttc::mqttbytes::{QoS as Q4, v4};
        let mut four = common::raw::Raw4::connect(broker.addr, "four").await;
        let publish = v4::Publish::new("t", Q4::AtMostOnce, "m");
        four.send_all(vec![v4::Packet::Publish(publish), v4::Packet::Disconnect])
            .await;
        assert!(four.recv().await.is_none(), "closed after DISCONNECT");
        let mut five = Raw::connect(broker.addr, "five").await;
        five.publish("t", "m", rumqttc::v5::mqttbytes::QoS::AtLeastOnce, None)
            .await;
        common::mqtt::goodbye(five, None).await;
        let mut dropped = Raw::connect(broker.addr, "dropped").await;
        dropped
            .publish("t", "m", rumqttc::v5::mqttbytes::QoS::AtMostOnce, None)
            .await;
        drop(dropped);
    }
    let log = std::sync::Arc::clone(&broker.log);
    common::eventually("every disconnect logged", || {
        log.lock()
            .iter()
            .filter(|l| l.contains("client disconnected"))
            .count()
            == 1 + 3 * ROUNDS
    })
    .await;
    signal(&broker.child, "TERM");
    broker.child.wait().await.unwrap();
    let first = log.lock().clone();
    assert!(noisy(&first).is_empty(), "{:#?}", noisy(&first));

    // A restart over the same data replays the storage engine's journal.
    let broker = start(&data, &args).await;
    let mut again = Raw::connect(broker.addr, "again").await;
    assert_eq!(
        &again.request(&[b"GET", b"k"]).await.payload[..],
        b"$1\r\nv\r\n"
    );
    let second = broker.log.lock().clone();
    assert!(noisy(&second).is_empty(), "{:#?}", noisy(&second));
}

#[tokio::test]
async fn sighup_reloads_the_configuration_and_never_stops_the_broker() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("statebroker.toml");
    std::fs::write(&config, "[log]\nlevel = \"info\"\n").unwrap();
    let broker = start(dir.path(), &["--config", config.to_str().unwrap()]).await;
    let log = std::sync::Arc::clone(&broker.log);
    let count = |needle: &str| log.lock().iter().filter(|l| l.contains(needle)).count();

    // Unchanged: nothing to apply, nothing to restart.
    signal(&broker.child, "HUP");
    common::eventually("the reload logged", || {
        count("configuration unchanged") == 1
    })
    .await;
    assert_eq!(count("restart"), 0);
    assert_eq!(count("reloaded"), 0);

    // A new level applies at once; a new node id is named as needing a
    // restart, and the summary says the configuration applied in part.
    std::fs::write(
        &config,
        "[log]\nlevel = \"debug\"\n[statestore]\nnode_id = \"other\"\n",
    )
    .unwrap();
    signal(&broker.child, "HUP");
    common::eventually("the second reload logged", || {
        count("configuration applied in part") == 1
    })
    .await;
    assert!(
        log.lock().iter().any(|l| l.contains(" ERROR ")
            && l.contains("statestore.node_id")
            && l.contains("restart")),
        "{:#?}",
        log.lock()
    );
    assert!(
        log.lock()
            .iter()
            .any(|l| l.contains("applied log.level; not applied (named above): statestore.node_id")),
        "{:#?}",
        log.lock()
    );
    let mut client = Raw::connect(broker.addr, "after-reload").await;
    assert_eq!(
        &client.request(&[b"SET", b"k", b"v"]).await.payload[..],
        b"+OK\r\n"
    );
    common::eventually("debug lines once the level is debug", || {
        count(" DEBUG ") > 0
    })
    .await;

    // A broken file changes nothing and says why.
    std::fs::write(
        &config,
        "[log]\nlevel = \"info\"\n[statestore]\nscan_page_size = \"lots\"\n",
    )
    .unwrap();
    signal(&broker.child, "HUP");
    common::eventually("the refusal logged", || {
        count("configuration refused, nothing applied") == 1
    })
    .await;
    assert!(
        log.lock()
            .iter()
            .any(|l| l.contains("statestore.scan_page_size"))
    );
    let version = client.request(&[b"SET", b"k2", b"v"]).await;
    assert_eq!(&version.payload[..], b"+OK\r\n", "still serving");
    let node = common::raw::user_property(&version, "__ts")
        .unwrap_or_default()
        .to_owned();
    assert!(
        node.ends_with(":statebroker"),
        "the node id needs a restart: {node}"
    );
}

#[tokio::test]
async fn json_logs_and_several_listen_addresses() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let mut child = Command::new(env!("CARGO_BIN_EXE_statebroker"))
        .args(["--in-memory", "--no-http", "--log-format", "json"])
        .args(["--listen", "127.0.0.2:0", "--listen", "localhost:0"])
        .env_remove("RUST_LOG")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut addrs = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), async {
        while addrs.len() < 2 {
            let line = lines.next_line().await.unwrap().expect("a log line");
            let json: serde_json::Value =
                serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
            assert!(
                json["timestamp"].is_string() && json["level"].is_string(),
                "{line}"
            );
            if json["message"] == "listening (MQTT 3.1.1 and 5)" {
                addrs.push(
                    json["addr"]
                        .as_str()
                        .unwrap()
                        .parse::<std::net::SocketAddr>()
                        .unwrap(),
                );
            }
        }
    })
    .await
    .expect("two listeners logged");
    assert!(addrs.iter().all(|a| a.ip().is_loopback()), "{addrs:?}");
    for addr in addrs.iter().filter(|a| a.is_ipv4()) {
        let mut client = Raw::connect(*addr, "json").await;
        assert_eq!(
            &client.request(&[b"SET", b"k", b"v"]).await.payload[..],
            b"+OK\r\n"
        );
    }
}

/// `statebroker passwd` writes a file the broker reads; SIGHUP applies a
/// changed file to new connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwd_and_sighup_change_who_may_connect() {
    let dir = tempfile::tempdir().unwrap();
    let users = dir.path().join("users");
    let passwd = |password: &'static str| {
        let users = users.clone();
        async move {
            let mut child = Command::new(env!("CARGO_BIN_EXE_statebroker"))
                .arg("passwd")
                .arg(&users)
                .args(["alice", "--password-stdin"])
                .stdin(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            use tokio::io::AsyncWriteExt;
            let mut stdin = child.stdin.take().unwrap();
            stdin
                .write_all(format!("{password}\n").as_bytes())
                .await
                .unwrap();
            drop(stdin);
            let out = child.wait_with_output().await.unwrap();
            assert!(out.status.success(), "{out:?}");
        }
    };
    passwd("old").await;
    let text = std::fs::read_to_string(&users).unwrap();
    assert!(text.starts_with("alice:$7$"), "{text}");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&users).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "only its owner reads it");
    }
    let config = dir.path().join("c.toml");
    std::fs::write(&config, "[broker]\npassword_file = \"users\"\n").unwrap();
    let broker = start(
        &dir.path().join("data"),
        &["--config", config.to_str().unwrap()],
    )
    .await;
    let login = |password: &'static str| {
        move |c: &mut (v5::Connect, Option<v5::LastWill>, Option<v5::Login>)| {
            c.2 = Some(v5::Login::new("alice", password));
        }
    };
    let (_c, ack) = Raw::connect_with(broker.addr, "a1", login("old")).await;
    assert_eq!(ack.code, v5::ConnectReturnCode::Success);
    passwd("new").await;
    signal(&broker.child, "HUP");
    common::eventually("the reload is logged", || {
        broker
            .log
            .lock()
            .iter()
            .any(|l| l.contains("configuration reloaded: password_file"))
    })
    .await;
    let (_c, ack) = Raw::connect_with(broker.addr, "a2", login("new")).await;
    assert_eq!(ack.code, v5::ConnectReturnCode::Success);
    let (_c, ack) = Raw::connect_with(broker.addr, "a3", login("old")).await;
    assert_eq!(ack.code, v5::ConnectReturnCode::BadUserNamePassword);
    // A missing user cannot be deleted; the file stays as it was.
    let out = Command::new(env!("CARGO_BIN_EXE_statebroker"))
        .arg("passwd")
        .arg(&users)
        .args(["bob", "--delete"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no user bob"));
}

/// `[log] level = "info"` (or any level) does not bring the storage
/// engine's INFO lines (13 at every restart, `Recovering current manifest`
/// ...) nor the router's line per packet: they stay at WARN unless the
/// filter names them.
#[tokio::test]
async fn a_plain_info_level_keeps_the_storage_engine_and_router_quiet() {
    use rumqttc::v5::mqttbytes::QoS;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("info.toml");
    std::fs::write(&config, "[log]\nlevel = \"info\"\n").unwrap();
    let data = dir.path().join("data");
    let args = ["--config", config.to_str().unwrap()];
    let quiet = |log: &[String]| -> Vec<String> {
        log.iter()
            .filter(|l| l.contains("lsm_tree") || l.contains("fjall") || l.contains("router::"))
            .cloned()
            .collect()
    };
    // The first start creates the database, the second recovers it.
    for round in 0..2 {
        let mut broker = start(&data, &args).await;
        let mut sub = Raw::connect(broker.addr, "sub").await;
        sub.subscribe("t/#", QoS::AtLeastOnce).await;
        let mut publisher = Raw::connect(broker.addr, "pub").await;
        publisher.publish("t/1", "m", QoS::AtLeastOnce, None).await;
        assert_eq!(&sub.next_publish().await.payload[..], b"m");
        assert_eq!(
            &publisher.request(&[b"SET", b"k", b"v"]).await.payload[..],
            b"+OK\r\n"
        );
        common::mqtt::goodbye(publisher, None).await;
        common::mqtt::goodbye(sub, None).await;
        let log = std::sync::Arc::clone(&broker.log);
        common::eventually("both disconnects logged", || {
            log.lock()
                .iter()
                .filter(|l| l.contains("client disconnected"))
                .count()
                == 2
        })
        .await;
        signal(&broker.child, "TERM");
        let status = tokio::time::timeout(Duration::from_secs(10), broker.child.wait())
            .await
            .expect("stops on SIGTERM")
            .unwrap();
        assert!(status.success(), "{status}");
        let log = log.lock().clone();
        assert!(
            log.iter()
                .any(|l| l.contains(" INFO ") && l.contains("client connected")),
            "round {round}: the filter is info: {log:#?}"
        );
        assert!(quiet(&log).is_empty(), "round {round}: {:#?}", quiet(&log));
    }
}

/// Runs the binary with `args` to its end; returns its exit code and stderr.
async fn run_to_end(command: &mut Command) -> (Option<i32>, String) {
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        command.env_remove("RUST_LOG").output(),
    )
    .await
    .expect("a refused start ends")
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{stderr}");
    (output.status.code(), stderr)
}

/// A start that fails binding an MQTT listener logs no line announcing
/// the HTTP endpoint (it was bound first, and once said so before the
/// failure).
#[tokio::test]
async fn a_failing_start_announces_no_http_endpoint() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (code, stderr) = run_to_end(Command::new(env!("CARGO_BIN_EXE_statebroker")).args([
        "--in-memory",
        "--listen",
        &addr,
        "--http",
        "127.0.0.1:0",
    ]))
    .await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot listen on {addr}")),
        "{stderr}"
    );
    assert!(!stderr.contains("HTTP endpoint"), "{stderr}");
    drop(taken);
}

/// The start-up log says which parts of the HTTP endpoint are on, and
/// that it is off with --no-http.
#[tokio::test]
async fn the_start_says_what_the_http_endpoint_serves() {
    let dir = tempfile::tempdir().unwrap();
    let broker = start(dir.path(), &[]).await;
    let line = broker
        .log
        .lock()
        .iter()
        .find(|l| l.contains("HTTP endpoint"))
        .cloned()
        .expect("an HTTP endpoint line before the listeners");
    for needle in [
        " INFO ",
        "/metrics /healthz /readyz on",
        "web view / on (loopback: no password)",
        "edit forms off ([http] allow_edit = false)",
        "faults off",
        "addr=127.0.0.1:",
    ] {
        assert!(line.contains(needle), "{needle:?} missing from {line}");
    }
    // Before any client: the connection series are there, at 0 (a
    // `statebroker_connections == 0` alert and rate() need them).
    let http = line
        .split("addr=")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap();
    let metrics = http_get(http, "/metrics").await;
    for series in [
        "statebroker_connections 0",
        "statebroker_connections_accepted_total 0",
    ] {
        assert!(
            metrics.lines().any(|l| l == series),
            "{series} missing:\n{metrics}"
        );
    }
    drop(broker);
    let mut command = Command::new(env!("CARGO_BIN_EXE_statebroker"));
    command.args(["--in-memory", "--listen", "127.0.0.1:0", "--no-http"]);
    let (_child, _, log) = common::spawn_command(command).await;
    assert!(
        log.lock()
            .iter()
            .any(|l| l.contains(" INFO ") && l.contains("HTTP endpoint off (--no-http")),
        "{:#?}",
        log.lock()
    );
}

/// A full store is the operator's business: a request refused for a
/// quota gets its `-ERR` and the log a WARN (once per 10 s, counting).
#[tokio::test]
async fn a_quota_reached_is_logged() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("small.toml");
    std::fs::write(&config, "[statestore.quota]\nmax_keys = 1\n").unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_statebroker"));
    command
        .args([
            "--in-memory",
            "--listen",
            "127.0.0.1:0",
            "--no-http",
            "--config",
        ])
        .arg(&config);
    let (_child, addr, log) = common::spawn_command(command).await;
    let mut client = Raw::connect(addr, "filler").await;
    assert_eq!(
        &client.request(&[b"SET", b"a", b"1"]).await.payload[..],
        b"+OK\r\n"
    );
    for key in [&b"b"[..], b"c"] {
        assert_eq!(
            &client.request(&[b"SET", key, b"1"]).await.payload[..],
            b"-ERR the quota has been exceeded\r\n"
        );
    }
    let start = std::time::Instant::now();
    while !log.lock().iter().any(|l| {
        l.contains(" WARN ") && l.contains("[statestore.quota] is reached") && l.contains("filler")
    }) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{:#?}",
            log.lock()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The body of `GET path` from `addr` (HTTP/1.0, `Host: localhost`).
async fn http_get(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or(answer)
}

/// A data directory that is a file: said in those words, not `File
/// exists (os error 17)`.
#[tokio::test]
async fn a_data_directory_that_is_a_file_is_named_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("data");
    std::fs::write(&file, "not a directory").unwrap();
    let (code, stderr) = run_to_end(
        Command::new(env!("CARGO_BIN_EXE_statebroker"))
            .args(["--listen", "127.0.0.1:0", "--no-http", "--data-dir"])
            .arg(&file),
    )
    .await;
    assert_eq!(code, Some(1), "{stderr}");
    let shown = file.display().to_string();
    assert!(
        stderr.contains(&format!("{shown} is a file, not a directory")),
        "{stderr}"
    );
    assert!(stderr.contains("--data-dir"), "{stderr}");
    assert!(!stderr.contains("os error"), "{stderr}");
}

/// A data directory another broker has open: the second one says so, not
/// just `Locked`.
#[tokio::test]
async fn a_data_directory_in_use_is_named_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let _first = common::spawn_broker(dir.path(), &[]).await;
    let (code, stderr) = run_to_end(
        Command::new(env!("CARGO_BIN_EXE_statebroker"))
            .args(["--listen", "127.0.0.1:0", "--no-http", "--data-dir"])
            .arg(dir.path()),
    )
    .await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("in use by another process"), "{stderr}");
}

/// A data directory the broker's user may not write (a bind mount owned
/// by root, in a container): the error names the directory, the user id
/// and what to do, not `FjallError: Io(Os { code: 13, ... })`. As root
/// (whom no permission stops) the binary runs as nobody through setpriv.
#[cfg(unix)]
#[tokio::test]
async fn an_unwritable_data_directory_names_the_user_and_the_fix() {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let root = std::fs::metadata("/proc/self").unwrap().uid() == 0;
    let (mut command, uid) = if root {
        if std::process::Command::new("setpriv")
            .arg("--version")
            .output()
            .is_err()
        {
            eprintln!("skipped: running as root without setpriv");
            return;
        }
        // nobody must reach the directory, and not write it.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut command = Command::new("setpriv");
        command
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(env!("CARGO_BIN_EXE_statebroker"));
        (command, 65534)
    } else {
        std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o555)).unwrap();
        let uid = std::fs::metadata("/proc/self").unwrap().uid();
        (Command::new(env!("CARGO_BIN_EXE_statebroker")), uid)
    };
    command
        .args(["--listen", "127.0.0.1:0", "--no-http", "--data-dir"])
        .arg(&data);
    let (code, stderr) = run_to_end(&mut command).await;
    assert_eq!(code, Some(1), "{stderr}");
    let shown = data.display().to_string();
    for needle in [
        format!("cannot open the data directory {shown}: permission denied (running as uid {uid})"),
        format!("chown -R {uid} {shown}"),
        "user:".to_owned(),
    ] {
        assert!(stderr.contains(&needle), "{needle:?} missing from {stderr}");
    }
    assert!(!stderr.contains("FjallError"), "{stderr}");
}

/// A listener in a file needs only `listen` (the README: a file holds
/// only what it changes); rumqttd's parser once wanted every field.
#[tokio::test]
async fn a_listener_in_a_file_needs_only_listen() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("listener.toml");
    std::fs::write(&config, "[v5.1]\nlisten = \"127.0.0.1:0\"\n").unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_statebroker"));
    command
        .args(["--in-memory", "--no-http", "--config"])
        .arg(&config);
    let (_child, addr, _) = common::spawn_command(command).await;
    let mut client = Raw::connect(addr, "file-listener").await;
    assert_eq!(
        &client.request(&[b"SET", b"k", b"v"]).await.payload[..],
        b"+OK\r\n"
    );
}

/// `statebroker healthcheck` (the image's HEALTHCHECK) asks where the
/// running broker says, through STATEBROKER_HEALTH_FILE: its HTTP
/// endpoint's /readyz on the port it was given, or with --no-http its MQTT
/// listener; not ready before the start and after the stop.
#[tokio::test]
async fn healthcheck_follows_the_configured_endpoint() {
    let dir = tempfile::tempdir().unwrap();
    let health = dir.path().join("health");
    let check = || {
        let health = health.clone();
        async move {
            let output = Command::new(env!("CARGO_BIN_EXE_statebroker"))
                .arg("healthcheck")
                .env("STATEBROKER_HEALTH_FILE", &health)
                .output()
                .await
                .unwrap();
            (
                output.status.code(),
                String::from_utf8_lossy(&output.stdout).into_owned(),
            )
        }
    };
    let (code, said) = check().await;
    assert_eq!(code, Some(1), "not started: {said}");
    assert!(said.starts_with("not ready"), "{said}");
    for http in [true, false] {
        let mut command = Command::new(env!("CARGO_BIN_EXE_statebroker"));
        command
            .args(["--in-memory", "--listen", "127.0.0.1:0"])
            .args(if http {
                &["--http", "127.0.0.1:0"][..]
            } else {
                &["--no-http"][..]
            })
            .env("STATEBROKER_HEALTH_FILE", &health);
        let (mut child, addr, _) = common::spawn_command(command).await;
        common::eventually("the health file is written", || health.exists()).await;
        let (code, said) = check().await;
        assert_eq!(code, Some(0), "{said}");
        if http {
            assert!(said.contains("/readyz: ready"), "{said}");
        } else {
            assert!(said.contains(&format!("MQTT listener {addr}")), "{said}");
        }
        signal(&child, "TERM");
        let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .expect("stops on SIGTERM")
            .unwrap();
        assert!(status.success(), "{status}");
        assert!(!health.exists(), "removed at the stop");
        let (code, said) = check().await;
        assert_eq!(code, Some(1), "stopped: {said}");
    }
}

/// SIGTERM with a client connected and a data directory: `stopped` is the
/// last line, and the process ends right after it (issue #32: it once
/// took about 2.1 s more). Prints the time from SIGTERM to `stopped` and
/// to the exit; asserts only that the exit comes, within 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_process_ends_once_stopped() {
    use rumqttc::v5::mqttbytes::QoS;
    let dir = tempfile::tempdir().unwrap();
    let mut broker = start(dir.path(), &[]).await;
    let mut client = Raw::connect(broker.addr, "connected-at-stop").await;
    client.subscribe("t/#", QoS::AtLeastOnce).await;
    assert_eq!(
        &client.request(&[b"SET", b"k", b"v"]).await.payload[..],
        b"+OK\r\n"
    );
    let log = std::sync::Arc::clone(&broker.log);
    let sent = std::time::Instant::now();
    signal(&broker.child, "TERM");
    // The client reads why and closes, as clients do.
    let d = client.expect_disconnect().await;
    assert_eq!(
        disconnect_reason(&d),
        Some(v5::DisconnectReasonCode::ServerShuttingDown)
    );
    drop(client);
    let mut stopped_at = None;
    let exit = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if stopped_at.is_none()
                && log
                    .lock()
                    .iter()
                    .any(|l| l.contains("statebroker: stopped"))
            {
                stopped_at = Some(sent.elapsed());
            }
            tokio::select! {
                status = broker.child.wait() => break status.unwrap(),
                () = tokio::time::sleep(Duration::from_millis(1)) => {}
            }
        }
    })
    .await
    .expect("the process ends within 10 s of SIGTERM");
    let exited_at = sent.elapsed();
    assert!(exit.success(), "{exit}");
    // The log's reader may trail the exit: wait for the last line.
    common::eventually("the stopped line", || {
        log.lock()
            .iter()
            .any(|l| l.contains("statebroker: stopped"))
    })
    .await;
    let log = log.lock().clone();
    assert!(
        log.last()
            .is_some_and(|l| l.contains("statebroker: stopped")),
        "stopped is the last line: {log:#?}"
    );
    println!("SIGTERM -> stopped {stopped_at:?}, -> exit {exited_at:?}");
}
