//! The official SDK's leased lock and lease clients with holders on
//! different nodes: they take turns, each holder's fencing token is greater
//! than the one before, a stale token is refused on every node, and a
//! locker waiting on one node gets the lock when the holder's node dies
//! (the expiry is reaped by whichever node is elected, and its DELETE
//! notification crosses nodes).

mod common;

#[path = "../../../tests/common/sdk.rs"]
#[allow(dead_code)]
mod sdk;

use std::time::{Duration, Instant};

use azure_iot_operations_services::leased_lock::ErrorKind;
use azure_iot_operations_services::state_store::{self, SetOptions};
use common::{PATIENCE, Setup, addr};
use sdk::{SdkClient, T, lease_client, lock_client};

/// A SET of `resource` with fencing token `token`.
async fn fenced_set(
    c: &SdkClient,
    value: &str,
    token: &azure_iot_operations_protocol::common::hybrid_logical_clock::HybridLogicalClock,
) -> Result<state_store::Response<bool>, state_store::Error> {
    c.client
        .set(
            b"resource".to_vec(),
            value.as_bytes().to_vec(),
            T,
            Some(token.clone()),
            SetOptions::default(),
        )
        .await
}

fn is_fenced(result: Result<state_store::Response<bool>, state_store::Error>) -> bool {
    match result {
        Err(e) => matches!(
            e.kind(),
            state_store::ErrorKind::ServiceError(
                state_store::ServiceError::FencingTokenLowerVersion
            )
        ),
        Ok(_) => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockers_on_different_nodes_take_turns_and_a_stale_token_is_refused_everywhere() {
    let setup = Setup::start(3, 3);
    let a = SdkClient::connect(addr(setup.ports[0]), "lock-a").await;
    let b = SdkClient::connect(addr(setup.ports[1]), "lock-b").await;
    let c = SdkClient::connect(addr(setup.ports[2]), "lock-c").await;
    let (ka, kb) = (
        lock_client(&a, "the-lock", "A"),
        lock_client(&b, "the-lock", "B"),
    );

    let token_a = ka.lock(Duration::from_secs(30), T, None).await.unwrap();
    fenced_set(&a, "by A", &token_a).await.expect("A writes");
    // The lease client on node 3 sees A hold it, and cannot take it.
    let lc = lease_client(&c, "the-lock", "C");
    assert_eq!(lc.get_holder(T).await.unwrap(), Some(b"A".to_vec()));
    let err = lc
        .acquire(Duration::from_secs(30), T, None)
        .await
        .unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::LeaseAlreadyHeld), "{err:?}");

    // B, on node 2, waits for the lock; A's unlock on node 1 wakes it (the
    // DELETE notification crosses nodes).
    let waiter = tokio::spawn(async move {
        let token = kb.lock(Duration::from_secs(30), T, None).await.unwrap();
        (kb, token)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiter.is_finished(), "B waits while A holds the lock");
    ka.unlock(T).await.unwrap();
    let (kb, token_b) = tokio::time::timeout(PATIENCE, waiter)
        .await
        .expect("B gets the lock")
        .unwrap();
    assert!(
        (token_b.timestamp, token_b.counter) > (token_a.timestamp, token_a.counter),
        "B's token {token_b:?} after A's {token_a:?}"
    );
    fenced_set(&b, "by B", &token_b).await.expect("B writes");

    // A's token is stale on every node, whoever sends it.
    for (n, client) in [&a, &b, &c].into_iter().enumerate() {
        assert!(
            is_fenced(fenced_set(client, "late A", &token_a).await),
            "A's stale token refused on node {}",
            n + 1
        );
    }
    for client in [&a, &c] {
        let got = client.client.get(b"resource".to_vec(), T).await.unwrap();
        assert_eq!(got.response, Some(b"by B".to_vec()));
    }
    assert_eq!(lc.get_holder(T).await.unwrap(), Some(b"B".to_vec()));
    kb.unlock(T).await.unwrap();
    assert_eq!(lc.get_holder(T).await.unwrap(), None);
    for client in [a, b, c] {
        client.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locker_on_another_node_gets_the_lock_when_the_holders_node_is_killed() {
    let mut setup = Setup::start(3, 3);
    let a = SdkClient::connect(addr(setup.ports[0]), "dies-a").await;
    let b = SdkClient::connect(addr(setup.ports[1]), "waits-b").await;
    let c = SdkClient::connect(addr(setup.ports[2]), "writes-c").await;
    let (ka, kb) = (
        lock_client(&a, "the-lock", "A"),
        lock_client(&b, "the-lock", "B"),
    );
    // A holds the lock for a 3 s term, then its node dies: nobody renews or
    // releases it.
    let term = Duration::from_secs(3);
    let token_a = ka.lock(term, T, None).await.unwrap();
    let locked = Instant::now();
    fenced_set(&a, "by A", &token_a).await.expect("A writes");
    setup.nodes[0].kill().expect("node 1 killed");

    let token_b = tokio::time::timeout(PATIENCE, kb.lock(Duration::from_secs(30), T, None))
        .await
        .expect("B gets the lock in time")
        .unwrap();
    let waited = locked.elapsed();
    assert!(
        waited >= term,
        "B got the lock before A's term ended: {waited:?}"
    );
    assert!(
        (token_b.timestamp, token_b.counter) > (token_a.timestamp, token_a.counter),
        "B's token {token_b:?} after A's {token_a:?}"
    );
    fenced_set(&b, "by B", &token_b).await.expect("B writes");
    assert!(
        is_fenced(fenced_set(&c, "late A", &token_a).await),
        "the dead holder's token is refused"
    );
    let got = c.client.get(b"resource".to_vec(), T).await.unwrap();
    assert_eq!(got.response, Some(b"by B".to_vec()));
    println!("B locked {waited:?} after A (term {term:?}, A's node killed)");
    drop(a);
    for client in [b, c] {
        client.close().await;
    }
}
