//! The SDK's `leased_lock` clients (lease and lock) against statebroker:
//! acquire, renew, release, observe the holder, contend, and outlive a holder
//! that stopped renewing.

mod common;

use std::time::Duration;

use azure_iot_operations_services::leased_lock::ErrorKind;
use azure_iot_operations_services::state_store::{self, SetOptions};
use common::{SdkClient, T, TIMEOUT, lease_client, lock_client, start_broker};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_acquire_contend_release() {
    let broker = start_broker().await;
    let a = SdkClient::connect(broker.local_addr(), "lease-a").await;
    let b = SdkClient::connect(broker.local_addr(), "lease-b").await;
    let (la, lb) = (
        lease_client(&a, "the-lease", "A"),
        lease_client(&b, "the-lease", "B"),
    );

    let token = la.acquire(Duration::from_secs(10), T, None).await.unwrap();
    assert_eq!(la.current_lease_fencing_token(), Some(token.clone()));
    assert_eq!(lb.get_holder(T).await.unwrap(), Some(b"A".to_vec()));
    let err = lb
        .acquire(Duration::from_secs(10), T, None)
        .await
        .unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::LeaseAlreadyHeld), "{err:?}");
    assert_eq!(lb.current_lease_fencing_token(), None);

    // Re-acquiring one's own lease renews it with a newer token.
    let renewed = la.acquire(Duration::from_secs(10), T, None).await.unwrap();
    assert!((renewed.timestamp, renewed.counter) > (token.timestamp, token.counter));

    // B releasing A's lease does nothing (VDEL with B's name).
    lb.release(T).await.unwrap();
    assert_eq!(la.get_holder(T).await.unwrap(), Some(b"A".to_vec()));
    la.release(T).await.unwrap();
    assert_eq!(la.get_holder(T).await.unwrap(), None);
    lb.acquire(Duration::from_secs(10), T, None).await.unwrap();
    assert_eq!(la.get_holder(T).await.unwrap(), Some(b"B".to_vec()));
    a.close().await;
    b.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_renewal_keeps_the_lease_and_holder_observation_sees_changes() {
    let broker = start_broker().await;
    let a = SdkClient::connect(broker.local_addr(), "renew-a").await;
    let b = SdkClient::connect(broker.local_addr(), "renew-b").await;
    let (la, lb) = (
        lease_client(&a, "the-lease", "A"),
        lease_client(&b, "the-lease", "B"),
    );
    let mut observation = lb.observe(T).await.unwrap();

    la.acquire(
        Duration::from_millis(600),
        T,
        Some(Duration::from_millis(200)),
    )
    .await
    .unwrap();
    // Well past the expiry of one term: renewals kept it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(lb.get_holder(T).await.unwrap(), Some(b"A".to_vec()));
    assert!(matches!(
        lb.acquire(Duration::from_secs(1), T, None)
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::LeaseAlreadyHeld
    ));
    // B saw A take the lease and renew it.
    let (first, _) = tokio::time::timeout(TIMEOUT, observation.recv_notification())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.operation, state_store::Operation::Set(b"A".to_vec()));

    // Release stops the renewal; B sees the delete and takes over.
    la.release(T).await.unwrap();
    loop {
        let (n, _) = tokio::time::timeout(TIMEOUT, observation.recv_notification())
            .await
            .unwrap()
            .unwrap();
        if n.operation == state_store::Operation::Del {
            break;
        }
    }
    lb.acquire(Duration::from_secs(5), T, None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        la.get_holder(T).await.unwrap(),
        Some(b"B".to_vec()),
        "A's renewal stopped"
    );
    a.close().await;
    b.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_stops_renewing_loses_the_lease_and_its_writes_are_fenced() {
    let broker = start_broker().await;
    let a = SdkClient::connect(broker.local_addr(), "stale-a").await;
    let b = SdkClient::connect(broker.local_addr(), "stale-b").await;
    let (la, lb) = (
        lease_client(&a, "the-lease", "A"),
        lease_client(&b, "the-lease", "B"),
    );

    let token_a = la
        .acquire(Duration::from_millis(300), T, None)
        .await
        .unwrap();
    a.client
        .set(
            b"resource".to_vec(),
            b"by A".to_vec(),
            T,
            Some(token_a.clone()),
            SetOptions::default(),
        )
        .await
        .unwrap();
    // A pauses past its lease; B takes the lease and writes with its token.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let token_b = lb.acquire(Duration::from_secs(10), T, None).await.unwrap();
    assert!((token_b.timestamp, token_b.counter) > (token_a.timestamp, token_a.counter));
    b.client
        .set(
            b"resource".to_vec(),
            b"by B".to_vec(),
            T,
            Some(token_b),
            SetOptions::default(),
        )
        .await
        .unwrap();
    // A wakes up and writes with its old token: fenced off.
    let err = a
        .client
        .set(
            b"resource".to_vec(),
            b"late A".to_vec(),
            T,
            Some(token_a),
            SetOptions::default(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(
            err.kind(),
            state_store::ErrorKind::ServiceError(
                state_store::ServiceError::FencingTokenLowerVersion
            )
        ),
        "{err:?}"
    );
    assert_eq!(
        b.client
            .get(b"resource".to_vec(), T)
            .await
            .unwrap()
            .response,
        Some(b"by B".to_vec())
    );
    a.close().await;
    b.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_lockers_take_turns() {
    let broker = start_broker().await;
    let a = SdkClient::connect(broker.local_addr(), "lock-a").await;
    let b = SdkClient::connect(broker.local_addr(), "lock-b").await;
    let (ka, kb) = (
        lock_client(&a, "the-lock", "A"),
        lock_client(&b, "the-lock", "B"),
    );

    ka.lock(Duration::from_secs(10), T, None).await.unwrap();
    let waiter = tokio::spawn(async move {
        let token = kb.lock(Duration::from_secs(10), T, None).await.unwrap();
        (kb, token)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "B waits while A holds the lock");
    ka.unlock(T).await.unwrap();
    let (kb, token) = tokio::time::timeout(TIMEOUT, waiter)
        .await
        .expect("B gets the lock")
        .unwrap();
    assert_eq!(kb.current_lock_fencing_token(), Some(token));
    assert_eq!(
        a.client
            .get(b"the-lock".to_vec(), T)
            .await
            .unwrap()
            .response,
        Some(b"B".to_vec())
    );
    a.close().await;
    b.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_locker_gets_the_lock_when_the_holder_expires() {
    let broker = start_broker().await;
    let a = SdkClient::connect(broker.local_addr(), "expire-a").await;
    let b = SdkClient::connect(broker.local_addr(), "expire-b").await;
    let (ka, kb) = (
        lock_client(&a, "the-lock", "A"),
        lock_client(&b, "the-lock", "B"),
    );
    // A takes the lock for 700 ms and never renews nor unlocks.
    ka.lock(Duration::from_millis(700), T, None).await.unwrap();
    let started = std::time::Instant::now();
    kb.lock(Duration::from_secs(10), T, None).await.unwrap();
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(500),
        "B got the lock too early: {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(3),
        "the expiry notification woke B: {waited:?}"
    );
    a.close().await;
    b.close().await;
}
