//! Issue #29 item 1, membership: each node registers in etcd under a
//! lease; a node that loses it (paused past it, or cut off from etcd)
//! sends its clients away with DISCONNECT 0x9C "use another server",
//! refuses CONNECT with 0x9C and is not ready, until it registers again;
//! a node id held by a live node is refused, one held by a killed run's
//! lease is waited for.
//! Real etcd, real node processes, SIGSTOP and SIGKILL.

mod common;

use std::time::{Duration, Instant};

use common::raw::{Raw, Recv, v5};
use common::{BROKER, PATIENCE, Setup, addr, eventually, http_status, lines_with, metric};

const MEMBERS: &str = "statebroker_cluster_members";

/// Waits for DISCONNECT 0x9C on `client`.
async fn sent_away(client: &mut Raw) {
    if let Some(other) = sent_away_or(client).await {
        panic!("expected DISCONNECT 0x9C, got {other:?}");
    }
}

/// Waits for DISCONNECT 0x9C on `client`; what came instead, if not.
async fn sent_away_or(client: &mut Raw) -> Option<Recv> {
    match client.recv_within(PATIENCE).await {
        Recv::Packet(v5::Packet::Disconnect(d))
            if d.reason_code == v5::DisconnectReasonCode::UseAnotherServer =>
        {
            None
        }
        other => Some(other),
    }
}

