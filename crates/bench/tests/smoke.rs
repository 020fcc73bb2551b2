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
