//! Small histories written by hand, each with a known verdict.

use statebroker_checker::history::{Condition, Event, HistoryError, Op, Operation, Outcome};
use statebroker_checker::{Answer, History, Report, ViolationKind, check};

/// Builds histories from (invoke, return) windows.
#[derive(Default)]
struct Builder {
    events: Vec<Event>,
    next_id: u64,
}

impl Builder {
    fn invoke(&mut self, process: u64, time_ns: u64, op: Op) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.events.push(Event::Invoke {
            id,
            process,
            time_ns,
            op,
        });
        id
    }

    /// `op` by `process` from `start` to `end`, answered `answer`.
    fn ok(&mut self, process: u64, start: u64, end: u64, op: Op, answer: &str) -> u64 {
        self.ok_v(process, start, end, op, answer, None)
    }

    fn ok_v(
        &mut self,
        process: u64,
        start: u64,
        end: u64,
        op: Op,
        answer: &str,
        version: Option<&str>,
    ) -> u64 {
        let id = self.invoke(process, start, op);
        self.events.push(Event::Ok {
            id,
            time_ns: end,
            answer: answer.parse().unwrap(),
            version: version.map(str::to_owned),
        });
        id
    }

    fn info(&mut self, process: u64, start: u64, end: u64, op: Op) {
        let id = self.invoke(process, start, op);
        self.events.push(Event::Info { id, time_ns: end });
    }

    fn fail(&mut self, process: u64, start: u64, end: u64, op: Op) {
        let id = self.invoke(process, start, op);
        self.events.push(Event::Fail { id, time_ns: end });
    }

    fn check(mut self) -> Report {
        self.events.sort_by_key(|e| e.time_ns());
        let history = History::from_events(self.events).unwrap();
        let report = check(&history);
        println!("{report}");
        report
    }
}

fn nx(key: &str, value: &str) -> Op {
    Op::Set {
        key: key.into(),
        value: value.into(),
        condition: Some(Condition::Nx),
        px: None,
        ft: None,
    }
}

fn fenced(key: &str, value: &str, ft: &str) -> Op {
    Op::Set {
        key: key.into(),
        value: value.into(),
        condition: None,
        px: None,
        ft: Some(ft.into()),
    }
}

fn only_kind(report: &Report, kind: ViolationKind) -> bool {
    !report.violations.is_empty() && report.violations.iter().all(|v| v.kind == kind)
}

#[test]
fn a_valid_concurrent_history_passes() {
    let mut h = Builder::default();
    h.ok(1, 0, 10, Op::set("k", "a"), "+OK");
    h.ok(2, 5, 15, Op::set("k", "b"), "+OK");
    // Both orders of the two SETs are possible while they overlap; this read
    // chooses "b then a".
    h.ok(3, 12, 20, Op::get("k"), "$a");
    h.ok(1, 21, 30, Op::get("k"), "$a");
    h.ok(2, 22, 31, nx("k", "c"), ":-1");
    h.ok(3, 25, 40, Op::vdel("k", "b"), ":-1");
    h.ok(1, 35, 45, Op::vdel("k", "a"), ":1");
    h.ok(2, 41, 50, Op::get("k"), "$-1");
    h.ok(3, 46, 55, Op::del("k"), ":0");
    h.ok(1, 46, 56, Op::get("other"), "$-1");
    let report = h.check();
    assert!(report.is_valid(), "{report}");
    assert_eq!((report.keys, report.ops), (2, 10));
}

#[test]
fn a_stale_read_is_flagged() {
    let mut h = Builder::default();
    h.ok(1, 0, 10, Op::set("k", "a"), "+OK");
    h.ok(2, 20, 30, Op::set("k", "b"), "+OK");
    h.ok(3, 40, 50, Op::get("k"), "$a");
    let report = h.check();
    assert!(
        only_kind(&report, ViolationKind::NotLinearizable),
        "{report}"
    );
    let v = &report.violations[0];
    assert_eq!(v.key, "k");
    assert!(v.message.contains("$a"), "{}", v.message);
    assert!(v.ops.iter().any(|op| op.id == 2), "the read is shown");
}

#[test]
fn a_read_concurrent_with_the_overwrite_may_see_the_old_value() {
    let mut h = Builder::default();
    h.ok(1, 0, 10, Op::set("k", "a"), "+OK");
    h.ok(2, 20, 45, Op::set("k", "b"), "+OK");
    h.ok(3, 40, 50, Op::get("k"), "$a");
    h.ok(3, 51, 60, Op::get("k"), "$b");
    assert!(h.check().is_valid());
}