/// Connects `client_id` to `port` once the node accepts it again (CONNACK
/// 0x9C meanwhile, or 0x88 while the other nodes link to a node that
/// registered again; nothing else).
async fn connect_when_serving(port: u16, client_id: &str) -> Raw {
    let start = Instant::now();
    loop {
        let (raw, ack) = Raw::connect_with(addr(port), client_id, |_| {}).await;
        match ack.code {
            v5::ConnectReturnCode::Success => return raw,
            v5::ConnectReturnCode::UseAnotherServer | v5::ConnectReturnCode::ServerUnavailable => {}
            other => panic!("refused with {other:?}"),
        }
        assert!(start.elapsed() < PATIENCE, "never served again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_its_lease_sends_clients_away_until_it_registers_again() {
    let mut setup = Setup::start_with(1, 2, &[("STATEBROKER__CLUSTERING__LEASE_TTL_MS", "2000")]);
    let http = setup.http.clone();
    for &port in &http {
        eventually("both nodes registered", || {
            metric(port, MEMBERS) == Some(2.0)
        })
        .await;
    }

    // A node id a live node holds: the second node does not start.
    let output = std::process::Command::new(BROKER)
        .args(["--listen=127.0.0.1:0", "--no-http", "--in-memory"])
        .arg("--cluster-node-id=sb1")
        .arg(format!(
            "--etcd-endpoints={}",
            setup.etcd.endpoints().join(",")
        ))
        .output()
        .expect("runs");
    assert!(!output.status.success());
    let log = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(log.contains("is registered by another live node"), "{log}");

    // Killed and started again at once: its previous run's registration
    // is still there; it waits for that lease and serves.
    setup.nodes[0].kill().unwrap();
    setup.nodes[0].restart().unwrap();
    setup.nodes[0].wait_tcp(setup.ports[0], PATIENCE).unwrap();
    drop(connect_when_serving(setup.ports[0], "early").await);
    assert!(
        setup.nodes[0]
            .log_tail(200)
            .contains("waiting for it to run out"),
        "{}",
        setup.nodes[0].log_tail(50)
    );

    // Paused past its lease: its registration goes from etcd (the other
    // node sees it go); once it wakes, its client is sent away, and it
    // serves again after registering anew. (sb2 must have seen sb1's new
    // registration first: its gauge still said 1 from the kill above, and
    // a pause judged by it could end before the lease did.)
    eventually("sb2 sees sb1 registered again", || {
        metric(http[1], MEMBERS) == Some(2.0)
    })
    .await;
    let mut client = Raw::connect(addr(setup.ports[0]), "roamer").await;
    setup.nodes[0].pause().unwrap();
    let registration = "/statebroker/N/sb1";
    eventually("sb1's lease runs out", || {
        setup.etcd.get(registration).unwrap().is_none()
    })
    .await;
    eventually("sb2 sees sb1 go", || metric(http[1], MEMBERS) == Some(1.0)).await;
    setup.nodes[0].resume().unwrap();
    if let Some(other) = sent_away_or(&mut client).await {
        panic!(
            "expected DISCONNECT 0x9C after the pause, got {other:?}; sb1's log:\n{}",
            setup.nodes[0].log_tail(40)
        );
    }
    let mut back = connect_when_serving(setup.ports[0], "roamer").await;
    // sb1 took the client only once sb2's link was back (it was sent
    // away with the clients): a publish on sb2 right after the SUBACK
    // reaches it.
    back.subscribe("rejoined", rumqttc::v5::mqttbytes::QoS::AtLeastOnce)
        .await;
    let mut publisher = connect_when_serving(setup.ports[1], "publisher").await;
    publisher
        .publish(
            "rejoined",
            "x",
            rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
            None,
        )
        .await;
    let p = back.next_publish().await;
    assert_eq!(&p.topic[..], b"rejoined");
    eventually("sb2 sees sb1 back", || {
        metric(http[1], MEMBERS) == Some(2.0)
    })
    .await;

    // Cut off from etcd: the same, and CONNECT answered 0x9C meanwhile.
    let mut client = Raw::connect(addr(setup.ports[1]), "stayer").await;
    setup.etcd.kill(0).unwrap();
    sent_away(&mut client).await;
    let (_, ack) = Raw::connect_with(addr(setup.ports[1]), "late", |_| {}).await;
    assert_eq!(ack.code, v5::ConnectReturnCode::UseAnotherServer);
    assert_eq!(http_status(http[1], "/readyz"), Some(503));
    setup.etcd.restart(0).unwrap();
    let _back = connect_when_serving(setup.ports[1], "late").await;
    eventually("/readyz 200 again", || {
        http_status(http[1], "/readyz") == Some(200)
    })
    .await;
}

/// #29's target "0 deliveries or answers on connections whose ownership
/// moved elsewhere": a node paused past its lease wakes with a publish
/// waiting in a client's socket; it neither routes it (its subscriber on
/// the same node gets no PUBLISH) nor acknowledges it: both clients get
/// DISCONNECT 0x9C first. The node knows from the clock, before its
/// renewing task has run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_wakes_past_its_lease_serves_nothing_more() {
    let mut setup = Setup::start_with(1, 1, &[("STATEBROKER__CLUSTERING__LEASE_TTL_MS", "2000")]);
    let port = setup.ports[0];
    let mut subscriber = Raw::connect(addr(port), "sub").await;
    subscriber
        .subscribe("t", rumqttc::v5::mqttbytes::QoS::AtLeastOnce)
        .await;
    let mut publisher = Raw::connect(addr(port), "pub").await;
    setup.nodes[0].pause().unwrap();
    // The lease ran out: etcd dropped the node's registration.
    let registration = "/statebroker/N/sb1";
    let start = Instant::now();
    while setup.etcd.get(registration).unwrap().is_some() {
        assert!(start.elapsed() < PATIENCE, "the lease never ran out");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut publish = v5::Publish::new(
        "t",
        rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
        bytes::Bytes::from_static(b"while away"),
        None,
    );
    publish.pkid = 1;
    publisher.send(v5::Packet::Publish(publish)).await;
    setup.nodes[0].resume().unwrap();
    sent_away(&mut subscriber).await;
    sent_away(&mut publisher).await;
}

/// An etcd leader election that outlasts the node's serving deadline
/// suspends its clients; it does not send them away: once the new leader
/// confirms the lease (etcd extends every lease across an election), they
/// go on, on the same connections. Before, every such election sent all
/// of a node's clients to other nodes at once.
///
/// Deterministic timing: the lease is 4 s, renewed every second, so the
/// node stops serving at most 3.2 s after the kill; etcd's election
/// timeout is 4 s, so no new leader is elected before ~3.9 s; the node
/// waits up to two more TTLs (8 s) for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_leader_election_pauses_clients_without_sending_them_away() {
    let mut options = statebroker_cluster_harness::EtcdOptions::default();
    options.extra_args.push("--election-timeout=4000".into());
    let mut setup = Setup::start_with_etcd(
        3,
        options,
        1,
        &[
            ("STATEBROKER__CLUSTERING__LEASE_TTL_MS", "4000"),
            // The claim below fails and is tried again before the node
            // is suspended.
            ("STATEBROKER__CLUSTERING__ETCD_REQUEST_TIMEOUT_MS", "1000"),
        ],
    );
    let (port, http) = (setup.ports[0], setup.http[0]);
    let mut subscriber = Raw::connect(addr(port), "steady-sub").await;
    subscriber
        .subscribe("e/#", rumqttc::v5::mqttbytes::QoS::AtLeastOnce)
        .await;
    let mut publisher = Raw::connect(addr(port), "steady-pub").await;
    let leader = setup.etcd.wait_leader(PATIENCE).expect("a leader");
    setup.etcd.kill(leader).unwrap();
    // A client accepted during the election: its ownership record cannot
    // be put before the node is suspended, and is put once etcd confirms
    // the lease (before, the claim was dropped at the suspension: the
    // client had a connection here and no record, so a connection to
    // another node would not have ended this one).
    let _elected = Raw::connect(addr(port), "mid-election").await;
    eventually("the node suspended", || {
        metric(http, "statebroker_cluster_suspensions_total").is_some_and(|n| n >= 1.0)
    })
    .await;
    // A publish sent while suspended waits, and goes through after.
    let reason = publisher
        .publish(
            "e/1",
            "during",
            rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
            None,
        )
        .await;
    assert_eq!(reason, Some(v5::PubAckReason::Success));
    let p = subscriber.next_publish().await;
    assert_eq!(&p.payload[..], b"during");
    assert_eq!(
        metric(http, "statebroker_cluster_lease_losses_total"),
        None,
        "the lease was never lost"
    );
    eventually("ready again", || http_status(http, "/readyz") == Some(200)).await;
    eventually(
        "the client accepted during the election is recorded",
        || {
            setup
                .etcd
                .get("/statebroker/C/mid-election")
                .unwrap()
                .is_some()
        },
    )
    .await;
    setup.etcd.restart(leader).unwrap();
    // The same connections, served.
    for client in [&mut subscriber, &mut publisher] {
        client.send(v5::Packet::PingReq(v5::PingReq)).await;
        match client.recv_within(PATIENCE).await {
            Recv::Packet(v5::Packet::PingResp(_)) => {}
            other => panic!("expected PINGRESP, got {other:?}"),
        }
    }
}

/// A CONNECT with Clean Start 0 waits for etcd (its session is read
/// there); a node that loses its lease meanwhile refuses it with 0x9C
/// when etcd answers, even if it serves again by then: the client may
/// have gone to another node, and the late CONNECT's claim would take it
/// from there (the long fault run saw clients ended with 0x8E so, by a
/// node they had left).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_that_waited_across_a_lease_loss_is_refused() {
    let mut setup = Setup::start_with(
        1,
        1,
        &[
            ("STATEBROKER__CLUSTERING__LEASE_TTL_MS", "2000"),
            // The session read waits for etcd past the lease's loss.
            ("STATEBROKER__CLUSTERING__ETCD_REQUEST_TIMEOUT_MS", "60000"),
        ],
    );
    let (port, http) = (setup.ports[0], setup.http[0]);
    setup.etcd.pause(0).unwrap();
    let connecting = tokio::spawn(Raw::try_connect(
        addr(port),
        "waiter",
        PATIENCE * 2,
        persistent,
    ));
    eventually("the node lost its lease", || {
        metric(http, "statebroker_cluster_lease_losses_total").is_some_and(|n| n >= 1.0)
    })
    .await;
    assert!(
        !connecting.is_finished(),
        "the CONNECT was answered before etcd was: it did not wait"
    );
    setup.etcd.resume(0).unwrap();
    let (_, ack) = connecting.await.unwrap().expect("a CONNACK");
    assert_eq!(
        ack.code,
        v5::ConnectReturnCode::UseAnotherServer,
        "{}",
        setup.nodes[0].log_tail(30)
    );
}

