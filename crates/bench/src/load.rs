//! The load run: C connections, each with one request in flight.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use hdrhistogram::Histogram;
use rumqttc::v5::mqttbytes::QoS;
use serde::Serialize;
use tokio::io::AsyncBufReadExt;
use tokio::time::Instant;

use crate::request::{Answer, Reply, Template};
use crate::resp::Resp;
use crate::wire::Wire;
use crate::{FillArgs, LoadArgs, Protocol, Responder};

/// The state store request topic (served in process by statebroker).
pub const REQUEST_TOPIC: &str = "statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke";

/// One benchmark connection, driven by its own task.
struct Conn {
    wire: Wire,
    response_topic: String,
    client_id: String,
    /// The requests' bytes that are the same each time (made for the
    /// run's topic at the first request).
    template: Option<Template>,
}

impl Conn {
    /// The next response (its PUBACK queued to go out with the next
    /// request); other packets (the PUBACKs of requests) are skipped.
    async fn next(&mut self) -> Result<Answer, String> {
        self.wire.next_answer().await
    }

    /// Sends the PUBACKs still queued and a DISCONNECT.
    async fn close(mut self) {
        if self.wire.disconnect().is_ok() {
            let _ = self.wire.flush().await;
        }
    }
}

/// Connects, subscribes to the response topic, and waits for the SUBACK.
async fn connect(target: SocketAddr, client_id: String) -> Result<Conn, String> {
    let mut wire = Wire::connect(target, &client_id).await?;
    let response_topic = format!("bench/{client_id}/response");
    wire.subscribe(&response_topic, QoS::AtLeastOnce)
        .await
        .map_err(|e| format!("{client_id}: {e}"))?;
    Ok(Conn {
        wire,
        response_topic,
        client_id,
        template: None,
    })
}

/// Opens `n` RESP connections (`--protocol resp`).
async fn connect_resp(target: SocketAddr, n: usize) -> Result<Vec<Client>, String> {
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        conns.push(Client::Resp(Resp::connect(target).await?));
    }
    Ok(conns)
}

/// Connects `n` clients, at most 64 handshakes at a time.
async fn connect_all(target: SocketAddr, n: usize, prefix: &str) -> Result<Vec<Conn>, String> {
    let mut conns = Vec::with_capacity(n);
    let mut pending = tokio::task::JoinSet::new();
    let mut next = 0;
    while conns.len() < n {
        while next < n && pending.len() < 64 {
            pending.spawn(connect(target, format!("{prefix}-{next}")));
            next += 1;
        }
        match pending.join_next().await {
            Some(Ok(Ok(conn))) => conns.push(conn),
            Some(Ok(Err(e))) => return Err(e),
            Some(Err(e)) => return Err(e.to_string()),
            None => break,
        }
    }
    Ok(conns)
}

/// The wall clock in ms (`__ts` as the SDK writes it).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Key number `i` as `size` characters: zero-padded decimal, its first
/// `size` digits when longer (what `format!("{i:0size$}")` cut to `size`
/// gave), written into `key` (kept between requests: no allocation each).
fn key_into(key: &mut Vec<u8>, i: u64, size: usize) {
    let mut buffer = itoa::Buffer::new();
    let digits = buffer.format(i).as_bytes();
    key.clear();
    key.resize(size.saturating_sub(digits.len()), b'0');
    key.extend_from_slice(&digits[..digits.len().min(size)]);
}

impl Conn {
    /// Queues a request; `flush` (or `send`) writes it.
    fn queue(&mut self, topic: &str, payload: &[u8], correlation: u64, persist: bool) {
        let template = match &mut self.template {
            Some(template) if template.is_for(topic) => template,
            other => other.insert(Template::new(topic, &self.response_topic, &self.client_id)),
        };
        self.wire
            .request(template, correlation, persist, now_ms(), payload);
    }

    /// Writes a request (with the PUBACK of the previous response, if any,
    /// in the same write).
    async fn send(
        &mut self,
        topic: &str,
        payload: &[u8],
        correlation: u64,
        persist: bool,
    ) -> Result<(), String> {
        self.queue(topic, payload, correlation, persist);
        self.wire.flush().await
    }
}

/// What one connection measured.
struct ConnStats {
    histogram: Histogram<u64>,
    ok: u64,
    errors: u64,
    lost: u64,
    failure: Option<String>,
}

/// What a request came to.
enum Outcome {
    /// Its answer (RESP3 from the state store, RESP from Redis): what
    /// kind.
    Answer(Reply),
    /// No answer in time.
    Lost,
    /// The connection failed.
    Failed(String),
}

