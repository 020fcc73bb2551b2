//! A real etcd cluster on loopback: one `etcd` process per member.

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use serde_json::Value;

use crate::process::{self, Proc, ProcState, free_port, tail_file};

const ETCD_HINT: &str = "the cluster tests need etcd 3.4 (Debian/Ubuntu: \
    `apt-get install etcd-server etcd-client`; CI installs it)";

/// How [`EtcdCluster::start_with`] starts a cluster.
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    /// How long to wait for a leader and a linearizable read on every member.
    pub ready_timeout: Duration,
    /// Whole-cluster starts tried when a port was taken by someone else
    /// between [`free_port`] and etcd binding it.
    pub attempts: usize,
    /// Extra flags for every member (after the harness's own, so they win
    /// where etcd lets a later flag override an earlier one).
    pub extra_args: Vec<String>,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            ready_timeout: Duration::from_secs(30),
            attempts: 5,
            extra_args: Vec::new(),
        }
    }
}

/// One member's answer to `etcdctl endpoint status`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberStatus {
    /// Index of the member in the cluster (0-based; its name is `m{member+1}`).
    pub member: usize,
    /// Its raft member id.
    pub id: u64,
    /// The cluster's id (differs between clusters).
    pub cluster_id: u64,
    /// The leader's member id as this member sees it (0: no leader).
    pub leader_id: u64,
    pub raft_term: u64,
    pub raft_index: u64,
    pub raft_applied_index: u64,
}

impl MemberStatus {
    /// Whether this member believes it is the leader.
    pub fn is_leader(&self) -> bool {
        self.id != 0 && self.id == self.leader_id
    }
}

struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    data_dir: PathBuf,
    log: PathBuf,
    proc: Proc,
}

/// A running etcd cluster of real `etcd` processes on 127.0.0.1, each with
/// its own data dir and log file under one temp dir. Dropping it kills the
/// members it started (and only those) and removes the temp dir.
///
/// Members are addressed by index `0..len()`; member `i` is named
/// `m{i+1}` (as in CLUSTER.md) in etcd, in its log file and in messages.
pub struct EtcdCluster {
    members: Vec<Member>,
    token: String,
    initial_cluster: String,
    etcd: PathBuf,
    etcdctl: PathBuf,
    extra_args: Vec<String>,
    // Last, so the members are killed before the dir is removed.
    dir: Option<tempfile::TempDir>,
}

impl std::fmt::Debug for EtcdCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdCluster")
            .field("dir", &self.dir())
            .field("token", &self.token)
            .field("endpoints", &self.endpoints())
            .field(
                "pids",
                &(0..self.len()).map(|i| self.pid(i)).collect::<Vec<_>>(),
            )
            .finish()
    }
}

enum StartError {
    /// A member could not bind its port: try again with other ports.
    PortClash(io::Error),
    Other(io::Error),
}

impl EtcdCluster {
    /// Starts a cluster of `members` etcd processes with the flags of
    /// CLUSTER.md §6 and waits (up to 30 s) until every member sees the
    /// same leader and answers a linearizable read.
    ///
    /// Fails with [`io::ErrorKind::NotFound`] if `etcd` or `etcdctl` is not
    /// on `PATH`, and with the failing member's log tail if the cluster does
    /// not come up.
    pub fn start(members: usize) -> io::Result<EtcdCluster> {
        Self::start_with(members, EtcdOptions::default())
    }

