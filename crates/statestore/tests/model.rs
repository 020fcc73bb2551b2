//! Model check: random command sequences against the store and a simple
//! reference model written straight from the protocol description, with a
//! controllable clock. Every answer, every `__ts` and every notification
//! must be the same.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use statestore::command::Page;
use statestore::resp3::encode_request;
use statestore::{Caller, Config, Event, Quota, Request, Store};

const T0: u64 = 1_700_000_000_000;
const SKEW: u64 = 60_000;
const NODE: &str = "statebroker";
const CLIENTS: [&str; 3] = ["c0", "c1", "c2"];
const KEYS: [&str; 4] = ["a", "b", "c", "ab"];
const VALUES: [&str; 3] = ["x", "y", ""];
const MAX_KEYS: usize = 3;
/// KEYNOTIFY limits: per client, per user (owner), in all.
const MAX_WATCHES: usize = 3;
const MAX_WATCHES_PER_USER: usize = 4;
const MAX_WATCHES_TOTAL: usize = 5;
/// Who the clients' quotas count against: c0 and c1 always share an
/// owner; c2 changes sides each time it reconnects.
const OWNERS: [&str; 2] = ["u0", "u1"];

fn owner(client: &str, connection: u64) -> &'static str {
    let i = CLIENTS.iter().position(|c| *c == client).unwrap();
    OWNERS[(i / 2 + connection as usize) % 2]
}
/// SCAN patterns and the keys of KEYS each matches (worked out by hand).
const PATTERNS: [(&str, &[&str]); 7] = [
    ("*", &["a", "b", "c", "ab"]),
    ("a*", &["a", "ab"]),
    ("?", &["a", "b", "c"]),
    ("[ab]", &["a", "b"]),
    ("[!a]*", &["b", "c"]),
    ("c", &["c"]),
    ("a?", &["ab"]),
];

#[derive(Debug, Clone)]
enum Ts {
    Now,
    Missing,
    Ahead(u64),
    Behind(u64),
    Malformed,
}

#[derive(Debug, Clone)]
enum Op {
    Set {
        client: usize,
        key: usize,
        value: usize,
        cond: u8,
        px: Option<u64>,
        ts: Ts,
        ft: Option<usize>,
    },
    Get {
        client: usize,
        key: usize,
    },
    Del {
        client: usize,
        key: usize,
        ft: Option<usize>,
    },
    VDel {
        client: usize,
        key: usize,
        value: usize,
        ft: Option<usize>,
    },
    Notify {
        client: usize,
        key: usize,
        stop: bool,
    },
    Close {
        client: usize,
    },
    Advance {
        ms: i64,
    },
    Expire,
    Scan {
        client: usize,
        pattern: usize,
    },
}

/// Fencing tokens: fixed times near T0, and one too far in the future.
fn token(i: usize) -> String {
    match i {
        0..=3 => format!("{}:{}:lockd", T0 + (i as u64 / 2) * 10, i % 2),
        _ => format!("{}:0:lockd", T0 + 10 * SKEW),
    }
}

fn ts_strategy() -> impl Strategy<Value = Ts> {
    prop_oneof![
        6 => Just(Ts::Now),
        1 => Just(Ts::Missing),
        1 => (0u64..90_000).prop_map(Ts::Ahead),
        1 => (0u64..5_000).prop_map(Ts::Behind),
        1 => Just(Ts::Malformed),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let c = 0..CLIENTS.len();
    let k = 0..KEYS.len();
    let v = 0..VALUES.len();
    let ft = proptest::option::weighted(0.4, 0usize..5);
    prop_oneof![
        6 => (c.clone(), k.clone(), v.clone(), 0u8..3, proptest::option::weighted(0.4, prop_oneof![1u64..12, Just(100), Just(1_000)]), ts_strategy(), ft.clone())
            .prop_map(|(client, key, value, cond, px, ts, ft)| Op::Set { client, key, value, cond, px, ts, ft }),
        3 => (c.clone(), k.clone()).prop_map(|(client, key)| Op::Get { client, key }),
        2 => (c.clone(), k.clone(), ft.clone()).prop_map(|(client, key, ft)| Op::Del { client, key, ft }),
        2 => (c.clone(), k.clone(), v, ft).prop_map(|(client, key, value, ft)| Op::VDel { client, key, value, ft }),
        3 => (c.clone(), k, any::<bool>()).prop_map(|(client, key, stop)| Op::Notify { client, key, stop }),
        1 => c.clone().prop_map(|client| Op::Close { client }),
        3 => prop_oneof![3 => -3i64..12, 1 => -500i64..3_000].prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::Expire),
        1 => (c, 0..PATTERNS.len()).prop_map(|(client, pattern)| Op::Scan { client, pattern }),
    ]
}