#[test]
fn a_lost_update_is_flagged() {
    // Two NX on a key nobody deletes: only the first may succeed.
    let mut h = Builder::default();
    h.ok(1, 0, 10, nx("lock", "p1"), "+OK");
    h.ok(2, 20, 30, nx("lock", "p2"), "+OK");
    let report = h.check();
    assert!(
        only_kind(&report, ViolationKind::NotLinearizable),
        "{report}"
    );

    // Even if they overlap.
    let mut h = Builder::default();
    h.ok(1, 0, 10, nx("lock", "p1"), "+OK");
    h.ok(2, 5, 30, nx("lock", "p2"), "+OK");
    assert!(!h.check().is_valid());

    // With a DEL in between, both may.
    let mut h = Builder::default();
    h.ok(1, 0, 10, nx("lock", "p1"), "+OK");
    h.ok(3, 12, 15, Op::del("lock"), ":1");
    h.ok(2, 20, 30, nx("lock", "p2"), "+OK");
    assert!(h.check().is_valid());
}

#[test]
fn an_unknown_outcome_may_explain_a_later_read_or_never_happen() {
    for (read, valid) in [("$b", true), ("$a", true), ("$c", false)] {
        let mut h = Builder::default();
        h.ok(1, 0, 10, Op::set("k", "a"), "+OK");
        h.info(2, 20, 30, Op::set("k", "b"));
        h.ok(3, 100, 110, Op::get("k"), read);
        assert_eq!(h.check().is_valid(), valid, "{read}");
    }
    // It may take effect long after it timed out: after one read, before
    // the next.
    let mut h = Builder::default();
    h.ok(1, 0, 10, Op::set("k", "a"), "+OK");
    h.info(2, 20, 30, Op::set("k", "b"));
    h.ok(3, 100, 110, Op::get("k"), "$a");
    h.ok(3, 200, 210, Op::get("k"), "$b");
    assert!(h.check().is_valid());
    // But only once: not a, b, a.
    let mut h = Builder::default();
    h.ok(1, 0, 10, Op::set("k", "a"), "+OK");
    h.info(2, 20, 30, Op::set("k", "b"));
    h.ok(3, 100, 110, Op::get("k"), "$b");
    h.ok(3, 200, 210, Op::get("k"), "$a");
    assert!(!h.check().is_valid());
    // An operation never completed counts as unknown.
    let mut h = Builder::default();
    h.ok(1, 0, 10, Op::set("k", "a"), "+OK");
    h.invoke(2, 20, Op::del("k"));
    h.ok(3, 100, 110, Op::get("k"), "$-1");
    assert!(h.check().is_valid());
}

#[test]
fn a_failed_operation_never_took_effect() {
    let mut h = Builder::default();
    h.ok(1, 0, 10, Op::set("k", "a"), "+OK");
    h.fail(2, 20, 30, Op::set("k", "b"));
    h.ok(3, 40, 50, Op::get("k"), "$b");
    assert!(!h.check().is_valid());
}

#[test]
fn errors_outside_the_model_count_as_not_applied() {
    let mut h = Builder::default();
    h.ok(
        1,
        0,
        10,
        Op::set("k", "a"),
        "-ERR the quota has been exceeded",
    );
    h.ok(2, 20, 30, Op::get("k"), "$-1");
    let report = h.check();
    assert!(report.is_valid(), "{report}");
    assert_eq!(report.ops, 1);
}

#[test]
fn fencing_tokens_follow_the_model() {
    let old = "001700000000000:00001:n1";
    let new = "001700000000005:00000:n2";
    // The refusal is what the model answers: valid.
    let mut h = Builder::default();
    h.ok(1, 0, 10, fenced("res", "a", new), "+OK");
    h.ok(
        2,
        20,
        30,
        fenced("res", "b", old),
        "-ERR the request fencing token is a lower version than the fencing token protecting the resource",
    );
    h.ok(
        3,
        40,
        50,
        Op::set("res", "c"),
        "-ERR a fencing token is required for this request",
    );
    h.ok(3, 60, 70, Op::get("res"), "$a");
    h.ok(3, 80, 90, fenced("res", "d", new), "+OK");
    let report = h.check();
    assert!(report.is_valid(), "{report}");

    // The old token accepted: both checks flag it.
    let mut h = Builder::default();
    h.ok(1, 0, 10, fenced("res", "a", new), "+OK");
    h.ok(2, 20, 30, fenced("res", "b", old), "+OK");
    let report = h.check();
    let kinds: Vec<_> = report.violations.iter().map(|v| v.kind).collect();
    assert_eq!(
        kinds,
        [
            ViolationKind::NotLinearizable,
            ViolationKind::StaleFencingTokenAccepted
        ],
        "{report}"
    );

    // A DEL in between removes the token: the old one may set it again.
    let mut h = Builder::default();
    h.ok(1, 0, 10, fenced("res", "a", new), "+OK");
    h.ok(
        3,
        12,
        15,
        Op::Del {
            key: "res".into(),
            ft: Some(new.into()),
        },
        ":1",
    );
    h.ok(2, 20, 30, fenced("res", "b", old), "+OK");
    let report = h.check();
    assert!(report.is_valid(), "{report}");
}

