//! Faults on a schedule, applied from a background thread to a cluster the
//! test shares with it.

use std::fmt;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::etcd::EtcdCluster;
use crate::node::Node;
use crate::process::ProcState;

/// The etcd cluster and the nodes, shared between a test and a
/// [`Nemesis`]: `Arc<Mutex<Cluster>>` ([`SharedCluster`]).
#[derive(Debug, Default)]
pub struct Cluster {
    pub etcd: Option<EtcdCluster>,
    pub nodes: Vec<Node>,
}

/// What a test and its nemesis both hold.
pub type SharedCluster = Arc<Mutex<Cluster>>;

impl Cluster {
    pub fn new(etcd: Option<EtcdCluster>, nodes: Vec<Node>) -> Cluster {
        Cluster { etcd, nodes }
    }

    /// Wraps it for sharing with a [`Nemesis`].
    pub fn shared(self) -> SharedCluster {
        Arc::new(Mutex::new(self))
    }

    /// Locks a shared cluster, ignoring poisoning (a panicking test thread
    /// must not stop the nemesis from working, nor the reverse).
    pub fn lock(shared: &SharedCluster) -> MutexGuard<'_, Cluster> {
        shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn etcd(&mut self) -> Result<&mut EtcdCluster, String> {
        self.etcd
            .as_mut()
            .ok_or_else(|| "no etcd cluster".to_string())
    }

    fn node(&mut self, i: usize) -> Result<&mut Node, String> {
        let len = self.nodes.len();
        self.nodes
            .get_mut(i)
            .ok_or_else(|| format!("no node {i} (there are {len})"))
    }
}

/// How long [`Fault::StopNode`] waits for the node to exit (then it is
/// killed, and the fault fails).
pub const STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

/// How long [`Fault::KillEtcdLeader`] and [`Fault::PauseEtcdLeader`] wait
/// for a member to lead (e.g. during an election) before giving up.
pub const LEADER_WAIT: Duration = Duration::from_secs(10);

/// One fault. Nodes and etcd members are indexes into [`Cluster::nodes`]
/// and the etcd cluster's members (member `i` is named `m{i+1}`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL node `i`.
    KillNode(usize),
    /// SIGTERM node `i` and wait (up to [`STOP_WAIT`]) for it to exit, as
    /// an operator's rolling restart stops a node.
    StopNode(usize),
    /// Start node `i` again (killing it first if it runs).
    RestartNode(usize),
    /// SIGSTOP node `i`.
    PauseNode(usize),
    /// SIGCONT node `i`.
    ResumeNode(usize),
    /// SIGKILL etcd member `i`.
    KillEtcd(usize),
    /// SIGKILL the member that is etcd's leader at that moment (waiting up
    /// to [`LEADER_WAIT`] for one, holding the lock).
    KillEtcdLeader,
    /// Start etcd member `i` again (same data dir and flags).
    RestartEtcd(usize),
    /// Start again every etcd member that is down (e.g. after
    /// [`Fault::KillEtcdLeader`], whose target is not known in advance).
    RestartEtcdDown,
    /// SIGSTOP etcd member `i`.
    PauseEtcd(usize),
    /// SIGSTOP the member that is etcd's leader at that moment (waiting up
    /// to [`LEADER_WAIT`] for one, holding the lock).
    PauseEtcdLeader,
    /// SIGCONT etcd member `i`.
    ResumeEtcd(usize),
    /// SIGCONT every paused etcd member.
    ResumeEtcdPaused,
}

