//! Sequential request/response round trips with the official SDK client.
//!
//! ```text
//! cargo run --release --example sdk_latency -- [ADDR | - | tls] [REQUESTS]
//! ```
//!
//! Without ADDR (or with `-`) it starts a broker in process on a free
//! loopback port; with `tls`, one whose listener is TLS (a certificate made
//! here) and that asks for a username and password, which the SDK gives
//! (its `use_tls`, `ca_file`, `username`, `password_file`). Prints
//! p50/p90/p99/max of SET+GET round trips (one at a time), which must show no
//! Nagle-style stall (tens of milliseconds).

// The tests' in-process broker and SDK client (tests/common/sdk.rs).
#[allow(dead_code)]
#[path = "../tests/common/sdk.rs"]
mod common;

use std::time::{Duration, Instant};

use azure_iot_operations_services::state_store::SetOptions;

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let addr_arg = args.next().filter(|a| a != "-");
    let requests: usize = args.next().and_then(|n| n.parse().ok()).unwrap_or(5_000);
    let _broker;
    let dir = tempfile::tempdir().unwrap();
    if addr_arg.as_deref() == Some("tls") {
        let (running, sdk) = tls_broker_and_client(dir.path()).await;
        _broker = running;
        return measure(sdk, requests).await;
    }
    let addr = match addr_arg {
        Some(addr) => addr.parse().expect("ADDR as host:port"),
        None => {
            let running = common::start_broker().await;
            let addr = running.local_addr();
            _broker = running;
            addr
        }
    };
    let sdk = common::SdkClient::connect(addr, "sdk-latency").await;
    measure(sdk, requests).await;
}

/// A broker with a TLS listener and a password file, and an SDK client
/// connected to it over TLS with a password.
async fn tls_broker_and_client(
    dir: &std::path::Path,
) -> (broker::RunningBroker, common::SdkClient) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, "latency CA");
    let ca = params.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let server = CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&key, &ca, &ca_key)
        .unwrap();
    let files = broker::config::TlsFiles {
        cert: write("server.pem", &server.pem()),
        key: write("server.key", &key.serialize_pem()),
        ca: None,
    };
    let users = write(
        "users",
        &broker::passwords::set_user("", "latency", b"secret").unwrap(),
    );
    let running = common::start_broker_with(|s| {
        s.listeners[0].tls = Some(files);
        s.listeners[0].allow_anonymous = false;
        s.password_file = Some(users);
    })
    .await;
    let ca_file = write("ca.pem", &ca.pem());
    let password = write("password", "secret");
    let sdk = common::SdkClient::connect_tls(
        running.local_addr(),
        "sdk-latency",
        &ca_file,
        "latency",
        &password,
    )
    .await;
    (running, sdk)
}

async fn measure(sdk: common::SdkClient, requests: usize) {
    let client = &sdk.client;

    let timeout = Duration::from_secs(10);
    let mut samples = Vec::with_capacity(requests);
    for i in 0..requests + 200 {
        let key = format!("latency-{}", i % 100).into_bytes();
        let started = Instant::now();
        if i % 2 == 0 {
            client
                .set(key, b"value".to_vec(), timeout, None, SetOptions::default())
                .await
                .expect("SET");
        } else {
            client.get(key, timeout).await.expect("GET");
        }
        if i >= 200 {
            samples.push(started.elapsed().as_micros() as u64);
        }
    }
    samples.sort_unstable();
    let q = |p: f64| samples[((samples.len() - 1) as f64 * p) as usize];
    println!(
        "SDK sequential round trips: n {}  p50 {} µs  p90 {} µs  p99 {} µs  max {} µs",
        samples.len(),
        q(0.50),
        q(0.90),
        q(0.99),
        samples[samples.len() - 1]
    );
    sdk.close().await;
}
