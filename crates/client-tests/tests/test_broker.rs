//! `TestBroker` itself, used as a client developer would: start, stop,
//! restart keeping data and port, faults refused without `[faults]`, and
//! the broker-wide faults (refused connections, disconnects, the clock,
//! keys expired now).

use std::time::Duration;

use azure_iot_operations_services::state_store::{self, SetOptions};
use client_tests::Sdk;
use statebroker::testing::{FaultError, RuleSpec, TestBroker};

const T: Duration = Duration::from_secs(5);

fn persisted() -> SetOptions {
    SetOptions {
        persist: true,
        ..SetOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_fast_and_stops_cleanly() {
    let started = std::time::Instant::now();
    let broker = TestBroker::start().await;
    let took = started.elapsed();
    println!("TestBroker::start took {took:?}");
    let addr = broker.addr();
    assert!(addr.ip().is_loopback() && addr.port() != 0);
    assert_eq!(broker.http_addr(), None, "no HTTP port unless asked");
    let sdk = Sdk::connect(addr, "kit-start").await;
    let set = sdk
        .client
        .set(b"k".to_vec(), b"v".to_vec(), T, None, SetOptions::default())
        .await
        .unwrap();
    assert!(set.response);
    assert_eq!(broker.key(b"k").unwrap().value, b"v");
    sdk.close().await;
    broker.stop().await;
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_keeps_persisted_keys_and_the_port() {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = TestBroker::builder()
        .node_id("kit-node")
        .data_dir(dir.path())
        .start()
        .await;
    let addr = broker.addr();
    let sdk = Sdk::connect(addr, "kit-restart").await;
    let kept = sdk
        .client
        .set(b"kept".to_vec(), b"1".to_vec(), T, None, persisted())
        .await
        .unwrap();
    sdk.client
        .set(
            b"gone".to_vec(),
            b"2".to_vec(),
            T,
            None,
            SetOptions::default(),
        )
        .await
        .unwrap();
    sdk.close().await;
    assert!(kept.version.is_some());

    broker.restart().await;
    assert_eq!(broker.addr(), addr, "same port");
    let view = broker.key(b"kept").expect("persisted key restored");
    assert!(view.version.ends_with(":kit-node"), "{}", view.version);
    assert_eq!(broker.key(b"gone"), None, "memory-only key gone");
    let sdk = Sdk::connect(addr, "kit-restart").await;
    let got = sdk.client.get(b"kept".to_vec(), T).await.unwrap();
    assert_eq!(got.response, Some(b"1".to_vec()));
    sdk.close().await;
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_without_faults_refuses_them() {
    let broker = TestBroker::builder().without_faults().start().await;
    let faults = broker.faults();
    assert!(!faults.status().enabled);
    let rule = RuleSpec {
        error: Some("x".into()),
        ..RuleSpec::default()
    };
    assert_eq!(faults.add_rule(rule.clone()), Err(FaultError::Disabled));
    assert_eq!(faults.set_clock_offset(1000), Err(FaultError::Disabled));
    assert_eq!(faults.expire_key(b"k"), Err(FaultError::Disabled));
    assert_eq!(faults.disconnect("c", 0x80), Err(FaultError::Disabled));
    let refused = TestBroker::builder()
        .without_faults()
        .fault(rule)
        .try_start()
        .await;
    assert!(refused.is_err());
    // A wrong rule says which field is wrong.
    let broker = TestBroker::start().await;
    let wrong = broker.faults().add_rule(RuleSpec {
        drop_response: Some("sometimes".into()),
        ..RuleSpec::default()
    });
    assert!(matches!(wrong, Err(FaultError::Invalid(e)) if e.contains("drop_response")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_connections_and_the_clock() {
    let broker = TestBroker::start().await;
    let faults = broker.faults();
    faults
        .refuse_connections(Duration::from_millis(400))
        .unwrap();
    // The SDK's session keeps retrying: it connects once the broker lets it.
    let started = std::time::Instant::now();
    let sdk = Sdk::connect(broker.addr(), "kit-refused").await;
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
    assert!(faults.status().injected["refuse_connection"] >= 1);

    // The store's clock two minutes behind the client's: its timestamps
    // are "too far in the future" (the 60-second skew rule).
    faults.set_clock_offset(-120_000).unwrap();
    let skewed = sdk
        .client
        .set(b"k".to_vec(), b"v".to_vec(), T, None, SetOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(
            skewed.kind(),
            state_store::ErrorKind::ServiceError(state_store::ServiceError::TimestampSkew)
        ),
        "{skewed:?}"
    );
    faults.set_clock_offset(0).unwrap();
    assert!(
        sdk.client
            .set(b"k".to_vec(), b"v".to_vec(), T, None, SetOptions::default())
            .await
            .unwrap()
            .response
    );
    sdk.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_expired_now_is_deleted_for_its_observers() {
    let broker = TestBroker::start().await;
    let sdk = Sdk::connect(broker.addr(), "kit-expire").await;
    sdk.client
        .set(
            b"session".to_vec(),
            b"on".to_vec(),
            T,
            None,
            SetOptions::default(),
        )
        .await
        .unwrap();
    let mut observation = sdk
        .client
        .observe(b"session".to_vec(), T)
        .await
        .unwrap()
        .response;
    assert_eq!(broker.faults().expire_key(b"session"), Ok(true));
    assert_eq!(broker.faults().expire_key(b"session"), Ok(false), "gone");
    let (notification, _) = tokio::time::timeout(T, observation.recv_notification())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(notification.operation, state_store::Operation::Del);
    assert_eq!(
        sdk.client
            .get(b"session".to_vec(), T)
            .await
            .unwrap()
            .response,
        None
    );
    assert_eq!(broker.faults().status().injected["expire_key"], 1);
    sdk.close().await;
}
