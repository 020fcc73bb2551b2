//! Generated concurrent histories: valid ones pass, mutated ones are flagged.

mod common;

use std::time::{Duration, Instant};

use common::{Generated, Params, flags, generate};
use proptest::prelude::*;
use statebroker_checker::history::{Op, Outcome};
use statebroker_checker::{History, check};

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    /// A history of a real store, each operation taking effect between its
    /// invoke and its return, with timeouts and failures: valid.
    #[test]
    fn generated_histories_pass(
        seed in any::<u64>(),
        processes in 1usize..=12,
        keys in 1usize..=3,
        ops in 1usize..=150,
        unique_values in any::<bool>(),
        fenced in any::<bool>(),
    ) {
        let mut p = Params::new(seed, processes, keys, ops);
        p.unique_values = unique_values;
        p.fenced = fenced;
        let history = generate(&p).history();
        let report = check(&history);
        prop_assert!(report.is_valid(), "{:?}\n{}", p, report);
        let counted = history.ops().iter().filter(|o| match o.outcome {
            Outcome::Fail { .. } => false,
            Outcome::Info { .. } => !matches!(o.op, Op::Get { .. }),
            Outcome::Ok { .. } => true,
        });
        prop_assert_eq!(report.ops, counted.count());
    }

    /// One GET answered with a value overwritten before it was invoked.
    #[test]
    fn a_generated_stale_read_is_flagged(
        seed in any::<u64>(),
        processes in 2usize..=12,
        keys in 1usize..=3,
        ops in 30usize..=150,
        pick in any::<u64>(),
    ) {
        let mut p = Params::new(seed, processes, keys, ops);
        p.unique_values = true;
        let generated = generate(&p);
        let mutated = generated.with_stale_read(pick);
        prop_assume!(mutated.is_some());
        let (history, id) = mutated.unwrap();
        let key = history.ops().iter().find(|o| o.id == id).unwrap().op.key().to_owned();
        let report = check(&history);
        prop_assert!(flags(&report, &key), "{:?}: stale read #{}\n{}", p, id, report);
    }

    /// One acknowledged SET whose effect is lost.
    #[test]
    fn a_generated_lost_update_is_flagged(
        seed in any::<u64>(),
        processes in 2usize..=12,
        keys in 1usize..=3,
        ops in 10usize..=150,
        pick in any::<u64>(),
    ) {
        let mut p = Params::new(seed, processes, keys, ops);
        p.unique_values = true;
        let generated = generate(&p);
        let mutated = generated.with_lost_update(pick);
        prop_assume!(mutated.is_some());
        let (history, id) = mutated.unwrap();
        let key = history.ops().iter().find(|o| o.id == id).unwrap().op.key().to_owned();
        let report = check(&history);
        prop_assert!(flags(&report, &key), "{:?}: lost #{}\n{}", p, id, report);
    }
}

fn timed(p: &Params) -> (History, Duration) {
    let history = generate(p).history();
    let start = Instant::now();
    let report = check(&history);
    let elapsed = start.elapsed();
    assert!(report.is_valid(), "{report}");
    println!(
        "{} processes, {} keys, {} operations: checked in {elapsed:.2?}",
        p.processes,
        p.keys,
        history.len()
    );
    (history, elapsed)
}

/// 12 processes, 40 keys, 5,000 operations: a few seconds at most (the
/// assertion is generous; the time is printed).
#[test]
fn five_thousand_operations_are_checked_quickly() {
    let (_, elapsed) = timed(&Params::new(1, 12, 40, 5_000));
    assert!(elapsed < Duration::from_secs(60), "{elapsed:?}");
}

/// 40 keys with ~500 operations each, and one key with 2,000 operations
/// all from 12 concurrent processes.
#[test]
fn larger_histories_are_checked_in_well_under_a_minute() {
    let (_, a) = timed(&Params::new(2, 12, 40, 20_000));
    let (_, b) = timed(&Params::new(3, 12, 1, 2_000));
    assert!(a + b < Duration::from_secs(60), "{a:?} + {b:?}");
}

/// The mutations themselves are what they claim: the stale read changed
/// one answer, the lost update kept the dropped SET's acknowledgement.
#[test]
fn mutations_change_what_they_say() {
    let mut found = (0, 0);
    for seed in 0..50 {
        let mut p = Params::new(seed, 4, 3, 100);
        p.unique_values = true;
        let generated: Generated = generate(&p);
        let original = generated.history();
        if let Some((stale, id)) = generated.with_stale_read(seed) {
            let differing: Vec<u64> = original
                .ops()
                .iter()
                .zip(stale.ops())
                .filter(|(a, b)| a != b)
                .map(|(a, _)| a.id)
                .collect();
            assert_eq!(differing, [id]);
            found.0 += 1;
        }
        if let Some((lost, id)) = generated.with_lost_update(seed) {
            let dropped = lost.ops().iter().find(|o| o.id == id).unwrap();
            assert!(dropped.answer().unwrap().is_ok());
            assert_eq!(lost.len(), original.len() + 1, "the final GET");
            found.1 += 1;
        }
    }
    println!(
        "of 50 histories, {} stale reads and {} lost updates made",
        found.0, found.1
    );
    assert!(found.0 > 25 && found.1 > 25, "{found:?}");
}
