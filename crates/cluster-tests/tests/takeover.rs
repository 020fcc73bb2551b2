//! Issue #29 item 3, the first part: one node at a time owns a client id.
//! A client that connects to another node ends its older connection with
//! DISCONNECT 0x8E "session taken over", as a single server does; the
//! owner is recorded in etcd and the record goes when the client leaves.
//! Real etcd, real node processes.

mod common;

use common::raw::{Raw, Recv, v5};
use common::{PATIENCE, Setup, addr, eventually};

/// Waits for DISCONNECT 0x8E on `client`.
async fn taken_over(client: &mut Raw) {
    match client.recv_within(PATIENCE).await {
        Recv::Packet(v5::Packet::Disconnect(d)) => {
            assert_eq!(d.reason_code, v5::DisconnectReasonCode::SessionTakenOver)
        }
        other => panic!("expected DISCONNECT 0x8E, got {other:?}"),
    }
}

/// `client` is still served: a PINGREQ gets its PINGRESP.
async fn still_served(client: &mut Raw) {
    client.send(v5::Packet::PingReq(v5::PingReq)).await;
    match client.recv_within(PATIENCE).await {
        Recv::Packet(v5::Packet::PingResp(_)) => {}
        other => panic!("expected PINGRESP, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_connecting_to_another_node_ends_its_older_connection() {
    let setup = Setup::start(1, 2);
    let record = "/statebroker/C/roamer";
    let owner = || {
        setup.etcd.get(record).unwrap().map(|v| {
            String::from_utf8_lossy(&v)
                .split('\n')
                .next()
                .unwrap_or("")
                .to_owned()
        })
    };
    let mut on_1 = Raw::connect(addr(setup.ports[0]), "roamer").await;
    // Recorded in the background (the CONNACK does not wait for etcd).
    eventually("node 1 recorded as the owner", || {
        owner().as_deref() == Some("sb1")
    })
    .await;
    let mut on_2 = Raw::connect(addr(setup.ports[1]), "roamer").await;
    taken_over(&mut on_1).await;
    still_served(&mut on_2).await;
    eventually("node 2 recorded as the owner", || {
        owner().as_deref() == Some("sb2")
    })
    .await;
    // And back: the connection on node 2 ends.
    let mut again_1 = Raw::connect(addr(setup.ports[0]), "roamer").await;
    taken_over(&mut on_2).await;
    still_served(&mut again_1).await;
    // Another client id is left alone.
    let mut other = Raw::connect(addr(setup.ports[1]), "stayer").await;
    still_served(&mut other).await;
    // A client that leaves takes its record with it.
    again_1
        .send(v5::Packet::Disconnect(v5::Disconnect::new(
            v5::DisconnectReasonCode::NormalDisconnection,
        )))
        .await;
    eventually("the owner's record goes with the client", || {
        owner().is_none()
    })
    .await;
    still_served(&mut other).await;
}
