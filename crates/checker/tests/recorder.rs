//! The recorder under real concurrency, the file it writes, and the
//! `statebroker-check` binary.

use std::process::Command;
use std::sync::{Arc, Mutex};

use statebroker_checker::history::{Answer, Op, Recorder};
use statebroker_checker::{History, check};
use statestore::resp3::encode_request;
use statestore::{Caller, Config, Request, Store};

/// 12 threads share one store behind a lock and record what they do: the
/// history, from memory or from the file, is valid and the same.
#[test]
fn threads_record_a_valid_history_to_memory_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("history.jsonl");
    let recorder = Arc::new(Recorder::create(&path, true).unwrap());
    let store = Arc::new(Mutex::new(Store::new(Config::default())));
    let threads: Vec<_> = (0..12u64)
        .map(|process| {
            let (recorder, store) = (Arc::clone(&recorder), Arc::clone(&store));
            std::thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(process);
                for n in 0..200 {
                    let key = format!("k{}", rng.u32(0..3));
                    let op = match rng.u32(0..4) {
                        0 => Op::get(key),
                        1 => Op::del(key),
                        2 => Op::vdel(key, "a"),
                        _ => Op::set(key, if rng.bool() { "a" } else { "b" }),
                    };
                    let payload = encode_request(&op.args());
                    let id = recorder.invoke(process, op);
                    let now = 1_700_000_000_000 + n;
                    let ts = format!("{now}:0:p{process}");
                    let request = Request {
                        payload: &payload,
                        timestamp: Some(&ts),
                        ..Request::default()
                    };
                    let caller = Caller {
                        client_id: "c",
                        connection: process,
                        owner: "c",
                    };
                    let out = store.lock().unwrap().execute(&request, caller, now);
                    std::thread::yield_now();
                    let answer = Answer::from_resp3(&out.payload).unwrap();
                    recorder.ok(id, answer, Some(out.timestamp.into()));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    recorder.flush().unwrap();
    let in_memory = recorder.history().unwrap();
    assert_eq!(in_memory.len(), 12 * 200);
    let from_file = History::load(&path).unwrap();
    assert_eq!(from_file, in_memory);
    let report = check(&from_file);
    assert!(report.is_valid(), "{report}");
    assert_eq!(report.keys, 3);
}

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn run(path: &std::path::Path) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_statebroker-check"))
        .arg(path)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_binary_exits_1_on_violations() {
    let dir = tempfile::tempdir().unwrap();
    let set = |id: u64, t: u64, v: &str| {
        format!(
            "{{\"type\":\"invoke\",\"id\":{id},\"process\":{id},\"time_ns\":{t},\"op\":{{\"f\":\"set\",\"key\":\"k\",\"value\":\"{v}\"}}}}\n\
             {{\"type\":\"ok\",\"id\":{id},\"time_ns\":{},\"answer\":\"+OK\",\"version\":\"00000000000{t}:00000:n\"}}\n",
            t + 5
        )
    };
    let get = "{\"type\":\"invoke\",\"id\":9,\"process\":9,\"time_ns\":50,\"op\":{\"f\":\"get\",\"key\":\"k\"}}\n\
               {\"type\":\"ok\",\"id\":9,\"time_ns\":60,\"answer\":\"$a\"}\n";

    let valid = write(
        &dir,
        "valid.jsonl",
        &(set(1, 10, "b") + &set(2, 20, "a") + get),
    );
    let (code, stdout, _) = run(&valid);
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.contains("1 keys, 3 operations: 0 violations"),
        "{stdout}"
    );

    let stale = write(
        &dir,
        "stale.jsonl",
        &(set(1, 10, "a") + &set(2, 20, "b") + get),
    );
    let (code, stdout, _) = run(&stale);
    assert_eq!(code, Some(1), "{stdout}");
    assert!(stdout.contains("NotLinearizable on key \"k\""), "{stdout}");

    let broken = write(
        &dir,
        "broken.jsonl",
        &(set(1, 10, "a") + "{\"type\":\"ok\""),
    );
    let (code, _, stderr) = run(&broken);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("line 3"), "{stderr}");

    let (code, _, stderr) = run(&dir.path().join("missing.jsonl"));
    assert_eq!(code, Some(2));
    assert!(stderr.contains("missing.jsonl"), "{stderr}");
}
