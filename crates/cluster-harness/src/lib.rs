//! Starts and hurts real processes for statebroker's cluster tests: an
//! etcd cluster ([`EtcdCluster`]), broker nodes or any other binary
//! ([`Node`]), and a schedule of faults against both ([`Nemesis`]).
//!
//! Everything is synchronous (`std::process`, `std::thread`); from a tokio
//! test call it from `spawn_blocking` or just accept blocking the test's
//! thread for the few seconds a start takes. Linux only (signals,
//! `/proc`).
//!
//! Processes are killed when their owner is dropped, including while a
//! test panics; not when the test process itself is SIGKILLed (no
//! `PR_SET_PDEATHSIG`: it fires when the *thread* that spawned the child
//! exits, and a nemesis thread restarts processes).
//!
//! # What it starts
//!
//! - [`EtcdCluster::start`]`(n)` runs `n` `etcd` processes (3.4, found on
//!   `PATH`; the tests fail, not skip, when it is missing) with the flags of
//!   CLUSTER.md §6: `--heartbeat-interval=100 --election-timeout=2500
//!   --pre-vote=true`, revision auto-compaction, an 8 GiB quota, 2 MiB
//!   requests, a zap log per member, and an `--initial-cluster-token`
//!   unique to the cluster. It returns once every member sees the same
//!   leader and answers a linearizable read (up to 30 s; the error has
//!   the members' log tails). A 3-member cluster took 0.5–4 s here (2
//!   busy cores); after a leader is killed or paused, the other two took
//!   a write after 2.8–4.3 s (the 2.5 s election timeout, randomized).
//!   An exit that is not the harness's doing fails the wait at once.
//! - [`Node::start`] runs any binary (e.g. `env!("CARGO_BIN_EXE_statebroker")`
//!   from the caller's integration test) with its args and env; `{dir}` in
//!   them becomes the node's temp dir.
//!
//! Both can be killed (SIGKILL, then waited for), paused (SIGSTOP),
//! resumed (SIGCONT) and restarted with the same command line. An etcd
//! member restarts with the same data dir and flags: etcd 3.4.23 ignores
//! `--initial-cluster*` (including `--initial-cluster-state new`) when the
//! data dir already holds a member, logging `"member-initialized":true`
//! and `"restarting local member"`, and rejoins.
//!
//! # Ports and files
//!
//! Everything listens on 127.0.0.1 only, on ports from [`free_port`] (the
//! kernel's choice for port 0, never the same twice in one process), so
//! tests run in parallel with each other and with other test binaries. An
//! etcd member has a client port and a peer port; a start that loses a
//! port to another process is retried with new ones.
//!
//! Each [`EtcdCluster`] has one temp dir (`$TMPDIR/statebroker-etcd-*`,
//! with `m1/` … data dirs and `m1.log` … logs); each [`Node`] one
//! (`$TMPDIR/statebroker-<name>-*`, with `node.log`, its stdout and
//! stderr). Logs are appended to across restarts, after a marker line.
//! Dropping either kills the processes it started, only those, and removes
//! its dir; set [`KEEP_ENV`] (`STATEBROKER_HARNESS_KEEP=1`) to keep the
//! dirs (their paths are printed). When dropped during a panic they print
//! their log tails, which the test's output then shows.
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//! use statebroker_cluster_harness::{Cluster, EtcdCluster, Fault, Nemesis, NodeSpec, free_port};
//!
//! # fn main() -> std::io::Result<()> {
//! let etcd = EtcdCluster::start(3)?;
//! let mut nodes = Vec::new();
//! for i in 1..=3 {
//!     let port = free_port();
//!     let mut node = NodeSpec::new("/path/to/statebroker") // env!("CARGO_BIN_EXE_statebroker")
//!         .name(format!("n{i}"))
//!         .arg(format!("--port={port}"))
//!         .arg(format!("--etcd={}", etcd.endpoints().join(",")))
//!         .arg("--data-dir={dir}/data")
//!         .env("RUST_LOG", "info")
//!         .start()?;
//!     node.wait_tcp(port, Duration::from_secs(10))?;
//!     nodes.push(node);
//! }
//! let cluster = Cluster::new(Some(etcd), nodes).shared();
//! let s = Duration::from_secs;
//! let nemesis = Nemesis::new([
//!     (s(20), Fault::KillNode(1)),
//!     (s(30), Fault::RestartNode(1)),
//!     (s(45), Fault::KillEtcdLeader),
//!     (s(55), Fault::RestartEtcdDown),
//! ])
//! .start(cluster.clone());
//! // ... the workload; `Cluster::lock(&cluster).nodes[0].pid()` etc. ...
//! for event in nemesis.join() {
//!     println!("{event}"); // "  45.012 s  KillEtcdLeader: killed etcd m2 (leader, pid 4242)"
//! }
//! let leader = Cluster::lock(&cluster)
//!     .etcd
//!     .as_mut()
//!     .unwrap()
//!     .wait_healthy(Duration::from_secs(30))?;
//! println!("etcd leader after healing: m{}", leader + 1);
//! # Ok(())
//! # }
//! ```

mod etcd;
mod nemesis;
mod node;
mod process;

pub use etcd::{EtcdCluster, EtcdOptions, MemberStatus};
pub use nemesis::{Cluster, Event, Fault, LEADER_WAIT, Nemesis, NemesisHandle, SharedCluster};
pub use node::{DIR_PLACEHOLDER, Node, NodeSpec};
pub use process::{KEEP_ENV, ProcState, free_port, keep_files, tail_file, wait_tcp};