#[test]
fn versions_must_rise_in_real_time() {
    let v1 = "001700000000000:00001:n1";
    let v2 = "001700000000000:00002:n2";
    let v3 = "001700000000001:00000:n1";
    // Overlapping SETs may get versions in either order.
    let mut h = Builder::default();
    h.ok_v(1, 0, 10, Op::set("k", "a"), "+OK", Some(v2));
    h.ok_v(2, 5, 15, Op::set("k", "b"), "+OK", Some(v1));
    h.ok_v(3, 20, 30, Op::set("k", "c"), "+OK", Some(v3));
    assert!(h.check().is_valid());

    // Not when one returned before the other was invoked; the node id does
    // not break ties, and the padding does not matter.
    for later in [v1, "001700000000000:00002:zzz", "1700000000000:1:n1"] {
        let mut h = Builder::default();
        h.ok_v(1, 0, 10, Op::set("k", "a"), "+OK", Some(v2));
        h.ok_v(2, 20, 30, Op::set("k", "b"), "+OK", Some(later));
        let report = h.check();
        assert!(
            only_kind(&report, ViolationKind::VersionNotIncreasing),
            "{later}: {report}"
        );
    }

    let mut h = Builder::default();
    h.ok_v(1, 0, 10, Op::set("k", "a"), "+OK", Some("yesterday"));
    let report = h.check();
    assert!(
        only_kind(&report, ViolationKind::MalformedVersion),
        "{report}"
    );
}

#[test]
fn the_record_format_is_the_documented_one() {
    let invoke = Event::Invoke {
        id: 17,
        process: 3,
        time_ns: 123,
        op: Op::Set {
            key: "k1".into(),
            value: "v".into(),
            condition: Some(Condition::Nx),
            px: Some(5000),
            ft: None,
        },
    };
    assert_eq!(
        serde_json::to_string(&invoke).unwrap(),
        r#"{"type":"invoke","id":17,"process":3,"time_ns":123,"op":{"f":"set","key":"k1","value":"v","condition":"nx","px":5000,"ft":null}}"#
    );
    let ok = Event::Ok {
        id: 17,
        time_ns: 456,
        answer: Answer::ok(),
        version: Some("001700000000000:00001:node1".into()),
    };
    assert_eq!(
        serde_json::to_string(&ok).unwrap(),
        r#"{"type":"ok","id":17,"time_ns":456,"answer":"+OK","version":"001700000000000:00001:node1"}"#
    );
    let text = r#"
{"type":"invoke","id":1,"process":1,"time_ns":1,"op":{"f":"vdel","key":"k","value":"v"}}
{"type":"invoke","id":2,"process":2,"time_ns":2,"op":{"f":"get","key":"k"}}
{"type":"ok","id":1,"time_ns":3,"answer":":0"}
{"type":"fail","id":2,"time_ns":4}
{"type":"invoke","id":3,"process":3,"time_ns":5,"op":{"f":"del","key":"k","ft":"5:0:n"}}
{"type":"info","id":3,"time_ns":6}
{"type":"invoke","id":4,"process":4,"time_ns":7,"op":{"f":"get","key":"k"}}
{"type":"ok","id":4,"time_ns":8,"answer":"$hello world"}
"#;
    let history = History::read(text.as_bytes()).unwrap();
    let ops: Vec<&Operation> = history.ops().iter().collect();
    assert_eq!(ops.len(), 4);
    assert_eq!(ops[0].op, Op::vdel("k", "v"));
    assert_eq!(ops[1].outcome, Outcome::Fail { time_ns: 4 });
    assert_eq!(ops[2].outcome, Outcome::Info { time_ns: Some(6) });
    assert_eq!(ops[3].answer(), Some(&Answer::Bulk("hello world".into())));
    // Nobody set "hello world".
    assert!(!check(&history).is_valid());
    // Round trip.
    let mut out = Vec::new();
    history.write_jsonl(&mut out).unwrap();
    assert_eq!(History::read(&out[..]).unwrap(), history);
}

