//! The state store protocol, request by request: each test is a row of the
//! answers table (request -> response payload, `__ts`, notifications).

use statestore::command::Page;
use statestore::hlc::Hlc;
use statestore::resp3::encode_request;
use statestore::{Caller, Config, Dialect, Event, Outcome, Quota, Request, Store};

const T0: u64 = 1_700_000_000_000;

struct Harness {
    store: Store,
    now: u64,
}

/// One request under construction.
struct Req<'h> {
    h: &'h mut Harness,
    args: Vec<Vec<u8>>,
    client: &'static str,
    connection: u64,
    owner: &'static str,
    ts: Option<String>,
    ft: Option<String>,
    persist: bool,
    dialect: Dialect,
    raw: Option<Vec<u8>>,
}

impl Harness {
    fn new() -> Harness {
        Harness::with(Config::default())
    }

    fn with(config: Config) -> Harness {
        Harness {
            store: Store::new(config),
            now: T0,
        }
    }

    /// A request from client "c1" on connection 1 (its own owner) with a
    /// `__ts` of now.
    fn req<A: AsRef<[u8]>>(&mut self, args: &[A]) -> Req<'_> {
        let ts = Some(format!("{}:0:c1", self.now));
        Req {
            h: self,
            args: args.iter().map(|a| a.as_ref().to_vec()).collect(),
            client: "c1",
            connection: 1,
            owner: "c1",
            ts,
            ft: None,
            persist: false,
            dialect: Dialect::V1,
            raw: None,
        }
    }

    /// Shorthand: send and return the payload.
    fn run<A: AsRef<[u8]>>(&mut self, args: &[A]) -> Vec<u8> {
        self.req(args).send().payload
    }
}

impl Req<'_> {
    /// From `client` on `connection`, counted against itself as owner.
    fn from(mut self, client: &'static str, connection: u64) -> Self {
        self.client = client;
        self.connection = connection;
        self.owner = client;
        self
    }
    /// Counted against `owner` (a user's several clients share one).
    fn owner(mut self, owner: &'static str) -> Self {
        self.owner = owner;
        self
    }
    fn ts(mut self, ts: Option<&str>) -> Self {
        self.ts = ts.map(str::to_owned);
        self
    }
    fn ft(mut self, ft: &str) -> Self {
        self.ft = Some(ft.to_owned());
        self
    }
    fn dialect(mut self, d: Dialect) -> Self {
        self.dialect = d;
        self
    }
    fn raw(mut self, payload: &[u8]) -> Self {
        self.raw = Some(payload.to_vec());
        self
    }
    fn send(self) -> Outcome {
        let payload = self.raw.unwrap_or_else(|| encode_request(&self.args));
        let request = Request {
            payload: &payload,
            timestamp: self.ts.as_deref(),
            fencing_token: self.ft.as_deref(),
            persist: self.persist,
            dialect: self.dialect,
            access: None,
        };
        let caller = Caller {
            client_id: self.client,
            connection: self.connection,
            owner: self.owner,
        };
        self.h.store.execute(&request, caller, self.h.now)
    }
}

fn hlc(s: &str) -> Hlc {
    s.parse().expect("an HLC")
}

fn err(text: &str) -> Vec<u8> {
    format!("-ERR {text}\r\n").into_bytes()
}

// ---------------------------------------------------------------- SET / GET

#[test]
fn set_new_key_then_get_it() {
    let mut h = Harness::new();
    let out = h.req(&["SET", "k", "v"]).send();
    assert_eq!(out.payload, b"+OK\r\n");
    let version = out.timestamp;
    let out = h.req(&["GET", "k"]).send();
    assert_eq!(out.payload, b"$1\r\nv\r\n");
    assert_eq!(out.timestamp, version, "GET answers the key's version");
}

#[test]
fn set_existing_key_overwrites_with_a_newer_version() {
    let mut h = Harness::new();
    let v1 = hlc(&h.req(&["SET", "k", "v1"]).send().timestamp);
    let v2 = hlc(&h.req(&["SET", "k", "v2"]).send().timestamp);
    assert!(v2.cmp_time(&v1).is_gt());
    assert_eq!(h.run(&["GET", "k"]), b"$2\r\nv2\r\n");
}

#[test]
fn get_missing_key_is_null() {
    let mut h = Harness::new();
    assert_eq!(h.run(&["GET", "nope"]), b"$-1\r\n");
}