    /// [`EtcdCluster::start`] with options.
    pub fn start_with(members: usize, options: EtcdOptions) -> io::Result<EtcdCluster> {
        if members == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "an etcd cluster needs at least one member",
            ));
        }
        let etcd = process::find_on_path("etcd", ETCD_HINT)?;
        let etcdctl = process::find_on_path("etcdctl", ETCD_HINT)?;
        let mut last = None;
        for _ in 0..options.attempts.max(1) {
            let ports: Vec<(u16, u16)> = (0..members).map(|_| (free_port(), free_port())).collect();
            match Self::try_start(&ports, &options, &etcd, &etcdctl) {
                Ok(cluster) => return Ok(cluster),
                Err(StartError::PortClash(e)) => last = Some(e),
                Err(StartError::Other(e)) => return Err(e),
            }
        }
        Err(last.expect("at least one attempt"))
    }

    /// One start on the given (client, peer) ports, one pair per member.
    fn try_start(
        ports: &[(u16, u16)],
        options: &EtcdOptions,
        etcd: &Path,
        etcdctl: &Path,
    ) -> Result<EtcdCluster, StartError> {
        static CLUSTERS: AtomicU64 = AtomicU64::new(0);
        let dir = tempfile::Builder::new()
            .prefix("statebroker-etcd-")
            .tempdir()
            .map_err(StartError::Other)?;
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let token = format!(
            "sbh-{}-{}-{nanos:x}",
            std::process::id(),
            CLUSTERS.fetch_add(1, Ordering::Relaxed)
        );
        let members: Vec<Member> = (ports.iter().enumerate())
            .map(|(i, &(client_port, peer_port))| {
                let name = format!("m{}", i + 1);
                Member {
                    client_port,
                    peer_port,
                    data_dir: dir.path().join(&name),
                    log: dir.path().join(format!("{name}.log")),
                    proc: Proc::default(),
                    name,
                }
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = EtcdCluster {
            members,
            token,
            initial_cluster,
            etcd: etcd.to_owned(),
            etcdctl: etcdctl.to_owned(),
            extra_args: options.extra_args.clone(),
            dir: Some(dir),
        };
        for i in 0..cluster.len() {
            cluster.spawn(i).map_err(StartError::Other)?;
        }
        match cluster.wait_healthy_inner(options.ready_timeout) {
            Ok(_) => Ok(cluster),
            Err(e) => Err(e),
        }
    }

    /// The command line of member `i`. The same for the first start and
    /// every restart: etcd 3.4.23 ignores `--initial-cluster*` when the data
    /// dir already holds a member (it logs `"member-initialized":true` and
    /// `"restarting local member"`), so `--initial-cluster-state new` is
    /// fine on a restart (checked by hand and by the tests).
    fn command(&self, i: usize) -> Command {
        let m = &self.members[i];
        let client = format!("http://127.0.0.1:{}", m.client_port);
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        let mut cmd = Command::new(&self.etcd);
        // etcd refuses a flag that an ETCD_* variable also sets; keep the
        // caller's environment out of it.
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("ETCD_") {
                cmd.env_remove(key);
            }
        }
        cmd.arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&m.data_dir)
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &self.initial_cluster])
            .args(["--initial-cluster-token", &self.token])
            .args(["--initial-cluster-state", "new"])
            .args([
                "--pre-vote=true",
                "--heartbeat-interval=100",
                "--election-timeout=2500",
                "--auto-compaction-mode=revision",
                "--auto-compaction-retention=1000000",
                "--quota-backend-bytes=8589934592",
                "--max-request-bytes=2097152",
                "--logger=zap",
            ])
            .arg({
                let mut flag = OsString::from("--log-outputs=");
                flag.push(&m.log);
                flag
            })
            .args(&self.extra_args);
        cmd
    }

    fn spawn(&mut self, i: usize) -> io::Result<()> {
        let cmd = self.command(i);
        let m = &mut self.members[i];
        m.proc.spawn(cmd, &m.log)
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Always false: a cluster has at least one member.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The temp dir holding the members' data dirs (`m1/`, …) and logs
    /// (`m1.log`, …).
    pub fn dir(&self) -> &Path {
        self.dir
            .as_ref()
            .expect("the dir lives as long as the cluster")
            .path()
    }

    /// The member's name in etcd: `m{i+1}`.
    pub fn name(&self, i: usize) -> &str {
        &self.members[i].name
    }

    /// Client URLs of all members, `http://127.0.0.1:PORT`, killed or not.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.len()).map(|i| self.endpoint(i)).collect()
    }

    /// Client URL of member `i`.
    pub fn endpoint(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.members[i].client_port)
    }

    /// Client port of member `i`.
    pub fn client_port(&self, i: usize) -> u16 {
        self.members[i].client_port
    }

    /// Peer (raft) port of member `i`.
    pub fn peer_port(&self, i: usize) -> u16 {
        self.members[i].peer_port
    }

    /// The pid of member `i`'s current process (None once killed).
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members[i].proc.pid()
    }

    /// Running, paused or down (killed, or exited by itself).
    pub fn state(&mut self, i: usize) -> ProcState {
        self.members[i].proc.state()
    }

    /// The path of member `i`'s log (etcd's zap log plus its stdout and
    /// stderr, appended across restarts).
    pub fn log_path(&self, i: usize) -> &Path {
        &self.members[i].log
    }

    /// When a member became etcd's leader, every time in every member's
    /// log, in order (read from the logs' `ts`, the wall clock's time to
    /// the millisecond): to tell how long an election took after a fault.
    pub fn elections(&self) -> Vec<SystemTime> {
        let mut at: Vec<SystemTime> = self
            .members
            .iter()
            .filter_map(|m| std::fs::read_to_string(&m.log).ok())
            .flat_map(|log| {
                log.lines()
                    .filter(|l| l.contains("became leader at term"))
                    .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                    .filter_map(|v| v.get("ts")?.as_str().and_then(parse_ts))
                    .collect::<Vec<_>>()
            })
            .collect();
        at.sort();
        at
    }

    /// The last 40 lines of member `i`'s log.
    pub fn log_tail(&self, i: usize) -> String {
        tail_file(&self.members[i].log, 40)
    }

    /// SIGKILL member `i` and wait for it to die. A no-op if it is down.
    pub fn kill(&mut self, i: usize) -> io::Result<()> {
        self.members[i].proc.kill().map(drop)
    }

    /// Starts member `i` again with the same data dir and flags (killing it
    /// first if it runs). Does not wait: see [`EtcdCluster::wait_healthy`].
    pub fn restart(&mut self, i: usize) -> io::Result<()> {
        self.spawn(i)
    }

    /// SIGSTOP member `i`.
    pub fn pause(&mut self, i: usize) -> io::Result<()> {
        let what = format!("etcd {}", self.members[i].name);
        self.members[i].proc.pause(&what)
    }

    /// SIGCONT member `i`.
    pub fn resume(&mut self, i: usize) -> io::Result<()> {
        let what = format!("etcd {}", self.members[i].name);
        self.members[i].proc.resume(&what)
    }

    /// Members that run (not paused, not down).
    fn running(&mut self) -> Vec<usize> {
        (0..self.len())
            .filter(|&i| self.members[i].proc.state() == ProcState::Running)
            .collect()
    }

    /// `etcdctl` (API v3) with `--endpoints` set to every member's client
    /// URL; add the subcommand. The caller's `ETCDCTL_*` variables are
    /// removed (etcdctl refuses one that shadows a flag).
    pub fn etcdctl(&self) -> Command {
        self.etcdctl_on(&(0..self.len()).collect::<Vec<_>>())
    }

    /// [`EtcdCluster::etcdctl`] talking only to the given members.
    pub fn etcdctl_on(&self, members: &[usize]) -> Command {
        let mut cmd = Command::new(&self.etcdctl);
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("ETCDCTL_") {
                cmd.env_remove(key);
            }
        }
        let endpoints: Vec<String> = members.iter().map(|&i| self.endpoint(i)).collect();
        cmd.env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", endpoints.join(",")))
            .args(["--dial-timeout=2s", "--command-timeout=5s"]);
        cmd
    }

    /// Puts `key` = `value` through `etcdctl put` on all endpoints.
    pub fn put(&self, key: &str, value: &str) -> io::Result<()> {
        let mut cmd = self.etcdctl();
        // `--` so that a value starting with '-' is not a flag.
        cmd.args(["put", "--", key, value]);
        run(cmd).map(drop)
    }

    /// Reads `key` through `etcdctl get` (linearizable) on all endpoints.
    pub fn get(&self, key: &str) -> io::Result<Option<Vec<u8>>> {
        let mut cmd = self.etcdctl();
        cmd.args(["get", "-w", "json", "--", key]);
        let out = run(cmd)?;
        let json: Value = serde_json::from_slice(&out.stdout).map_err(io::Error::other)?;
        match json["kvs"].as_array().and_then(|kvs| kvs.first()) {
            None => Ok(None),
            Some(kv) => {
                let value = kv["value"].as_str().unwrap_or("");
                base64_decode(value).map(Some)
            }
        }
    }

    /// How many keys start with `prefix` (`etcdctl get --prefix
    /// --keys-only`, linearizable; etcdctl 3.4 has no `--count-only`).
    pub fn count_prefix(&self, prefix: &str) -> io::Result<u64> {
        let mut cmd = self.etcdctl();
        cmd.args(["get", "--prefix", "--keys-only", "-w", "json", "--", prefix]);
        let out = run(cmd)?;
        let json: Value = serde_json::from_slice(&out.stdout).map_err(io::Error::other)?;
        Ok(json["count"].as_u64().unwrap_or(0))
    }

    /// `etcdctl endpoint status` of the running members (paused and killed
    /// ones are not asked); members that do not answer within about 1 s
    /// are missing from the result.
    pub fn status(&mut self) -> Vec<MemberStatus> {
        let running = self.running();
        if running.is_empty() {
            return Vec::new();
        }
        let mut cmd = self.etcdctl_on(&running);
        cmd.args([
            "--dial-timeout=1s",
            "--command-timeout=1s",
            "endpoint",
            "status",
            "-w",
            "json",
        ]);
        // It exits non-zero when some endpoint failed, yet prints the others.
        let Ok(out) = cmd.output() else {
            return Vec::new();
        };
        let Ok(Value::Array(entries)) = serde_json::from_slice::<Value>(&out.stdout) else {
            return Vec::new();
        };
        entries
            .iter()
            .filter_map(|entry| {
                let endpoint = entry["Endpoint"].as_str()?;
                let member = (0..self.len()).find(|&i| {
                    let url = self.endpoint(i);
                    endpoint == url || Some(endpoint) == url.strip_prefix("http://")
                })?;
                let status = &entry["Status"];
                Some(MemberStatus {
                    member,
                    id: status["header"]["member_id"].as_u64()?,
                    cluster_id: status["header"]["cluster_id"].as_u64().unwrap_or(0),
                    leader_id: status["leader"].as_u64().unwrap_or(0),
                    raft_term: status["raftTerm"].as_u64().unwrap_or(0),
                    raft_index: status["raftIndex"].as_u64().unwrap_or(0),
                    raft_applied_index: status["raftAppliedIndex"].as_u64().unwrap_or(0),
                })
            })
            .collect()
    }

    /// The running member that says it is the leader (the one in the
    /// highest term if, briefly, two do). None if there is none right now.
    pub fn leader(&mut self) -> Option<usize> {
        self.status()
            .into_iter()
            .filter(MemberStatus::is_leader)
            .max_by_key(|s| s.raft_term)
            .map(|s| s.member)
    }

    /// Polls [`EtcdCluster::leader`] until there is one.
    pub fn wait_leader(&mut self, timeout: Duration) -> io::Result<usize> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(leader) = self.leader() {
                return Ok(leader);
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no etcd member says it leads after {timeout:?}"),
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until every running member (not paused, not killed) answers
    /// status, they all see the same leader, which is one of them, and
    /// each answers a linearizable read (`etcdctl endpoint health`).
    /// Returns the leader's index. Fails at once, with its log tail, if a
    /// member the harness did not kill has exited; on timeout, with what
    /// was last seen and the log tails of the members.
    pub fn wait_healthy(&mut self, timeout: Duration) -> io::Result<usize> {
        self.wait_healthy_inner(timeout).map_err(|e| match e {
            StartError::PortClash(e) | StartError::Other(e) => e,
        })
    }

    fn wait_healthy_inner(&mut self, timeout: Duration) -> Result<usize, StartError> {
        let deadline = Instant::now() + timeout;
        loop {
            for i in 0..self.len() {
                if let Some(status) = self.members[i].proc.exit_status() {
                    let tail = self.log_tail(i);
                    let message = format!(
                        "etcd member {} exited by itself ({status}); log {}:\n{tail}",
                        self.members[i].name,
                        self.members[i].log.display()
                    );
                    return Err(if tail.contains("address already in use") {
                        StartError::PortClash(io::Error::new(io::ErrorKind::AddrInUse, message))
                    } else {
                        StartError::Other(io::Error::other(message))
                    });
                }
            }
            let last = match self.check_healthy() {
                Ok(leader) => return Ok(leader),
                Err(why) => why,
            };
            if Instant::now() >= deadline {
                let tails: String = (0..self.len())
                    .map(|i| {
                        let state = self.members[i].proc.state();
                        let m = &self.members[i];
                        format!(
                            "\n--- {} ({state:?}), log {}:\n{}",
                            m.name,
                            m.log.display(),
                            tail_file(&m.log, 15)
                        )
                    })
                    .collect();
                return Err(StartError::Other(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("etcd cluster not healthy after {timeout:?}: {last}{tails}"),
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// One health poll: Ok(leader) or why not.
    fn check_healthy(&mut self) -> Result<usize, String> {
        let running = self.running();
        if running.is_empty() {
            return Err("no member is running".into());
        }
        let statuses = self.status();
        for &i in &running {
            if !statuses.iter().any(|s| s.member == i) {
                return Err(format!(
                    "{} does not answer endpoint status",
                    self.members[i].name
                ));
            }
        }
        let leader_id = statuses[0].leader_id;
        if leader_id == 0 || statuses.iter().any(|s| s.leader_id != leader_id) {
            let seen: Vec<String> = statuses
                .iter()
                .map(|s| format!("{} sees {:x}", self.members[s.member].name, s.leader_id))
                .collect();
            return Err(format!("no agreed leader ({})", seen.join(", ")));
        }
        let Some(leader) = statuses
            .iter()
            .find(|s| s.id == leader_id)
            .map(|s| s.member)
        else {
            return Err(format!("the leader {leader_id:x} is not a running member"));
        };
        // `endpoint health` reads a key (linearizably) on every endpoint at once.
        let mut cmd = self.etcdctl_on(&running);
        cmd.args([
            "--dial-timeout=1s",
            "--command-timeout=2s",
            "endpoint",
            "health",
            "-w",
            "json",
        ]);
        let out = cmd.output().map_err(|e| format!("etcdctl: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "endpoint health: {}",
                String::from_utf8_lossy(&out.stdout).trim()
            ));
        }
        Ok(leader)
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        let panicking = std::thread::panicking();
        for m in &mut self.members {
            let _ = m.proc.kill();
            if panicking {
                eprintln!(
                    "--- etcd {} log ({}), last lines:\n{}",
                    m.name,
                    m.log.display(),
                    tail_file(&m.log, 10)
                );
            }
        }
        if let Some(dir) = self.dir.take() {
            process::finish_dir(dir, "etcd");
        }
    }
}

/// Runs `cmd`; its output if it succeeded, else an error with its stderr.
fn run(mut cmd: Command) -> io::Result<Output> {
    let out = cmd.output()?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(io::Error::other(format!(
            "{:?} failed ({}): {}",
            cmd,
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// Decodes a value from etcdctl's JSON output (`-w json`), which holds
/// keys and values as standard base64 with padding (Go's `[]byte` in
/// `encoding/json`).
fn base64_decode(text: &str) -> io::Result<Vec<u8>> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("etcdctl's JSON holds a value that is not base64 ({e}): {text:?}"),
            )
        })
}

/// A zap log's `ts`, `2026-11-27T23:29:07.987Z` (UTC).
fn parse_ts(ts: &str) -> Option<SystemTime> {
    let (date, time) = ts.strip_suffix('Z')?.split_once('T')?;
    let mut ymd = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (y, m, d) = (ymd.next()??, ymd.next()??, ymd.next()??);
    let mut hms = time.splitn(3, ':');
    let (h, min) = (
        hms.next()?.parse::<i64>().ok()?,
        hms.next()?.parse::<i64>().ok()?,
    );
    let seconds: f64 = hms.next()?.parse().ok()?;
    // Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's
    // days_from_civil).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let whole = u64::try_from(days * 86_400 + h * 3_600 + min * 60).ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::from_secs(whole) + Duration::from_secs_f64(seconds))
}

#[cfg(test)]
mod tests;
