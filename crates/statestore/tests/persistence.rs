//! What the store asks the broker to make durable, and how it comes back.

use statestore::hlc::Version;
use statestore::persist::{PersistPolicy, Record, Write};
use statestore::resp3::encode_request;
use statestore::{Caller, Config, Outcome, Request, Store};

const T0: u64 = 1_700_000_000_000;
const ME: Caller<'static> = Caller {
    client_id: "me",
    connection: 1,
    owner: "me",
};

fn run(store: &mut Store, args: &[&str], persist: bool, now: u64) -> Outcome {
    let payload = encode_request(args);
    let ts = format!("{now}:0:me");
    store.execute(
        &Request {
            payload: &payload,
            timestamp: Some(&ts),
            persist,
            ..Request::default()
        },
        ME,
        now,
    )
}

fn puts(out: &Outcome) -> Vec<&Record> {
    out.writes
        .iter()
        .filter_map(|w| match w {
            Write::Put(r) => Some(r),
            _ => None,
        })
        .collect()
}

#[test]
fn persisted_keys_produce_writes_and_stay_persisted() {
    let mut s = Store::new(Config::default());
    assert!(
        run(&mut s, &["SET", "plain", "v"], false, T0)
            .writes
            .is_empty()
    );

    let out = run(&mut s, &["SET", "k", "v1", "PX", "5000"], true, T0);
    let r = puts(&out)[0];
    assert_eq!(
        (r.key.as_slice(), r.value.as_slice(), r.expires_at),
        (&b"k"[..], &b"v1"[..], Some(T0 + 5000))
    );
    assert_eq!(r.version.format("statebroker"), out.timestamp);

    // A later SET without the property keeps the key persisted.
    let out = run(&mut s, &["SET", "k", "v2"], false, T0 + 1);
    assert_eq!(puts(&out)[0].value, b"v2");
    assert_eq!(
        run(&mut s, &["DEL", "k"], false, T0 + 2).writes,
        vec![Write::Delete(b"k".to_vec())]
    );
    // Deleted: a new plain SET is not persisted any more.
    assert!(
        run(&mut s, &["SET", "k", "v3"], false, T0 + 3)
            .writes
            .is_empty()
    );

    run(&mut s, &["SET", "v", "x"], true, T0 + 4);
    assert_eq!(
        run(&mut s, &["VDEL", "v", "x"], false, T0 + 5).writes,
        vec![Write::Delete(b"v".to_vec())]
    );
    // Not applied: nothing to write.
    run(&mut s, &["SET", "n", "x"], true, T0 + 6);
    assert!(
        run(&mut s, &["SET", "n", "y", "NX"], true, T0 + 7)
            .writes
            .is_empty()
    );
    assert!(
        run(&mut s, &["VDEL", "n", "y"], false, T0 + 8)
            .writes
            .is_empty()
    );
}

#[test]
fn expiry_of_a_persisted_key_is_a_delete() {
    let mut s = Store::new(Config::default());
    run(&mut s, &["SET", "ttl", "v", "PX", "10"], true, T0);
    let fx = s.expire(T0 + 10);
    assert_eq!(fx.writes, vec![Write::Delete(b"ttl".to_vec())]);
}

#[test]
fn policy_persists_without_the_property() {
    let mut s = Store::new(Config {
        persist_policy: PersistPolicy::parse(&["glob:cfg/*", "exact:lock"]).unwrap(),
        ..Config::default()
    });
    assert_eq!(
        puts(&run(&mut s, &["SET", "cfg/a", "1"], false, T0)).len(),
        1
    );
    assert_eq!(
        puts(&run(&mut s, &["SET", "lock", "1"], false, T0)).len(),
        1
    );
    assert!(
        run(&mut s, &["SET", "other", "1"], false, T0)
            .writes
            .is_empty()
    );
}

/// The clock marks an outcome writes.
fn marks(out: &Outcome) -> Vec<u64> {
    out.writes
        .iter()
        .filter_map(|w| match w {
            Write::ClockMark(m) => Some(*m),
            _ => None,
        })
        .collect()
}