/// The session a CONNECT refused across a lease loss read from etcd (the
/// client's session on another node) is not kept on the refusing node.
/// Only sb1's lease is short: sb2 keeps its lease (and with it its claim
/// of the client) through the pause, so the session never becomes
/// ownerless, which sb1 would rightly adopt when it registers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_refused_across_a_lease_loss_leaves_no_session_behind() {
    let waits = ("STATEBROKER__CLUSTERING__ETCD_REQUEST_TIMEOUT_MS", "60000");
    let mut setup = Setup::start(1, 0);
    setup.add_node(&[waits, ("STATEBROKER__CLUSTERING__LEASE_TTL_MS", "2000")]);
    setup.add_node(&[waits, ("STATEBROKER__CLUSTERING__LEASE_TTL_MS", "60000")]);
    setup.all_linked().await;
    let (sb1, http) = (setup.ports[0], setup.http.clone());
    // Each node also keeps the sessions of the other nodes' links.
    let kept = |i: usize| metric(http[i], "statebroker_kept_sessions").unwrap_or(-1.0);
    let linked = |i: usize| metric(http[i], "statebroker_cluster_peer_links") == Some(1.0);
    let before = kept(0);
    session_left_on(setup.ports[1], "waiter").await;
    eventually("sb2 recorded the session in etcd", || {
        setup
            .etcd
            .get("/statebroker/S/waiter")
            .ok()
            .flatten()
            .is_some()
    })
    .await;

    setup.etcd.pause(0).unwrap();
    let connecting = tokio::spawn(Raw::try_connect(
        addr(sb1),
        "waiter",
        PATIENCE * 2,
        persistent,
    ));
    eventually("sb1 lost its lease", || {
        metric(http[0], "statebroker_cluster_lease_losses_total").is_some_and(|n| n >= 1.0)
    })
    .await;
    setup.etcd.resume(0).unwrap();
    let (_, ack) = connecting.await.unwrap().expect("a CONNACK");
    assert_eq!(ack.code, v5::ConnectReturnCode::UseAnotherServer);
    eventually(
        "sb1 linked again and keeps no session of the client",
        || linked(0) && kept(0) == before,
    )
    .await;
    assert_eq!(
        metric(http[1], "statebroker_cluster_lease_losses_total"),
        None,
        "sb2 kept its lease"
    );
    assert_eq!(owner(&setup, "waiter").as_deref(), Some("sb2"));
}