type Time = (u64, u64);

#[derive(Debug, Clone)]
struct MEntry {
    value: String,
    version: Time,
    token: Option<Time>,
    expires: Option<u64>,
}

/// A notification: (watcher, key, Some(value) for SET / None for DELETE, version).
type Note = (String, String, Option<Vec<u8>>, String);

#[derive(Default)]
struct Model {
    now: u64,
    last: Time,
    entries: BTreeMap<String, MEntry>,
    /// key -> client -> connection
    watchers: BTreeMap<String, BTreeMap<String, u64>>,
    connection: [u64; 3],
}

fn fmt(t: Time) -> String {
    format!("{:015}:{:05}:{NODE}", t.0, t.1)
}

fn err(text: &str) -> Vec<u8> {
    format!("-ERR {text}\r\n").into_bytes()
}

fn bulk(s: &str) -> Vec<u8> {
    format!("${}\r\n{s}\r\n", s.len()).into_bytes()
}

impl Model {
    fn clock(&self) -> Time {
        if self.now > self.last.0 {
            (self.now, 0)
        } else {
            self.last
        }
    }

    /// HLC rules: the largest of the last version, the wall clock and the
    /// request's time; on a tie of wall times, one more than the largest counter.
    fn next_version(&mut self, ts: Time) -> Time {
        let wall = self.now.max(self.last.0).max(ts.0);
        let mut counter = None;
        for (w, c) in [self.last, ts] {
            if w == wall {
                counter = Some(counter.unwrap_or(0).max(c + 1));
            }
        }
        self.last = (wall, counter.unwrap_or(0));
        self.last
    }

    fn notify(&self, key: &str, value: Option<&str>, version: Time, notes: &mut Vec<Note>) {
        if let Some(ws) = self.watchers.get(key) {
            for client in ws.keys() {
                notes.push((
                    client.clone(),
                    key.to_owned(),
                    value.map(|v| v.as_bytes().to_vec()),
                    fmt(version),
                ));
            }
        }
    }

    fn expire(&mut self, notes: &mut Vec<Note>) {
        let now = self.now;
        let due: Vec<String> = self
            .entries
            .iter()
            .filter(|(_, e)| e.expires.is_some_and(|at| at <= now))
            .map(|(k, _)| k.clone())
            .collect();
        for key in due {
            let e = self.entries.remove(&key).unwrap();
            self.notify(&key, None, e.version, notes);
        }
    }

    fn fencing(&self, key: &str, ft: Option<usize>) -> Result<(), Vec<u8>> {
        let Some(protecting) = self.entries.get(key).and_then(|e| e.token) else {
            return Ok(());
        };
        match ft {
            None => Err(err("a fencing token is required for this request")),
            Some(i) if tok_time(i) < protecting => Err(err(
                "the request fencing token is a lower version than the fencing token protecting the resource",
            )),
            Some(_) => Ok(()),
        }
    }