/// One benchmark connection, in the protocol of the run.
enum Client {
    Mqtt(Conn),
    Resp(Resp),
}

impl Client {
    /// Sends `command` (on MQTT, as a state store request on `topic`,
    /// numbered `correlation`) and waits until `deadline` for its answer.
    async fn exchange(
        &mut self,
        topic: &str,
        command: &[u8],
        correlation: u64,
        persist: bool,
        deadline: Instant,
    ) -> Outcome {
        match self {
            Client::Mqtt(conn) => {
                if let Err(e) = conn.send(topic, command, correlation, persist).await {
                    return Outcome::Failed(e);
                }
                loop {
                    match tokio::time::timeout_at(deadline, conn.next()).await {
                        Ok(Ok(answer)) if answer.correlation == correlation => {
                            return Outcome::Answer(answer.reply);
                        }
                        Ok(Ok(_)) => continue, // a late answer to a lost request
                        Ok(Err(e)) => return Outcome::Failed(e),
                        Err(_) => return Outcome::Lost,
                    }
                }
            }
            // One reply per command, in order: a reply that does not come
            // in time leaves the connection out of step, so it ends.
            Client::Resp(resp) => {
                match tokio::time::timeout_at(deadline, resp.request(command)).await {
                    Ok(Ok(reply)) => Outcome::Answer(reply),
                    Ok(Err(e)) => Outcome::Failed(e),
                    Err(_) => Outcome::Failed("no reply in time".into()),
                }
            }
        }
    }

    async fn close(self) {
        if let Client::Mqtt(conn) = self {
            conn.close().await;
        }
    }
}

async fn drive(
    mut client: Client,
    args: LoadArgs,
    topic: String,
    warm_end: Instant,
    end: Instant,
) -> ConnStats {
    let mut stats = ConnStats {
        histogram: Histogram::new_with_bounds(1, 600_000_000, 3).expect("histogram bounds"),
        ok: 0,
        errors: 0,
        lost: 0,
        failure: None,
    };
    let timeout = Duration::from_millis(args.timeout_ms);
    let value = vec![b'v'; args.value_size];
    let mut correlation = 0u64;
    let mut k = Vec::with_capacity(args.key_size);
    while Instant::now() < end {
        correlation += 1;
        key_into(&mut k, fastrand::u64(..args.keys), args.key_size);
        let is_set = fastrand::f64() < args.set_ratio;
        let command = if is_set {
            statestore::resp3::encode_request(&[&b"SET"[..], &k, &value])
        } else {
            statestore::resp3::encode_request(&[&b"GET"[..], &k])
        };
        let started = Instant::now();
        let measured = started >= warm_end;
        let persist = is_set && args.persist;
        match client
            .exchange(&topic, &command, correlation, persist, started + timeout)
            .await
        {
            Outcome::Answer(reply) => {
                if measured {
                    let good = reply == if is_set { Reply::Ok } else { Reply::Bulk };
                    if good {
                        stats.ok += 1;
                        let us = started.elapsed().as_micros().max(1) as u64;
                        let _ = stats.histogram.record(us);
                    } else {
                        stats.errors += 1;
                    }
                }
            }
            Outcome::Lost => stats.lost += u64::from(measured),
            Outcome::Failed(e) => {
                stats.failure = Some(e);
                stats.lost += u64::from(measured);
                return stats;
            }
        }
    }
    client.close().await;
    stats
}

/// The result of a run, as printed with `--json`.
#[derive(Debug, Serialize)]
pub struct Report {
    pub target: String,
    pub protocol: String,
    pub responder: String,
    pub connections: usize,
    pub duration_s: f64,
    pub requests: u64,
    pub requests_per_sec: f64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
    pub errors: u64,
    pub lost: u64,
    pub failed_connections: usize,
    pub wildcard_subscribers: usize,
}

/// Clients that only hold a wildcard subscription each
/// (`--wildcard-subscribers`), connected one after the other and kept
/// until the run ends.
async fn wildcard_subscribers(target: SocketAddr, n: usize) -> Result<Vec<Wire>, String> {
    let mut held = Vec::with_capacity(n);
    for i in 0..n {
        let mut wire =
            Wire::connect(target, &format!("bench-wild-{}-{i}", std::process::id())).await?;
        wire.subscribe(&format!("bench/wild/{i}/+"), QoS::AtMostOnce)
            .await
            .map_err(|e| format!("wildcard subscriber {i}: {e}"))?;
        held.push(wire);
    }
    Ok(held)
}