#[test]
fn keys_and_values_are_arbitrary_bytes() {
    let mut h = Harness::new();
    let key = b"\x00\r\n\xff*$".to_vec();
    let value = b"\r\n\r\n\x00".to_vec();
    assert_eq!(
        h.run(&[b"SET".to_vec(), key.clone(), value.clone()]),
        b"+OK\r\n"
    );
    let mut expected = b"$5\r\n".to_vec();
    expected.extend_from_slice(&value);
    expected.extend_from_slice(b"\r\n");
    assert_eq!(h.run(&[b"GET".to_vec(), key]), expected);
    assert_eq!(h.run(&["SET", "empty", ""]), b"+OK\r\n");
    assert_eq!(h.run(&["GET", "empty"]), b"$0\r\n\r\n");
}

#[test]
fn set_nx() {
    let mut h = Harness::new();
    assert_eq!(h.run(&["SET", "k", "a", "NX"]), b"+OK\r\n");
    assert_eq!(h.run(&["SET", "k", "b", "NX"]), b":-1\r\n");
    assert_eq!(h.run(&["GET", "k"]), b"$1\r\na\r\n");
}

#[test]
fn set_nex() {
    let mut h = Harness::new();
    assert_eq!(
        h.run(&["SET", "lock", "me", "NEX"]),
        b"+OK\r\n",
        "absent: applied"
    );
    assert_eq!(
        h.run(&["SET", "lock", "me", "NEX"]),
        b"+OK\r\n",
        "same value: applied"
    );
    assert_eq!(
        h.run(&["SET", "lock", "you", "NEX"]),
        b":-1\r\n",
        "other value: not applied"
    );
    assert_eq!(h.run(&["GET", "lock"]), b"$2\r\nme\r\n");
}

#[test]
fn not_applied_set_reports_the_existing_version() {
    let mut h = Harness::new();
    let v1 = h.req(&["SET", "k", "a"]).send().timestamp;
    let out = h.req(&["SET", "k", "b", "NX"]).send();
    assert_eq!(out.payload, b":-1\r\n");
    assert_eq!(out.timestamp, v1);
}

#[test]
fn set_without_timestamp_is_refused() {
    let mut h = Harness::new();
    assert_eq!(
        h.req(&["SET", "k", "v"]).ts(None).send().payload,
        err("missing timestamp")
    );
    assert_eq!(h.run(&["GET", "k"]), b"$-1\r\n", "nothing was written");
    // Other commands do not need one.
    assert_eq!(h.req(&["GET", "k"]).ts(None).send().payload, b"$-1\r\n");
    assert_eq!(h.req(&["DEL", "k"]).ts(None).send().payload, b":0\r\n");
}

// ---------------------------------------------------------------- DEL / VDEL

#[test]
fn del() {
    let mut h = Harness::new();
    let version = h.req(&["SET", "k", "v"]).send().timestamp;
    let out = h.req(&["DEL", "k"]).send();
    assert_eq!(out.payload, b":1\r\n");
    assert_eq!(
        out.timestamp, version,
        "DEL answers the version the key had"
    );
    assert_eq!(h.run(&["DEL", "k"]), b":0\r\n");
    assert_eq!(h.run(&["GET", "k"]), b"$-1\r\n");
}

#[test]
fn vdel() {
    let mut h = Harness::new();
    assert_eq!(h.run(&["VDEL", "k", "v"]), b":0\r\n", "missing");
    let version = h.req(&["SET", "k", "v"]).send().timestamp;
    assert_eq!(h.run(&["VDEL", "k", "other"]), b":-1\r\n", "value differs");
    assert_eq!(h.run(&["GET", "k"]), b"$1\r\nv\r\n");
    let out = h.req(&["VDEL", "k", "v"]).send();
    assert_eq!(out.payload, b":1\r\n");
    assert_eq!(out.timestamp, version);
    assert_eq!(h.run(&["GET", "k"]), b"$-1\r\n");
}

// ---------------------------------------------------------------- versions

