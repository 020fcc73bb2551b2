//! The floor under the clustered store's speed: raw etcd requests shaped
//! like a node's, with no broker in between. A SET is the node's
//! transaction (`If mod_revision(key) == m Then Put(record) Else
//! Get(key)`, with `m` from this client's last answer for the key, as a
//! node plans against the record it knows); a GET is a linearizable read.
//! `bench/cluster-bench.sh` runs it beside statebroker-bench on the same
//! members, so the broker's overhead over etcd can be read off one run.
//!
//!   etcd-txn-bench --endpoints http://127.0.0.1:2379 -c 64 -d 10 --set-ratio 1

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use parking_lot::Mutex;

#[derive(Parser, Debug)]
#[command(about = "Raw etcd transactions and reads shaped like a statebroker node's")]
struct Args {
    /// etcd client URLs, comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    endpoints: Vec<String>,
    /// Concurrent requests, one in flight each.
    #[arg(short, long, default_value_t = 16)]
    connections: usize,
    /// Measured seconds (after the warm-up).
    #[arg(short, long, default_value_t = 10.0)]
    duration: f64,
    /// Warm-up seconds (not measured).
    #[arg(long, default_value_t = 2.0)]
    warmup: f64,
    /// Distinct keys.
    #[arg(long, default_value_t = 10_000)]
    keys: u64,
    /// Fraction of requests that are SETs (the rest are GETs).
    #[arg(long, default_value_t = 0.5)]
    set_ratio: f64,
    /// Key prefix in etcd.
    #[arg(long, default_value = "/etcd-txn-bench/")]
    prefix: String,
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let client = Client::connect(&args.endpoints, None).await?;
    // The mod revision each key had when this bench last saw it.
    let known: Arc<Mutex<HashMap<u64, i64>>> = Arc::default();
    let start = Instant::now();
    let measure_from = start + Duration::from_secs_f64(args.warmup);
    let end = measure_from + Duration::from_secs_f64(args.duration);
    let mut tasks = Vec::new();
    for task in 0..args.connections {
        let mut client = client.clone();
        let known = Arc::clone(&known);
        let (keys, prefix, set_ratio) = (args.keys, args.prefix.clone(), args.set_ratio);
        tasks.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(task as u64);
            // A record as a node writes it: header, node name, 32-byte value.
            let record = vec![b'v'; 64];
            let mut latencies = Vec::new();
            let mut errors = 0u64;
            loop {
                let now = Instant::now();
                if now >= end {
                    break;
                }
                let k = rng.u64(..keys);
                let key = format!("{prefix}K/{k:016}");
                let ok = if rng.f64() < set_ratio {
                    let m = known.lock().get(&k).copied().unwrap_or(0);
                    let txn = Txn::new()
                        .when([Compare::mod_revision(key.clone(), CompareOp::Equal, m)])
                        .and_then([TxnOp::put(key.clone(), record.clone(), None)])
                        .or_else([TxnOp::get(key, None)]);
                    match client.txn(txn).await {
                        Ok(r) => {
                            let revision = if r.succeeded() {
                                r.header().map_or(0, |h| h.revision())
                            } else {
                                r.op_responses()
                                    .into_iter()
                                    .find_map(|op| match op {
                                        TxnOpResponse::Get(g) => {
                                            g.kvs().first().map(|kv| kv.mod_revision())
                                        }
                                        _ => None,
                                    })
                                    .unwrap_or(0)
                            };
                            known.lock().insert(k, revision);
                            true
                        }
                        Err(_) => false,
                    }
                } else {
                    client.get(key, None).await.is_ok()
                };
                let done = Instant::now();
                if now >= measure_from && done <= end {
                    if ok {
                        latencies.push(done.duration_since(now));
                    } else {
                        errors += 1;
                    }
                }
            }
            (latencies, errors)
        }));
    }
    let mut latencies = Vec::new();
    let mut errors = 0;
    for task in tasks {
        let (l, e) = task.await?;
        latencies.extend(l);
        errors += e;
    }
    latencies.sort();
    let at = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
            .map_or(0, |d| d.as_micros())
    };
    let mean = latencies.iter().sum::<Duration>() / u32::try_from(latencies.len().max(1))?;
    println!(
        "{:.0} requests/s, {} errors; latency p50 {} us, p99 {} us, mean {} us",
        latencies.len() as f64 / args.duration,
        errors,
        at(0.50),
        at(0.99),
        mean.as_micros()
    );
    Ok(())
}