#[test]
fn answers_parse_as_documented() {
    for (text, answer) in [
        ("+OK", Answer::ok()),
        (":-1", Answer::Integer(-1)),
        (":1", Answer::Integer(1)),
        ("$-1", Answer::Nil),
        ("$", Answer::Bulk(String::new())),
        ("$hello", Answer::Bulk("hello".into())),
        (
            "-ERR syntax error",
            Answer::Error("ERR syntax error".into()),
        ),
    ] {
        assert_eq!(text.parse::<Answer>().unwrap(), answer);
        assert_eq!(answer.to_string(), text);
    }
    for bad in ["", "OK", ":x", ":", "-", "é"] {
        assert!(bad.parse::<Answer>().is_err(), "{bad:?}");
    }
    assert_eq!(
        Answer::from_resp3(b"$5\r\nhello\r\n").unwrap(),
        Answer::Bulk("hello".into())
    );
    assert_eq!(Answer::from_resp3(b"$-1\r\n").unwrap(), Answer::Nil);
    assert!(Answer::from_resp3(b"$5\r\nhel").is_err());
}

#[test]
fn malformed_histories_are_clear_errors() {
    let cases = [
        ("not json\n", "line 1"),
        (
            "\n{\"type\":\"invoke\",\"id\":1,\"process\":1,\"time_ns\":1,\"op\":{\"f\":\"nope\",\"key\":\"k\"}}\n",
            "line 2",
        ),
        (
            "{\"type\":\"ok\",\"id\":1,\"time_ns\":1,\"answer\":\"+OK\"}\n",
            "never invoked",
        ),
        (
            "{\"type\":\"invoke\",\"id\":1,\"process\":1,\"time_ns\":1,\"op\":{\"f\":\"get\",\"key\":\"k\"}}\n\
             {\"type\":\"ok\",\"id\":1,\"time_ns\":2,\"answer\":\"OK\"}\n",
            "line 2",
        ),
        (
            "{\"type\":\"invoke\",\"id\":1,\"process\":1,\"time_ns\":5,\"op\":{\"f\":\"get\",\"key\":\"k\"}}\n\
             {\"type\":\"ok\",\"id\":1,\"time_ns\":2,\"answer\":\"$-1\"}\n",
            "before its invoke",
        ),
        (
            "{\"type\":\"invoke\",\"id\":1,\"process\":1,\"time_ns\":1,\"op\":{\"f\":\"get\",\"key\":\"k\"}}\n\
             {\"type\":\"fail\",\"id\":1,\"time_ns\":2}\n{\"type\":\"fail\",\"id\":1,\"time_ns\":3}\n",
            "completes twice",
        ),
        (
            "{\"type\":\"invoke\",\"id\":1,\"process\":1,\"time_ns\":1,\"op\":{\"f\":\"get\",\"key\":\"k\"}}\n\
             {\"type\":\"invoke\",\"id\":1,\"process\":1,\"time_ns\":2,\"op\":{\"f\":\"get\",\"key\":\"k\"}}\n",
            "invoked twice",
        ),
    ];
    for (text, expected) in cases {
        let error = History::read(text.as_bytes()).unwrap_err();
        let message = error.to_string();
        assert!(message.contains(expected), "{text:?}: {message}");
    }
    let missing = History::load("/nonexistent/history.jsonl").unwrap_err();
    assert!(matches!(missing, HistoryError::Io { .. }));
    assert!(missing.to_string().contains("/nonexistent/history.jsonl"));
}

#[test]
fn a_search_past_its_limit_is_undecided_not_judged() {
    let mut h = Builder::default();
    h.ok(1, 0, 10, Op::set("k", "a"), "+OK");
    h.ok(2, 20, 30, Op::set("k", "b"), "+OK");
    h.ok(3, 40, 50, Op::get("k"), "$a");
    h.events.sort_by_key(|e| e.time_ns());
    let history = History::from_events(h.events).unwrap();
    let options = statebroker_checker::linearizability::Options {
        max_steps_per_key: 2,
        threads: 1,
    };
    let report = statebroker_checker::linearizability::check_with(&history, &options);
    assert!(report.violations.is_empty(), "{report}");
    assert_eq!(report.undecided, ["k"]);
    assert!(!report.is_valid());
}
