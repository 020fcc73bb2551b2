//! Generated histories: concurrent clients simulated against one real
//! `statestore::Store`, so every history is linearizable by construction
//! (each operation takes effect at one point between its invoke and its
//! return), and mutations of them that are not.

#![allow(dead_code)]

use statebroker_checker::history::{Condition, Event, History, Op};
use statebroker_checker::{Answer, ViolationKind};
use statestore::resp3::encode_request;
use statestore::{Caller, Config, Request, Store};

/// What to generate.
#[derive(Debug, Clone)]
pub struct Params {
    pub seed: u64,
    pub processes: usize,
    pub keys: usize,
    pub ops: usize,
    /// Every SET writes a value of its own (`v<id>`); otherwise values come
    /// from a pool of three, which makes NEX and VDEL hit more often.
    pub unique_values: bool,
    /// Per mille of operations that time out (info), half before taking
    /// effect, half after.
    pub info_per_mille: u32,
    /// Per mille of operations that fail (not applied).
    pub fail_per_mille: u32,
    /// Writes to the first half of the keys carry fencing tokens (versions
    /// handed out earlier).
    pub fenced: bool,
}

impl Params {
    pub fn new(seed: u64, processes: usize, keys: usize, ops: usize) -> Params {
        Params {
            seed,
            processes,
            keys,
            ops,
            unique_values: false,
            info_per_mille: 10,
            fail_per_mille: 10,
            fenced: true,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    Ok,
    Fail,
    Info,
}

/// One generated operation, with what really happened to it.
#[derive(Debug, Clone)]
pub struct GenOp {
    pub id: u64,
    pub process: u64,
    pub op: Op,
    pub invoke: u64,
    /// Completion time (the info event's time for `Info`).
    pub end_time: u64,
    pub end: End,
    /// When it took effect on the store, if it did.
    pub applied_at: Option<u64>,
    pub answer: Answer,
    pub version: String,
}

pub struct Generated {
    pub ops: Vec<GenOp>,
}

const WALL: u64 = 1_700_000_000_000;
const CALLER: Caller<'static> = Caller {
    client_id: "gen",
    connection: 1,
    owner: "gen",
};

/// Runs `op` on `store` at simulated time `t`: the answer and the version.
pub fn execute(store: &mut Store, op: &Op, t: u64) -> (Answer, String) {
    let now = WALL + t / 1_000;
    let timestamp = format!("{now}:0:gen");
    let payload = encode_request(&op.args());
    let request = Request {
        payload: &payload,
        timestamp: Some(&timestamp),
        fencing_token: op.fencing_token(),
        ..Request::default()
    };
    let out = store.execute(&request, CALLER, now);
    (
        Answer::from_resp3(&out.payload).unwrap(),
        out.timestamp.into(),
    )
}

enum Slot {
    Idle,
    Invoked(usize),
    Applied(usize),
}

pub fn generate(p: &Params) -> Generated {
    let mut rng = fastrand::Rng::with_seed(p.seed);
    let config = Config {
        node_id: "n1".to_owned(),
        ..Config::default()
    };
    let mut store = Store::new(config);
    let mut ops: Vec<GenOp> = Vec::new();
    let mut slots: Vec<(u64, Slot)> = (0..p.processes).map(|i| (i as u64, Slot::Idle)).collect();
    let mut next_process = p.processes as u64;
    let mut versions: Vec<String> = Vec::new();
    let mut last_value: Vec<Option<String>> = vec![None; p.keys];
    let pool = ["a", "b", "c"];
    let mut t = 0u64;
    loop {
        if ops.len() >= p.ops && slots.iter().all(|(_, s)| matches!(s, Slot::Idle)) {
            break;
        }
        t += 1 + rng.u64(0..3);
        let slot = rng.usize(0..slots.len());
        let (process, state) = &mut slots[slot];
        match *state {
            Slot::Idle => {
                if ops.len() >= p.ops {
                    continue;
                }
                let id = ops.len() as u64;
                let k = rng.usize(0..p.keys);
                let key = format!("k{k}");
                let fresh = |rng: &mut fastrand::Rng| {
                    if p.unique_values {
                        format!("v{id}")
                    } else {
                        pool[rng.usize(0..pool.len())].to_owned()
                    }
                };
                let ft = (p.fenced
                    && k < p.keys.div_ceil(2)
                    && !versions.is_empty()
                    && rng.u32(0..10) < 8)
                    .then(|| {
                        let recent = versions.len().saturating_sub(10);
                        versions[rng.usize(recent..versions.len())].clone()
                    });
                let op = match rng.u32(0..100) {
                    0..35 => Op::get(key),
                    35..70 => {
                        let value = fresh(&mut rng);
                        last_value[k] = Some(value.clone());
                        Op::Set {
                            key,
                            value,
                            condition: match rng.u32(0..10) {
                                0..6 => None,
                                6..8 => Some(Condition::Nx),
                                _ => Some(Condition::Nex),
                            },
                            px: (rng.u32(0..10) == 0).then_some(100_000_000),
                            ft,
                        }
                    }
                    70..85 => Op::Del { key, ft },
                    _ => {
                        let value = match (&last_value[k], rng.bool()) {
                            (Some(v), true) => v.clone(),
                            _ => fresh(&mut rng),
                        };
                        Op::Vdel { key, value, ft }
                    }
                };
                ops.push(GenOp {
                    id,
                    process: *process,
                    op,
                    invoke: t,
                    end_time: 0,
                    end: End::Ok,
                    applied_at: None,
                    answer: Answer::Nil,
                    version: String::new(),
                });
                *state = Slot::Invoked(id as usize);
            }
            Slot::Invoked(i) => {
                let roll = rng.u32(0..1000);
                if roll < p.fail_per_mille {
                    ops[i].end = End::Fail;
                    ops[i].end_time = t;
                    *state = Slot::Idle;
                } else if roll < p.fail_per_mille + p.info_per_mille / 2 {
                    ops[i].end = End::Info;
                    ops[i].end_time = t;
                    *state = Slot::Idle;
                    *process = next_process;
                    next_process += 1;
                } else {
                    let (answer, version) = execute(&mut store, &ops[i].op, t);
                    if matches!(ops[i].op, Op::Set { .. }) && answer.is_ok() {
                        versions.push(version.clone());
                    }
                    ops[i].answer = answer;
                    ops[i].version = version;
                    ops[i].applied_at = Some(t);
                    *state = Slot::Applied(i);
                }
            }
            Slot::Applied(i) => {
                ops[i].end_time = t;
                if rng.u32(0..1000) < p.info_per_mille / 2 {
                    ops[i].end = End::Info;
                    *process = next_process;
                    next_process += 1;
                } else {
                    ops[i].end = End::Ok;
                }
                *state = Slot::Idle;
            }
        }
    }
    Generated { ops }
}

impl Generated {
    pub fn history(&self) -> History {
        let mut events = Vec::new();
        for op in &self.ops {
            events.push(Event::Invoke {
                id: op.id,
                process: op.process,
                time_ns: op.invoke,
                op: op.op.clone(),
            });
            events.push(match op.end {
                End::Ok => Event::Ok {
                    id: op.id,
                    time_ns: op.end_time,
                    answer: op.answer.clone(),
                    version: Some(op.version.clone()),
                },
                End::Fail => Event::Fail {
                    id: op.id,
                    time_ns: op.end_time,
                },
                End::Info => Event::Info {
                    id: op.id,
                    time_ns: op.end_time,
                },
            });
        }
        events.sort_by_key(|e| (e.time_ns(), !matches!(e, Event::Invoke { .. })));
        History::from_events(events).unwrap()
    }

