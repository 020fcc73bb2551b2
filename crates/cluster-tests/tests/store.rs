//! The state store on three nodes and three etcd members: every node
//! serves the same keys, versions increase across nodes, KEYNOTIFY reaches
//! watchers on every node, fencing tokens hold across nodes, expiry, SCAN,
//! readiness without a quorum, a node killed.

mod common;

use std::time::Duration;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_node_serves_the_same_keys_and_versions_increase_across_nodes() {
    let setup = Setup::start(3, 3);
    let mut c: Vec<_> = Vec::new();
    for (i, port) in setup.ports.iter().enumerate() {
        c.push(client(*port, &format!("c{i}")).await);
    }
    let set = ask(&mut c[0], &["SET", "door", "open"]).await;
    assert_eq!(text(&set), "+OK");
    let v1 = set.version.clone().unwrap();
    assert!(v1.ends_with(":sb1"), "{v1}");
    for client in c.iter_mut().skip(1) {
        let got = ask(client, &["GET", "door"]).await;
        assert_eq!(text(&got), "$open");
        assert_eq!(
            got.version.as_deref(),
            Some(v1.as_str()),
            "GET shows the SET's version"
        );
    }
    // Each SET, on any node, after the answer of another: a greater version.
    let mut last = time_of(&v1);
    for round in 0..6 {
        let node = round % 3;
        let set = ask(&mut c[node], &["SET", "door", &format!("v{round}")]).await;
        assert_eq!(text(&set), "+OK");
        let now = time_of(set.version.as_deref().unwrap());
        assert!(now > last, "round {round}: {now:?} <= {last:?}");
        last = now;
    }
    // Conditions are decided on the key's current record, whichever node
    // wrote it.
    assert_eq!(
        text(&ask(&mut c[1], &["SET", "door", "x", "NX"]).await),
        ":-1"
    );
    assert_eq!(
        text(&ask(&mut c[2], &["SET", "door", "v5", "NEX"]).await),
        "+OK"
    );
    assert_eq!(
        text(&ask(&mut c[0], &["VDEL", "door", "nope"]).await),
        ":-1"
    );
    let deleted = ask(&mut c[1], &["DEL", "door"]).await;
    assert_eq!(text(&deleted), ":1");
    assert_eq!(text(&ask(&mut c[2], &["GET", "door"]).await), "$-1");
    assert_eq!(text(&ask(&mut c[0], &["DEL", "door"]).await), ":0");
    // A SET after the delete, on another node: still a greater version
    // (the tombstone keeps the last one).
    let again = ask(&mut c[2], &["SET", "door", "new", "NX"]).await;
    assert_eq!(text(&again), "+OK");
    let after = time_of(again.version.as_deref().unwrap());
    let at_delete = time_of(deleted.version.as_deref().unwrap());
    assert!(after > at_delete, "{after:?} <= {at_delete:?}");
    // Errors are the single node's.
    assert_eq!(
        text(&ask(&mut c[0], &["SET", "k"]).await),
        "-ERR wrong number of arguments"
    );
    assert_eq!(
        text(&ask(&mut c[1], &["GET", ""]).await),
        "-ERR the key length is zero"
    );
}

