//! `statebroker-bench`: request/response load in the state store protocol.
//!
//! ```text
//! statebroker-bench --target 127.0.0.1:1883 --connections 64 --duration 10 [--responder external] [--json]
//! statebroker-bench --protocol resp --target 127.0.0.1:6379 -c 64  # the same requests to Redis
//! statebroker-bench responder --target 127.0.0.1:1883        # the external responder on its own
//! statebroker-bench fill --target 127.0.0.1:1883 --keys 1000000
//! statebroker-bench idle --target 127.0.0.1:1883 --connections 10000 --hold 30
//! ```
//!
//! Each connection issues sequential requests at QoS 1 (50/50 GET/SET over a
//! key space) and waits for each response; a request without a response
//! within `--timeout-ms` counts as lost. With `--responder external`, the
//! requests go to a topic that any MQTT 5 broker routes, and a separate
//! process (this binary's `responder` mode, one plain MQTT client with a hash
//! map) answers them: the same workload on any broker.

mod idle;
mod load;
mod pubsub;
mod request;
mod resp;
mod responder;
mod wire;

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Request/response load in the Azure IoT Operations state store protocol.
#[derive(Parser, Debug)]
#[command(version, about, args_conflicts_with_subcommands = true)]
pub struct Cli {
    #[command(subcommand)]
    mode: Option<Mode>,
    #[command(flatten)]
    load: LoadArgs,
}

#[derive(Subcommand, Debug)]
enum Mode {
    /// Run only the external responder (answers requests from a hash map).
    Responder(ResponderArgs),
    /// SET keys 0..N (16-byte keys, 32-byte values) as fast as possible.
    Fill(FillArgs),
    /// Open N MQTT connections and hold them idle.
    Idle(IdleArgs),
    /// Publish/subscribe load: pairs, fan-in or fan-out, QoS 0/1/2, with
    /// end-to-end latency and exact lost and duplicated counts.
    ///
    /// Example: statebroker-bench pubsub --pattern fan-out --clients 64 --qos 1
    #[command(name = "pubsub")]
    PubSub(PubSubArgs),
}

/// Who publishes to whom.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Pattern {
    /// N publishers, N subscribers, each publisher to its own subscriber.
    Pairs,
    /// N publishers, one subscriber of all their topics.
    FanIn,
    /// One publisher, N subscribers of its topic.
    FanOut,
}

/// Options of `pubsub`.
#[derive(Args, Debug, Clone)]
pub struct PubSubArgs {
    /// Broker address (the publishers', and the subscribers' unless
    /// --subscriber-target is given).
    #[arg(long, default_value = "127.0.0.1:1883")]
    pub target: SocketAddr,
    /// Where the subscribers connect, if not to --target: another node of
    /// a cluster, to measure publishes crossing between nodes.
    #[arg(long)]
    pub subscriber_target: Option<SocketAddr>,
    /// Who publishes to whom.
    #[arg(long, value_enum, default_value_t = Pattern::Pairs)]
    pub pattern: Pattern,
    /// N: pairs, publishers (fan-in) or subscribers (fan-out).
    #[arg(short = 'n', long, default_value_t = 64)]
    pub clients: usize,
    /// QoS of publishes and subscriptions (0, 1 or 2).
    #[arg(long, default_value_t = 1)]
    pub qos: u8,
    /// Payload bytes (at least 20: the benchmark's header).
    #[arg(long, default_value_t = 64)]
    pub payload: usize,
    /// Messages a publisher keeps on their way, per subscriber of its topic.
    #[arg(long, default_value_t = 32)]
    pub window: usize,
    /// Measured seconds (after the warm-up).
    #[arg(short, long, default_value_t = 10.0)]
    pub duration: f64,
    /// Warm-up seconds (not measured).
    #[arg(long, default_value_t = 2.0)]
    pub warmup: f64,
    /// A publisher whose messages stop arriving for this long writes its
    /// window off (they count as lost unless they arrive later).
    #[arg(long, default_value_t = 2_000)]
    pub timeout_ms: u64,
    /// How long subscribers wait after the run for messages still on their way.
    #[arg(long, default_value_t = 3_000)]
    pub drain_ms: u64,
    /// Publish with RETAIN (each publish replaces its topic's retained
    /// message: with a data directory, it is saved before it is
    /// acknowledged). Run it against a fresh broker: retained messages of
    /// an earlier run would reach the new subscribers.
    #[arg(long)]
    pub retain: bool,
    /// Subscribers keep persistent sessions (Session Expiry Interval 300 s):
    /// with a data directory, every QoS 1/2 message for them is saved
    /// until they acknowledge it.
    #[arg(long)]
    pub persistent: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Who answers the requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Responder {
    /// The broker's in-process state store (statebroker only).
    Inprocess,
    /// A separate responder process: works with any MQTT 5 broker.
    External,
}

/// What the load run speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Protocol {
    /// MQTT 5 state store requests (statebroker, or any broker with
    /// `--responder external`).
    Mqtt,
    /// The same GETs and SETs as Redis commands, to a Redis server: both
    /// servers measured with this one client (see `resp.rs`).
    Resp,
}