/// `client_id` connects to `port` with a persistent session, subscribes
/// to `<client_id>/inbox` and leaves (DISCONNECT): its session stays.
async fn session_left_on(port: u16, client_id: &str) {
    let mut client = connect_persistent(port, client_id).await;
    client
        .subscribe(
            &format!("{client_id}/inbox"),
            rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
        )
        .await;
    client
        .send(v5::Packet::Disconnect(v5::Disconnect::new(
            v5::DisconnectReasonCode::NormalDisconnection,
        )))
        .await;
}

/// A CONNECT with Clean Start 0 and a session kept 60 s.
fn persistent((connect, _, _): &mut (v5::Connect, Option<v5::LastWill>, Option<v5::Login>)) {
    connect.clean_start = false;
    connect
        .properties
        .get_or_insert_with(Default::default)
        .session_expiry_interval = Some(60);
}

/// Connects `client_id` with Clean Start 0 and a session kept 60 s.
async fn connect_persistent(port: u16, client_id: &str) -> Raw {
    let (raw, ack) = Raw::connect_with(addr(port), client_id, persistent).await;
    assert_eq!(ack.code, v5::ConnectReturnCode::Success);
    raw
}

/// The node `C/<client_id>` names as the client's owner.
fn owner(setup: &Setup, client_id: &str) -> Option<String> {
    let value = setup
        .etcd
        .get(&format!("/statebroker/C/{client_id}"))
        .ok()
        .flatten()?;
    let value = String::from_utf8(value).ok()?;
    value.split('\n').next().map(str::to_owned)
}

/// `client` is ended with DISCONNECT 0x8E (session taken over).
async fn taken_over(client: &mut Raw, node: &statebroker_cluster_harness::Node) {
    match client.recv_within(PATIENCE).await {
        Recv::Packet(v5::Packet::Disconnect(d)) => assert_eq!(
            d.reason_code,
            v5::DisconnectReasonCode::SessionTakenOver,
            "{}",
            node.log_tail(30)
        ),
        other => panic!("not taken over: {other:?}\n{}", node.log_tail(30)),
    }
}

/// `client`'s connection goes on (a PINGREQ answered).
async fn goes_on(client: &mut Raw, node: &statebroker_cluster_harness::Node) {
    client.send(v5::Packet::PingReq(v5::PingReq)).await;
    match client.recv_within(PATIENCE).await {
        Recv::Packet(v5::Packet::PingResp(_)) => {}
        other => panic!(
            "the connection did not go on: {other:?}\n{}",
            node.log_tail(30)
        ),
    }
}