#[test]
fn versions_beat_the_request_timestamp_and_everything_before() {
    let mut h = Harness::new();
    let ahead = format!("{}:41:other-node", T0 + 30_000);
    let v = hlc(&h.req(&["SET", "a", "1"]).ts(Some(&ahead)).send().timestamp);
    assert_eq!(
        (v.wall_ms, v.counter, v.node.as_str()),
        (T0 + 30_000, 42, "statebroker")
    );
    // The wall clock is behind the last version: the counter still rises.
    let w = hlc(&h.req(&["SET", "b", "2"]).send().timestamp);
    assert!(w.cmp_time(&v).is_gt());
    // The wall clock steps back.
    h.now -= 10_000;
    let x = hlc(&h.req(&["SET", "c", "3"]).send().timestamp);
    assert!(x.cmp_time(&w).is_gt());
}

#[test]
fn configured_node_id_appears_in_versions() {
    let mut h = Harness::with(Config {
        node_id: "edge-7".into(),
        ..Config::default()
    });
    assert!(
        h.req(&["SET", "k", "v"])
            .send()
            .timestamp
            .ends_with(":edge-7")
    );
}

// ---------------------------------------------------------------- timestamps

#[test]
fn timestamp_skew() {
    let mut h = Harness::new();
    let too_far = format!("{}:0:c1", T0 + 60_001);
    let just_ok = format!("{}:0:c1", T0 + 60_000);
    let behind = format!("{}:0:c1", T0 - 3_600_000);
    let skew = err(
        "the request timestamp is too far in the future; ensure that the client and broker system clocks are synchronized",
    );
    assert_eq!(
        h.req(&["SET", "k", "v"]).ts(Some(&too_far)).send().payload,
        skew
    );
    assert_eq!(h.req(&["GET", "k"]).ts(Some(&too_far)).send().payload, skew);
    assert_eq!(
        h.req(&["SET", "k", "v"]).ts(Some(&just_ok)).send().payload,
        b"+OK\r\n"
    );
    assert_eq!(
        h.req(&["SET", "k", "v"]).ts(Some(&behind)).send().payload,
        b"+OK\r\n"
    );
}

#[test]
fn skew_limit_is_configurable() {
    let mut h = Harness::with(Config {
        max_clock_skew_ms: 1_000,
        ..Config::default()
    });
    let ahead = format!("{}:0:c1", T0 + 2_000);
    assert!(
        h.req(&["SET", "k", "v"])
            .ts(Some(&ahead))
            .send()
            .error
            .is_some()
    );
}

#[test]
fn malformed_timestamps() {
    let mut h = Harness::new();
    for bad in ["", "garbage", "1:2", "x:0:n", "1:y:n", "+1:0:n"] {
        let out = h.req(&["SET", "k", "v"]).ts(Some(bad)).send();
        assert_eq!(out.payload, err("malformed timestamp"), "__ts {bad:?}");
        let out = h.req(&["SET", "k", "v"]).ft(bad).send();
        assert_eq!(out.payload, err("malformed timestamp"), "__ft {bad:?}");
    }
}

// ---------------------------------------------------------------- fencing

#[test]
fn fencing_tokens() {
    let mut h = Harness::new();
    let t1 = format!("{}:1:lockd", T0 - 1000);
    let t0 = format!("{}:0:lockd", T0 - 1000);
    let t2 = format!("{}:2:lockd", T0 - 1000);
    // SET with __ft on a key without a token stores the token.
    assert_eq!(
        h.req(&["SET", "res", "a"]).ft(&t1).send().payload,
        b"+OK\r\n"
    );
    let required = err("a fencing token is required for this request");
    let lower = err(
        "the request fencing token is a lower version than the fencing token protecting the resource",
    );
    for args in [
        &["SET", "res", "b"][..],
        &["DEL", "res"],
        &["VDEL", "res", "a"],
    ] {
        assert_eq!(
            h.req(args).send().payload,
            required,
            "{args:?} without __ft"
        );
        assert_eq!(
            h.req(args).ft(&t0).send().payload,
            lower,
            "{args:?} with an older __ft"
        );
    }
    assert_eq!(h.run(&["GET", "res"]), b"$1\r\na\r\n", "nothing changed");
    // Equal token: fine. Newer token: fine, and SET keeps it.
    assert_eq!(
        h.req(&["SET", "res", "b"]).ft(&t1).send().payload,
        b"+OK\r\n"
    );
    assert_eq!(
        h.req(&["SET", "res", "c"]).ft(&t2).send().payload,
        b"+OK\r\n"
    );
    assert_eq!(
        h.req(&["SET", "res", "d"]).ft(&t1).send().payload,
        lower,
        "t2 now protects it"
    );
    assert_eq!(
        h.req(&["VDEL", "res", "x"]).ft(&t2).send().payload,
        b":-1\r\n"
    );
    assert_eq!(h.req(&["DEL", "res"]).ft(&t2).send().payload, b":1\r\n");
    // Deleted with the key: a plain SET works again.
    assert_eq!(h.run(&["SET", "res", "free"]), b"+OK\r\n");
    assert_eq!(h.run(&["DEL", "res"]), b":1\r\n");
}