/// Options of the load run (the default mode).
#[derive(Args, Debug, Clone)]
pub struct LoadArgs {
    /// Broker address.
    #[arg(long, default_value = "127.0.0.1:1883")]
    pub target: SocketAddr,
    /// Concurrent connections, each with one request in flight.
    #[arg(short, long, default_value_t = 16)]
    pub connections: usize,
    /// Measured seconds (after the warm-up).
    #[arg(short, long, default_value_t = 10.0)]
    pub duration: f64,
    /// Warm-up seconds (not measured).
    #[arg(long, default_value_t = 2.0)]
    pub warmup: f64,
    /// Number of distinct keys.
    #[arg(long, default_value_t = 10_000)]
    pub keys: u64,
    /// Key size in bytes (at least 8).
    #[arg(long, default_value_t = 16)]
    pub key_size: usize,
    /// Value size in bytes.
    #[arg(long, default_value_t = 32)]
    pub value_size: usize,
    /// A request without a response after this long is lost.
    #[arg(long, default_value_t = 5_000)]
    pub timeout_ms: u64,
    /// The protocol: MQTT state store requests, or the same commands to a
    /// Redis server (`--target` its address).
    #[arg(long, value_enum, default_value_t = Protocol::Mqtt)]
    pub protocol: Protocol,
    /// Who answers: the broker's in-process store, or an external responder process.
    #[arg(long, value_enum, default_value_t = Responder::Inprocess)]
    pub responder: Responder,
    /// Fraction of requests that are SETs (the rest are GETs).
    #[arg(long, default_value_t = 0.5)]
    pub set_ratio: f64,
    /// Send SETs with `aio-persistence: true` (the key is kept on disk).
    #[arg(long)]
    pub persist: bool,
    /// First connect N more clients that each only hold a wildcard
    /// subscription (`bench/wild/<i>/+`), as a broker's other clients would:
    /// what they cost the requests' answers.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub wildcard_subscribers: usize,
    /// Request topic for `--responder external`.
    #[arg(long, default_value = responder::EXTERNAL_TOPIC)]
    pub external_topic: String,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Options of the responder.
#[derive(Args, Debug, Clone)]
pub struct ResponderArgs {
    /// Broker address.
    #[arg(long, default_value = "127.0.0.1:1883")]
    pub target: SocketAddr,
    /// Request topic to serve.
    #[arg(long, default_value = responder::EXTERNAL_TOPIC)]
    pub topic: String,
}

/// Options of `fill`.
#[derive(Args, Debug, Clone)]
pub struct FillArgs {
    /// Broker address.
    #[arg(long, default_value = "127.0.0.1:1883")]
    pub target: SocketAddr,
    /// Keys to write.
    #[arg(long, default_value_t = 1_000_000)]
    pub keys: u64,
    /// Connections to write with.
    #[arg(short, long, default_value_t = 32)]
    pub connections: usize,
    /// Requests in flight per connection.
    #[arg(long, default_value_t = 16)]
    pub pipeline: usize,
    /// Send SETs with `aio-persistence: true`.
    #[arg(long)]
    pub persist: bool,
}

/// Options of `idle`.
#[derive(Args, Debug, Clone)]
pub struct IdleArgs {
    /// Broker address.
    #[arg(long, default_value = "127.0.0.1:1883")]
    pub target: SocketAddr,
    /// Connections to open.
    #[arg(short, long, default_value_t = 10_000)]
    pub connections: usize,
    /// Seconds to hold them after all are connected.
    #[arg(long, default_value_t = 10)]
    pub hold: u64,
    /// Handshakes under way at once (`--parallel 10000 -c 10000`: all
    /// clients connect at the same moment).
    #[arg(long, default_value_t = 128)]
    pub parallel: usize,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = runtime.block_on(async move {
        match cli.mode {
            Some(Mode::Responder(args)) => responder::run(args).await,
            Some(Mode::Fill(args)) => load::fill(args).await,
            Some(Mode::Idle(args)) => idle::run(args).await,
            Some(Mode::PubSub(args)) => pubsub::run(args).await,
            None => load::run(cli.load).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("statebroker-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Prints a run's report: one JSON object with `--json`, else `text()`;
/// connection failures go to stderr either way.
pub(crate) fn emit<S: AsRef<str>>(
    report: &impl serde::Serialize,
    json: bool,
    failures: impl IntoIterator<Item = S>,
    text: impl FnOnce() -> String,
) -> Result<(), String> {
    for f in failures {
        eprintln!("connection failure: {}", f.as_ref());
    }
    if json {
        println!(
            "{}",
            serde_json::to_string(report).map_err(|e| e.to_string())?
        );
    } else {
        println!("{}", text());
    }
    Ok(())
}
