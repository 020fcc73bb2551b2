use super::*;

fn count_limit(per_client: usize) -> WatchLimits {
    WatchLimits {
        per_client,
        ..WatchLimits::default()
    }
}

fn ids(w: &Watchers, key: &[u8]) -> Vec<String> {
    let mut v: Vec<String> = w.of_key(key).iter().map(|c| c.to_string()).collect();
    v.sort();
    v
}

#[test]
fn changes_are_kept_only_when_asked_and_once() {
    let limits = count_limit(10);
    let mut w = Watchers::default();
    w.register("a", "a", 1, b"k", &limits).unwrap();
    assert_eq!(w.take_changes(), Some(Vec::new()), "not kept unless asked");
    w.keep_changes(4);
    w.register("a", "a", 1, b"k", &limits).unwrap();
    w.register("a", "a", 1, b"j", &limits).unwrap();
    w.register("b", "b", 2, b"k", &limits).unwrap();
    w.connection_closed("a", 1);
    let made = |c: &str, k: &[u8]| WatchChange::Made {
        client: c.into(),
        key: k.into(),
    };
    let ended = |c: &str, k: &[u8]| WatchChange::Ended {
        client: c.into(),
        key: k.into(),
    };
    let mut changes = w.take_changes().unwrap();
    // The two ends come in the client's map order.
    changes[2..].sort_by(|x, y| format!("{x:?}").cmp(&format!("{y:?}")));
    assert_eq!(
        changes,
        [
            made("a", b"j"),
            made("b", b"k"),
            ended("a", b"j"),
            ended("a", b"k")
        ],
        "registering again is no change"
    );
    assert_eq!(w.take_changes(), Some(Vec::new()), "taken once");
    assert_eq!(w.all(), [(Arc::from("b"), Box::from(&b"k"[..]))]);
    // Past the limit the list goes: the caller reads them all.
    for key in [b"1", b"2", b"3", b"4", b"5"] {
        w.register("b", "b", 2, key, &limits).unwrap();
    }
    assert_eq!(w.take_changes(), None, "5 made, 4 kept at most");
    w.unregister("b", b"1");
    assert_eq!(w.take_changes().map(|c| c.len()), Some(1), "kept again");
}

#[test]
fn register_unregister() {
    let mut w = Watchers::default();
    w.register("a", "a", 1, b"k", &count_limit(10)).unwrap();
    w.register("a", "a", 1, b"k", &count_limit(10)).unwrap();
    w.register("b", "b", 2, b"k", &count_limit(10)).unwrap();
    assert_eq!(ids(&w, b"k"), ["a", "b"]);
    assert!(w.unregister("a", b"k"));
    assert!(!w.unregister("a", b"k"));
    assert!(!w.unregister("zz", b"k"));
    assert_eq!(ids(&w, b"k"), ["b"]);
    assert_eq!(w.len(), 1);
}

#[test]
fn a_closed_connection_only_drops_its_own_registrations() {
    let mut w = Watchers::default();
    w.register("a", "a", 1, b"old", &count_limit(10)).unwrap();
    w.register("a", "a", 1, b"both", &count_limit(10)).unwrap();
    // The client reconnects (connection 2) before connection 1's clean-up ran.
    w.register("a", "a", 2, b"both", &count_limit(10)).unwrap();
    w.register("a", "a", 2, b"new", &count_limit(10)).unwrap();
    assert_eq!(w.connection_closed("a", 1), 1);
    assert!(w.of_key(b"old").is_empty());
    assert_eq!(ids(&w, b"both"), ["a"]);
    assert_eq!(ids(&w, b"new"), ["a"]);
    assert_eq!(w.connection_closed("a", 2), 2);
    assert!(w.is_empty());
    assert_eq!(w.connection_closed("a", 2), 0);
}

#[test]
fn per_client_limit() {
    let mut w = Watchers::default();
    w.register("a", "a", 1, b"1", &count_limit(2)).unwrap();
    w.register("a", "a", 1, b"2", &count_limit(2)).unwrap();
    assert_eq!(
        w.register("a", "a", 1, b"3", &count_limit(2)),
        Err(TooManyWatches)
    );
    w.register("a", "a", 1, b"2", &count_limit(2)).unwrap();
    w.register("b", "b", 1, b"3", &count_limit(2)).unwrap();
    assert_eq!(
        w.register("c", "c", 1, b"3", &count_limit(0)),
        Err(TooManyWatches)
    );
}

#[test]
fn byte_and_total_limits() {
    let limits = WatchLimits {
        per_client: 100,
        per_client_bytes: 10,
        per_user: 100,
        per_user_bytes: 100,
        total: 3,
        total_bytes: 15,
    };
    let mut w = Watchers::default();
    w.register("a", "a", 1, b"123456", &limits).unwrap();
    assert_eq!(
        w.register("a", "a", 1, b"12345", &limits),
        Err(TooManyWatches),
        "11 key bytes for one client"
    );
    w.register("a", "a", 1, b"1234", &limits).unwrap();
    assert_eq!(w.bytes(), 10);
    assert_eq!(
        w.register("b", "b", 1, b"123456", &limits),
        Err(TooManyWatches),
        "16 key bytes in all"
    );
    w.register("b", "b", 1, b"x", &limits).unwrap();
    assert_eq!(
        w.register("c", "c", 1, b"y", &limits),
        Err(TooManyWatches),
        "4 in all"
    );
    // Registering again costs nothing; ending frees the room.
    w.register("a", "a", 2, b"1234", &limits).unwrap();
    assert_eq!(w.connection_closed("a", 2), 1);
    assert_eq!((w.len(), w.bytes()), (2, 7));
    w.register("c", "c", 1, b"y", &limits).unwrap();
}