/// Two nodes on one etcd member, each claim of sb1 and sb2 held back as
/// `delays` says (`[faults] claim_delay_ms`), and client "mover" connected
/// with Clean Start 0 to sb1, then to sb2.
async fn claims_delayed(delays: [Option<&str>; 2]) -> (Setup, Raw, Raw) {
    let mut setup = Setup::start_with(1, 0, &[]);
    for delay in delays {
        match delay {
            Some(ms) => setup.add_node(&[
                ("STATEBROKER__FAULTS__ENABLED", "true"),
                ("STATEBROKER__FAULTS__CLAIM_DELAY_MS", ms),
            ]),
            None => setup.add_node(&[]),
        }
    }
    setup.all_linked().await;
    let early = connect_persistent(setup.ports[0], "mover").await;
    let later = connect_persistent(setup.ports[1], "mover").await;
    (setup, early, later)
}

/// A claim etcd takes late (`[faults] claim_delay_ms` on sb1) does not
/// take the client from a node it connected to after: sb1 read the
/// client's session before sb2 did, so sb2's CONNECT is the later one,
/// whichever claim reaches etcd last. sb1's connection ends (0x8E), sb2's
/// goes on and stays the owner (sb1's late claim took it from sb2 before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_claim_does_not_take_the_client_from_a_later_connect() {
    let (setup, mut early, mut later) = claims_delayed([Some("3000"), None]).await;
    eventually("sb2 recorded as the owner", || {
        owner(&setup, "mover").as_deref() == Some("sb2")
    })
    .await;
    taken_over(&mut early, &setup.nodes[0]).await;
    goes_on(&mut later, &setup.nodes[1]).await;
    assert_eq!(owner(&setup, "mover").as_deref(), Some("sb2"));
}

/// The other way round: sb1's claim reaches etcd between sb2's read and
/// sb2's late claim (`claim_delay_ms` 2 s on sb1, 6 s on sb2). sb1's
/// CONNECT read first, so sb2's claim is put over sb1's record, and
/// sb1's connection ends (0x8E).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_connects_late_claim_is_put_over_an_earlier_ones() {
    let (setup, mut early, mut later) = claims_delayed([Some("2000"), Some("6000")]).await;
    eventually("sb1 recorded as the owner first", || {
        owner(&setup, "mover").as_deref() == Some("sb1")
    })
    .await;
    taken_over(&mut early, &setup.nodes[0]).await;
    assert_eq!(owner(&setup, "mover").as_deref(), Some("sb2"));
    goes_on(&mut later, &setup.nodes[1]).await;
}

/// Two nodes, sb1 on one etcd member, sb2 on the other two, each lease
/// long enough to outlast a pause of sb1's member; returns the member.
async fn sb1_on_its_own_member() -> (Setup, usize) {
    let env = [
        // sb1 keeps its lease while its member is paused.
        ("STATEBROKER__CLUSTERING__LEASE_TTL_MS", "30000"),
        ("STATEBROKER__CLUSTERING__ETCD_REQUEST_TIMEOUT_MS", "60000"),
    ];
    let mut setup = Setup::start_with(3, 0, &env);
    let leader = setup.etcd.wait_leader(PATIENCE).expect("an etcd leader");
    let slow = (leader + 1) % 3;
    let others: Vec<usize> = (0..3).filter(|&i| i != slow).collect();
    setup.add_node_on(&env, &[slow]);
    setup.add_node_on(&env, &others);
    setup.all_linked().await;
    (setup, slow)
}

