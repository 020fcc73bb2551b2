//! Linearizability, key by key: Wing & Gong's search with Lowe's
//! memoization, as in porcupine.
//!
//! Keys are independent in the state store, so a history is linearizable if
//! the operations on each key are (P-compositionality). For one key:
//!
//! 1. Each operation becomes a call entry at its invoke time and a return
//!    entry at its return time, in one doubly linked list sorted by time
//!    (calls before returns at equal times: such operations count as
//!    concurrent). An operation with an unknown outcome (`info`, or never
//!    completed) returns at +infinity; `fail` operations, and `-ERR` answers
//!    the model cannot give from the key's state, are left out (they did not
//!    take effect).
//! 2. The search walks the list from its head. At a call entry it tries to
//!    linearize that operation next: the model (the `statestore` crate, see
//!    the crate documentation) must give the recorded answer in the current
//!    state (any answer, for unknown outcomes). If so, and the pair (set of
//!    linearized operations, new state) was not seen before, the operation
//!    is lifted out of the list, pushed on a stack, and the walk restarts at
//!    the head. At a return entry, the operation returning there should have
//!    been linearized already: the search backtracks (pops the last
//!    operation, puts it back, and tries the entry after it).
//! 3. The list empties: linearizable. The walk reaches the return of an
//!    unknown outcome: every operation left is one that may never take
//!    effect, so linearizable too. Backtracking with an empty stack: not
//!    linearizable.
//!
//! The violation reported shows the longest sequence that did linearize (its
//! last operations), the operation that could not follow it, and the
//! operations concurrent with that one.

use std::collections::{BTreeMap, HashSet};

use hashbrown::HashTable;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::history::{History, Operation, Outcome};
use crate::model::{KeyModel, is_modelled_error};
use crate::{Report, Violation, ViolationKind};

/// Limits of the search.
#[derive(Debug, Clone)]
pub struct Options {
    /// Search steps allowed for one key; a key that needs more is reported
    /// as undecided ([`Report::undecided`]) rather than searched for ever.
    pub max_steps_per_key: u64,
    /// Keys checked in parallel; 0: as many as the machine has cores.
    pub threads: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            max_steps_per_key: 50_000_000,
            threads: 0,
        }
    }
}

/// Checks every key of `history` with the default [`Options`].
pub fn check(history: &History) -> Report {
    check_with(history, &Options::default())
}

/// The operations of `history` the search considers, by key: all but
/// `fail`, `-ERR` answers outside the model, and reads with unknown
/// outcomes.
pub(crate) fn by_key(history: &History) -> BTreeMap<&str, Vec<&Operation>> {
    let mut keys: BTreeMap<&str, Vec<&Operation>> = BTreeMap::new();
    for op in history.ops() {
        let counts = match &op.outcome {
            Outcome::Fail { .. } => false,
            Outcome::Ok {
                answer: crate::history::Answer::Error(text),
                ..
            } => is_modelled_error(text),
            // A read whose answer is unknown changes nothing and shows
            // nothing.
            Outcome::Info { .. } => !matches!(op.op, crate::history::Op::Get { .. }),
            Outcome::Ok { .. } => true,
        };
        if counts {
            keys.entry(op.op.key()).or_default().push(op);
        }
    }
    keys
}

/// Checks every key of `history`.
pub fn check_with(history: &History, options: &Options) -> Report {
    let keys: Vec<(&str, Vec<&Operation>)> = by_key(history).into_iter().collect();
    let mut report = Report {
        keys: keys.len(),
        ops: keys.iter().map(|(_, ops)| ops.len()).sum(),
        ..Report::default()
    };
    let threads = match options.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
    .clamp(1, keys.len().max(1));
    let results: Mutex<Vec<(usize, KeyResult)>> = Mutex::new(Vec::new());
    let next = AtomicUsize::new(0);
    let work = || {
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some((key, ops)) = keys.get(i) else {
                break;
            };
            let result = check_key(key, ops, options.max_steps_per_key);
            results
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((i, result));
        }
    };
    if threads == 1 {
        work();
    } else {
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(work);
            }
        });
    }
    let mut results = results.into_inner().unwrap_or_else(|e| e.into_inner());
    results.sort_by_key(|(i, _)| *i);
    for (i, result) in results {
        match result {
            KeyResult::Linearizable => {}
            KeyResult::Violation(v) => report.violations.push(*v),
            KeyResult::Undecided => report.undecided.push(keys[i].0.to_owned()),
        }
    }
    report
}

