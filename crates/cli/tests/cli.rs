//! `statebroker-cli` against a broker started in the test: every command,
//! the output formats and the exit statuses.

use std::net::SocketAddr;
use std::process::Output;
use std::time::Duration;

use broker::{Broker, RunningBroker, Settings};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

async fn broker_with(tweak: impl FnOnce(&mut Settings)) -> RunningBroker {
    let mut settings = Settings::listening_on("127.0.0.1:0".parse().unwrap());
    tweak(&mut settings);
    Broker::start(settings).await.expect("broker starts")
}

fn cli(addr: SocketAddr) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_statebroker-cli"));
    command
        .args(["-h", &addr.ip().to_string(), "-p", &addr.port().to_string()])
        .kill_on_drop(true);
    command
}

async fn run(addr: SocketAddr, args: &[&str]) -> Output {
    cli(addr)
        .args(["--timeout", "5"])
        .args(args)
        .output()
        .await
        .unwrap()
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_get_del_vdel_and_formats() {
    let broker = broker_with(|_| {}).await;
    let addr = broker.local_addr();

    let set = run(addr, &["set", "greeting", "hello world", "--px", "60000"]).await;
    assert!(set.status.success(), "{set:?}");
    assert_eq!(stdout(&set), "OK\n");
    let get = run(addr, &["get", "greeting"]).await;
    assert_eq!(
        (stdout(&get).as_str(), get.status.code()),
        ("hello world\n", Some(0))
    );

    // -v: the version (an HLC of the broker's node) and the properties.
    let verbose = stdout(&run(addr, &["-v", "get", "greeting"]).await);
    let mut lines = verbose.lines();
    assert_eq!(lines.next(), Some("hello world"));
    let version = lines.next().unwrap();
    assert!(
        version.starts_with("version: ") && version.ends_with(":statebroker"),
        "{verbose}"
    );
    assert!(verbose.contains("property: __stat=200"), "{verbose}");

    // --json, with bytes that are not UTF-8 as hex.
    let json: serde_json::Value =
        serde_json::from_str(&stdout(&run(addr, &["--json", "get", "greeting"]).await)).unwrap();
    assert_eq!(json["value"], "hello world");
    assert!(json["version"].as_str().unwrap().ends_with(":statebroker"));
    let missing = run(addr, &["get", "nothing"]).await;
    assert_eq!(
        (stdout(&missing).as_str(), missing.status.code()),
        ("", Some(0))
    );
    // A missing key has no version: `-v` prints none.
    let verbose_missing = stdout(&run(addr, &["-v", "get", "nothing"]).await);
    assert_eq!(verbose_missing.lines().next(), Some("(nil)"));
    assert!(!verbose_missing.contains("version:"), "{verbose_missing}");
    let json: serde_json::Value =
        serde_json::from_str(&stdout(&run(addr, &["--json", "get", "nothing"]).await)).unwrap();
    assert!(json["value"].is_null());
    assert!(json["version"].is_null(), "{json}");

    // Conditions: NX refused on an existing key prints -1.
    assert_eq!(
        stdout(&run(addr, &["set", "greeting", "x", "--nx"]).await),
        "-1\n"
    );
    assert_eq!(
        stdout(&run(addr, &["vdel", "greeting", "other"]).await),
        "-1\n"
    );
    assert_eq!(
        stdout(&run(addr, &["vdel", "greeting", "hello world"]).await),
        "1\n"
    );
    assert_eq!(stdout(&run(addr, &["del", "greeting"]).await), "0\n");
    run(addr, &["set", "k", "v"]).await;
    assert_eq!(stdout(&run(addr, &["del", "k"]).await), "1\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persist_keeps_a_key_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let on_disk = |s: &mut Settings| {
        s.persistence = Some(broker::config::PersistenceSettings {
            data_dir: dir.path().to_owned(),
            mode: broker::config::Mode::Fsync,
            accept_data_loss: false,
        });
    };
    let broker = broker_with(on_disk).await;
    let addr = broker.local_addr();
    assert!(
        run(addr, &["set", "kept", "v", "--persist"])
            .await
            .status
            .success()
    );
    assert!(run(addr, &["set", "lost", "v"]).await.status.success());
    broker.shutdown(Duration::from_secs(2)).await;
    let broker = broker_with(on_disk).await;
    let addr = broker.local_addr();
    assert_eq!(stdout(&run(addr, &["get", "kept"]).await), "v\n");
    assert_eq!(stdout(&run(addr, &["get", "lost"]).await), "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_exit_1_and_no_answer_exits_2() {
    let broker = broker_with(|_| {}).await;
    let addr = broker.local_addr();
    let unknown = run(addr, &["raw", "NOSUCH", "thing"]).await;
    assert_eq!(unknown.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&unknown.stderr),
        "ERR unknown command\n"
    );
    assert!(unknown.stdout.is_empty());
    let json = run(addr, &["--json", "raw", "GET"]).await;
    assert_eq!(json.status.code(), Some(1));
    assert!(
        stdout(&json).contains("wrong number of arguments"),
        "{json:?}"
    );

    // Something that accepts connections and never answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let started = std::time::Instant::now();
    let timeout = cli(silent_addr)
        .args(["--timeout", "0.5", "get", "k"])
        .output()
        .await
        .unwrap();
    assert_eq!(timeout.status.code(), Some(2), "{timeout:?}");
    assert!(String::from_utf8_lossy(&timeout.stderr).contains("no answer within the timeout"));
    assert!(started.elapsed() < Duration::from_secs(4));
    // Nobody listening at all.
    drop(broker);
    let refused = run(addr, &["get", "k"]).await;
    assert_eq!(refused.status.code(), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_reads_every_scan_page() {
    let broker = broker_with(|s| s.statestore.scan_page_size = 3).await;
    let addr = broker.local_addr();
    let client = run(addr, &["set", "a", "1"]).await;
    assert!(client.status.success());
    for i in 0..10 {
        let key = format!("sensor-{i}");
        assert!(run(addr, &["set", &key, "v"]).await.status.success());
    }
    let mut keys: Vec<String> = stdout(&run(addr, &["keys", "sensor-*"]).await)
        .lines()
        .map(str::to_owned)
        .collect();
    keys.sort();
    let want: Vec<String> = (0..10).map(|i| format!("sensor-{i}")).collect();
    assert_eq!(keys, want, "ten keys over four pages of three");
    let all = stdout(&run(addr, &["keys"]).await);
    assert_eq!(all.lines().count(), 11);
    assert_eq!(
        stdout(&run(addr, &["keys", "sensor-[!0-8]"]).await),
        "sensor-9\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_prints_each_change() {
    let broker = broker_with(|_| {}).await;
    let addr = broker.local_addr();
    let mut watcher = cli(addr)
        .args(["--timeout", "5", "-v", "watch", "door", "window"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut ready = BufReader::new(watcher.stderr.take().unwrap()).lines();
    let note = tokio::time::timeout(Duration::from_secs(10), ready.next_line())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(note.as_deref(), Some("watching 2 key(s); Ctrl-C to stop"));
    run(addr, &["set", "door", "open"]).await;
    run(addr, &["set", "ignored", "x"]).await;
    run(addr, &["del", "door"]).await;
    run(addr, &["set", "window", "shut"]).await;
    let mut lines = BufReader::new(watcher.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    for _ in 0..3 {
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .expect("a change line")
            .unwrap()
            .unwrap();
        seen.push(line);
    }
    let fields: Vec<Vec<&str>> = seen.iter().map(|l| l.split('\t').collect()).collect();
    assert_eq!(fields[0][..3], ["SET", "door", "open"]);
    assert_eq!(fields[1][..3], ["DELETE", "door", ""]);
    assert_eq!(fields[2][..3], ["SET", "window", "shut"]);
    // A DELETE carries the version the key had (as the README shows).
    assert_eq!(fields[1][3], fields[0][3], "{seen:?}");
    assert!(
        fields.iter().all(|f| f[3].ends_with(":statebroker")),
        "{seen:?}"
    );
    watcher.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_acquires_renews_refuses_and_releases() {
    let broker = broker_with(|_| {}).await;
    let addr = broker.local_addr();
    let first = run(addr, &["-i", "worker-1", "lock", "jobs", "--ttl", "10000"]).await;
    assert!(first.status.success(), "{first:?}");
    let token = stdout(&first).trim().to_owned();
    assert!(token.ends_with(":statebroker"), "a fencing token: {token}");

    let other = run(addr, &["-i", "worker-2", "lock", "jobs", "--ttl", "10000"]).await;
    assert_eq!(other.status.code(), Some(1));
    let why = String::from_utf8_lossy(&other.stderr);
    assert!(why.contains("lock jobs is held by worker-1"), "{why}");

    // The holder renews: a newer token.
    let renewed = run(
        addr,
        &["-i", "worker-1", "--json", "lock", "jobs", "--ttl", "10000"],
    )
    .await;
    let json: serde_json::Value = serde_json::from_str(&stdout(&renewed)).unwrap();
    let newer = json["fencing_token"].as_str().unwrap();
    assert!(newer > token.as_str(), "{newer} after {token}");
    assert_eq!(json["holder"], "worker-1");

    // The token fences a write.
    let fenced = run(addr, &["set", "job", "done", "--fencing-token", newer]).await;
    assert!(fenced.status.success());
    let stale = run(addr, &["set", "job", "again", "--fencing-token", &token]).await;
    assert_eq!(stale.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&stale.stderr).contains("lower version"));

    let wrong = run(addr, &["-i", "worker-2", "lock", "jobs", "--release"]).await;
    assert_eq!(wrong.status.code(), Some(1));
    let released = run(addr, &["-i", "worker-1", "lock", "jobs", "--release"]).await;
    assert!(released.status.success(), "{released:?}");
    let taken = run(addr, &["-i", "worker-2", "lock", "jobs", "--ttl", "10000"]).await;
    assert!(taken.status.success(), "free after the release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn username_and_password_from_flag_or_file() {
    let dir = tempfile::tempdir().unwrap();
    let users = dir.path().join("users");
    std::fs::write(
        &users,
        broker::passwords::set_user("", "alice", b"secret").unwrap(),
    )
    .unwrap();
    let broker = broker_with(|s| {
        s.password_file = Some(users);
        s.listeners[0].allow_anonymous = false;
    })
    .await;
    let addr = broker.local_addr();
    let ok = run(addr, &["-u", "alice", "-P", "secret", "set", "k", "v"]).await;
    assert!(ok.status.success(), "{ok:?}");
    let file = dir.path().join("password");
    std::fs::write(&file, "secret\n").unwrap();
    let from_file = run(
        addr,
        &[
            "-u",
            "alice",
            "--password-file",
            file.to_str().unwrap(),
            "get",
            "k",
        ],
    )
    .await;
    assert_eq!(stdout(&from_file), "v\n");
    let refused = run(addr, &["-u", "alice", "-P", "wrong", "get", "k"]).await;
    assert_eq!(refused.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("refused"),
        "{refused:?}"
    );
}

#[tokio::test]
async fn help_has_examples() {
    let help = Command::new(env!("CARGO_BIN_EXE_statebroker-cli"))
        .arg("--help")
        .output()
        .await
        .unwrap();
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    for needle in [
        "Examples:",
        "-h, --host",
        "-i, --id",
        "--timeout",
        "watch",
        "lock",
        "--json",
    ] {
        assert!(text.contains(needle), "--help lacks {needle}");
    }
}

/// `--cafile`, `--cert` and `--key` against a mutual-TLS listener whose
/// certificates are made here; a wrong CA file is refused with status 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_client_certificate() {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let ca = |name: &str| {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        (params.self_signed(&key).unwrap(), key)
    };
    let (ca_cert, ca_key) = ca("cli CA");
    let issue = |names: Vec<String>, cn: &str| {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(names).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        let cert = params.signed_by(&key, &ca_cert, &ca_key).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_pem, server_key) = issue(vec!["127.0.0.1".into()], "server");
    let (client_pem, client_key) = issue(Vec::new(), "cli-user");
    let files = broker::config::TlsFiles {
        cert: write("server.pem", &server_pem),
        key: write("server.key", &server_key),
        ca: Some(write("ca.pem", &ca_cert.pem())),
    };
    let broker = broker_with(|s| s.listeners[0].tls = Some(files)).await;
    let addr = broker.local_addr();
    let ca_file = dir.path().join("ca.pem");
    let cert = write("client.pem", &client_pem);
    let key = write("client.key", &client_key);
    let tls_args = [
        "--cafile",
        ca_file.to_str().unwrap(),
        "--cert",
        cert.to_str().unwrap(),
        "--key",
        key.to_str().unwrap(),
    ];
    let set = run(addr, &[&tls_args[..], &["set", "over-tls", "yes"]].concat()).await;
    assert!(set.status.success(), "{set:?}");
    let get = run(addr, &[&tls_args[..], &["get", "over-tls"]].concat()).await;
    assert_eq!(stdout(&get), "yes\n");
    // Without the client certificate, or trusting another CA: no connection.
    let no_cert = run(
        addr,
        &["--cafile", ca_file.to_str().unwrap(), "get", "over-tls"],
    )
    .await;
    assert_eq!(no_cert.status.code(), Some(2), "{no_cert:?}");
    let (other, _) = ca("another CA");
    let other = write("other.pem", &other.pem());
    let mut wrong = tls_args;
    wrong[1] = other.to_str().unwrap();
    let refused = run(addr, &[&wrong[..], &["get", "over-tls"]].concat()).await;
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
}

/// Values that are not text: hexadecimal, from a file, from stdin; and
/// what a person gets for an expiry of 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_from_hex_a_file_or_stdin() {
    let broker = broker_with(|_| {}).await;
    let addr = broker.local_addr();
    let get_hex = |key: &'static str| async move {
        let json: serde_json::Value =
            serde_json::from_str(&stdout(&run(addr, &["--json", "get", key]).await)).unwrap();
        json["value"]["hex"].as_str().map(str::to_owned)
    };
    let set = run(addr, &["set", "bin", "--hex", "00ff10"]).await;
    assert!(set.status.success(), "{set:?}");
    assert_eq!(get_hex("bin").await.as_deref(), Some("00ff10"));

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("value");
    std::fs::write(&file, [0xfe, 0x00, 0x0a]).unwrap();
    let set = run(
        addr,
        &["set", "from-file", "--file", file.to_str().unwrap()],
    )
    .await;
    assert!(set.status.success(), "{set:?}");
    assert_eq!(get_hex("from-file").await.as_deref(), Some("fe000a"));
    // VDEL compares the same bytes.
    assert_eq!(
        stdout(&run(addr, &["vdel", "from-file", "--hex", "fe000a"]).await),
        "1\n"
    );

    let mut child = cli(addr)
        .args(["--timeout", "5", "set", "from-stdin", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use tokio::io::AsyncWriteExt;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(&[0xc3, 0x28, b'\n']).await.unwrap();
    }
    let done = child.wait_with_output().await.unwrap();
    assert!(done.status.success(), "{done:?}");
    assert_eq!(get_hex("from-stdin").await.as_deref(), Some("c3280a"));

    let bad = run(addr, &["set", "bin", "--hex", "0g"]).await;
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not hexadecimal"));
    let zero = run(addr, &["set", "k", "v", "--px", "0"]).await;
    assert_eq!(zero.status.code(), Some(2));
    let why = String::from_utf8_lossy(&zero.stderr);
    assert!(why.contains("at least 1"), "{why}");
}

/// A value of a megabyte goes in from a file and comes back whole (the
/// client once took in no packet over 10 KiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_value_comes_back_whole() {
    let broker = broker_with(|_| {}).await;
    let addr = broker.local_addr();
    let value: Vec<u8> = (0..1_000_000u32).map(|i| b'a' + (i % 26) as u8).collect();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("value");
    std::fs::write(&file, &value).unwrap();
    let set = run(addr, &["set", "big", "--file", file.to_str().unwrap()]).await;
    assert!(set.status.success(), "{set:?}");
    let got = run(addr, &["get", "big"]).await;
    assert!(
        got.status.success(),
        "{:?}",
        String::from_utf8_lossy(&got.stderr)
    );
    assert_eq!(
        got.stdout.strip_suffix(b"\n").unwrap_or(&got.stdout),
        &value[..]
    );
}

#[tokio::test]
async fn completions_and_a_manual_page() {
    let completions = Command::new(env!("CARGO_BIN_EXE_statebroker-cli"))
        .args(["completions", "bash"])
        .output()
        .await
        .unwrap();
    assert!(completions.status.success());
    let script = String::from_utf8_lossy(&completions.stdout);
    assert!(
        script.contains("complete") && script.contains("statebroker-cli"),
        "{script}"
    );
    let man = Command::new(env!("CARGO_BIN_EXE_statebroker-cli"))
        .arg("man")
        .output()
        .await
        .unwrap();
    assert!(man.status.success());
    let page = String::from_utf8_lossy(&man.stdout);
    assert!(page.contains(".TH statebroker-cli 1"), "{page}");
}
