//! Sequential request/response round trips with the official SDK client.
//!
//! ```text
//! cargo run --release --example sdk_latency -- [ADDR] [REQUESTS]
//! ```
//!
//! Without ADDR it starts a broker in process on a free loopback port. Prints
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
        "SDK sequential round trips against {addr}: n {}  p50 {} µs  p90 {} µs  p99 {} µs  max {} µs",
        samples.len(),
        q(0.50),
        q(0.90),
        q(0.99),
        samples[samples.len() - 1]
    );
    sdk.close().await;
}