#[test]
fn fencing_token_skew() {
    let mut h = Harness::new();
    let far = format!("{}:0:lockd", T0 + 61_000);
    assert_eq!(
        h.req(&["SET", "k", "v"]).ft(&far).send().payload,
        err(
            "the request fencing token timestamp is too far in the future; ensure that the client and broker system clocks are synchronized"
        )
    );
}

// ---------------------------------------------------------------- expiry

#[test]
fn px_expires_exactly_on_time() {
    let mut h = Harness::new();
    assert_eq!(h.run(&["SET", "k", "v", "PX", "100"]), b"+OK\r\n");
    h.now += 99;
    assert_eq!(h.run(&["GET", "k"]), b"$1\r\nv\r\n");
    h.now += 1;
    assert_eq!(h.run(&["GET", "k"]), b"$-1\r\n");
    assert_eq!(h.run(&["VDEL", "k", "v"]), b":0\r\n");
    assert_eq!(
        h.run(&["SET", "k", "w", "NX"]),
        b"+OK\r\n",
        "NX sees no key"
    );
    assert_eq!(h.store.len(), 1);
}

#[test]
fn expired_key_is_not_equal_for_nex() {
    let mut h = Harness::new();
    h.run(&["SET", "lock", "a", "NEX", "PX", "10"]);
    h.now += 10;
    assert_eq!(h.run(&["SET", "lock", "b", "NEX", "PX", "10"]), b"+OK\r\n");
}

#[test]
fn nex_px_renewal_extends_the_expiry() {
    let mut h = Harness::new();
    h.run(&["SET", "lock", "me", "NEX", "PX", "100"]);
    h.now += 80;
    assert_eq!(
        h.run(&["SET", "lock", "me", "NEX", "PX", "100"]),
        b"+OK\r\n"
    );
    h.now += 80;
    assert_eq!(h.run(&["GET", "lock"]), b"$2\r\nme\r\n");
    h.now += 20;
    assert_eq!(h.run(&["GET", "lock"]), b"$-1\r\n");
}

#[test]
fn plain_set_clears_an_expiry() {
    let mut h = Harness::new();
    h.run(&["SET", "k", "v", "PX", "10"]);
    h.run(&["SET", "k", "v"]);
    h.now += 1_000;
    assert_eq!(h.run(&["GET", "k"]), b"$1\r\nv\r\n");
    assert_eq!(h.store.next_expiry(), None);
}

#[test]
fn active_expiry_notifies_watchers() {
    let mut h = Harness::new();
    h.run(&["KEYNOTIFY", "k"]);
    let set = h.req(&["SET", "k", "v", "PX", "50"]).send();
    let version = set.timestamp;
    assert_eq!(h.store.next_expiry(), Some(T0 + 50));
    assert!(h.store.expire(T0 + 49).notices.is_empty());
    let notices = h.store.expire(T0 + 50).notices;
    assert_eq!(notices.len(), 1);
    assert_eq!(notices[0].event, Event::Delete);
    assert_eq!(notices[0].version, version);
    assert_eq!(notices[0].key, b"k");
    assert!(h.store.is_empty());
}

// ---------------------------------------------------------------- KEYNOTIFY