/// Starts `statebroker-bench responder` as a child process and waits until it serves.
async fn spawn_responder(target: SocketAddr, topic: &str) -> Result<tokio::process::Child, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = tokio::process::Command::new(exe)
        .args([
            "responder",
            "--target",
            &target.to_string(),
            "--topic",
            topic,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start the responder: {e}"))?;
    let stdout = child.stdout.take().ok_or("responder without stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    match tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await {
        Ok(Ok(Some(line))) if line.starts_with("ready") => Ok(child),
        other => Err(format!("responder did not start: {other:?}")),
    }
}

/// Runs the connections, spread over one single-threaded runtime per core,
/// and returns what each measured.
///
/// Why not one multi-threaded runtime: once more than 256 tasks are ready on
/// one of its workers, tokio moves the overflow to a global queue that the
/// worker visits only every few dozen polls, while connections woken by the
/// network keep refilling the local queue. At 1,024 connections on one core
/// that left some connections waiting up to a second: p99 170 ms against a
/// p50 of 3 ms, the load generator's unfairness rather than the server's. A
/// single-threaded runtime polls its ready tasks in FIFO order.
async fn run_shards(args: &LoadArgs, topic: &str) -> Result<Vec<Vec<ConnStats>>, String> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let shards = cores.min(args.connections);
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel::<Result<(), String>>(shards);
    // The measurement window, sent once every shard is connected.
    let (window_tx, window_rx) = tokio::sync::watch::channel(None::<(Instant, Instant)>);
    let mut threads = Vec::with_capacity(shards);
    for shard in 0..shards {
        let n = args.connections / shards + usize::from(shard < args.connections % shards);
        let prefix = format!("bench-{}-{shard}", std::process::id());
        let (args, topic, ready_tx, mut window_rx) = (
            args.clone(),
            topic.to_owned(),
            ready_tx.clone(),
            window_rx.clone(),
        );
        let thread = std::thread::Builder::new()
            .name(format!("load-{shard}"))
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| e.to_string())?;
                runtime.block_on(async move {
                    let conns = match args.protocol {
                        Protocol::Mqtt => connect_all(args.target, n, &prefix)
                            .await
                            .map(|conns| conns.into_iter().map(Client::Mqtt).collect()),
                        Protocol::Resp => connect_resp(args.target, n).await,
                    };
                    let ready = conns.as_ref().map(|_| ()).map_err(Clone::clone);
                    let _ = ready_tx.send(ready).await;
                    let conns = conns?;
                    let (warm_end, end) = loop {
                        if let Some(window) = *window_rx.borrow_and_update() {
                            break window;
                        }
                        if window_rx.changed().await.is_err() {
                            return Err("another shard failed".to_owned());
                        }
                    };
                    let tasks: Vec<_> = conns
                        .into_iter()
                        .map(|conn| {
                            tokio::spawn(drive(conn, args.clone(), topic.clone(), warm_end, end))
                        })
                        .collect();
                    let mut stats = Vec::with_capacity(tasks.len());
                    for task in tasks {
                        stats.push(task.await.map_err(|e| e.to_string())?);
                    }
                    Ok(stats)
                })
            })
            .map_err(|e| format!("cannot start a load thread: {e}"))?;
        threads.push(thread);
    }
    drop(ready_tx);
    for _ in 0..shards {
        match ready_rx.recv().await {
            Some(Ok(())) => {}
            Some(Err(e)) => return Err(e),
            None => return Err("a load thread ended early".into()),
        }
    }
    let warm_end = Instant::now() + Duration::from_secs_f64(args.warmup);
    let end = warm_end + Duration::from_secs_f64(args.duration);
    let _ = window_tx.send(Some((warm_end, end)));
    tokio::task::spawn_blocking(move || {
        threads
            .into_iter()
            .map(|t| t.join().map_err(|_| "a load thread panicked".to_owned())?)
            .collect()
    })
    .await
    .map_err(|e| e.to_string())?
}

