//! `statebroker-check <history.jsonl>`: checks a recorded state store
//! history and prints the report.
//!
//! Exit status: 0 valid, 1 violations found, 2 the history cannot be read
//! (or bad usage), 3 no violation found but some key was undecided (the
//! search reached its limit).

use std::process::ExitCode;

use statebroker_checker::{History, check};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [path] = args.as_slice() else {
        eprintln!("usage: statebroker-check <history.jsonl>");
        return ExitCode::from(2);
    };
    if path == "-h" || path == "--help" {
        println!("usage: statebroker-check <history.jsonl>");
        println!("Checks a state store history (JSON Lines) for linearizability per key,");
        println!("version order and fencing tokens. Exits 1 on violations.");
        return ExitCode::SUCCESS;
    }
    let history = match History::load(path) {
        Ok(history) => history,
        Err(e) => {
            eprintln!("statebroker-check: {e}");
            return ExitCode::from(2);
        }
    };
    let start = std::time::Instant::now();
    let report = check(&history);
    print!("{report}");
    println!("checked in {:.2?}", start.elapsed());
    if !report.violations.is_empty() {
        ExitCode::from(1)
    } else if !report.undecided.is_empty() {
        ExitCode::from(3)
    } else {
        ExitCode::SUCCESS
    }
}
