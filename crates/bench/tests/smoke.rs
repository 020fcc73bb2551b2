//! A short run of the benchmark binary against an in-process broker: the
//! numbers are not checked here (benchmarks print them), only that every
//! request got its answer.

use std::time::Duration;

/// Runs the benchmark binary with `args`; its one JSON object.
async fn bench(args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&bench_text(args).await).expect("one JSON object")
}

async fn run_bench(extra: &[&str]) -> serde_json::Value {
    let settings = broker::Settings::listening_on("127.0.0.1:0".parse().unwrap());
    let running = broker::Broker::start(settings).await.unwrap();
    let target = running.local_addr().to_string();
    let mut args = vec![
        "--target", &target, "-c", "3", "-d", "1", "--warmup", "0.2", "--json",
    ];
    args.extend_from_slice(extra);
    bench(&args).await
}

fn check(report: &serde_json::Value) {
    assert_eq!(report["lost"], 0, "{report}");
    assert_eq!(report["errors"], 0, "{report}");
    assert_eq!(report["failed_connections"], 0, "{report}");
    assert!(report["requests"].as_u64().unwrap() > 0, "{report}");
    for field in ["requests_per_sec", "p50_us", "p99_us"] {
        assert!(report[field].as_f64().unwrap() > 0.0, "{field}: {report}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_store_smoke_run() {
    check(&run_bench(&[]).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wildcard_subscribers_smoke_run() {
    let report = run_bench(&["--wildcard-subscribers", "20"]).await;
    assert_eq!(report["wildcard_subscribers"], 20, "{report}");
    check(&report);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_responder_smoke_run() {
    let report = run_bench(&["--responder", "external"]).await;
    assert_eq!(report["responder"], "external");
    check(&report);
}

/// `--protocol resp` sends the same requests to a real Redis server
/// (`redis-server`, as `bench/compare.py` starts it): every GET and SET
/// answered, and the report says which protocol it spoke. With MQTT-only
/// options it refuses to run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resp_protocol_smoke_run_against_redis() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut redis = tokio::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("redis-server runs (apt-get install redis-server)");
    let target = format!("127.0.0.1:{port}");
    let start = std::time::Instant::now();
    while tokio::net::TcpStream::connect(&target).await.is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "redis-server listens"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let report = bench(&[
        "--protocol",
        "resp",
        "--target",
        &target,
        "-c",
        "3",
        "-d",
        "1",
        "--warmup",
        "0.2",
        "--json",
    ])
    .await;
    assert_eq!(report["protocol"], "resp", "{report}");
    check(&report);
    let refused = tokio::process::Command::new(env!("CARGO_BIN_EXE_statebroker-bench"))
        .args(["--protocol", "resp", "--target", &target, "--persist"])
        .output()
        .await
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--persist"),
        "{refused:?}"
    );
    redis.kill().await.unwrap();
}

/// A short `pubsub` run: every pattern at every QoS delivers each message
/// exactly once to each subscriber (nothing lost, nothing twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pubsub_smoke_runs() {
    let settings = broker::Settings::listening_on("127.0.0.1:0".parse().unwrap());
    let running = broker::Broker::start(settings).await.unwrap();
    let target = running.local_addr().to_string();
    for (pattern, qos) in [
        ("pairs", "1"),
        ("fan-in", "2"),
        ("fan-out", "0"),
        ("fan-out", "1"),
    ] {
        let args = [
            "pubsub",
            "--target",
            &target,
            "--pattern",
            pattern,
            "--qos",
            qos,
            "-n",
            "3",
            "-d",
            "0.5",
            "--warmup",
            "0.2",
            "--json",
        ];
        let report = bench(&args).await;
        assert_eq!(report["lost"], 0, "{report}");
        assert_eq!(report["duplicated"], 0, "{report}");
        assert_eq!(report["failed_connections"], 0, "{report}");
        assert!(report["sent"].as_u64().unwrap() > 0, "{report}");
        assert_eq!(report["received"], report["expected"], "{report}");
        assert!(
            report["messages_per_sec"].as_f64().unwrap() > 0.0,
            "{report}"
        );
    }
}

/// Runs the benchmark binary with `args` (within a minute, successfully);
/// its standard output.
async fn bench_text(args: &[&str]) -> String {
    let output = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_statebroker-bench"))
            .args(args)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("bench finishes")
    .expect("bench runs");
    assert!(
        output.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("text")
}

/// `fill` writes every key (each SET answered +OK), and `idle` holds its
/// connections all opened at once; the broker sees both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fill_and_idle_smoke_runs() {
    let settings = broker::Settings::listening_on("127.0.0.1:0".parse().unwrap());
    let running = broker::Broker::start(settings).await.unwrap();
    let target = running.local_addr().to_string();

    let out = bench_text(&["fill", "--target", &target, "--keys", "300", "-c", "3"]).await;
    assert!(out.starts_with("filled 300 keys"), "{out}");
    assert!(out.trim_end().ends_with(", 0 errors"), "{out}");
    let last = running
        .store()
        .with_store(|store| store.view(&b"0000000000000299"[..]))
        .expect("the last key was written");
    assert_eq!(last.value, [b'v'; 32]);

    let out = bench_text(&[
        "idle",
        "--target",
        &target,
        "-c",
        "40",
        "--parallel",
        "40",
        "--hold",
        "0",
    ])
    .await;
    assert!(out.starts_with("connected 40 in "), "{out}");
}