    /// The answer (payload, __ts) and notifications for `op`.
    fn apply(&mut self, op: &Op, notes: &mut Vec<Note>) -> (Vec<u8>, String) {
        self.expire(notes);
        let clock = fmt(self.clock());
        let ft_skew = |ft: Option<usize>| ft.is_some_and(|i| i >= 4);
        let ft_err = err(
            "the request fencing token timestamp is too far in the future; ensure that the client and broker system clocks are synchronized",
        );
        match op {
            Op::Set {
                client,
                key,
                value,
                cond,
                px,
                ts,
                ft,
            } => {
                let ts_time = match ts {
                    Ts::Malformed => return (err("malformed timestamp"), clock),
                    Ts::Ahead(ms) if *ms > SKEW => {
                        return (
                            err(
                                "the request timestamp is too far in the future; ensure that the client and broker system clocks are synchronized",
                            ),
                            clock,
                        );
                    }
                    _ if ft_skew(*ft) => return (ft_err, clock),
                    Ts::Missing => return (err("missing timestamp"), clock),
                    Ts::Now => (self.now, 0),
                    Ts::Ahead(ms) => (self.now + ms, 0),
                    Ts::Behind(ms) => (self.now - ms, 0),
                };
                let _ = client;
                let (key, value) = (KEYS[*key], VALUES[*value]);
                if let Err(e) = self.fencing(key, *ft) {
                    return (e, clock);
                }
                if let Some(existing) = self.entries.get(key) {
                    let applies = match cond {
                        1 => false,
                        2 => existing.value == value,
                        _ => true,
                    };
                    if !applies {
                        return (b":-1\r\n".to_vec(), fmt(existing.version));
                    }
                } else if self.entries.len() >= MAX_KEYS {
                    return (err("the quota has been exceeded"), clock);
                }
                let old_token = self.entries.get(key).and_then(|e| e.token);
                let token = match (old_token, ft.map(tok_time)) {
                    (Some(o), Some(n)) => Some(o.max(n)),
                    (o, n) => o.or(n),
                };
                let version = self.next_version(ts_time);
                let expires = px.map(|ms| self.now + ms);
                self.entries.insert(
                    key.to_owned(),
                    MEntry {
                        value: value.to_owned(),
                        version,
                        token,
                        expires,
                    },
                );
                self.notify(key, Some(value), version, notes);
                (b"+OK\r\n".to_vec(), fmt(version))
            }
            Op::Get { key, .. } => match self.entries.get(KEYS[*key]) {
                Some(e) => (bulk(&e.value), fmt(e.version)),
                None => (b"$-1\r\n".to_vec(), clock),
            },
            Op::Del { key, ft, .. } | Op::VDel { key, ft, .. } => {
                if ft_skew(*ft) {
                    return (ft_err, clock);
                }
                let key = KEYS[*key];
                let Some(e) = self.entries.get(key).cloned() else {
                    return (b":0\r\n".to_vec(), clock);
                };
                if let Err(x) = self.fencing(key, *ft) {
                    return (x, clock);
                }
                if let Op::VDel { value, .. } = op
                    && e.value != VALUES[*value]
                {
                    return (b":-1\r\n".to_vec(), fmt(e.version));
                }
                self.entries.remove(key);
                self.notify(key, None, e.version, notes);
                (b":1\r\n".to_vec(), fmt(e.version))
            }
            Op::Notify { client, key, stop } => {
                let (name, key) = (CLIENTS[*client], KEYS[*key]);
                if *stop {
                    let removed = self
                        .watchers
                        .get_mut(key)
                        .is_some_and(|ws| ws.remove(name).is_some());
                    self.watchers.retain(|_, ws| !ws.is_empty());
                    return (
                        if removed {
                            b"+OK\r\n".to_vec()
                        } else {
                            b":0\r\n".to_vec()
                        },
                        clock,
                    );
                }
                let registered = self
                    .watchers
                    .get(key)
                    .is_some_and(|ws| ws.contains_key(name));
                let me = owner(name, self.connection[*client]);
                let all = || self.watchers.values().flatten();
                let count = all().filter(|(c, _)| c.as_str() == name).count();
                let of_owner = all().filter(|(c, conn)| owner(c, **conn) == me).count();
                let total = all().count();
                if !registered
                    && (count >= MAX_WATCHES
                        || of_owner >= MAX_WATCHES_PER_USER
                        || total >= MAX_WATCHES_TOTAL)
                {
                    return (err("the quota has been exceeded"), clock);
                }
                self.watchers
                    .entry(key.to_owned())
                    .or_default()
                    .insert(name.to_owned(), self.connection[*client]);
                (b"+OK\r\n".to_vec(), clock)
            }
            Op::Close { .. } | Op::Advance { .. } | Op::Expire | Op::Scan { .. } => unreachable!(),
        }
    }
}

