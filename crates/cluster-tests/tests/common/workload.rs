//! A recorded workload against several nodes: processes (one client
//! connection each) send random SET / SET NX / SET NEX / GET / DEL / VDEL
//! on a few keys, and SETs with a fencing token on a fenced one, and record each operation's invoke and return
//! (`statebroker_checker::Recorder`). A request without an answer within
//! [`TIMEOUT`] is recorded `info` (it may or may not have taken effect) and
//! its process goes on under a new id on the next node, as Jepsen's do.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use statebroker_checker::history::{Answer, Condition, Op, Recorder};
use statebroker_cli::client::{Client, Target};
use statestore::resp3::Reply;

/// How long a request may go unanswered before it counts as unknown.
pub const TIMEOUT: Duration = Duration::from_secs(5);

/// What the workload did.
#[derive(Debug)]
pub struct Tally {
    pub ok: AtomicU64,
    pub info: AtomicU64,
    pub reconnects: AtomicU64,
    /// When the workload started.
    pub start: Instant,
    /// When the last answer came, microseconds after `start`.
    last_answer_us: AtomicU64,
    /// The longest time without any answer, microseconds: how long the
    /// worst fault stalled every client.
    pub longest_gap_us: AtomicU64,
    /// Every time without any answer longer than [`STALL`]: when it ended
    /// (after `start`, to tell which fault it followed; approximate when
    /// answers race) and how long it was.
    stalls: parking_lot::Mutex<Vec<(Duration, Duration)>>,
}

/// A time without any answer this long is listed in [`Tally::stalls`].
pub const STALL: Duration = Duration::from_secs(1);

impl Tally {
    fn new() -> Tally {
        Tally {
            ok: AtomicU64::new(0),
            info: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            start: Instant::now(),
            last_answer_us: AtomicU64::new(0),
            longest_gap_us: AtomicU64::new(0),
            stalls: parking_lot::Mutex::new(Vec::new()),
        }
    }

    fn answered(&self) {
        self.ok.fetch_add(1, Ordering::Relaxed);
        let now = self.start.elapsed().as_micros() as u64;
        let last = self.last_answer_us.fetch_max(now, Ordering::Relaxed);
        let gap = now.saturating_sub(last);
        self.longest_gap_us.fetch_max(gap, Ordering::Relaxed);
        if gap >= STALL.as_micros() as u64 {
            self.stalls
                .lock()
                .push((Duration::from_micros(now), Duration::from_micros(gap)));
        }
    }

    /// The times without any answer longer than [`STALL`]: when each
    /// ended (after `start`) and how long it was, in the order they ended.
    pub fn stall_times(&self) -> Vec<(Duration, Duration)> {
        let mut stalls = self.stalls.lock().clone();
        stalls.sort();
        stalls
    }

    /// The times without any answer longer than [`STALL`], as `"4.46 s
    /// ending at 49.5 s"`, in the order they ended.
    pub fn stalls(&self) -> Vec<String> {
        self.stall_times()
            .iter()
            .map(|(end, gap)| {
                format!(
                    "{:.2} s ending at {:.1} s",
                    gap.as_secs_f64(),
                    end.as_secs_f64()
                )
            })
            .collect()
    }

    /// The longest stall.
    pub fn longest_gap(&self) -> Duration {
        Duration::from_micros(self.longest_gap_us.load(Ordering::Relaxed))
    }
}

/// Runs `per_node` processes on each of `ports` for `duration` over
/// `keys` keys (`k0`, `k1`, ...) and one fenced key; `seed` picks the
/// operations.
pub async fn run(
    ports: &[u16],
    per_node: usize,
    keys: usize,
    duration: Duration,
    seed: u64,
    recorder: Arc<Recorder>,
) -> Arc<Tally> {
    let mut names = key_names(keys);
    names.push(format!("{FENCED}0"));
    run_on(ports, per_node, &names, duration, seed, recorder).await
}

/// Keys written only with a fencing token (`__ft`); [`run`] adds one.
pub const FENCED: &str = "fenced-";

/// The keys [`run`] uses: `k0`, `k1`, ...
pub fn key_names(keys: usize) -> Vec<String> {
    (0..keys).map(|k| format!("k{k}")).collect()
}

/// [`run`] over the keys named (none of which may exist yet: the checker
/// starts every key absent).
pub async fn run_on(
    ports: &[u16],
    per_node: usize,
    keys: &[String],
    duration: Duration,
    seed: u64,
    recorder: Arc<Recorder>,
) -> Arc<Tally> {
    let keys: Arc<[String]> = keys.into();
    let tally = Arc::new(Tally::new());
    let next_process = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    let mut tasks = Vec::new();
    for (n, _) in ports.iter().enumerate() {
        for p in 0..per_node {
            let ports = ports.to_vec();
            let recorder = Arc::clone(&recorder);
            let tally = Arc::clone(&tally);
            let next_process = Arc::clone(&next_process);
            let rng =
                fastrand::Rng::with_seed(seed ^ ((n * 1000 + p) as u64).wrapping_mul(0x9e37_79b9));
            tasks.push(tokio::spawn(process(
                ports,
                n,
                Arc::clone(&keys),
                deadline,
                rng,
                recorder,
                tally,
                next_process,
            )));
        }
    }
    for task in tasks {
        task.await.expect("a workload process panicked");
    }
    tally
}