    fn ret(&self, op: &GenOp) -> u64 {
        match op.end {
            End::Info => u64::MAX,
            _ => op.end_time,
        }
    }

    /// Whether `op` is an acknowledged change of its key.
    fn changed(op: &GenOp) -> bool {
        op.end == End::Ok
            && match op.op {
                Op::Set { .. } => op.answer.is_ok(),
                Op::Del { .. } | Op::Vdel { .. } => op.answer == Answer::Integer(1),
                Op::Get { .. } => false,
            }
    }

    /// A stale read (needs unique values): a GET answered with the value of
    /// a SET that was overwritten (or deleted) by an acknowledged change
    /// that returned before the GET was invoked. `None` if the history has
    /// no such triple.
    pub fn with_stale_read(&self, pick: u64) -> Option<(History, u64)> {
        let mut candidates = Vec::new();
        for g in self
            .ops
            .iter()
            .filter(|g| g.end == End::Ok && matches!(g.op, Op::Get { .. }))
        {
            let key = g.op.key();
            let stale = self.ops.iter().find(|s| {
                s.op.key() == key
                    && matches!(s.op, Op::Set { .. })
                    && Self::changed(s)
                    && self.ops.iter().any(|w| {
                        w.id != s.id
                            && w.op.key() == key
                            && Self::changed(w)
                            && s.end_time < w.invoke
                            && w.end_time < g.invoke
                    })
            });
            if let Some(Op::Set { value, .. }) = stale.map(|s| &s.op) {
                candidates.push((g.id, value.clone()));
            }
        }
        if candidates.is_empty() {
            return None;
        }
        let (id, value) = candidates[(pick % candidates.len() as u64) as usize].clone();
        let mut mutated = Generated {
            ops: self.ops.clone(),
        };
        mutated.ops[id as usize].answer = Answer::Bulk(value);
        Some((mutated.history(), id))
    }