#[test]
fn keynotify_set_del_stop() {
    let mut h = Harness::new();
    assert_eq!(h.run(&["KEYNOTIFY", "k"]), b"+OK\r\n");
    assert_eq!(h.run(&["KEYNOTIFY", "k"]), b"+OK\r\n", "again: still fine");

    let out = h.req(&["SET", "k", "v"]).from("c2", 2).send();
    assert_eq!(out.notices.len(), 1, "another client's SET notifies c1");
    let n = &out.notices[0];
    assert_eq!((&*n.watchers[0], n.key.as_slice()), ("c1", &b"k"[..]));
    assert_eq!(n.event, Event::Set(b"v".to_vec()));
    assert_eq!(n.version, out.timestamp);

    let out = h.req(&["DEL", "k"]).send();
    assert_eq!(out.notices[0].event, Event::Delete);
    assert_eq!(
        out.notices[0].payload(),
        b"*2\r\n$6\r\nNOTIFY\r\n$6\r\nDELETE\r\n"
    );

    h.run(&["SET", "k", "v"]);
    let out = h.req(&["VDEL", "k", "v"]).send();
    assert_eq!(out.notices[0].event, Event::Delete);

    assert_eq!(h.run(&["KEYNOTIFY", "k", "STOP"]), b"+OK\r\n");
    assert_eq!(h.run(&["KEYNOTIFY", "k", "stop"]), b":0\r\n");
    assert!(h.req(&["SET", "k", "v"]).send().notices.is_empty());
}

#[test]
fn not_applied_changes_do_not_notify() {
    let mut h = Harness::new();
    h.run(&["KEYNOTIFY", "k"]);
    h.run(&["SET", "k", "v"]);
    assert!(h.req(&["SET", "k", "w", "NX"]).send().notices.is_empty());
    assert!(h.req(&["VDEL", "k", "w"]).send().notices.is_empty());
    assert!(h.req(&["DEL", "missing"]).send().notices.is_empty());
}

#[test]
fn keynotify_bad_option() {
    let mut h = Harness::new();
    assert_eq!(h.run(&["KEYNOTIFY", "k", "START"]), err("syntax error"));
}

#[test]
fn registrations_die_with_their_connection() {
    let mut h = Harness::new();
    h.req(&["KEYNOTIFY", "a"]).from("c1", 1).send();
    // c1 reconnects (connection 7) and registers "b" before connection 1's clean-up.
    h.req(&["KEYNOTIFY", "b"]).from("c1", 7).send();
    assert_eq!(h.store.connection_closed("c1", 1), 1);
    assert!(h.req(&["SET", "a", "x"]).send().notices.is_empty());
    assert_eq!(h.req(&["SET", "b", "x"]).send().notices.len(), 1);
}

#[test]
fn watch_quota() {
    let mut h = Harness::with(Config {
        max_watches_per_client: 2,
        ..Config::default()
    });
    h.run(&["KEYNOTIFY", "a"]);
    h.run(&["KEYNOTIFY", "b"]);
    assert_eq!(
        h.run(&["KEYNOTIFY", "c"]),
        err("the quota has been exceeded")
    );
}

#[test]
fn watch_quota_in_bytes() {
    let mut h = Harness::with(Config {
        max_watch_bytes_per_client: 100,
        ..Config::default()
    });
    let big = "k".repeat(60);
    assert_eq!(h.run(&["KEYNOTIFY", &big]), b"+OK\r\n");
    let other = "j".repeat(60);
    assert_eq!(
        h.run(&["KEYNOTIFY", &other]),
        b"-ERR the quota has been exceeded\r\n"
    );
    assert_eq!(h.run(&["KEYNOTIFY", &big, "STOP"]), b"+OK\r\n");
    assert_eq!(h.run(&["KEYNOTIFY", &other]), b"+OK\r\n");
}