#[allow(clippy::too_many_arguments)]
async fn process(
    ports: Vec<u16>,
    mut node: usize,
    keys: Arc<[String]>,
    deadline: Instant,
    mut rng: fastrand::Rng,
    recorder: Arc<Recorder>,
    tally: Arc<Tally>,
    next_process: Arc<AtomicU64>,
) {
    let mut seq = 0u64;
    // The version of this process's last acknowledged SET: the fencing
    // token it sends (`__ft`) on fenced keys, as a lock holder sends the
    // version of its lock's SET. Others' later SETs make it stale.
    let mut token: Option<String> = None;
    'process: while Instant::now() < deadline {
        let id = next_process.fetch_add(1, Ordering::Relaxed);
        let client_id = format!("p{id}");
        // Connect to this node, or the next ones if it is down.
        let mut client = None;
        for _ in 0..ports.len() * 4 {
            if Instant::now() >= deadline {
                break 'process;
            }
            if let Some(c) = connect(ports[node], &client_id).await {
                client = Some(c);
                break;
            }
            node = (node + 1) % ports.len();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let Some(mut client) = client else { break };
        while Instant::now() < deadline {
            seq += 1;
            let key = keys[rng.usize(..keys.len())].clone();
            let value = format!("p{id}-{seq}");
            let op = pick(&mut rng, key, value, token.as_ref());
            let args = args_of(&op);
            let extra: Vec<(&str, String)> = op
                .fencing_token()
                .map(|ft| ("__ft", ft.to_owned()))
                .into_iter()
                .collect();
            let is_set = matches!(op, Op::Set { .. });
            let invoke = recorder.invoke(id, op);
            let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
            match tokio::time::timeout(TIMEOUT, client.request(&args, &extra)).await {
                Ok(Ok(answer)) => {
                    let answered = answer_of(&answer.reply);
                    if is_set && answered.is_ok() {
                        token = answer.version.clone().or(token);
                    }
                    recorder.ok(invoke, answered, answer.version);
                    tally.answered();
                }
                _ => {
                    // Unknown: the process ends; a new one takes over on the
                    // next node.
                    recorder.info(invoke);
                    tally.info.fetch_add(1, Ordering::Relaxed);
                    tally.reconnects.fetch_add(1, Ordering::Relaxed);
                    node = (node + 1) % ports.len();
                    continue 'process;
                }
            }
        }
        client.disconnect().await;
    }
}

async fn connect(port: u16, client_id: &str) -> Option<Client> {
    let target = Target {
        host: "127.0.0.1".into(),
        port,
        client_id: client_id.into(),
        login: None,
        timeout: TIMEOUT,
        tls: None,
    };
    tokio::time::timeout(TIMEOUT, Client::connect(&target))
        .await
        .ok()?
        .ok()
}

/// On a fenced key: SET with the fencing token `token` 70 % (refused once
/// a later token protects the key), GET otherwise. On the others: SET 30 %,
/// NX 10 %, NEX 10 %, GET 25 %, DEL 10 %, VDEL 15 % (of a value some
/// process may have written).
fn pick(rng: &mut fastrand::Rng, key: String, value: String, token: Option<&String>) -> Op {
    let roll = rng.u32(..100);
    let set = |condition, ft: Option<&String>| Op::Set {
        key: key.clone(),
        value: value.clone(),
        condition,
        px: None,
        ft: ft.cloned(),
    };
    if key.starts_with(FENCED) {
        return match token {
            Some(token) if roll < 70 => set(None, Some(token)),
            _ => Op::get(key.clone()),
        };
    }
    match roll {
        0..30 => set(None, None),
        30..40 => set(Some(Condition::Nx), None),
        40..50 => set(Some(Condition::Nex), None),
        50..75 => Op::get(key.clone()),
        75..85 => Op::del(key.clone()),
        _ => Op::vdel(key.clone(), value),
    }
}

fn args_of(op: &Op) -> Vec<String> {
    op.args()
}

fn answer_of(reply: &Reply) -> Answer {
    match reply {
        Reply::Simple(s) => Answer::Simple(s.clone()),
        Reply::Error(e) => Answer::Error(e.clone()),
        Reply::Integer(n) => Answer::Integer(*n),
        Reply::Bulk(b) => Answer::Bulk(String::from_utf8_lossy(b).into_owned()),
        Reply::Null => Answer::Nil,
        Reply::Array(_) => Answer::Error("an array answer".into()),
    }
}