impl Fault {
    /// Applies the fault now (the nemesis does so holding the cluster's
    /// lock). Ok: what was done ("killed etcd m2 (leader,
    /// pid 4242)"); Err: why not.
    pub fn apply(&self, cluster: &mut Cluster) -> Result<String, String> {
        let e = |e: std::io::Error| e.to_string();
        match *self {
            Fault::KillNode(i) => {
                let node = cluster.node(i)?;
                let pid = node.pid();
                node.kill().map_err(e)?;
                Ok(format!("killed node {} (pid {})", node.name(), show(pid)))
            }
            Fault::StopNode(i) => {
                let node = cluster.node(i)?;
                let pid = node.pid();
                let started = std::time::Instant::now();
                match node.stop(STOP_WAIT).map_err(e)? {
                    Some(status) if status.success() => Ok(format!(
                        "stopped node {} (pid {}) in {} ms",
                        node.name(),
                        show(pid),
                        started.elapsed().as_millis()
                    )),
                    status => Err(format!(
                        "node {} (pid {}) did not stop by itself within {STOP_WAIT:?}: {status:?}",
                        node.name(),
                        show(pid)
                    )),
                }
            }
            Fault::RestartNode(i) => {
                let node = cluster.node(i)?;
                node.restart().map_err(e)?;
                Ok(format!(
                    "restarted node {} (pid {})",
                    node.name(),
                    show(node.pid())
                ))
            }
            Fault::PauseNode(i) => {
                let node = cluster.node(i)?;
                node.pause().map_err(e)?;
                Ok(format!(
                    "paused node {} (pid {})",
                    node.name(),
                    show(node.pid())
                ))
            }
            Fault::ResumeNode(i) => {
                let node = cluster.node(i)?;
                node.resume().map_err(e)?;
                Ok(format!(
                    "resumed node {} (pid {})",
                    node.name(),
                    show(node.pid())
                ))
            }
            Fault::KillEtcd(i) => kill_etcd(cluster.etcd()?, i, ""),
            Fault::KillEtcdLeader => {
                let etcd = cluster.etcd()?;
                let leader = etcd.wait_leader(LEADER_WAIT).map_err(e)?;
                kill_etcd(etcd, leader, "leader, ")
            }
            Fault::RestartEtcd(i) => {
                let etcd = cluster.etcd()?;
                check_member(etcd, i)?;
                etcd.restart(i).map_err(e)?;
                Ok(format!(
                    "restarted etcd {} (pid {})",
                    etcd.name(i),
                    show(etcd.pid(i))
                ))
            }
            Fault::RestartEtcdDown => {
                let etcd = cluster.etcd()?;
                let mut done = Vec::new();
                for i in 0..etcd.len() {
                    if etcd.state(i) == ProcState::Down {
                        etcd.restart(i).map_err(e)?;
                        done.push(format!("{} (pid {})", etcd.name(i), show(etcd.pid(i))));
                    }
                }
                Ok(format!("restarted etcd [{}]", done.join(", ")))
            }
            Fault::PauseEtcd(i) => pause_etcd(cluster.etcd()?, i, ""),
            Fault::PauseEtcdLeader => {
                let etcd = cluster.etcd()?;
                let leader = etcd.wait_leader(LEADER_WAIT).map_err(e)?;
                pause_etcd(etcd, leader, "leader, ")
            }
            Fault::ResumeEtcd(i) => {
                let etcd = cluster.etcd()?;
                check_member(etcd, i)?;
                etcd.resume(i).map_err(e)?;
                Ok(format!(
                    "resumed etcd {} (pid {})",
                    etcd.name(i),
                    show(etcd.pid(i))
                ))
            }
            Fault::ResumeEtcdPaused => {
                let etcd = cluster.etcd()?;
                let mut done = Vec::new();
                for i in 0..etcd.len() {
                    if etcd.state(i) == ProcState::Paused {
                        etcd.resume(i).map_err(e)?;
                        done.push(format!("{} (pid {})", etcd.name(i), show(etcd.pid(i))));
                    }
                }
                Ok(format!("resumed etcd [{}]", done.join(", ")))
            }
        }
    }
}

fn show(pid: Option<u32>) -> String {
    pid.map_or_else(|| "-".into(), |p| p.to_string())
}

fn check_member(etcd: &EtcdCluster, i: usize) -> Result<(), String> {
    if i < etcd.len() {
        Ok(())
    } else {
        Err(format!("no etcd member {i} (there are {})", etcd.len()))
    }
}

fn kill_etcd(etcd: &mut EtcdCluster, i: usize, note: &str) -> Result<String, String> {
    check_member(etcd, i)?;
    let pid = etcd.pid(i);
    etcd.kill(i).map_err(|e| e.to_string())?;
    Ok(format!(
        "killed etcd {} ({note}pid {})",
        etcd.name(i),
        show(pid)
    ))
}

fn pause_etcd(etcd: &mut EtcdCluster, i: usize, note: &str) -> Result<String, String> {
    check_member(etcd, i)?;
    etcd.pause(i).map_err(|e| e.to_string())?;
    Ok(format!(
        "paused etcd {} ({note}pid {})",
        etcd.name(i),
        show(etcd.pid(i))
    ))
}

/// What the nemesis did, and when.
#[derive(Clone, Debug)]
pub struct Event {
    /// When it was applied, from [`NemesisHandle::started_at`].
    pub at: Duration,
    /// When it was scheduled for.
    pub scheduled: Duration,
    pub fault: Fault,
    /// What was done, or why it could not be.
    pub outcome: Result<String, String>,
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:>8.3} s  {:?}: ", self.at.as_secs_f64(), self.fault)?;
        match &self.outcome {
            Ok(done) => f.write_str(done),
            Err(why) => write!(f, "FAILED: {why}"),
        }
    }
}