/// The clients of one user (owner) share its limit: one client cannot
/// take the room of others by opening connections or changing client id;
/// unregistering and the end of a connection give it back.
#[test]
fn watch_quota_per_user() {
    let mut h = Harness::with(Config {
        max_watches_per_client: 2,
        max_watches_per_user: 3,
        ..Config::default()
    });
    let full = err("the quota has been exceeded");
    let watch = |h: &mut Harness, client, conn, owner, key: &str| {
        let out = h.req(&["KEYNOTIFY", key]).from(client, conn).owner(owner);
        out.send().payload
    };
    assert_eq!(watch(&mut h, "c1", 1, "u", "a"), b"+OK\r\n");
    assert_eq!(watch(&mut h, "c1", 1, "u", "b"), b"+OK\r\n");
    assert_eq!(watch(&mut h, "c2", 2, "u", "c"), b"+OK\r\n");
    assert_eq!(watch(&mut h, "c2", 2, "u", "d"), full, "the user's limit");
    assert_eq!(watch(&mut h, "c9", 9, "u", "d"), full, "a new client id");
    // Registering a key again does not count twice.
    assert_eq!(watch(&mut h, "c1", 1, "u", "b"), b"+OK\r\n");
    assert_eq!(watch(&mut h, "c2", 2, "u", "c"), b"+OK\r\n");
    // Another user is not affected.
    assert_eq!(watch(&mut h, "c3", 3, "v", "d"), b"+OK\r\n");
    // c1 unregisters a key: room for one more, and only one.
    let stop = h.req(&["KEYNOTIFY", "a", "STOP"]).from("c1", 1).owner("u");
    assert_eq!(stop.send().payload, b"+OK\r\n");
    assert_eq!(watch(&mut h, "c2", 2, "u", "d"), b"+OK\r\n");
    assert_eq!(watch(&mut h, "c1", 1, "u", "e"), full);
    // c2's connection ends: its two registrations are given back.
    assert_eq!(h.store.connection_closed("c2", 2), 2);
    assert_eq!(watch(&mut h, "c1", 1, "u", "e"), b"+OK\r\n");
    assert_eq!(watch(&mut h, "c4", 4, "u", "f"), b"+OK\r\n");
    assert_eq!(watch(&mut h, "c4", 4, "u", "g"), full);
    // The notifications go to whoever holds a registration.
    let out = h.req(&["SET", "d", "x"]).send();
    let watchers: Vec<&str> = out.notices[0].watchers.iter().map(|w| &**w).collect();
    assert_eq!(watchers, ["c3"]);
    assert_eq!(h.store.watch_count(), 4);
}

// ---------------------------------------------------------------- SCAN

fn scan_all(h: &mut Harness, pattern: &str) -> (Vec<Vec<u8>>, usize) {
    let mut keys = Vec::new();
    let mut token: Option<Vec<u8>> = None;
    let mut pages = 0;
    loop {
        let mut args = vec![b"SCAN".to_vec(), pattern.as_bytes().to_vec()];
        args.extend(token.take());
        let out = h.req(&args).send();
        pages += 1;
        let Page {
            keys: page,
            token: next,
        } = Page::decode(&out.payload).unwrap();
        keys.extend(page);
        match next {
            Some(t) => token = Some(t),
            None => return (keys, pages),
        }
        assert!(pages < 10_000, "scan does not end");
    }
}

#[test]
fn scan_small_store_is_one_page() {
    let mut h = Harness::new();
    assert_eq!(h.run(&["SCAN", "*"]), b"*1\r\n*0\r\n");
    h.run(&["SET", "k1", "v"]);
    h.run(&["SET", "k2", "v"]);
    h.run(&["SET", "other", "v"]);
    assert_eq!(
        h.run(&["SCAN", "k*"]),
        b"*1\r\n*2\r\n$2\r\nk1\r\n$2\r\nk2\r\n"
    );
}

#[test]
fn scan_pages_through_hundreds_of_keys() {
    let mut h = Harness::with(Config {
        scan_page_size: 10,
        ..Config::default()
    });
    for i in 0..500 {
        h.run(&["SET", &format!("sensor/{i:03}"), "v"]);
        h.run(&["SET", &format!("other/{i:03}"), "v"]);
    }
    let (mut keys, pages) = scan_all(&mut h, "sensor/*");
    assert!(pages > 10, "{pages} pages");
    keys.sort();
    let expected: Vec<Vec<u8>> = (0..500)
        .map(|i| format!("sensor/{i:03}").into_bytes())
        .collect();
    assert_eq!(keys, expected, "every key exactly once");
    let (keys, _) = scan_all(&mut h, "sensor/1[0-4]?");
    assert_eq!(keys.len(), 50);
}

#[test]
fn scan_never_returns_a_key_deleted_before_its_page() {
    let mut h = Harness::with(Config {
        scan_page_size: 5,
        ..Config::default()
    });
    for i in 0..100 {
        h.run(&["SET", &format!("k{i:03}"), "v"]);
    }
    let mut seen = Vec::new();
    let mut token: Option<Vec<u8>> = None;
    let mut deleted = Vec::new();
    loop {
        let mut args = vec![b"SCAN".to_vec(), b"*".to_vec()];
        args.extend(token.take());
        let Page {
            keys: page,
            token: next,
        } = Page::decode(&h.req(&args).send().payload).unwrap();
        for key in &page {
            assert!(
                !deleted.contains(key),
                "{key:?} was deleted before its page"
            );
        }
        seen.extend(page);
        // Between pages, delete every key ending in 7 that has not been served yet.
        for i in (7..100).step_by(10) {
            let key = format!("k{i:03}").into_bytes();
            if !seen.contains(&key) && !deleted.contains(&key) {
                h.run(&[b"DEL".to_vec(), key.clone()]);
                deleted.push(key);
                break;
            }
        }
        match next {
            Some(t) => token = Some(t),
            None => break,
        }
    }
    let unique: std::collections::HashSet<_> = seen.iter().collect();
    assert_eq!(unique.len(), seen.len(), "no key twice");
    assert_eq!(seen.len() + deleted.len(), 100);
}

