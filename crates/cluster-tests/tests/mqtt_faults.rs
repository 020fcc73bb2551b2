//! Issue #29 item 5: MQTT publishers and subscribers on every node, each
//! with a persistent session, under the store's fault schedule (a node
//! SIGKILLed and restarted, the etcd leader SIGKILLed, a node SIGSTOPped
//! past its lease, a node stopped with SIGTERM and started again; the
//! long run also loses etcd's quorum for 12 s); each client moves to the next node when its own fails
//! it. Checked (`statebroker_checker::delivery`): no acknowledged message
//! lost for a subscriber that stayed on a live node, nor for any
//! subscriber after it resumed its session elsewhere; QoS 2 exactly once
//! (but for a message its publisher had to send again to another node,
//! its own having died between forwarding it and its PUBREC, and for one
//! published while a subscriber's session moved, which reached both
//! nodes' copies of it: handed over at QoS 1); each publisher's order for
//! a subscriber that stayed; the same
//! retained messages on every node after the faults.
//!
//! This is the short run of `cargo test`; `bench/cluster-faults.sh mqtt`
//! runs the long one (`STATEBROKER_FAULT_RUN=long`) round after round.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::traffic::{self, PublisherLog, PublisherSpec};
use common::{Setup, eventually, long_fault_run, long_fault_schedule, metric};
use statebroker_checker::delivery;
use statebroker_cluster_harness::{Cluster, Fault, Nemesis};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_under_node_and_etcd_faults_are_not_lost_nor_doubled() {
    let setup = Setup::start(3, 3);
    for &http in &setup.http {
        eventually("every node linked to the two others", || {
            metric(http, "statebroker_cluster_peer_links") == Some(2.0)
        })
        .await;
    }
    let ports = Arc::new(setup.ports.clone());
    let http = setup.http.clone();
    let cluster = Cluster::new(Some(setup.etcd), setup.nodes).shared();
    let s = Duration::from_secs;
    let long = long_fault_run();
    // Node 0 is never faulted: its clients are the ones that stay put.
    let (schedule, duration) = if long {
        long_fault_schedule()
    } else {
        (
            vec![
                // A rolling restart's stop (SIGTERM): its clients' sessions
                // are handed over to node 0, where they go on.
                (s(2), Fault::StopNode(2)),
                (s(4), Fault::RestartNode(2)),
                // Node 1's clients go to node 2.
                (s(6), Fault::KillNode(1)),
                (s(9), Fault::RestartNode(1)),
                (s(12), Fault::KillEtcdLeader),
                (s(15), Fault::RestartEtcdDown),
                (s(17), Fault::PauseNode(2)),
                // Past its lease (5 s).
                (s(25), Fault::ResumeNode(2)),
            ],
            s(29),
        )
    };

    let done = Arc::new(AtomicBool::new(false));
    let mut subscribers = Vec::new();
    for node in 0..3 {
        let name = format!("s{node}");
        subscribers.push(
            traffic::subscriber(Arc::clone(&ports), &name, node, "t/#", Arc::clone(&done)).await,
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut specs = Vec::new();
    for node in 0..3 {
        let spec = |name: String, prefix: &str, qos, window, retain, pause| PublisherSpec {
            name,
            home: node,
            prefix: prefix.into(),
            qos,
            window,
            retain,
            pause,
        };
        let ms = Duration::from_millis;
        specs.push(spec(format!("a{node}"), "t/", 1, 8, false, ms(4)));
        specs.push(spec(format!("b{node}"), "t/", 2, 4, false, ms(8)));
        specs.push(spec(format!("r{node}"), "r/", 1, 1, true, ms(100)));
    }
    let started = Instant::now();
    let publishers: Vec<_> = specs
        .into_iter()
        .map(|spec| {
            tokio::spawn(traffic::publisher(
                Arc::clone(&ports),
                spec,
                Arc::clone(&stop),
            ))
        })
        .collect();
    let nemesis = Nemesis::new(schedule).start_at(Arc::clone(&cluster), started);
    tokio::time::sleep_until((started + duration).into()).await;
    stop.store(true, Ordering::Release);
    let mut logs: Vec<PublisherLog> = Vec::new();
    for p in publishers {
        logs.push(p.await.expect("publisher"));
    }
    let events = nemesis.join();
    for event in &events {
        println!("{event}");
    }
    assert!(
        events.iter().all(|e| e.outcome.is_ok()),
        "every fault was applied"
    );
    done.store(true, Ordering::Release);
    let mut received = Vec::new();
    for s in subscribers {
        received.push(s.await.expect("subscriber"));
    }

    for log in &logs {
        let p = &log.published;
        println!(
            "publisher {} (QoS {}): {} sent, {} acknowledged, {} refused, {} reconnections",
            p.publisher,
            p.qos,
            p.sent,
            p.acknowledged.len(),
            log.refused,
            p.reconnects
        );
        assert!(
            p.acknowledged.len() > 50,
            "publisher {} made progress",
            p.publisher
        );
    }
    let first_sent: HashMap<&str, &[Instant]> = logs
        .iter()
        .map(|l| (l.published.publisher.as_str(), l.first_sent.as_slice()))
        .collect();
    let published: Vec<_> = logs
        .iter()
        .filter(|l| !l.published.publisher.starts_with('r'))
        .map(|l| l.published.clone())
        .collect();
    let mut failures = Vec::new();
    for log in &received {
        // A subscriber that stayed on its node must have had every
        // acknowledged message, in each publisher's order; one that moved,
        // every message first sent after its session resumed (what was
        // queued on a node that died is lost with it; what was queued on
        // a paused node comes when that node is back, after newer ones:
        // reordered, counted, allowed. docs/cluster.md).
        let moved = log.reconnected_at.last().copied();
        let report = delivery::check(&published, &log.received, |p, n| {
            moved.is_none_or(|since| first_sent[p.publisher.as_str()][n as usize] > since)
        });
        // Told, not checked: what one that moved lost of every
        // acknowledged message, before its move too (a dead node's queue
        // not yet in etcd; before 2026-11-30 also what was published
        // while no node held its session, docs/cluster.md "What no node
        // had").
        let in_all = if moved.is_some() {
            let lost = delivery::check(&published, &log.received, |_, _| true).lost;
            format!(", {lost} lost in all")
        } else {
            String::new()
        };
        println!(
            "{report} ({} reconnections, {} QoS 2 packet ids reused by a node that took the session over{in_all})",
            log.received.reconnects, log.reused_pkids
        );
        let valid = if moved.is_none() {
            report.is_valid()
        } else {
            report.lost == 0 && report.duplicates_qos2 == 0 && report.unknown == 0
        };
        if !valid {
            failures.push(report.to_string());
        }
        // A node that took a session over numbers its QoS 2 deliveries in
        // another block of packet ids than the node it left
        // (docs/architecture.md): none the client kept comes again.
        if log.reused_pkids > 0 {
            failures.push(format!(
                "{}: {} QoS 2 packet ids it kept were used again for new messages",
                log.received.subscriber, log.reused_pkids
            ));
        }
    }
    // The subscriber on the node never faulted stays, so that the strict
    // check above ran. Not in the long run: an etcd without the fix of
    // etcd-io/etcd#15247 (#16822, in 3.4 by #17465 in 2024; Debian's
    // 3.4.23 is older) revokes every lease when a paused leader wakes up,
    // and every node then rightly sends its clients away.
    if !long {
        assert_eq!(
            received[0].received.reconnects, 0,
            "the subscriber on the node never faulted stayed"
        );
    }

    // Retained: every node serves the same, and each publisher's is the
    // last it had acknowledged or a later one it sent.
    let retained_ok = |sets: &[std::collections::BTreeMap<String, u64>]| {
        sets.windows(2).all(|w| w[0] == w[1])
            && logs
                .iter()
                .filter(|l| l.published.publisher.starts_with('r'))
                .all(|l| {
                    let p = &l.published;
                    let last = p.acknowledged.iter().max();
                    let got = sets[0].get(&p.publisher);
                    match (last, got) {
                        (Some(last), Some(got)) => got >= last && *got < p.sent,
                        (None, _) => true,
                        (Some(_), None) => false,
                    }
                })
    };
    let mut sets = Vec::new();
    let deadline = Instant::now() + common::PATIENCE;
    for round in 0.. {
        sets.clear();
        for (node, &port) in ports.iter().enumerate() {
            sets.push(traffic::retained(port, &format!("rc{node}-{round}"), "r/#").await);
        }
        if retained_ok(&sets) || Instant::now() > deadline {
            break;
        }
    }
    println!("retained on each node: {sets:?}");
    if !retained_ok(&sets) {
        failures.push(format!("retained messages differ or are stale: {sets:?}"));
    }
    for &port in &http {
        println!(
            "node {port}: unconfirmed forwards {:?}",
            metric(port, "statebroker_cluster_unconfirmed_total")
        );
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