#[test]
fn clock_marks_run_a_lease_ahead() {
    let mut s = Store::new(Config {
        clock_lease_ms: Some(10_000),
        ..Config::default()
    });
    assert_eq!(
        marks(&run(&mut s, &["SET", "a", "1"], false, T0)),
        vec![T0 + 10_000]
    );
    assert!(marks(&run(&mut s, &["SET", "a", "2"], false, T0 + 4_999)).is_empty());
    assert_eq!(
        marks(&run(&mut s, &["SET", "a", "3"], false, T0 + 5_000)),
        vec![T0 + 15_000]
    );
    // Reads hand out no versions: no marks.
    assert!(marks(&run(&mut s, &["GET", "a"], false, T0 + 9_000)).is_empty());
}

/// After a crash the clock starts at the last mark, ahead of the wall
/// clock: the next mark goes just past its versions, not a lease past
/// them, so the next crash's clock is not a lease further ahead (it was:
/// eight quick restarts put versions 70 s ahead, and the fencing tokens
/// of locks taken then were refused as from the future). Once the wall
/// clock catches up, marks run a lease ahead of it again.
#[test]
fn a_clock_ahead_of_the_wall_clock_marks_just_past_its_versions() {
    let lease = 10_000;
    let config = || Config {
        clock_lease_ms: Some(lease),
        ..Config::default()
    };
    let mut mark = T0 + lease;
    let mut now = T0;
    for crash in 0..5 {
        let (mut s, _) = Store::restore(config(), Vec::new(), Some(mark), now);
        let set = run(&mut s, &["SET", "k", "v"], false, now);
        assert!(
            set.timestamp.starts_with(&format!("{mark:015}:")),
            "{crash}: {}",
            set.timestamp
        );
        let written = marks(&set);
        assert_eq!(written.len(), 1);
        assert!(
            written[0] <= mark.max(now + lease) + 10,
            "crash {crash}: mark {} for versions at {mark}, wall clock {now}",
            written[0]
        );
        assert!(marks(&run(&mut s, &["SET", "k", "w"], false, now)).is_empty());
        mark = written[0];
        now += 100;
    }
    // A lease ahead of the wall clock at most, not five leases.
    assert!(
        mark <= now + lease,
        "five crashes pushed the mark to {mark} (wall clock {now})"
    );
    // The wall clock past the versions: a lease ahead of it again.
    let (mut s, _) = Store::restore(config(), Vec::new(), Some(mark), mark + 1);
    assert_eq!(
        marks(&run(&mut s, &["SET", "k", "v"], false, mark + 1)),
        vec![mark + 1 + lease]
    );
}

#[test]
fn restore_brings_back_values_versions_tokens_and_expiry() {
    let records = vec![
        Record {
            key: b"kept".to_vec(),
            value: b"v".to_vec(),
            version: Version {
                wall_ms: T0 - 10,
                counter: 3,
            },
            fencing_token: Some(format!("{}:0:lock", T0 - 20).parse().unwrap()),
            expires_at: Some(T0 + 60_000),
        },
        Record {
            key: b"gone".to_vec(),
            value: b"v".to_vec(),
            version: Version {
                wall_ms: T0 - 5,
                counter: 0,
            },
            fencing_token: None,
            expires_at: Some(T0 - 1),
        },
    ];
    let mark = T0 + 7_000;
    let (mut s, restored) = Store::restore(Config::default(), records, Some(mark), T0);
    assert_eq!(restored.keys, 1);
    assert_eq!(restored.expired, vec![b"gone".to_vec()]);
    let get = run(&mut s, &["GET", "kept"], false, T0);
    assert_eq!(get.payload, b"$1\r\nv\r\n");
    assert_eq!(
        get.timestamp,
        Version {
            wall_ms: T0 - 10,
            counter: 3
        }
        .format("statebroker")
    );
    assert_eq!(run(&mut s, &["GET", "gone"], false, T0).payload, b"$-1\r\n");
    // The token is back: writes need it.
    assert!(
        run(&mut s, &["DEL", "kept"], false, T0)
            .payload
            .starts_with(b"-ERR a fencing token")
    );
    // Versions start above the mark, even with the wall clock behind it.
    let set = run(&mut s, &["SET", "new", "v"], false, T0);
    assert_eq!(
        set.timestamp,
        Version {
            wall_ms: mark,
            counter: 1
        }
        .format("statebroker")
    );
    // The key expires on time.
    assert_eq!(
        s.expire(T0 + 60_000).writes,
        vec![Write::Delete(b"kept".to_vec())]
    );
}
