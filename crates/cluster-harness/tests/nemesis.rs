//! The nemesis against a real etcd cluster and nodes the test also holds.

use std::time::{Duration, Instant};

use statebroker_cluster_harness::{Cluster, EtcdCluster, Fault, Nemesis, NodeSpec, ProcState};

fn sleeper(name: &str) -> NodeSpec {
    NodeSpec::new("/bin/sh")
        .name(name)
        .args(["-c", "exec sleep 600"])
}

#[test]
fn the_nemesis_applies_its_schedule_and_records_it() {
    let etcd = EtcdCluster::start(3).unwrap_or_else(|e| panic!("etcd cluster: {e}"));
    let nodes = vec![
        sleeper("n1").start().unwrap(),
        sleeper("n2").start().unwrap(),
    ];
    let cluster = Cluster::new(Some(etcd), nodes).shared();
    let first_n2 = Cluster::lock(&cluster).nodes[1].pid().unwrap();

    let ms = Duration::from_millis;
    let nemesis = Nemesis::new([
        (ms(300), Fault::KillEtcdLeader),
        (ms(600), Fault::PauseNode(0)),
        (ms(900), Fault::KillNode(1)),
        (ms(1200), Fault::RestartNode(1)),
        (ms(1500), Fault::ResumeNode(0)),
        (ms(1800), Fault::RestartEtcdDown),
        (ms(1800), Fault::KillNode(7)),
    ])
    .start(cluster.clone());

    // The test holds the nodes too, between faults.
    std::thread::sleep(ms(750));
    assert_eq!(Cluster::lock(&cluster).nodes[0].state(), ProcState::Paused);

    let events = nemesis.join();
    print!(
        "{}",
        events.iter().map(|e| format!("{e}\n")).collect::<String>()
    );
    assert_eq!(events.len(), 7);
    for e in &events {
        assert!(e.at >= e.scheduled, "{e}");
        assert!(e.at < e.scheduled + Duration::from_secs(5), "{e}");
    }
    assert!(events[..6].iter().all(|e| e.outcome.is_ok()), "{events:#?}");
    let killed = events[0].outcome.as_ref().unwrap();
    assert!(
        killed.starts_with("killed etcd m") && killed.contains("leader"),
        "{killed}"
    );
    let member = killed.split_whitespace().nth(2).unwrap(); // "m2"
    assert!(
        events[5].outcome.as_ref().unwrap().contains(member),
        "{events:#?}"
    );
    assert!(
        events[6]
            .outcome
            .as_ref()
            .unwrap_err()
            .contains("no node 7")
    );
    assert!(
        events[0]
            .to_string()
            .contains("KillEtcdLeader: killed etcd m")
    );

    let mut guard = Cluster::lock(&cluster);
    assert_eq!(guard.nodes[0].state(), ProcState::Running);
    assert_eq!(guard.nodes[1].state(), ProcState::Running);
    assert_ne!(guard.nodes[1].pid().unwrap(), first_n2);
    let etcd = guard.etcd.as_mut().unwrap();
    let t = Instant::now();
    etcd.wait_healthy(Duration::from_secs(30)).unwrap();
    println!(
        "etcd healthy again {:.2} s after the schedule ended",
        t.elapsed().as_secs_f64()
    );
    assert_eq!(etcd.status().len(), 3);
}

#[test]
fn a_stopped_nemesis_skips_the_rest() {
    let cluster = Cluster::new(None, vec![sleeper("n1").start().unwrap()]).shared();
    let nemesis = Nemesis::new([(Duration::ZERO, Fault::PauseEtcdLeader)])
        .at(Duration::from_secs(3600), Fault::KillNode(0));
    let start = Instant::now();
    let handle = nemesis.start(cluster.clone());
    while handle.events().is_empty() {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!handle.is_finished());
    let events = handle.stop();
    assert!(start.elapsed() < Duration::from_secs(60));
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].outcome, Err("no etcd cluster".into()));
    assert_eq!(Cluster::lock(&cluster).nodes[0].state(), ProcState::Running);
}
