//! What SCAN's glob costs: per key (typical patterns on 100-byte keys, and
//! hostile ones on keys of the maximum size) and per SCAN page.
//!
//! ```text
//! cargo run --release -p statestore --example glob_cost                # all, timed
//! cargo run --release -p statestore --example glob_cost -- key NAME N  # one case N times
//! cargo run --release -p statestore --example glob_cost -- compile NAME N
//! valgrind --tool=callgrind target/release/examples/glob_cost key NAME N
//! ```
//!
//! `key NAME N` matches case NAME N times (`compile NAME N`: compiles its
//! pattern and matches it once, N times) and prints nothing else, for
//! instruction counts (callgrind's are the same on any machine; subtract
//! a run with N = 0 for the setup). Times depend on the machine and its
//! load: the numbers in the commit messages and docs are from a shared
//! 2-core VM.

use std::hint::black_box;
use std::time::{Duration, Instant};

use statestore::glob::Pattern;
use statestore::resp3::encode_request;
use statestore::{Caller, Config, Request, Store};

/// The largest key the store takes by default.
const MAX_KEY: usize = 64 << 10;

struct Case {
    name: &'static str,
    pattern: Vec<u8>,
    key: Vec<u8>,
}

fn cases() -> Vec<Case> {
    let typical = |name, pattern: &str, key: &[u8]| Case {
        name,
        pattern: pattern.as_bytes().to_vec(),
        key: key.to_vec(),
    };
    // A 100-byte key that the typical patterns below have to look through.
    let mut key100 = b"sensors/building-7/floor-3/room-42/".to_vec();
    while key100.len() < 90 {
        key100.extend_from_slice(b"temp/");
    }
    key100.extend_from_slice(b"humid-xyz");
    key100.truncate(100);
    let probe = |name, stars_after: bool, n: usize| {
        let mut pattern = b"*".to_vec();
        pattern.extend(std::iter::repeat_n(b'a', n / 2));
        pattern.push(b'b');
        if stars_after {
            pattern.push(b'*');
        }
        Case {
            name,
            pattern,
            key: vec![b'a'; n],
        }
    };
    vec![
        typical("prefix-hit", "sensors/*", &key100),
        typical("prefix-miss", "actuators/*", &key100),
        typical("mid-hit", "*humid*", &key100),
        typical("mid-miss", "*pressure*", &key100),
        typical("class-hit", "[a-z]?n*", &key100),
        typical("class-miss", "[a-z]?x*", &key100),
        typical("literal-miss", "sensors/building-7", &key100),
        typical("two-stars", "sensors/*/room-*/humid*", &key100),
        // The probe: keys of 64 KiB of `a`, `*` + 32768 `a` + `b`.
        probe("probe", false, MAX_KEY),
        // The same with a star after the `b`: no anchored end to check.
        probe("probe-star", true, MAX_KEY),
        // Smaller versions (an eighth of the key), for callgrind.
        probe("probe-8k", false, MAX_KEY / 8),
        probe("probe-star-8k", true, MAX_KEY / 8),
        // Tables for `?` between stars: a row bit for each byte value, for
        // a key exactly as long as the pattern's fixed tokens.
        Case {
            name: "any-half",
            pattern: [&b"*"[..], &[b'?'; MAX_KEY / 2 - 1], b"b*"].concat(),
            key: vec![b'a'; MAX_KEY / 2],
        },
    ]
}

fn per_key(case: &Case) -> (Duration, u32) {
    let pattern = Pattern::new(&case.pattern);
    let mut runs = 0;
    let start = Instant::now();
    while runs == 0 || (start.elapsed() < Duration::from_millis(300) && runs < 1_000_000) {
        black_box(pattern.matches(black_box(&case.key)));
        runs += 1;
    }
    (start.elapsed() / runs, runs)
}

const NOW: u64 = 1_700_000_000_000;

/// A SCAN of `keys` keys like the probe's (64 KiB, all `a` but the last
/// bytes) with `pattern`: the time of the first page and of all pages.
fn per_page(keys: usize, pattern: &[u8]) -> (Duration, Duration, usize) {
    let mut store = Store::new(Config::default());
    let me = Caller {
        client_id: "bench",
        connection: 1,
        owner: "bench",
    };
    let ts = format!("{NOW}:0:bench");
    for i in 0..keys {
        let mut key = "a".repeat(MAX_KEY - 8);
        key.push_str(&format!("{i:08}"));
        let payload = encode_request(&["SET", &key, "v"]);
        let request = Request {
            payload: &payload,
            timestamp: Some(&ts),
            ..Request::default()
        };
        store.execute(&request, me, NOW);
    }
    let mut token: Option<Vec<u8>> = None;
    let (mut first, mut pages) = (None, 0);
    let start = Instant::now();
    loop {
        let mut args = vec![b"SCAN".to_vec(), pattern.to_vec()];
        args.extend(token.take());
        let payload = encode_request(&args);
        let request = Request {
            payload: &payload,
            ..Request::default()
        };
        let page_start = Instant::now();
        let out = store.execute(&request, me, NOW);
        first.get_or_insert(page_start.elapsed());
        pages += 1;
        let page = statestore::command::Page::decode(&out.payload).expect("a SCAN page");
        match page.token {
            Some(next) => token = Some(next),
            None => break,
        }
    }
    (first.unwrap_or_default(), start.elapsed(), pages)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [mode, name, n] = &args[..]
        && (mode == "key" || mode == "compile")
    {
        let case = cases()
            .into_iter()
            .find(|c| c.name == name)
            .expect("no such case");
        let pattern = Pattern::new(&case.pattern);
        if mode == "compile" {
            for _ in 0..n.parse::<u32>().expect("a count") {
                black_box(Pattern::new(black_box(&case.pattern)).matches(&case.key));
            }
            return;
        }
        for _ in 0..n.parse::<u32>().expect("a count") {
            black_box(pattern.matches(black_box(&case.key)));
        }
        return;
    }
    println!("per key: pattern against one key");
    for case in cases() {
        let (time, runs) = per_key(&case);
        println!(
            "  {:<14} pattern {:>6} B, key {:>6} B: {:>12.3?} per key ({runs} runs)",
            case.name,
            case.pattern.len(),
            case.key.len(),
            time,
        );
    }
    println!("per pattern: compile, then match one key (builds the tables)");
    for case in cases() {
        let mut runs = 0u32;
        let start = Instant::now();
        while runs == 0 || (start.elapsed() < Duration::from_millis(300) && runs < 1_000_000) {
            black_box(Pattern::new(black_box(&case.pattern)).matches(black_box(&case.key)));
            runs += 1;
        }
        let time = start.elapsed() / runs;
        println!("  {:<14} {time:>12.3?} ({runs} runs)", case.name);
    }
    println!("per page: SCAN over 10 keys like the probe's (default config)");
    for case in cases()
        .iter()
        .filter(|c| c.name == "probe" || c.name == "probe-star")
    {
        let (first, all, pages) = per_page(10, &case.pattern);
        let name = case.name;
        println!("  {name:<14} first page {first:>10.3?}, all {pages} pages {all:>10.3?}");
    }
}