fn user_limit(per_user: usize, per_user_bytes: usize) -> WatchLimits {
    WatchLimits {
        per_client: 5,
        per_user,
        per_user_bytes,
        ..WatchLimits::default()
    }
}

/// Two clients of one user share its limit; unregistering and the end
/// of a connection give the room back, to the last registration.
#[test]
fn per_user_limit_spans_clients_and_follows_releases() {
    let limits = user_limit(3, 1 << 20);
    let mut w = Watchers::default();
    w.register("a", "u", 1, b"k1", &limits).unwrap();
    w.register("a", "u", 1, b"k2", &limits).unwrap();
    w.register("b", "u", 2, b"k3", &limits).unwrap();
    assert_eq!(w.register("b", "u", 2, b"k4", &limits), Err(TooManyWatches));
    assert_eq!(w.register("c", "u", 3, b"k4", &limits), Err(TooManyWatches));
    // Registering again costs nothing, at the limit too.
    w.register("a", "u", 1, b"k1", &limits).unwrap();
    w.register("b", "u", 2, b"k3", &limits).unwrap();
    assert_eq!(w.of_owner("u"), (3, 6));
    // Another user has its own room.
    w.register("d", "v", 4, b"k4", &limits).unwrap();
    // One unregisters: room again, once.
    assert!(w.unregister("a", b"k1"));
    assert_eq!(w.of_owner("u"), (2, 4));
    w.register("b", "u", 2, b"k4", &limits).unwrap();
    assert_eq!(w.register("a", "u", 1, b"k5", &limits), Err(TooManyWatches));
    // b's connection ends: its two registrations are released.
    assert_eq!(w.connection_closed("b", 2), 2);
    assert_eq!(w.of_owner("u"), (1, 2));
    w.register("a", "u", 1, b"k5", &limits).unwrap();
    w.register("c", "u", 3, b"k6", &limits).unwrap();
    assert_eq!(w.register("c", "u", 3, b"k7", &limits), Err(TooManyWatches));
    assert_eq!(w.of_owner("u"), (3, 6));
    assert_eq!(w.connection_closed("a", 1), 2);
    assert_eq!(w.connection_closed("c", 3), 1);
    assert_eq!(w.of_owner("u"), (0, 0));
    assert_eq!(w.owners(), 1, "only v is left");
    assert!(w.unregister("d", b"k4"));
    assert_eq!((w.owners(), w.len(), w.bytes()), (0, 0, 0));
}

#[test]
fn per_user_limit_in_bytes() {
    let limits = user_limit(100, 10);
    let mut w = Watchers::default();
    w.register("a", "u", 1, b"123456", &limits).unwrap();
    assert_eq!(
        w.register("b", "u", 2, b"12345", &limits),
        Err(TooManyWatches),
        "11 key bytes for one user"
    );
    w.register("b", "u", 2, b"1234", &limits).unwrap();
    w.register("c", "v", 3, b"12345", &limits).unwrap();
    assert_eq!(w.of_owner("u"), (2, 10));
    assert_eq!(w.connection_closed("a", 1), 1);
    w.register("b", "u", 2, b"12345", &limits).unwrap();
    assert_eq!(w.of_owner("u"), (2, 9));
}

/// A client that comes back counted against another owner (another
/// user, or another address) takes its registration along, if the
/// new owner has room; the old connection's late clean-up leaves it.
#[test]
fn registering_again_under_another_owner_moves_the_count() {
    let limits = user_limit(1, 1 << 20);
    let mut w = Watchers::default();
    w.register("a", "u", 1, b"k", &limits).unwrap();
    w.register("a", "v", 2, b"k", &limits).unwrap();
    assert_eq!((w.of_owner("u"), w.of_owner("v")), ((0, 0), (1, 1)));
    assert_eq!(w.connection_closed("a", 1), 0);
    // The new owner is full: refused, and the registration stays as it was.
    w.register("x", "u", 3, b"other", &limits).unwrap();
    assert_eq!(w.register("a", "u", 4, b"k", &limits), Err(TooManyWatches));
    assert_eq!(w.of_owner("v"), (1, 1));
    assert_eq!(w.connection_closed("a", 2), 1);
    assert_eq!(w.of_owner("v"), (0, 0));
    assert_eq!((w.len(), w.owners()), (1, 1));
}

/// A client id's new connection drops what its earlier connections
/// registered, and keeps what it registered itself; other clients'
/// registrations stay.
#[test]
fn a_new_connection_drops_its_earlier_connections_registrations() {
    let limits = user_limit(100, 1 << 20);
    let mut w = Watchers::default();
    w.register("a", "u", 1, b"old", &limits).unwrap();
    w.register("a", "u", 1, b"both", &limits).unwrap();
    w.register("b", "u", 1, b"old", &limits).unwrap();
    w.register("a", "u", 2, b"both", &limits).unwrap();
    assert_eq!(w.connection_opened("a", 2), 1);
    assert_eq!(w.of_key(b"old"), [Arc::from("b")]);
    assert_eq!(w.of_key(b"both"), [Arc::from("a")]);
    assert_eq!(w.of_owner("u"), (2, 7));
    // The earlier connection's late clean-up finds nothing of it.
    assert_eq!(w.connection_closed("a", 1), 0);
    assert_eq!(w.len(), 2);
}

#[test]
fn set_payload() {
    let n = Notice {
        key: b"k".to_vec(),
        event: Event::Set(b"v\r\n".to_vec()),
        version: Default::default(),
        watchers: vec![],
    };
    assert_eq!(
        n.payload(),
        b"*4\r\n$6\r\nNOTIFY\r\n$3\r\nSET\r\n$5\r\nVALUE\r\n$3\r\nv\r\n\r\n"
    );
}