/// A pattern whose every key costs a good part of a page's budget of glob
/// steps (8 KiB keys of `a`, `*` + 4096 `a` + `b*`: 65 words of state for
/// each byte): pages end after a few keys instead of looking at all 30 in
/// one go, and paging through still finds each matching key once, and no
/// key deleted before its page.
#[test]
fn scan_with_a_costly_pattern_ends_pages_early() {
    let mut h = Harness::new();
    let mut matching = Vec::new();
    for i in 0..30 {
        let mut key = format!("{i:02}{}", "a".repeat(8190)).into_bytes();
        if i % 4 == 1 {
            key[6000] = b'b';
            matching.push(key.clone());
        }
        h.run(&[b"SET".to_vec(), key, b"v".to_vec()]);
    }
    let pattern = format!("*{}b*", "a".repeat(4096));
    let deleted = matching.pop().unwrap();
    let mut first = true;
    let mut found = Vec::new();
    let mut token: Option<Vec<u8>> = None;
    let mut pages = 0;
    loop {
        let mut args = vec![b"SCAN".to_vec(), pattern.as_bytes().to_vec()];
        args.extend(token.take());
        let Page { keys, token: next } = Page::decode(&h.req(&args).send().payload).unwrap();
        pages += 1;
        found.extend(keys);
        if first {
            h.run(&[b"DEL".to_vec(), deleted.clone()]);
            first = false;
        }
        match next {
            Some(t) => token = Some(t),
            None => break,
        }
    }
    assert!((5..30).contains(&pages), "{pages} pages");
    assert_eq!(
        found, matching,
        "the matching keys, once each, in the order set"
    );
}

#[test]
fn scan_with_a_forged_token_is_a_syntax_error() {
    let mut h = Harness::new();
    assert_eq!(h.run(&["SCAN", "*", "not-a-token"]), err("syntax error"));
    // A token past the end is simply the end.
    assert_eq!(h.run(&["SCAN", "*", "s99999"]), b"*1\r\n*0\r\n");
}

// ---------------------------------------------------------------- errors

#[test]
fn malformed_resp_is_a_syntax_error() {
    let mut h = Harness::new();
    for raw in [
        &b""[..],
        b"GET k\r\n",
        b"*2\r\n$3\r\nGET\r\n$5\r\nk\r\n",
        b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\ntrailing",
        b"*1\r\n:5\r\n",
        b"*99999999999999999999999999\r\n",
        b"*0\r\n",
    ] {
        assert_eq!(
            h.req::<&str>(&[]).raw(raw).send().payload,
            err("syntax error"),
            "{raw:?}"
        );
    }
}

#[test]
fn unknown_command_arity_and_zero_length_key() {
    let mut h = Harness::new();
    assert_eq!(h.run(&["HSET", "k", "f", "v"]), err("unknown command"));
    assert_eq!(h.run(&["GET"]), err("wrong number of arguments"));
    assert_eq!(h.run(&["GET", "a", "b"]), err("wrong number of arguments"));
    assert_eq!(h.run(&["GET", ""]), err("the key length is zero"));
    assert_eq!(h.run(&["SET", "k", "v", "EX", "10"]), err("syntax error"));
}

#[test]
fn error_answers_carry_the_clock() {
    let mut h = Harness::new();
    let out = h.req(&["NOPE"]).send();
    assert_eq!(out.error, Some(statestore::Error::UnknownCommand));
    assert!(hlc(&out.timestamp).wall_ms >= T0);
}

// ---------------------------------------------------------------- quotas