/// What the search found for one key.
pub(crate) enum KeyResult {
    Linearizable,
    Violation(Box<Violation>),
    Undecided,
}

const NIL: usize = usize::MAX;
/// Operations of the longest linearized sequence shown in a violation.
const SHOWN_BEFORE: usize = 6;
/// Operations concurrent with the stuck one shown in a violation.
const SHOWN_CONCURRENT: usize = 14;

/// The search for one key (`ops` by invoke time).
pub(crate) fn check_key(key: &str, ops: &[&Operation], max_steps: u64) -> KeyResult {
    let n = ops.len();
    if n == 0 {
        return KeyResult::Linearizable;
    }
    // Entries 0..2n; node 2n is the head of the list.
    let mut entries: Vec<(u64, bool, usize)> = Vec::with_capacity(2 * n);
    for (i, op) in ops.iter().enumerate() {
        entries.push((op.invoke_ns, false, i));
        entries.push((op.return_ns().unwrap_or(u64::MAX), true, i));
    }
    entries.sort_unstable();
    let head = 2 * n;
    let mut next = vec![NIL; 2 * n + 1];
    let mut prev = vec![NIL; 2 * n + 1];
    let mut return_of = vec![NIL; n];
    for (node, &(_, is_return, op)) in entries.iter().enumerate() {
        if is_return {
            return_of[op] = node;
        }
    }
    // The list in time order: node i follows node i - 1, node 0 the head.
    next[head] = 0;
    prev[0] = head;
    for node in 1..2 * n {
        next[node - 1] = node;
        prev[node] = node - 1;
    }
    let is_return = |node: usize| entries[node].1;
    let op_of = |node: usize| entries[node].2;
    let unknown: Vec<bool> = ops.iter().map(|op| op.return_ns().is_none()).collect();

    let mut model = KeyModel::new(key);
    let mut linearized = vec![0u64; n.div_ceil(64)];
    // The configurations seen: (linearized set, state), hashed by a
    // Zobrist hash of the set kept up to date as operations come and go, so
    // that only new configurations are copied.
    let mut rng = SplitMix(0x5eed_0fc4_ec4e_1200);
    let zobrist: Vec<u64> = (0..n).map(|_| rng.next()).collect();
    let mut set_hash = 0u64;
    let mut seen: HashTable<(Box<[u64]>, u32)> = HashTable::new();
    let hash_of = |set_hash: u64, state: u32| {
        (set_hash ^ u64::from(state).wrapping_mul(0x9e37_79b9_7f4a_7c15)).rotate_left(29)
    };
    let mut stack: Vec<(usize, u32)> = Vec::new();
    let mut state = 0u32;
    // The deepest point reached: the linearized operations, the state after
    // them, and the operation whose return stopped the search there.
    let mut deepest: Option<(Vec<usize>, u32, usize)> = None;
    let mut steps = 0u64;
    let mut entry = next[head];
    while next[head] != NIL {
        steps += 1;
        if steps > max_steps {
            return KeyResult::Undecided;
        }
        if entry == NIL || (is_return(entry) && unknown[op_of(entry)]) {
            // Every operation left may never take effect.
            return KeyResult::Linearizable;
        }
        if !is_return(entry) {
            let i = op_of(entry);
            let after = model.step(state, i as u32, &ops[i].op, ops[i].answer());
            if let Some(after) = after {
                linearized[i / 64] |= 1 << (i % 64);
                set_hash ^= zobrist[i];
                let hash = hash_of(set_hash, after);
                let is_new = seen
                    .find(hash, |(bits, s)| *s == after && **bits == *linearized)
                    .is_none();
                if is_new {
                    seen.insert_unique(
                        hash,
                        (linearized.clone().into_boxed_slice(), after),
                        |(bits, s)| hash_of(zobrist_of(&zobrist, bits), *s),
                    );
                    stack.push((entry, state));
                    state = after;
                    // Lift the call and its return out of the list.
                    let ret = return_of[i];
                    next[prev[entry]] = next[entry];
                    prev[next[entry]] = prev[entry];
                    next[prev[ret]] = next[ret];
                    if next[ret] != NIL {
                        prev[next[ret]] = prev[ret];
                    }
                    entry = next[head];
                    continue;
                }
                linearized[i / 64] &= !(1 << (i % 64));
                set_hash ^= zobrist[i];
            }
            entry = next[entry];
        } else {
            if deepest
                .as_ref()
                .is_none_or(|(prefix, _, _)| stack.len() > prefix.len())
            {
                let prefix = stack.iter().map(|&(node, _)| op_of(node)).collect();
                deepest = Some((prefix, state, op_of(entry)));
            }
            let Some((call, before)) = stack.pop() else {
                let (prefix, state, stuck) = deepest.unwrap_or((Vec::new(), 0, op_of(entry)));
                return KeyResult::Violation(Box::new(explain(
                    key, ops, &mut model, &prefix, state, stuck,
                )));
            };
            state = before;
            let i = op_of(call);
            linearized[i / 64] &= !(1 << (i % 64));
            set_hash ^= zobrist[i];
            // Put the return back, then the call.
            let ret = return_of[i];
            next[prev[ret]] = ret;
            if next[ret] != NIL {
                prev[next[ret]] = ret;
            }
            next[prev[call]] = call;
            prev[next[call]] = call;
            entry = next[call];
        }
    }
    KeyResult::Linearizable
}