/// The default mode.
pub async fn run(args: LoadArgs) -> Result<(), String> {
    if args.key_size < 8 {
        return Err("--key-size must be at least 8".into());
    }
    if args.connections == 0 || args.keys == 0 {
        return Err("--connections and --keys must be at least 1".into());
    }
    if args.protocol == Protocol::Resp
        && (args.responder != Responder::Inprocess || args.persist || args.wildcard_subscribers > 0)
    {
        return Err(
            "--protocol resp talks to a Redis server: --responder, --persist and --wildcard-subscribers are MQTT's"
                .into(),
        );
    }
    let (_responder, topic) = match args.responder {
        Responder::Inprocess => (None, REQUEST_TOPIC.to_owned()),
        Responder::External => (
            Some(spawn_responder(args.target, &args.external_topic).await?),
            args.external_topic.clone(),
        ),
    };
    let _others = wildcard_subscribers(args.target, args.wildcard_subscribers).await?;
    let shards = run_shards(&args, &topic).await?;
    let mut histogram = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).expect("bounds");
    let (mut ok, mut errors, mut lost, mut failed) = (0, 0, 0, 0);
    let mut failures = HashSet::new();
    for stats in shards.into_iter().flatten() {
        histogram.add(&stats.histogram).map_err(|e| e.to_string())?;
        ok += stats.ok;
        errors += stats.errors;
        lost += stats.lost;
        if let Some(f) = stats.failure {
            failed += 1;
            failures.insert(f);
        }
    }
    let duration = args.duration;
    let report = Report {
        target: args.target.to_string(),
        protocol: format!("{:?}", args.protocol).to_lowercase(),
        responder: format!("{:?}", args.responder).to_lowercase(),
        connections: args.connections,
        duration_s: duration,
        requests: ok,
        requests_per_sec: ok as f64 / duration,
        p50_us: histogram.value_at_quantile(0.50),
        p90_us: histogram.value_at_quantile(0.90),
        p99_us: histogram.value_at_quantile(0.99),
        max_us: histogram.max(),
        errors,
        lost,
        failed_connections: failed,
        wildcard_subscribers: args.wildcard_subscribers,
    };
    crate::emit(&report, args.json, &failures, || {
        format!(
            "target {}  protocol {}  responder {}  connections {}  measured {:.1} s\n\
             requests {}  requests/s {:.0}  errors {}  lost {}  failed connections {}\n\
             latency µs: p50 {}  p90 {}  p99 {}  max {}",
            report.target,
            report.protocol,
            report.responder,
            report.connections,
            report.duration_s,
            report.requests,
            report.requests_per_sec,
            report.errors,
            report.lost,
            report.failed_connections,
            report.p50_us,
            report.p90_us,
            report.p99_us,
            report.max_us
        )
    })?;
    Ok(())
}

/// `fill`: writes keys 0..N with pipelined SETs and reports the rate.
pub async fn fill(args: FillArgs) -> Result<(), String> {
    let prefix = format!("fill-{}", std::process::id());
    let conns = connect_all(args.target, args.connections.max(1), &prefix).await?;
    let started = Instant::now();
    let per = args.keys.div_ceil(conns.len() as u64);
    let mut tasks = Vec::new();
    for (i, mut conn) in conns.into_iter().enumerate() {
        let range = (i as u64 * per)..((i as u64 + 1) * per).min(args.keys);
        let pipeline = args.pipeline.max(1) as u64;
        let args = args.clone();
        tasks.push(tokio::spawn(async move {
            let value = vec![b'v'; 32];
            let mut key = Vec::with_capacity(16);
            let mut next = range.start;
            let mut outstanding = 0u64;
            let mut errors = 0u64;
            while next < range.end || outstanding > 0 {
                while next < range.end && outstanding < pipeline {
                    key_into(&mut key, next, 16);
                    let payload = statestore::resp3::encode_request(&[&b"SET"[..], &key, &value]);
                    conn.queue(REQUEST_TOPIC, &payload, next + 1, args.persist);
                    next += 1;
                    outstanding += 1;
                }
                conn.wire.flush().await?;
                match tokio::time::timeout(Duration::from_secs(30), conn.next()).await {
                    Ok(Ok(answer)) => {
                        outstanding -= 1;
                        errors += u64::from(answer.reply != Reply::Ok);
                    }
                    Ok(Err(e)) => return Err(e),
                    Err(_) => return Err("fill: no response".to_owned()),
                }
            }
            conn.close().await;
            Ok::<u64, String>(errors)
        }));
    }
    let mut errors = 0;
    for task in tasks {
        errors += task.await.map_err(|e| e.to_string())??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    println!(
        "filled {} keys in {:.1} s ({:.0} SET/s), {} errors",
        args.keys,
        elapsed,
        args.keys as f64 / elapsed,
        errors
    );
    if errors > 0 {
        return Err(format!("{errors} SETs failed"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::key_into;

    /// The keys are what `format!("{i:0size$}")` cut to `size` made.
    #[test]
    fn keys_are_zero_padded_decimals_cut_to_size() {
        let mut key = Vec::new();
        for (i, size) in [
            (0, 16),
            (42, 16),
            (9_999, 8),
            (123_456, 3),
            (u64::MAX, 16),
            (7, 1),
            (0, 0),
        ] {
            key_into(&mut key, i, size);
            let mut expected = format!("{i:0size$}").into_bytes();
            expected.truncate(size);
            assert_eq!(key, expected, "{i} {size}");
        }
    }
}
