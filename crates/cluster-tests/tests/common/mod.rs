//! Three etcd members and N statebroker nodes on loopback, each test its
//! own, and a state store client for each node.

#![allow(dead_code)]

pub mod traffic;
pub mod workload;

/// The broker's raw MQTT 5 client (packets as they are: reason codes,
/// DISCONNECT from the server).
#[path = "../../../../tests/common/raw.rs"]
pub mod raw;

/// Publishes completed packet by packet over [`raw`] (QoS 2 included).
#[path = "../../../../tests/common/mqtt.rs"]
pub mod mqtt;

/// The fault schedule of the long runs (docs/cluster.md: a node killed
/// and restarted, the etcd leader killed and restarted, the etcd leader
/// paused 10 s, a node paused 8 s, a node stopped with SIGTERM and
/// started again first, etcd without a quorum for 12 s last), and the
/// run's length.
pub fn long_fault_schedule() -> (
    Vec<(Duration, statebroker_cluster_harness::Fault)>,
    Duration,
) {
    use statebroker_cluster_harness::Fault;
    let s = Duration::from_secs;
    (
        vec![
            (s(8), Fault::StopNode(2)),
            (s(12), Fault::RestartNode(2)),
            (s(20), Fault::KillNode(1)),
            (s(30), Fault::RestartNode(1)),
            (s(45), Fault::KillEtcdLeader),
            (s(55), Fault::RestartEtcdDown),
            (s(70), Fault::PauseEtcdLeader),
            (s(80), Fault::ResumeEtcdPaused),
            (s(90), Fault::PauseNode(2)),
            (s(98), Fault::ResumeNode(2)),
            // Two members of three paused: no quorum for 12 s.
            (s(125), Fault::PauseEtcd(1)),
            (s(125), Fault::PauseEtcd(2)),
            (s(137), Fault::ResumeEtcdPaused),
        ],
        s(155),
    )
}

/// `STATEBROKER_FAULT_RUN=long`: the fault tests run
/// [`long_fault_schedule`] (`bench/cluster-faults.sh`).
pub fn long_fault_run() -> bool {
    std::env::var("STATEBROKER_FAULT_RUN").as_deref() == Ok("long")
}

/// How long the raw client waits for a packet.
pub const TIMEOUT: Duration = PATIENCE;

use std::time::Duration;

use statebroker_cli::client::{Answer, Client, Target};
pub use statebroker_cluster_harness::free_port;
use statebroker_cluster_harness::{EtcdCluster, Node, NodeSpec};
use statestore::resp3::Reply;

/// The broker binary, built with clustering.
pub const BROKER: &str = env!("CARGO_BIN_EXE_statebroker-node");

/// How long a start or an answer may take on a loaded CI machine.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// A node's MQTT address on loopback.
pub fn addr(port: u16) -> std::net::SocketAddr {
    ([127, 0, 0, 1], port).into()
}

/// etcd and the nodes.
pub struct Setup {
    pub etcd: EtcdCluster,
    pub nodes: Vec<Node>,
    pub ports: Vec<u16>,
    pub http: Vec<u16>,
}

impl Setup {
    /// `members` etcd members and `nodes` broker nodes, all ready.
    pub fn start(members: usize, nodes: usize) -> Setup {
        Setup::start_with(members, nodes, &[])
    }

    /// The same, with `env` for every node.
    pub fn start_with(members: usize, nodes: usize, env: &[(&str, &str)]) -> Setup {
        // STATEBROKER_ETCD_ELECTION_MS: etcd's election timeout (the
        // harness's 2,500 ms keeps a loaded CI machine from spurious
        // elections; a leader kill stalls requests about that long).
        let mut options = statebroker_cluster_harness::EtcdOptions::default();
        if let Ok(ms) = std::env::var("STATEBROKER_ETCD_ELECTION_MS") {
            options.extra_args.push(format!("--election-timeout={ms}"));
        }
        Setup::start_with_etcd(members, options, nodes, env)
    }

    /// The same, etcd started with `options`.
    pub fn start_with_etcd(
        members: usize,
        options: statebroker_cluster_harness::EtcdOptions,
        nodes: usize,
        env: &[(&str, &str)],
    ) -> Setup {
        let etcd = EtcdCluster::start_with(members, options).expect("etcd starts");
        let mut setup = Setup {
            etcd,
            nodes: Vec::new(),
            ports: Vec::new(),
            http: Vec::new(),
        };
        for _ in 0..nodes {
            setup.add_node(env);
        }
        setup
    }

    /// Three nodes on one etcd member, each linked to the two others.
    pub async fn three_linked() -> Setup {
        let setup = Setup::start(1, 3);
        setup.all_linked().await;
        setup
    }

    /// Waits until every node is linked to every other.
    pub async fn all_linked(&self) {
        let others = (self.nodes.len() - 1) as f64;
        for &http in &self.http {
            eventually("every node linked to the others", || {
                metric(http, "statebroker_cluster_peer_links") == Some(others)
            })
            .await;
        }
    }

    /// Starts node `i` again (killed before, or it is killed now) and
    /// waits until every node is linked to every other again.
    pub async fn restart_node(&mut self, i: usize) {
        self.nodes[i].restart().unwrap();
        self.nodes[i].wait_tcp(self.ports[i], PATIENCE).unwrap();
        self.all_linked().await;
    }

    /// One more node (`sb<n>`), with `env`, ready.
    pub fn add_node(&mut self, env: &[(&str, &str)]) {
        let members: Vec<usize> = (0..self.etcd.len()).collect();
        self.add_node_on(env, &members);
    }