    /// A lost update (needs unique values): SET `s` is acknowledged but
    /// its effect is dropped (the store's answers after it are replayed
    /// without it), and a final GET of its key after every operation
    /// returned shows the loss. Only for an `s` where that is certain: the
    /// final value's only writer (or, if the key ends absent, every
    /// operation that may have deleted it) returned before `s` was invoked,
    /// so nothing can follow `s` and give the final answer. `None` if there
    /// is no such `s`.
    pub fn with_lost_update(&self, pick: u64) -> Option<(History, u64)> {
        let sets: Vec<&GenOp> = self
            .ops
            .iter()
            .filter(|s| matches!(s.op, Op::Set { .. }) && Self::changed(s))
            .collect();
        let n = sets.len() as u64;
        for offset in 0..n {
            let s = sets[((pick + offset) % n) as usize];
            let (mut mutated, mut store) = self.replay_without(s.id);
            let key = s.op.key().to_owned();
            mutated.append_final_get(&key, &mut store);
            let last = mutated.ops.last().expect("the final GET");
            let may_explain = |o: &GenOp| {
                if o.op.key() != key || o.id == s.id || o.end == End::Fail {
                    return false;
                }
                let effect = o.end == End::Info || Self::changed(o);
                match (&o.op, &last.answer) {
                    (Op::Set { value, .. }, Answer::Bulk(read)) => effect && value == read,
                    (Op::Del { .. } | Op::Vdel { .. }, Answer::Nil) => effect,
                    _ => false,
                }
            };
            if mutated
                .ops
                .iter()
                .any(|o| may_explain(o) && mutated.ret(o) > s.invoke)
            {
                continue;
            }
            return Some((mutated.history(), s.id));
        }
        None
    }

    /// The same operations and times, the store's answers recomputed
    /// without the effect of `dropped` (which keeps its answer).
    fn replay_without(&self, dropped: u64) -> (Generated, Store) {
        let mut ops = self.ops.clone();
        let mut order: Vec<usize> = (0..ops.len())
            .filter(|&i| ops[i].applied_at.is_some())
            .collect();
        order.sort_by_key(|&i| ops[i].applied_at);
        let mut store = Store::new(Config {
            node_id: "n1".to_owned(),
            ..Config::default()
        });
        for i in order {
            if ops[i].id == dropped {
                continue;
            }
            let (answer, version) = execute(&mut store, &ops[i].op, ops[i].applied_at.unwrap());
            ops[i].answer = answer;
            ops[i].version = version;
        }
        (Generated { ops }, store)
    }

    /// A GET of `key` by a new process, after everything else returned.
    fn append_final_get(&mut self, key: &str, store: &mut Store) {
        let t = self.ops.iter().map(|o| o.end_time).max().unwrap_or(0) + 10;
        let op = Op::get(key);
        let (answer, version) = execute(store, &op, t);
        self.ops.push(GenOp {
            id: self.ops.len() as u64,
            process: u64::MAX,
            op,
            invoke: t,
            end_time: t + 1,
            end: End::Ok,
            applied_at: Some(t),
            answer,
            version,
        });
    }
}

/// Whether `report` has a linearizability violation on `key`.
pub fn flags(report: &statebroker_checker::Report, key: &str) -> bool {
    report
        .of_kind(ViolationKind::NotLinearizable)
        .any(|v| v.key == key)
}