/// Large records deleted together: the watch answer carrying them (each
/// event with the record it replaced) passed gRPC's default decoding
/// limit, 4 MiB, and the watch broke at it again and again: KEYNOTIFY
/// stopped on every node, silently. Ten DELs of 1 MB values, pipelined
/// by one client so that they commit together; then a watched key's
/// change still reaches its watchers on every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keynotify_goes_on_after_large_records_deleted_together() {
    use common::raw::{REQUEST_TOPIC, Raw, now_hlc, v5};
    use rumqttc::v5::mqttbytes::QoS;
    let setup = Setup::start(3, 3);
    let mut watchers = Vec::new();
    for node in [0, 1, 2] {
        let mut w = client(setup.ports[node], &format!("big-watcher{node}")).await;
        assert_eq!(text(&ask(&mut w, &["KEYNOTIFY", "probe"]).await), "+OK");
        let notes = w.notifications().expect("notifications");
        watchers.push((w, notes));
    }
    let mut writer = client(setup.ports[0], "big-writer").await;
    let value = "v".repeat(1_000_000);
    for i in 0..10 {
        let key = format!("big-{i}");
        assert_eq!(text(&ask(&mut writer, &["SET", &key, &value]).await), "+OK");
    }
    let mut bulk = Raw::connect(common::addr(setup.ports[0]), "big-bulk").await;
    bulk.ensure_response_subscription().await;
    let mut bytes = bytes::BytesMut::new();
    for i in 0..10u16 {
        let ts = now_hlc("big-bulk");
        let properties = bulk.request_properties(&i.to_be_bytes(), &[("__ts", &ts)]);
        let key = format!("big-{i}");
        let payload = statestore::resp3::encode_request(&["DEL", &key]);
        let mut publish =
            v5::Publish::new(REQUEST_TOPIC, QoS::AtLeastOnce, payload, Some(properties));
        publish.pkid = i + 1;
        v5::Packet::Publish(publish)
            .write(&mut bytes, None)
            .unwrap();
    }
    bulk.send_bytes(&bytes).await;
    for _ in 0..10 {
        let answer = bulk.next_publish().await;
        assert_eq!(&answer.payload[..], b":1\r\n");
    }
    assert_eq!(
        text(&ask(&mut writer, &["SET", "probe", "after"]).await),
        "+OK"
    );
    for (node, (_, notes)) in watchers.iter_mut().enumerate() {
        let note = tokio::time::timeout(PATIENCE, notes.recv())
            .await
            .unwrap_or_else(|_| panic!("node {node}: no notification after the DELs"))
            .expect("open");
        assert_eq!(note.value.as_deref(), Some(&b"after"[..]), "node {node}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keynotify_reaches_watchers_on_every_node_in_order_once() {
    let setup = Setup::start(3, 3);
    let mut writer = client(setup.ports[0], "writer").await;
    let mut watchers = Vec::new();
    for node in [0, 1, 2] {
        let mut w = client(setup.ports[node], &format!("watcher{node}")).await;
        assert_eq!(text(&ask(&mut w, &["KEYNOTIFY", "counter"]).await), "+OK");
        let notes = w.notifications().expect("notifications");
        watchers.push((w, notes));
    }
    let n = 40;
    let mut versions = Vec::new();
    for i in 0..n {
        // Writes from every node, in this order.
        let node = i % 3;
        let target = if node == 0 {
            &mut writer
        } else {
            &mut watchers[node].0
        };
        let set = ask(target, &["SET", "counter", &i.to_string()]).await;
        versions.push(set.version.unwrap());
    }
    let deleted = ask(&mut watchers[1].0, &["DEL", "counter"]).await;
    assert_eq!(text(&deleted), ":1");
    for (node, (_, notes)) in watchers.iter_mut().enumerate() {
        for (i, version) in versions.iter().enumerate() {
            let note = tokio::time::timeout(PATIENCE, notes.recv())
                .await
                .unwrap_or_else(|_| panic!("watcher on node {node}: notification {i} missing"))
                .expect("open");
            assert_eq!(
                note.value.as_deref(),
                Some(i.to_string().as_bytes()),
                "node {node}, #{i}"
            );
            assert_eq!(note.version.as_ref(), Some(version), "node {node}, #{i}");
        }
        let last = tokio::time::timeout(PATIENCE, notes.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(last.value, None, "DELETE last, on node {node}");
        // Nothing more (no duplicate).
        let extra = tokio::time::timeout(Duration::from_millis(500), notes.recv()).await;
        assert!(
            extra.is_err(),
            "node {node}: an extra notification {extra:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_and_expiry_hold_across_nodes() {
    let setup = Setup::start(3, 3);
    let mut a = client(setup.ports[0], "holder-a").await;
    let mut b = client(setup.ports[1], "holder-b").await;
    let mut watcher = client(setup.ports[2], "watcher").await;
    assert_eq!(
        text(&ask(&mut watcher, &["KEYNOTIFY", "lock"]).await),
        "+OK"
    );
    let mut notes = watcher.notifications().unwrap();
    // A acquires the lock on node 1 for 1.5 s and fences the resource with
    // the lock's version.
    let lock_a = ask(&mut a, &["SET", "lock", "a", "NX", "PX", "1500"]).await;
    assert_eq!(text(&lock_a), "+OK");
    let token_a = lock_a.version.unwrap();
    let ft = |t: &str| [("__ft", t.to_owned())];
    let write = ask_with(&mut a, &["SET", "resource", "from-a"], &ft(&token_a)).await;
    assert_eq!(text(&write), "+OK");
    // B cannot take the lock while it is held, on another node.
    assert_eq!(
        text(&ask(&mut b, &["SET", "lock", "b", "NX", "PX", "1500"]).await),
        ":-1"
    );
    // The lock expires: exactly on read everywhere, and its watcher gets
    // DELETE from the reaper.
    let set_note = tokio::time::timeout(PATIENCE, notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(set_note.value.as_deref(), Some(&b"a"[..]));
    let delete_note = tokio::time::timeout(PATIENCE, notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(delete_note.value, None, "expiry notifies DELETE");
    assert_eq!(text(&ask(&mut b, &["GET", "lock"]).await), "$-1");
    // B takes it on node 2: a greater token, and writes with it.
    let lock_b = ask(&mut b, &["SET", "lock", "b", "NX", "PX", "60000"]).await;
    assert_eq!(text(&lock_b), "+OK");
    let token_b = lock_b.version.unwrap();
    assert!(time_of(&token_b) > time_of(&token_a));
    let write = ask_with(&mut b, &["SET", "resource", "from-b"], &ft(&token_b)).await;
    assert_eq!(text(&write), "+OK");
    // A, paused past its lease, comes back with its old token: refused on
    // every node.
    for client in [&mut a, &mut b, &mut watcher] {
        let stale = ask_with(client, &["SET", "resource", "late-a"], &ft(&token_a)).await;
        assert_eq!(
            text(&stale),
            "-ERR the request fencing token is a lower version than the fencing token protecting the resource"
        );
    }
    assert_eq!(text(&ask(&mut a, &["GET", "resource"]).await), "$from-b");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_written_after_it_expired_and_before_the_reaper_notifies_its_delete_first() {
    let mut setup = Setup::start(1, 0);
    // The test holds the reaper's election before any node campaigns: no
    // node reaps, as when the elected one is late or dead.
    let mut etcd = etcd_client::Client::connect(setup.etcd.endpoints(), None)
        .await
        .expect("etcd");
    let lease = etcd.lease_grant(60, None).await.expect("a lease").id();
    etcd.campaign("/statebroker/E/reaper", "the test", lease)
        .await
        .expect("elected");
    setup.add_node(&[]);
    setup.add_node(&[]);
    let mut writer = client(setup.ports[0], "writer").await;
    let mut watcher = client(setup.ports[1], "watcher").await;
    assert_eq!(text(&ask(&mut watcher, &["KEYNOTIFY", "k"]).await), "+OK");
    let mut notes = watcher.notifications().expect("notifications");
    let first = ask(&mut writer, &["SET", "k", "one", "PX", "200"]).await;
    assert_eq!(text(&first), "+OK");
    let note = tokio::time::timeout(PATIENCE, notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(note.value.as_deref(), Some(&b"one"[..]));
    // Expired (exact on read), not reaped.
    let start = std::time::Instant::now();
    loop {
        if text(&ask(&mut writer, &["GET", "k"]).await) == "$-1" {
            break;
        }
        assert!(start.elapsed() < PATIENCE, "k never expired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let again = ask(&mut writer, &["SET", "k", "two"]).await;
    assert_eq!(text(&again), "+OK");
    // As on a single node: the expiry's DELETE (with the expired entry's
    // version), then the SET.
    let delete = tokio::time::timeout(PATIENCE, notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(delete.value, None, "the expiry's DELETE first: {delete:?}");
    assert_eq!(delete.version, first.version);
    let set = tokio::time::timeout(PATIENCE, notes.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(set.value.as_deref(), Some(&b"two"[..]));
    assert_eq!(set.version, again.version);
    // Once a node reaps again, nothing more for the key that was written.
    etcd.lease_revoke(lease).await.expect("resigned");
    let extra = tokio::time::timeout(Duration::from_secs(2), notes.recv()).await;
    assert!(extra.is_err(), "an extra notification {extra:?}");
}

/// The keys and `next` of a page of the web view's `/api/keys` (the
/// values in these tests hold no quotes).
fn keys_page(http: u16, query: &str) -> (Vec<String>, Option<String>, String) {
    let page = http_get(http, &format!("/api/keys?{query}")).unwrap();
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    let body = page.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    let keys = body
        .split("\"key\":\"")
        .skip(1)
        .map(|rest| rest.split('"').next().unwrap().to_owned())
        .collect();
    let next = body
        .split("\"next\":\"")
        .nth(1)
        .map(|rest| rest.split('"').next().unwrap().to_owned());
    (keys, next, body)
}

/// The web view's key pages on a cluster node list the keys in etcd,
/// whichever node wrote them: live ones only, page after page, values cut
/// to their first 1,024 bytes, versions as the nodes made them, with the
/// KEYNOTIFY watchers registered on the node; its edit forms change them
/// there, and watchers on other nodes hear of it. A page reads every
/// write answered before it (since 2026-11-30: before, pages read a
/// member's copy, and the test waited 20 ms).
/// Before 2026-11-29 the pages showed no keys and an edit answered `+OK`
/// having changed only the node's own store; then both answered 501.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_web_view_lists_and_edits_the_keys_in_etcd() {
    use std::io::{Read, Write};
    let setup = Setup::start_with(1, 2, &[("STATEBROKER__HTTP__ALLOW_EDIT", "true")]);
    let mut c = client(setup.ports[0], "web-check").await;
    for k in ["k1", "k2", "k3", "k4", "k5"] {
        assert_eq!(text(&ask(&mut c, &["SET", k, "v"]).await), "+OK");
    }
    assert_eq!(text(&ask(&mut c, &["DEL", "k3"]).await), ":1");
    assert_eq!(
        text(&ask(&mut c, &["SET", "k6", "v", "PX", "1"]).await),
        "+OK"
    );
    let big = "b".repeat(3000);
    assert_eq!(text(&ask(&mut c, &["SET", "big", &big]).await), "+OK");
    // On the other node, two keys a page (linearizable: every write
    // answered before is there).
    let http = setup.http[1];
    let mut seen = Vec::new();
    let mut start = String::new();
    for _ in 0..10 {
        let (keys, next, _) = keys_page(http, &format!("pattern=k*&limit=2&start={start}"));
        assert!(keys.len() <= 2, "{keys:?}");
        seen.extend(keys);
        match next {
            Some(next) => start = next,
            None => break,
        }
    }
    assert_eq!(seen, ["k1", "k2", "k4", "k5"], "live keys, in order, once");
    let (keys, next, body) = keys_page(http, "pattern=big");
    assert_eq!((keys, next), (vec!["big".to_owned()], None));
    assert!(body.contains("\"value_len\":3000"), "{body}");
    assert!(
        body.contains(&format!("\"value\":\"{}\"", "b".repeat(1024))),
        "{body}"
    );
    assert!(body.contains(":sb1\""), "the version sb1 made: {body}");
    // A start that is no page's `next`.
    assert_eq!(http_status(http, "/api/keys?start=zz"), Some(400));
    // The edit forms change the keys in etcd, on any node.
    let edit = |path: &str, body: &str| {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", setup.http[1])).unwrap();
        write!(
            stream,
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        answer
    };
    let mut w = client(setup.ports[0], "web-watcher").await;
    assert_eq!(text(&ask(&mut w, &["KEYNOTIFY", "k1"]).await), "+OK");
    let mut notes = w.notifications().expect("notifications");
    // The node it registered on shows it at once.
    let (_, _, body) = keys_page(setup.http[0], "pattern=k1");
    assert!(body.contains(r#""watchers":["web-watcher"]"#), "{body}");
    let answer = edit("/api/set", r#"{"key":"k1","value":"from-the-page"}"#);
    assert!(answer.contains(r#""answer":"+OK""#), "{answer}");
    assert_eq!(text(&ask(&mut c, &["GET", "k1"]).await), "$from-the-page");
    let note = tokio::time::timeout(PATIENCE, notes.recv())
        .await
        .expect("the watcher on node 1 told")
        .expect("open");
    assert_eq!(note.value.as_deref(), Some(&b"from-the-page"[..]));
    let answer = edit("/api/del", r#"{"key":"k2"}"#);
    assert!(answer.contains(r#""answer":":1""#), "{answer}");
    assert_eq!(text(&ask(&mut c, &["GET", "k2"]).await), "$-1");
}

/// A key page shows the KEYNOTIFY watchers of every node, not only its
/// own: each node records its registrations in etcd under its lease.
/// They go when the registration ends (KEYNOTIFY STOP, the connection
/// closes) and with a killed node's lease. Before 2026-11-30 a page showed
/// only the watchers registered on its own node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_page_shows_the_watchers_of_every_node() {
    let mut setup = Setup::start_with(1, 3, &[("STATEBROKER__CLUSTERING__LEASE_TTL_MS", "2000")]);
    let mut c = client(setup.ports[0], "pages").await;
    for k in ["w1", "w2", "w3"] {
        assert_eq!(text(&ask(&mut c, &["SET", k, "v"]).await), "+OK");
    }
    // Watchers on nodes 2 and 3, none on node 1.
    let mut a = client(setup.ports[1], "watcher.a").await;
    let mut b = client(setup.ports[2], "watcher-b").await;
    for k in ["w1", "w3"] {
        assert_eq!(text(&ask(&mut a, &["KEYNOTIFY", k]).await), "+OK");
    }
    assert_eq!(text(&ask(&mut b, &["KEYNOTIFY", "w1"]).await), "+OK");
    let http = setup.http[0];
    let watchers = |key: &str| -> String {
        let (_, _, body) = keys_page(http, &format!("pattern={key}"));
        body.split("\"watchers\":")
            .nth(1)
            .and_then(|rest| rest.split(']').next())
            .map(|list| format!("{list}]"))
            .unwrap_or_default()
    };
    eventually("node 1's page lists the watchers of nodes 2 and 3", || {
        watchers("w1") == r#"["watcher-b","watcher.a"]"# && watchers("w3") == r#"["watcher.a"]"#
    })
    .await;
    assert_eq!(watchers("w2"), "[]");
    // Every node's page, its own watchers included, and once each.
    let (_, _, body) = keys_page(setup.http[1], "pattern=w1");
    assert!(
        body.contains(r#""watchers":["watcher-b","watcher.a"]"#),
        "{body}"
    );
    // A registration that ends.
    assert_eq!(
        text(&ask(&mut a, &["KEYNOTIFY", "w3", "STOP"]).await),
        "+OK"
    );
    eventually("the ended registration gone from node 1's page", || {
        watchers("w3") == "[]"
    })
    .await;
    // A connection that closes.
    a.disconnect().await;
    eventually("the closed connection's registration gone", || {
        watchers("w1") == r#"["watcher-b"]"#
    })
    .await;
    // A node killed: its records go with its lease.
    setup.nodes[2].kill().unwrap();
    eventually("the killed node's watchers gone with its lease", || {
        watchers("w1") == "[]"
    })
    .await;
    assert_eq!(text(&ask(&mut c, &["GET", "w1"]).await), "$v");
}

/// A registration etcd could not take reaches the other nodes' pages
/// once etcd is back: the recording task's failed write is tried again
/// (every registration of the node rewritten from its store). Every
/// member is killed, so the write cannot commit later by itself; the
/// lease is long enough that the nodes keep serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_etcd_could_not_record_reaches_the_pages_later() {
    let mut setup = Setup::start_with(3, 2, &[("STATEBROKER__CLUSTERING__LEASE_TTL_MS", "30000")]);
    let mut c = client(setup.ports[0], "setter").await;
    assert_eq!(text(&ask(&mut c, &["SET", "late", "v"]).await), "+OK");
    let mut w = client(setup.ports[1], "late-watcher").await;
    for member in 0..3 {
        setup.etcd.kill(member).unwrap();
    }
    // Served by node 2's own store, without etcd.
    assert_eq!(text(&ask(&mut w, &["KEYNOTIFY", "late"]).await), "+OK");
    let node = &setup.nodes[1];
    eventually("node 2 failed to record the registration", || {
        lines_with(node, "cannot record the KEYNOTIFY registrations") > 0
    })
    .await;
    for member in 0..3 {
        setup.etcd.restart(member).unwrap();
    }
    let http = setup.http[0];
    eventually("node 1's page lists the watcher", || {
        http_get(http, "/api/keys?pattern=late")
            .is_some_and(|page| page.contains(r#""watchers":["late-watcher"]"#))
    })
    .await;
}

/// One etcd member of three down, a quorum left: the nodes stay ready and
/// serve, and a node whose endpoints name the dead member first starts.
/// Before, etcd's client sent about one request in three to the dead
/// member and failed it: `/readyz` answered 503 in a third of the samples
/// and three starts in four failed (etcdv3/etcd-client#39; the node now
/// keeps only the members that answer in its channel, and asks them again
/// when a request fails). The member killed is not the leader: a leader's
/// death makes the nodes wait for an election, which is not this test's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_etcd_member_down_leaves_the_nodes_ready_and_lets_a_node_start() {
    let mut setup = Setup::start(3, 2);
    let leader = setup.etcd.wait_healthy(PATIENCE).expect("etcd healthy");
    let dead = (leader + 1) % 3;
    setup.etcd.kill(dead).unwrap();
    assert_eq!(
        setup
            .etcd
            .wait_healthy(PATIENCE)
            .expect("the other two healthy"),
        leader,
        "the leader stays"
    );
    // Ready throughout: every sample, on every node, for a few seconds.
    let mut not_ready = 0;
    for _ in 0..20 {
        for &http in &setup.http {
            if http_status(http, "/readyz") != Some(200) {
                not_ready += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    assert_eq!(not_ready, 0, "samples not ready of 40");
    // A node told of the dead member first starts, is ready and serves.
    setup.add_node_on(&[], &[dead, leader, (dead + 2) % 3]);
    let mut c = client(setup.ports[2], "after-the-kill").await;
    assert_eq!(text(&ask(&mut c, &["SET", "k", "v"]).await), "+OK");
    let mut other = client(setup.ports[0], "reader").await;
    assert_eq!(text(&ask(&mut other, &["GET", "k"]).await), "$v");
}

/// Linearizable reads (etcd `Range`s) member `i` of `setup`'s etcd has
/// served (0 for a member killed).
fn ranges_served(setup: &mut Setup, i: usize) -> f64 {
    if setup.etcd.state(i) != statebroker_cluster_harness::ProcState::Running {
        return 0.0;
    }
    metric(
        setup.etcd.client_port(i),
        r#"grpc_server_handled_total{grpc_code="OK",grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"}"#,
    )
    .unwrap_or_else(|| panic!("etcd member {i} reports its Ranges"))
}

/// How many of `gets` GETs of one key on `c` each member served.
async fn ranges_of_gets(
    setup: &mut Setup,
    c: &mut statebroker_cli::client::Client,
    gets: usize,
) -> Vec<f64> {
    let before: Vec<f64> = (0..3).map(|i| ranges_served(setup, i)).collect();
    for _ in 0..gets {
        assert_eq!(text(&ask(c, &["GET", "k"]).await), "$v");
    }
    (0..3)
        .map(|i| ranges_served(setup, i) - before[i])
        .collect()
}

/// The node sends the keys' reads to etcd's leader (a read at a follower
/// waits for one more round trip between members), and to the new one
/// after the leader is killed, answering throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gets_go_to_etcds_leader_and_to_the_next_one_after_it_dies() {
    let mut setup = Setup::start(3, 1);
    let leader = setup.etcd.wait_healthy(PATIENCE).expect("etcd healthy");
    let routed_to = |setup: &Setup, member: usize| {
        let line = format!(
            "requests go to etcd's leader endpoint=\"{}\"",
            setup.etcd.endpoint(member)
        );
        lines_with(&setup.nodes[0], &line) > 0
    };
    eventually("the node names etcd's leader", || routed_to(&setup, leader)).await;
    let mut c = client(setup.ports[0], "reader").await;
    assert_eq!(text(&ask(&mut c, &["SET", "k", "v"]).await), "+OK");
    let served = ranges_of_gets(&mut setup, &mut c, 200).await;
    // The node's other reads (readiness, sessions, ...) go to any member,
    // about as many to each however long the GETs take: the leader served
    // the GETs over and above them.
    assert!(served[leader] >= 200.0, "the leader served {served:?}");
    for follower in (0..3).filter(|&m| m != leader) {
        assert!(
            served[leader] - served[follower] >= 150.0,
            "member {follower} served {served:?}"
        );
    }

    setup.etcd.kill(leader).unwrap();
    let next = setup.etcd.wait_healthy(PATIENCE).expect("a new leader");
    assert_ne!(next, leader);
    // Answered while etcd elects and the node finds the new leader.
    for _ in 0..20 {
        assert_eq!(text(&ask(&mut c, &["GET", "k"]).await), "$v");
    }
    eventually("the node names the new leader", || routed_to(&setup, next)).await;
    let served = ranges_of_gets(&mut setup, &mut c, 200).await;
    assert!(served[next] >= 200.0, "the new leader served {served:?}");
    let other = (0..3).find(|&m| m != leader && m != next).unwrap();
    assert!(
        served[next] - served[other] >= 150.0,
        "member {other} served {served:?}"
    );
}

/// Every key a SCAN of `pattern` lists, page after page, and how many
/// pages it took.
async fn scan_all(c: &mut statebroker_cli::client::Client, pattern: &[u8]) -> (Vec<String>, usize) {
    let mut seen = Vec::new();
    let mut token: Option<Vec<u8>> = None;
    let mut pages = 0;
    loop {
        let mut args: Vec<&[u8]> = vec![b"SCAN", pattern];
        if let Some(t) = &token {
            args.push(t);
        }
        let answer = c.request(&args, &[]).await.expect("SCAN answer");
        let page = statestore::command::Page::decode(&encode(&answer.reply)).expect("a page");
        seen.extend(page.keys.into_iter().map(|k| String::from_utf8(k).unwrap()));
        pages += 1;
        assert!(pages < 100, "SCAN does not end");
        match page.token {
            Some(t) => token = Some(t),
            None => return (seen, pages),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scan_pages_through_keys_written_on_every_node() {
    let setup = Setup::start(1, 2);
    let mut c0 = client(setup.ports[0], "c0").await;
    let mut c1 = client(setup.ports[1], "c1").await;
    let mut expected = Vec::new();
    for i in 0..250 {
        let key = format!("scan-{i:03}");
        let target = if i % 2 == 0 { &mut c0 } else { &mut c1 };
        assert_eq!(text(&ask(target, &["SET", &key, "v"]).await), "+OK");
        expected.push(key);
    }
    for i in 0..30 {
        ask(&mut c0, &["SET", &format!("other-{i}"), "v"]).await;
    }
    ask(&mut c1, &["DEL", "scan-007"]).await;
    expected.retain(|k| k != "scan-007");
    let (mut seen, pages) = scan_all(&mut c1, b"scan-*").await;
    assert!(pages >= 3, "250 keys in pages of 100: {pages} pages");
    seen.sort();
    assert_eq!(seen, expected);
}

/// A SCAN page spends a bounded number of glob steps (as on a single
/// node): with long keys and a costly pattern it ends early, after fewer
/// keys than a page holds, and paging on still lists each matching key
/// once. One page matched them all before, whatever it cost (about 2 s
/// a key for a 64 KiB key and a pattern of 32 KiB: the node stalled).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_costly_scan_pattern_ends_pages_early() {
    let setup = Setup::three_linked().await;
    let mut c = client(setup.ports[0], "scanner").await;
    let run = "a".repeat(8_000);
    let mut expected = Vec::new();
    for i in 0..12 {
        let key = format!("costly-{i:02}-{run}{}", if i % 2 == 0 { "b" } else { "c" });
        assert_eq!(text(&ask(&mut c, &["SET", &key, "v"]).await), "+OK");
        if i % 2 == 0 {
            expected.push(key);
        }
    }
    let pattern = format!("costly-*{}b*", "a".repeat(4_096));
    let (mut seen, pages) = scan_all(&mut c, pattern.as_bytes()).await;
    let pattern = statestore::glob::Pattern::new(pattern.as_bytes());
    let per_key = pattern.cost(expected[0].len());
    assert!(
        12 * per_key > statestore::command::STEPS_PER_PAGE,
        "the keys cost more than a page's steps ({per_key} each)"
    );
    assert!(pages >= 2, "{pages} page(s) for 12 costly keys");
    seen.sort();
    assert_eq!(seen, expected);
}

/// GETs waiting at the same time go to etcd as one request: each still
/// gets its own key's value, large ones too (16 values of 600 KB in one
/// answer pass gRPC's default 4 MiB decoding limit); SCAN lists keys
/// whose values together pass it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_gets_each_get_their_own_key_and_scan_large_values() {
    const KEYS: usize = 40;
    const BIG: usize = 10;
    const READERS: usize = 16;
    let setup = Setup::start(1, 1);
    let (port, http) = (setup.ports[0], setup.http[0]);
    let value = |i: usize| {
        if i < BIG {
            format!("{i:06}").repeat(100_000)
        } else {
            format!("small-{i}")
        }
    };
    let mut writer = client(port, "writer").await;
    for i in 0..KEYS {
        let set = ask(&mut writer, &["SET", &format!("key-{i}"), &value(i)]).await;
        assert_eq!(text(&set), "+OK");
    }
    let before = metric(http, "statebroker_cluster_reads_total").unwrap_or(0.0);
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(READERS));
    let readers: Vec<_> = (0..READERS)
        .map(|r| {
            let start = start.clone();
            tokio::spawn(async move {
                let mut c = client(port, &format!("reader-{r}")).await;
                start.wait().await;
                // The large values first, each reader from its own one.
                let order = (0..BIG)
                    .map(|j| (j + r) % BIG)
                    .chain((BIG..KEYS).map(|j| BIG + (j + r) % (KEYS - BIG)));
                for i in order {
                    let got = ask(&mut c, &["GET", &format!("key-{i}")]).await;
                    assert!(
                        text(&got) == format!("${}", value(i)),
                        "reader {r}, key-{i}: another value ({} bytes)",
                        text(&got).len()
                    );
                }
            })
        })
        .collect();
    for reader in readers {
        reader.await.expect("the reader got every value");
    }
    let reads = metric(http, "statebroker_cluster_reads_total").expect("counted") - before;
    let requests = metric(http, "statebroker_cluster_read_requests_total").expect("counted");
    // A read that fails is tried again and counted again: on one etcd
    // member on loopback none does, unless a batch's answer is refused.
    assert_eq!(
        reads,
        (READERS * KEYS) as f64,
        "reads for {} GETs: some failed and were tried again",
        READERS * KEYS
    );
    assert!(
        requests < reads,
        "{requests} etcd requests for {reads} reads: none went together"
    );
    // Each answered read request's time is in etcd's histogram.
    let timed = |what: &str| {
        metric(
            http,
            &format!("statebroker_cluster_etcd_request_duration_seconds_{what}{{kind=\"read\"}}"),
        )
        .expect("etcd's time of the reads")
    };
    assert_eq!(timed("count"), requests, "every read request timed once");
    assert!(timed("sum") > 0.0);
    let page = writer
        .request(&[b"SCAN", b"key-*"], &[])
        .await
        .expect("SCAN");
    let page = statestore::command::Page::decode(&encode(&page.reply)).expect("a page");
    assert_eq!(page.keys.len(), KEYS, "{:?}", page.token);
}

/// Writes waiting at the same time go to etcd as one transaction, all or
/// nothing: when another node changed one of their keys first, that write
/// plans again and the others are sent again. Clients on two nodes race
/// `SET NX` on the same keys and overwrite three hot keys, between writes
/// of keys of their own: each raced key has exactly one winner, whom both
/// nodes then read, and every write of their own is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_on_two_nodes_each_commit_once() {
    const RACED: usize = 20;
    const RACERS: usize = 8;
    let setup = Setup::start(1, 2);
    let (ports, http) = (setup.ports.clone(), setup.http[0]);
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(RACERS * 2));
    let mut tasks = Vec::new();
    for r in 0..RACERS * 2 {
        let start = start.clone();
        let port = ports[r % 2];
        tasks.push(tokio::spawn(async move {
            let me = format!("racer-{r}");
            let mut c = client(port, &me).await;
            start.wait().await;
            let mut won = Vec::new();
            for i in 0..RACED {
                // A key of its own in between: a write that must commit.
                let own = ask(&mut c, &["SET", &format!("{me}-{i}"), "v"]).await;
                assert_eq!(text(&own), "+OK");
                // Keys both nodes keep changing: conflicts in batches.
                let hot = ask(&mut c, &["SET", &format!("hot-{}", i % 3), &me]).await;
                assert_eq!(text(&hot), "+OK");
                let race = ask(&mut c, &["SET", &format!("raced-{i}"), &me, "NX"]).await;
                match text(&race).as_str() {
                    "+OK" => won.push(i),
                    ":-1" => {}
                    other => panic!("{me}, raced-{i}: {other}"),
                }
            }
            (me, won)
        }));
    }
    let mut winners = vec![Vec::new(); RACED];
    for task in tasks {
        let (me, won) = task.await.expect("every write answered");
        for i in won {
            winners[i].push(me.clone());
        }
    }
    let mut readers = [
        client(ports[0], "reader-0").await,
        client(ports[1], "reader-1").await,
    ];
    for (i, won) in winners.iter().enumerate() {
        assert_eq!(won.len(), 1, "raced-{i}: winners {won:?}");
        for reader in &mut readers {
            let got = ask(reader, &["GET", &format!("raced-{i}")]).await;
            assert_eq!(text(&got), format!("${}", won[0]));
        }
        for r in 0..RACERS * 2 {
            let own = ask(&mut readers[r % 2], &["GET", &format!("racer-{r}-{i}")]).await;
            assert_eq!(text(&own), "$v");
        }
    }
    let writes = metric(http, "statebroker_cluster_writes_total").expect("counted");
    let requests = metric(http, "statebroker_cluster_write_requests_total").expect("counted");
    assert!(
        requests < writes,
        "{requests} etcd requests for {writes} writes on node 1: none went together"
    );
}

fn encode(reply: &statestore::resp3::Reply) -> Vec<u8> {
    use statestore::resp3::Reply;
    let mut out = Vec::new();
    match reply {
        Reply::Array(parts) => {
            out.extend_from_slice(format!("*{}\r\n", parts.len()).as_bytes());
            for p in parts {
                out.extend(encode(p));
            }
        }
        Reply::Bulk(b) => {
            out.extend_from_slice(format!("${}\r\n", b.len()).as_bytes());
            out.extend_from_slice(b);
            out.extend_from_slice(b"\r\n");
        }
        other => panic!("not in a SCAN page: {other:?}"),
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_etcd_quorum_is_not_ready_and_recovers_and_a_killed_node_loses_nothing() {
    let mut setup = Setup::start(3, 2);
    let mut c0 = client(setup.ports[0], "c0").await;
    for i in 0..20 {
        let set = ask(&mut c0, &["SET", &format!("k{i}"), &i.to_string()]).await;
        assert_eq!(text(&set), "+OK");
    }
    // The node the client used is killed: another serves every key.
    setup.nodes[0].kill().unwrap();
    let mut c1 = client(setup.ports[1], "c0").await;
    for i in 0..20 {
        assert_eq!(
            text(&ask(&mut c1, &["GET", &format!("k{i}")]).await),
            format!("${i}")
        );
    }
    // Two of three members gone: no quorum, not ready.
    let http = setup.http[1];
    assert_eq!(http_status(http, "/readyz"), Some(200));
    setup.etcd.kill(0).unwrap();
    setup.etcd.kill(1).unwrap();
    eventually("/readyz 503 without quorum", || {
        http_status(http, "/readyz") == Some(503)
    })
    .await;
    // Back: ready again by itself (registered again: its clients were sent
    // away meanwhile, see membership.rs), and the keys are there.
    setup.etcd.restart(0).unwrap();
    setup.etcd.restart(1).unwrap();
    eventually("/readyz 200 with quorum back", || {
        http_status(http, "/readyz") == Some(200)
    })
    .await;
    drop(c1);
    let mut c1 = client(setup.ports[1], "c0").await;
    assert_eq!(text(&ask(&mut c1, &["GET", "k7"]).await), "$7");
}

#[test]
fn etcd_unreachable_at_start_is_a_clear_error() {
    let dead = statebroker_cluster_harness::free_port();
    let output = std::process::Command::new(BROKER)
        .args([
            "--listen=127.0.0.1:0",
            "--no-http",
            "--in-memory",
            "--cluster-node-id=lonely",
            &format!("--etcd-endpoints=http://127.0.0.1:{dead}"),
        ])
        .env("STATEBROKER__CLUSTERING__ETCD_REQUEST_TIMEOUT_MS", "500")
        .output()
        .expect("runs");
    assert!(!output.status.success());
    let log = String::from_utf8_lossy(&output.stderr).into_owned()
        + &String::from_utf8_lossy(&output.stdout);
    assert!(
        log.contains(&format!("cannot reach etcd at http://127.0.0.1:{dead}")),
        "{log}"
    );
}

#[test]
fn a_node_id_without_endpoints_is_refused() {
    let output = std::process::Command::new(BROKER)
        .args([
            "--listen=127.0.0.1:0",
            "--no-http",
            "--in-memory",
            "--cluster-node-id=sb1",
        ])
        .output()
        .expect("runs");
    assert_eq!(output.status.code(), Some(2));
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(err.contains("clustering.etcd_endpoints is empty"), "{err}");
}

/// `[clustering] cached_reads = true`: a GET answers from the node's
/// watch-fed copy of the records, so it sees another node's writes once
/// the watch brings them, and keeps answering while etcd does not; a key
/// the node does not keep is read from etcd (no answer without it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_reads_follow_the_watch_and_answer_without_etcd() {
    let mut setup = Setup::start_with(1, 2, &[("STATEBROKER__CLUSTERING__CACHED_READS", "true")]);
    let mut writer = client(setup.ports[0], "writer").await;
    let mut reader = client(setup.ports[1], "reader").await;
    assert_eq!(text(&ask(&mut writer, &["SET", "k", "v1"]).await), "+OK");
    assert_eq!(text(&ask(&mut reader, &["GET", "k"]).await), "$v1");
    // The reader's node keeps the key now: the next value reaches it
    // through the watch.
    assert_eq!(text(&ask(&mut writer, &["SET", "k", "v2"]).await), "+OK");
    let started = std::time::Instant::now();
    loop {
        let got = text(&ask(&mut reader, &["GET", "k"]).await);
        if got == "$v2" {
            break;
        }
        assert_eq!(got, "$v1", "only the old value or the new one");
        assert!(started.elapsed() < PATIENCE, "the watch never brought v2");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // etcd stops answering: the kept key still reads, others get no
    // answer.
    setup.etcd.pause(0).unwrap();
    assert_eq!(text(&ask(&mut reader, &["GET", "k"]).await), "$v2");
    let mut impatient = {
        let target = statebroker_cli::client::Target {
            host: "127.0.0.1".into(),
            port: setup.ports[1],
            client_id: "impatient".into(),
            login: None,
            // Short: the pause must stay well inside the membership
            // lease (the node stops serving 4 s after its last renewal,
            // which may be 1.25 s old when etcd stops).
            timeout: std::time::Duration::from_secs(1),
            tls: None,
        };
        statebroker_cli::client::Client::connect(&target)
            .await
            .expect("connects")
    };
    let unknown: [&[u8]; 2] = [b"GET", b"never-written"];
    assert!(
        impatient.request(&unknown, &[]).await.is_err(),
        "a key the node does not keep is read from etcd"
    );
    setup.etcd.resume(0).unwrap();
    assert_eq!(
        text(&ask(&mut reader, &["GET", "never-written"]).await),
        "$-1"
    );
}

/// The `keys:` line of INFO keyspace on `client`'s node.
async fn keys_in_info(client: &mut statebroker_cli::client::Client) -> String {
    let info = text(&ask(client, &["INFO", "keyspace"]).await);
    info.split("\r\n")
        .find(|l| l.starts_with("keys:"))
        .unwrap_or_default()
        .to_owned()
}

/// Polls INFO on `client`'s node until it counts `keys` keys.
async fn until_info_counts(client: &mut statebroker_cli::client::Client, keys: usize) {
    let start = std::time::Instant::now();
    loop {
        let line = keys_in_info(client).await;
        if line == format!("keys:{keys}") {
            return;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "INFO says {line:?}, not {keys} keys"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Issue #28: INFO and the store-wide quota (`max_keys`) count the keys of
/// every node, as each node's watch delivers them: once both nodes count
/// five keys, a sixth is refused on either; a key replaced is not a new
/// one; a key deleted on one node makes room on the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_and_quotas_count_every_nodes_keys() {
    let setup = Setup::start_with(1, 2, &[("STATEBROKER__STATESTORE__QUOTA__MAX_KEYS", "5")]);
    let mut a = client(setup.ports[0], "a").await;
    let mut b = client(setup.ports[1], "b").await;
    for key in ["a1", "a2", "a3"] {
        assert_eq!(text(&ask(&mut a, &["SET", key, "v"]).await), "+OK");
    }
    for key in ["b1", "b2"] {
        assert_eq!(text(&ask(&mut b, &["SET", key, "v"]).await), "+OK");
    }
    until_info_counts(&mut a, 5).await;
    until_info_counts(&mut b, 5).await;
    for node in [&mut a, &mut b] {
        let refused = text(&ask(node, &["SET", "sixth", "v"]).await);
        assert!(refused.contains("quota"), "{refused}");
        assert_eq!(text(&ask(node, &["SET", "a1", "replaced"]).await), "+OK");
    }
    assert_eq!(text(&ask(&mut a, &["DEL", "a1"]).await), ":1");
    until_info_counts(&mut b, 4).await;
    assert_eq!(text(&ask(&mut b, &["SET", "sixth", "v"]).await), "+OK");
    until_info_counts(&mut a, 5).await;
}