    /// [`Setup::add_node`] that speaks to etcd `members` only.
    pub fn add_node_on(&mut self, env: &[(&str, &str)], members: &[usize]) {
        self.add_node_with(env, members, &[]);
    }

    /// [`Setup::add_node_on`] with more arguments (`--data-dir=DIR` gives
    /// the node a data directory; without one it runs `--in-memory`;
    /// `--cluster-node-id=ID` another id than `sb<n>`).
    pub fn add_node_with(&mut self, env: &[(&str, &str)], members: &[usize], args: &[String]) {
        let endpoints: Vec<String> = members.iter().map(|&i| self.etcd.endpoint(i)).collect();
        let endpoints = endpoints.join(",");
        let n = self.nodes.len() + 1;
        let (port, http) = (free_port(), free_port());
        let storage = if args.iter().any(|a| a.starts_with("--data-dir")) {
            None
        } else {
            Some("--in-memory")
        };
        let mut spec = NodeSpec::new(BROKER)
            .name(format!("sb{n}"))
            .arg(format!("--listen=127.0.0.1:{port}"))
            .arg(format!("--http=127.0.0.1:{http}"))
            .args(storage)
            .args(
                (!args.iter().any(|a| a.starts_with("--cluster-node-id")))
                    .then(|| format!("--cluster-node-id=sb{n}")),
            )
            .arg(format!("--etcd-endpoints={endpoints}"))
            .env("RUST_LOG", "info,broker::cluster=debug,broker::cluster::queue=trace,broker::cluster::recent=trace")
            .args(args);
        for (k, v) in env {
            spec = spec.env(k, v);
        }
        let mut node = spec.start().expect("the node starts");
        node.wait_tcp(port, PATIENCE).expect("the node listens");
        // A node takes clients once the others have linked to it.
        let start = std::time::Instant::now();
        while http_status(http, "/readyz") != Some(200) {
            assert!(
                start.elapsed() < PATIENCE,
                "node sb{n} never became ready: {}",
                node.log_tail(30)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        self.nodes.push(node);
        self.ports.push(port);
        self.http.push(http);
    }
}

/// Node `port` on loopback, for client `client_id`.
fn target(port: u16, client_id: &str) -> Target {
    Target {
        host: "127.0.0.1".into(),
        port,
        client_id: client_id.into(),
        login: None,
        timeout: PATIENCE,
        tls: None,
    }
}

/// A client of node `port`.
pub async fn client(port: u16, client_id: &str) -> Client {
    Client::connect(&target(port, client_id))
        .await
        .expect("connects")
}

/// A client of node `port` once the node takes clients again: a node
/// that lost its membership lease (etcd without a quorum) refuses CONNECT
/// (0x9C) until it has registered again.
pub async fn client_when_serving(port: u16, client_id: &str) -> Client {
    let target = target(port, client_id);
    let start = std::time::Instant::now();
    loop {
        match Client::connect(&target).await {
            Ok(client) => return client,
            Err(e) if start.elapsed() < PATIENCE => {
                eprintln!("{client_id}: not connected yet ({e}); trying again");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("{client_id} never connected: {e}"),
        }
    }
}

/// Sends a request; panics without an answer.
pub async fn ask(client: &mut Client, args: &[&str]) -> Answer {
    ask_with(client, args, &[]).await
}

/// Sends a request with extra user properties (`__ft`).
pub async fn ask_with(client: &mut Client, args: &[&str], extra: &[(&str, String)]) -> Answer {
    let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
    client
        .request(&args, extra)
        .await
        .unwrap_or_else(|e| panic!("no answer to {args:?}: {e}"))
}

/// The answer as text: `+OK`, `:1`, `$value`, `$-1`, `-ERR text`, or the
/// keys of a SCAN page (`*k1,k2|token`).
pub fn text(answer: &Answer) -> String {
    reply_text(&answer.reply)
}

fn reply_text(reply: &Reply) -> String {
    match reply {
        Reply::Simple(s) => format!("+{s}"),
        Reply::Error(e) => format!("-{e}"),
        Reply::Integer(n) => format!(":{n}"),
        Reply::Bulk(b) => format!("${}", String::from_utf8_lossy(b)),
        Reply::Null => "$-1".into(),
        Reply::Array(parts) => {
            let parts: Vec<String> = parts.iter().map(reply_text).collect();
            format!("*{}", parts.join("|"))
        }
    }
}

/// `(wall, counter)` of a version `WWW:CCCCC:node`.
pub fn time_of(version: &str) -> (u64, u64) {
    let mut parts = version.splitn(3, ':');
    let wall = parts.next().and_then(|w| w.parse().ok()).expect("wall");
    let counter = parts.next().and_then(|c| c.parse().ok()).expect("counter");
    (wall, counter)
}

/// The value of `series` at `/metrics` on `port` (`None`: absent or no
/// answer).
pub fn metric(port: u16, series: &str) -> Option<f64> {
    let body = http_get(port, "/metrics")?;
    body.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// The whole response to `GET path` on `port`.
pub fn http_get(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream =
        std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), PATIENCE).ok()?;
    stream.set_read_timeout(Some(PATIENCE)).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    Some(response)
}

/// The HTTP status of `GET path` on `port`.
pub fn http_status(port: u16, path: &str) -> Option<u16> {
    http_get(port, path)?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// How many lines of `node`'s log contain `text`.
pub fn lines_with(node: &statebroker_cluster_harness::Node, text: &str) -> usize {
    std::fs::read_to_string(node.log_path())
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(text))
        .count()
}

/// Polls `cond` until it holds; panics after [`PATIENCE`] naming `what`.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !cond() {
        assert!(start.elapsed() < PATIENCE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