/// "mover" connects to sb1 with Clean Start 0 while sb1's etcd member
/// (`slow`) is paused, gives up (closes the socket) and connects to sb2;
/// then the member resumes and sb1 is done with the abandoned CONNECT.
/// Returns the connection to sb2.
async fn give_up_on_sb1(setup: &mut Setup, slow: usize) -> Raw {
    let (sb1, sb2) = (setup.ports[0], setup.ports[1]);
    setup.etcd.pause(slow).unwrap();
    let waiting = tokio::spawn(Raw::try_connect(addr(sb1), "mover", PATIENCE, persistent));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiting.is_finished(),
        "sb1 answered without its etcd member"
    );
    waiting.abort();
    let _ = waiting.await;
    let later = connect_persistent(sb2, "mover").await;
    eventually("sb2 recorded as the owner", || {
        owner(setup, "mover").as_deref() == Some("sb2")
    })
    .await;
    setup.etcd.resume(slow).unwrap();
    let sb1 = &setup.nodes[0];
    eventually("sb1 done with the abandoned CONNECT", || {
        sb1.log_tail(200)
            .contains("closed the connection while its CONNECT waited")
            || sb1.log_tail(200).contains("client connected peer")
                && sb1.log_tail(200).contains("\"mover\"")
    })
    .await;
    later
}

/// A CONNECT with Clean Start 0 waits for etcd (its session is read
/// there). Its client gives up meanwhile, closes the socket and connects
/// to another node: when etcd answers, the first node does not accept the
/// abandoned CONNECT, so its claim does not take the client from the
/// node it went to (the read, served after the other node's claim, makes
/// it the later CONNECT in etcd's order). sb1 speaks to one etcd member,
/// SIGSTOPped while sb1's read waits (for less than sb1's lease); sb2 to
/// the two others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_its_client_gave_up_on_takes_nothing() {
    let (mut setup, slow) = sb1_on_its_own_member().await;
    let mut later = give_up_on_sb1(&mut setup, slow).await;
    // A claim sb1 made would be in etcd within this (its own would show
    // failing the test; nothing here waits for the test to pass).
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        owner(&setup, "mover").as_deref(),
        Some("sb2"),
        "{}",
        setup.nodes[0].log_tail(30)
    );
    goes_on(&mut later, &setup.nodes[1]).await;
}

/// The session sb1 read from etcd for a CONNECT it then did not accept
/// is not kept there: it would collect the client's messages (and write
/// copies of them to etcd) until it expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_its_client_gave_up_on_leaves_no_session_behind() {
    let (mut setup, slow) = sb1_on_its_own_member().await;
    // Each node also keeps the sessions of the other nodes' links.
    let http = setup.http.clone();
    let kept = |i: usize| metric(http[i], "statebroker_kept_sessions").unwrap_or(-1.0);
    let before = kept(0);
    session_left_on(setup.ports[1], "mover").await;

    let mut later = give_up_on_sb1(&mut setup, slow).await;
    // sb1 read the session from etcd before it logged that it did not
    // accept the CONNECT: kept there, it would count from then on.
    eventually("sb1 keeps no session of the client", || kept(0) == before).await;
    goes_on(&mut later, &setup.nodes[1]).await;
}

/// Two processes given one node id: the second starts while the first is
/// paused past its lease and registers the id. The first, back, cannot
/// register again: it says so (a WARN, once), serves no client, and its
/// links stay away from the other nodes. Before, it waited without a word
/// (DEBUG lines) while its links and the new process's took each other
/// over on the other nodes (about 430 WARN lines in 20 s on each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_id_was_taken_while_it_was_paused_says_so_and_leaves_the_links() {
    let mut setup = Setup::three_linked().await;
    setup.nodes[0].pause().unwrap();
    eventually("sb1's lease runs out", || {
        setup.etcd.get("/statebroker/N/sb1").unwrap().is_none()
    })
    .await;
    setup.add_node_with(&[], &[0], &["--cluster-node-id=sb1".to_owned()]);
    let twin = setup.nodes.len() - 1;
    setup.nodes[0].resume().unwrap();
    let said = "cannot register again";
    eventually("the paused one says it cannot register", || {
        lines_with(&setup.nodes[0], said) > 0
    })
    .await;
    // A few seconds for the links to take each other over, if they do.
    let ended = "a node ended its link";
    let before = lines_with(&setup.nodes[twin], ended);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let flaps = lines_with(&setup.nodes[twin], ended) - before;
    assert!(
        flaps <= 2,
        "the new sb1's links were ended {flaps} times in 5 s; its log:\n{}",
        setup.nodes[twin].log_tail(20)
    );
    assert_eq!(lines_with(&setup.nodes[0], said), 1, "said once");
    assert_eq!(http_status(setup.http[0], "/readyz"), Some(503));
    assert_eq!(http_status(setup.http[twin], "/readyz"), Some(200));
}
