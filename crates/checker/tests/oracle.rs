//! The search against brute force: on small one-key histories with random
//! answers, the checker's verdict is the one found by trying every order
//! that respects real time on a real `Store`, run sequentially.

mod common;

use common::{Params, execute, generate};
use proptest::prelude::*;
use statebroker_checker::history::{Answer, History, Operation, Outcome};
use statebroker_checker::linearizability;
use statestore::{Config, Store};

/// Whether some order of `ops` (all on one key) that respects real time,
/// leaving out any unknown outcomes it likes, gives every recorded answer.
fn brute_force(ops: &[&Operation], prefix: &mut Vec<usize>, left: &mut Vec<usize>) -> bool {
    if left.iter().all(|&i| ops[i].return_ns().is_none()) {
        return true;
    }
    for pos in 0..left.len() {
        let x = left[pos];
        // x may come next if it was invoked before every other operation
        // left returned (equal times count as concurrent).
        let blocked = left
            .iter()
            .any(|&y| y != x && ops[y].return_ns().is_some_and(|r| r < ops[x].invoke_ns));
        if blocked {
            continue;
        }
        let mut store = Store::new(Config::default());
        for &i in prefix.iter() {
            execute(&mut store, &ops[i].op, 0);
        }
        let (answer, _) = execute(&mut store, &ops[x].op, 0);
        if ops[x].answer().is_some_and(|recorded| *recorded != answer) {
            continue;
        }
        prefix.push(x);
        left.remove(pos);
        let found = brute_force(ops, prefix, left);
        left.insert(pos, x);
        prefix.pop();
        if found {
            return true;
        }
    }
    false
}

const ANSWERS: &[&str] = &[
    "+OK",
    ":-1",
    ":0",
    ":1",
    "$-1",
    "$a",
    "$b",
    "$c",
    "-ERR a fencing token is required for this request",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn the_search_agrees_with_brute_force(
        seed in any::<u64>(),
        processes in 1usize..=4,
        ops in 1usize..=7,
        fenced in any::<bool>(),
        changes in proptest::collection::vec((0usize..7, 0usize..ANSWERS.len()), 0..3),
    ) {
        let mut p = Params::new(seed, processes, 1, ops);
        p.info_per_mille = 150;
        p.fail_per_mille = 50;
        p.fenced = fenced;
        let mut events = generate(&p).history().events();
        for (which, answer) in changes {
            let oks: Vec<usize> = (0..events.len())
                .filter(|&i| matches!(events[i], statebroker_checker::Event::Ok { .. }))
                .collect();
            if oks.is_empty() {
                break;
            }
            if let statebroker_checker::Event::Ok { answer: a, .. } = &mut events[oks[which % oks.len()]] {
                *a = ANSWERS[answer].parse::<Answer>().unwrap();
            }
        }
        let history = History::from_events(events).unwrap();
        let considered: Vec<&Operation> = history
            .ops()
            .iter()
            .filter(|o| !matches!(o.outcome, Outcome::Fail { .. }))
            .collect();
        let expected = brute_force(&considered, &mut Vec::new(), &mut (0..considered.len()).collect());
        let report = linearizability::check(&history);
        prop_assert_eq!(report.violations.is_empty(), expected, "{:?}\n{}", history.ops(), report);
    }
}