fn tok_time(i: usize) -> Time {
    let t: statestore::hlc::Hlc = token(i).parse().unwrap();
    (t.wall_ms, t.counter)
}

fn args_of(op: &Op) -> Vec<String> {
    let s = |x: &str| x.to_owned();
    match op {
        Op::Set {
            key,
            value,
            cond,
            px,
            ..
        } => {
            let mut a = vec![s("SET"), s(KEYS[*key]), s(VALUES[*value])];
            match cond {
                1 => a.push(s("NX")),
                2 => a.push(s("NEX")),
                _ => {}
            }
            if let Some(ms) = px {
                a.extend([s("PX"), ms.to_string()]);
            }
            a
        }
        Op::Get { key, .. } => vec![s("GET"), s(KEYS[*key])],
        Op::Del { key, .. } => vec![s("DEL"), s(KEYS[*key])],
        Op::VDel { key, value, .. } => vec![s("VDEL"), s(KEYS[*key]), s(VALUES[*value])],
        Op::Notify { key, stop, .. } => {
            let mut a = vec![s("KEYNOTIFY"), s(KEYS[*key])];
            if *stop {
                a.push(s("STOP"));
            }
            a
        }
        _ => unreachable!(),
    }
}

fn notes_of(out: &statestore::Outcome) -> Vec<Note> {
    let mut notes = Vec::new();
    for n in &out.notices {
        for w in &n.watchers {
            let value = match &n.event {
                Event::Set(v) => Some(v.clone()),
                Event::Delete => None,
            };
            notes.push((
                w.to_string(),
                String::from_utf8(n.key.clone()).unwrap(),
                value,
                n.version.to_string(),
            ));
        }
    }
    notes.sort();
    notes
}