/// A schedule of faults: `(time from start, fault)`.
///
/// ```no_run
/// use std::time::Duration;
/// use statebroker_cluster_harness::{Cluster, EtcdCluster, Fault, Nemesis};
///
/// let cluster = Cluster::new(Some(EtcdCluster::start(3)?), Vec::new()).shared();
/// let s = Duration::from_secs;
/// let nemesis = Nemesis::new([
///     (s(45), Fault::KillEtcdLeader),
///     (s(55), Fault::RestartEtcdDown),
///     (s(70), Fault::PauseEtcdLeader),
///     (s(80), Fault::ResumeEtcdPaused),
/// ])
/// .start(cluster.clone());
/// // ... run the workload, locking `cluster` when it needs the nodes ...
/// let events = nemesis.join();
/// for event in &events {
///     println!("{event}"); // "  45.012 s  KillEtcdLeader: killed etcd m2 (leader, pid 4242)"
/// }
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct Nemesis {
    schedule: Vec<(Duration, Fault)>,
}

impl Nemesis {
    /// The faults, in any order (they are applied in time order; equal
    /// times in the given order).
    pub fn new(schedule: impl IntoIterator<Item = (Duration, Fault)>) -> Nemesis {
        let mut schedule: Vec<_> = schedule.into_iter().collect();
        schedule.sort_by_key(|(at, _)| *at);
        Nemesis { schedule }
    }

    /// Adds a fault.
    pub fn at(mut self, at: Duration, fault: Fault) -> Nemesis {
        self.schedule.push((at, fault));
        self.schedule.sort_by_key(|(at, _)| *at);
        self
    }

    pub fn schedule(&self) -> &[(Duration, Fault)] {
        &self.schedule
    }

    /// Runs the schedule on a background thread, times counted from now.
    pub fn start(self, cluster: SharedCluster) -> NemesisHandle {
        self.start_at(cluster, Instant::now())
    }

    /// Runs the schedule on a background thread, times counted from
    /// `start` (e.g. the workload's own time origin).
    pub fn start_at(self, cluster: SharedCluster, start: Instant) -> NemesisHandle {
        let events = Arc::new(Mutex::new(Vec::new()));
        let (stop, stopped) = mpsc::channel::<()>();
        let log = events.clone();
        let thread = std::thread::Builder::new()
            .name("nemesis".into())
            .spawn(move || {
                for (scheduled, fault) in self.schedule {
                    let wait = (start + scheduled).saturating_duration_since(Instant::now());
                    match stopped.recv_timeout(wait) {
                        Err(RecvTimeoutError::Timeout) => {}
                        // Stopped, or the handle is gone.
                        Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
                    }
                    let mut guard = Cluster::lock(&cluster);
                    let at = start.elapsed();
                    let outcome = fault.apply(&mut guard);
                    drop(guard);
                    let event = Event {
                        at,
                        scheduled,
                        fault,
                        outcome,
                    };
                    eprintln!("nemesis: {event}");
                    log.lock().unwrap_or_else(|e| e.into_inner()).push(event);
                }
            })
            .expect("spawn the nemesis thread");
        NemesisHandle {
            start,
            events,
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

/// The running nemesis. Dropping it stops it (faults not yet applied are
/// skipped; a fault being applied is finished).
#[derive(Debug)]
pub struct NemesisHandle {
    start: Instant,
    events: Arc<Mutex<Vec<Event>>>,
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl NemesisHandle {
    /// The time origin of the schedule and of [`Event::at`].
    pub fn started_at(&self) -> Instant {
        self.start
    }

    /// What was done so far.
    pub fn events(&self) -> Vec<Event> {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether the whole schedule has been applied (or it was stopped).
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// One line per event.
    pub fn report(&self) -> String {
        self.events().iter().map(|e| format!("{e}\n")).collect()
    }

    /// Waits for the whole schedule; what was done.
    pub fn join(mut self) -> Vec<Event> {
        self.wait();
        self.events()
    }

    /// Skips the faults not applied yet; what was done.
    pub fn stop(mut self) -> Vec<Event> {
        self.stop.take();
        self.wait();
        self.events()
    }

    fn wait(&mut self) {
        if let Some(thread) = self.thread.take()
            && let Err(panic) = thread.join()
        {
            std::panic::resume_unwind(panic);
        }
    }
}

impl Drop for NemesisHandle {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