#[test]
fn quotas() {
    let mut h = Harness::with(Config {
        quota: Quota {
            max_keys: 2,
            max_bytes: 20,
            max_key_size: 4,
            max_value_size: 8,
        },
        ..Config::default()
    });
    let quota = err("the quota has been exceeded");
    assert_eq!(h.run(&["SET", "long-key", "v"]), quota);
    assert_eq!(h.run(&["SET", "k", "123456789"]), quota);
    assert_eq!(h.run(&["SET", "a", "12345678"]), b"+OK\r\n");
    assert_eq!(h.run(&["SET", "b", "12345678"]), b"+OK\r\n");
    assert_eq!(h.run(&["SET", "c", "1"]), quota, "third key");
    assert_eq!(
        h.run(&["SET", "a", "1234567"]),
        b"+OK\r\n",
        "replacing within bytes"
    );
    assert_eq!((h.store.len(), h.store.bytes()), (2, 17));
    assert_eq!(h.run(&["DEL", "b"]), b":1\r\n");
    assert_eq!(h.run(&["SET", "c", "1"]), b"+OK\r\n");
}

// ---------------------------------------------------------------- 2023 dialect

#[test]
fn legacy_2023_dialect() {
    let mut h = Harness::new();
    let d = Dialect::Legacy2023;
    assert_eq!(
        h.req(&["set", "k", "v", "NX"]).dialect(d).send().payload,
        b"+OK\r\n"
    );
    assert_eq!(
        h.req(&["get", "k"]).dialect(d).send().payload,
        b"$1\r\nv\r\n"
    );
    assert_eq!(
        h.req(&["GET", "k"]).dialect(d).send().payload,
        err("unknown command")
    );
    assert_eq!(
        h.req(&["set", "k", "v", "nx"]).dialect(d).send().payload,
        err("syntax error")
    );
    assert_eq!(
        h.req(&["vdel", "k", "v"]).dialect(d).send().payload,
        b":1\r\n"
    );
    assert_eq!(h.req(&["del", "k"]).dialect(d).send().payload, b":0\r\n");
    // Same store on both topics.
    h.run(&["SET", "shared", "x"]);
    assert_eq!(
        h.req(&["get", "shared"]).dialect(d).send().payload,
        b"$1\r\nx\r\n"
    );
}

// ---------------------------------------------------------------- PING / INFO

#[test]
fn ping_answers_pong_or_the_message() {
    let mut h = Harness::new();
    assert_eq!(h.run(&["PING"]), b"+PONG\r\n");
    assert_eq!(h.run(&["ping", "hi\r\nthere"]), b"$9\r\nhi\r\nthere\r\n");
    assert_eq!(h.run(&["PING", "a", "b"]), err("wrong number of arguments"));
    // No `__ts` needed; the answer carries the store's clock.
    let out = h.req(&["PING"]).ts(None).send();
    assert_eq!(out.payload, b"+PONG\r\n");
    assert!(out.timestamp.ends_with(":statebroker"), "{}", out.timestamp);
    // Not a verb of the 2023 topic.
    let out = h.req(&["ping"]).dialect(Dialect::Legacy2023).send();
    assert_eq!(out.payload, err("unknown command"));
}

#[test]
fn info_describes_the_store_by_section() {
    let mut h = Harness::new();
    h.run(&["SET", "k", "value"]);
    h.run(&["KEYNOTIFY", "k"]);
    let info = |h: &mut Harness, args: &[&str]| {
        let payload = h.run(args);
        match statestore::resp3::parse_reply(&payload) {
            Ok(statestore::resp3::Reply::Bulk(text)) => String::from_utf8(text).unwrap(),
            other => panic!("INFO answers a bulk string: {other:?}"),
        }
    };
    let all = info(&mut h, &["INFO"]);
    for line in [
        "# Server",
        "node_id:statebroker",
        "# Keyspace",
        "keys:1",
        "bytes:6",
        "watches:1",
        "# Quota",
        "max_watches_per_client:10000",
        "max_watches_per_user:100000",
        "max_watch_bytes_per_user:33554432",
        "max_watches:1000000",
    ] {
        assert!(
            all.split("\r\n").any(|l| l == line),
            "{line} missing in {all:?}"
        );
    }
    assert_eq!(
        info(&mut h, &["info", "all"]).split("\r\n").count(),
        all.split("\r\n").count()
    );
    let keyspace = info(&mut h, &["INFO", "keyspace"]);
    assert!(keyspace.starts_with("# Keyspace\r\n") && !keyspace.contains("# Server"));
    assert_eq!(info(&mut h, &["INFO", "nosuch"]), "");
    assert_eq!(h.run(&["INFO", "a", "b"]), err("wrong number of arguments"));
}