fn run(ops: &[Op]) -> Result<(), TestCaseError> {
    let mut store = Store::new(Config {
        node_id: NODE.into(),
        max_clock_skew_ms: SKEW,
        scan_page_size: 2,
        quota: Quota {
            max_keys: MAX_KEYS as u64,
            ..Quota::default()
        },
        max_watches_per_client: MAX_WATCHES,
        max_watches_per_user: MAX_WATCHES_PER_USER,
        max_watches: MAX_WATCHES_TOTAL,
        ..Config::default()
    });
    let mut model = Model {
        now: T0,
        ..Model::default()
    };
    for (step, op) in ops.iter().enumerate() {
        match op {
            Op::Advance { ms } => {
                model.now = model.now.saturating_add_signed(*ms);
                continue;
            }
            Op::Close { client } => {
                let name = CLIENTS[*client];
                let conn = model.connection[*client];
                store.connection_closed(name, conn);
                for ws in model.watchers.values_mut() {
                    ws.retain(|c, k| !(c == name && *k == conn));
                }
                model.watchers.retain(|_, ws| !ws.is_empty());
                model.connection[*client] += 1;
                continue;
            }
            Op::Expire => {
                let mut expected = Vec::new();
                model.expire(&mut expected);
                expected.sort();
                let out = statestore::Outcome {
                    payload: vec![],
                    timestamp: Default::default(),
                    notices: store.expire(model.now).notices,
                    writes: vec![],
                    observed: statestore::persist::Observed::Nothing,
                    command: None,
                    error: None,
                };
                prop_assert_eq!(notes_of(&out), expected, "step {}: {:?}", step, op);
                continue;
            }
            Op::Scan { client, pattern } => {
                let (pat, matching) = PATTERNS[*pattern];
                let mut expected_notes = Vec::new();
                model.expire(&mut expected_notes);
                let mut listed = BTreeSet::new();
                let mut token: Option<Vec<u8>> = None;
                let caller = Caller {
                    client_id: CLIENTS[*client],
                    connection: model.connection[*client],
                    owner: owner(CLIENTS[*client], model.connection[*client]),
                };
                for page in 0.. {
                    prop_assert!(page < 100, "SCAN does not end");
                    let mut args = vec![b"SCAN".to_vec(), pat.as_bytes().to_vec()];
                    args.extend(token.take());
                    let payload = encode_request(&args);
                    let out = store.execute(
                        &Request {
                            payload: &payload,
                            ..Request::default()
                        },
                        caller,
                        model.now,
                    );
                    if page == 0 {
                        let mut notes = expected_notes.clone();
                        notes.sort();
                        prop_assert_eq!(notes_of(&out), notes);
                    }
                    prop_assert_eq!(&out.timestamp, &fmt(model.clock()));
                    let Page { keys, token: next } = Page::decode(&out.payload).unwrap();
                    for k in keys {
                        prop_assert!(listed.insert(k.clone()), "{:?} listed twice", k);
                    }
                    match next {
                        Some(t) => token = Some(t),
                        None => break,
                    }
                }
                let expected: BTreeSet<Vec<u8>> = matching
                    .iter()
                    .filter(|k| model.entries.contains_key(**k))
                    .map(|k| k.as_bytes().to_vec())
                    .collect();
                prop_assert_eq!(listed, expected, "step {}: SCAN {}", step, pat);
                continue;
            }
            _ => {}
        }
        let client = match op {
            Op::Set { client, .. }
            | Op::Get { client, .. }
            | Op::Del { client, .. }
            | Op::VDel { client, .. }
            | Op::Notify { client, .. } => *client,
            _ => unreachable!(),
        };
        let ts = match op {
            Op::Set { ts, .. } => match ts {
                Ts::Now => Some(format!("{}:0:{}", model.now, CLIENTS[client])),
                Ts::Missing => None,
                Ts::Ahead(ms) => Some(format!("{}:0:{}", model.now + ms, CLIENTS[client])),
                Ts::Behind(ms) => Some(format!("{}:0:{}", model.now - ms, CLIENTS[client])),
                Ts::Malformed => Some("not-a-clock".to_owned()),
            },
            _ => Some(format!("{}:0:{}", model.now, CLIENTS[client])),
        };
        let ft = match op {
            Op::Set { ft, .. } | Op::Del { ft, .. } | Op::VDel { ft, .. } => ft.map(token),
            _ => None,
        };
        let payload = encode_request(&args_of(op));
        let request = Request {
            payload: &payload,
            timestamp: ts.as_deref(),
            fencing_token: ft.as_deref(),
            ..Request::default()
        };
        let caller = Caller {
            client_id: CLIENTS[client],
            connection: model.connection[client],
            owner: owner(CLIENTS[client], model.connection[client]),
        };
        let out = store.execute(&request, caller, model.now);
        let mut expected_notes = Vec::new();
        let (payload, timestamp) = model.apply(op, &mut expected_notes);
        expected_notes.sort();
        prop_assert_eq!(
            String::from_utf8_lossy(&out.payload),
            String::from_utf8_lossy(&payload),
            "step {}: {:?}",
            step,
            op
        );
        prop_assert_eq!(&out.timestamp, &timestamp, "step {}: {:?}", step, op);
        prop_assert_eq!(notes_of(&out), expected_notes, "step {}: {:?}", step, op);
        prop_assert_eq!(store.len(), model.entries.len(), "step {}", step);
        prop_assert_eq!(
            store.watch_count(),
            model.watchers.values().map(BTreeMap::len).sum::<usize>()
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn store_agrees_with_the_model(ops in proptest::collection::vec(op_strategy(), 1..120)) {
        run(&ops)?;
    }
}