/// The Zobrist hash of a set of operations (when the table grows).
fn zobrist_of(zobrist: &[u64], bits: &[u64]) -> u64 {
    let mut hash = 0;
    for (w, &word) in bits.iter().enumerate() {
        let mut word = word;
        while word != 0 {
            let b = word.trailing_zeros() as usize;
            hash ^= zobrist[w * 64 + b];
            word &= word - 1;
        }
    }
    hash
}

/// A small deterministic generator for the Zobrist keys.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// The violation of `key`: `prefix` (operation indexes, in order) is the
/// longest sequence that linearized, leaving the key in `state`, and `stuck`
/// returned before it could be linearized after them.
fn explain(
    key: &str,
    ops: &[&Operation],
    model: &mut KeyModel<'_>,
    prefix: &[usize],
    state: u32,
    stuck: usize,
) -> Violation {
    let stuck_op = ops[stuck];
    let (would, _) = model.run(state, &stuck_op.op);
    let in_prefix: HashSet<usize> = prefix.iter().copied().collect();
    let (start, end) = (stuck_op.invoke_ns, stuck_op.return_ns().unwrap_or(u64::MAX));
    let mut shown: Vec<&Operation> = prefix[prefix.len().saturating_sub(SHOWN_BEFORE)..]
        .iter()
        .map(|&i| ops[i])
        .collect();
    shown.push(stuck_op);
    shown.extend(
        (0..ops.len())
            .filter(|&i| i != stuck && !in_prefix.contains(&i))
            .filter(|&i| ops[i].invoke_ns <= end && ops[i].return_ns().unwrap_or(u64::MAX) >= start)
            .take(SHOWN_CONCURRENT)
            .map(|i| ops[i]),
    );
    let message = format!(
        "no order of the {} operations on this key explains their answers. The longest order \
         found ({} operations) leaves the key {}; of the operations left, #{} returned first, \
         so it or one invoked before its return must come next, and no choice gets further: #{} `{}` \
         answered `{}` where the model answers `{}`. Shown: the end of that order, #{}, and \
         the operations left that overlap it.",
        ops.len(),
        prefix.len(),
        model.state(state),
        stuck_op.id,
        stuck_op.id,
        stuck_op.op,
        stuck_op
            .answer()
            .map_or_else(|| "?".to_owned(), ToString::to_string),
        would,
        stuck_op.id,
    );
    Violation {
        key: key.to_owned(),
        kind: ViolationKind::NotLinearizable,
        message,
        ops: shown.into_iter().cloned().collect(),
    }
}
