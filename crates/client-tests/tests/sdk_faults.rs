//! The official Rust SDK under each fault, asserting what the SDK actually
//! does: the tests a client developer writes for their retry, timeout,
//! lock and failover paths.

use std::sync::Arc;
use std::time::{Duration, Instant};

use azure_iot_operations_protocol::common::aio_protocol_error::AIOProtocolErrorKind;
use azure_iot_operations_services::leased_lock::lease;
use azure_iot_operations_services::state_store::{
    self, ErrorKind, Operation, ServiceError, SetCondition, SetOptions,
};
use client_tests::Sdk;
use statebroker::testing::{DelaySpec, RuleSpec, TestBroker};

const T: Duration = Duration::from_secs(5);

fn is_timeout(e: &state_store::Error) -> bool {
    matches!(e.kind(), ErrorKind::AIOProtocolError(p) if p.kind == AIOProtocolErrorKind::Timeout)
}

fn nx() -> SetOptions {
    SetOptions {
        set_condition: SetCondition::OnlyIfDoesNotExist,
        ..SetOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_answer_within_and_beyond_the_timeout() {
    let broker = TestBroker::builder()
        .fault(RuleSpec {
            commands: vec!["GET".into()],
            keys: "slow*".into(),
            delay_ms: Some(DelaySpec::Fixed(300)),
            ..RuleSpec::default()
        })
        .start()
        .await;
    let sdk = Sdk::connect(broker.addr(), "delayed").await;
    let started = Instant::now();
    let got = sdk.client.get(b"slow-1".to_vec(), T).await.unwrap();
    assert_eq!(got.response, None);
    assert!(started.elapsed() >= Duration::from_millis(300));
    // Other keys are not delayed.
    let started = Instant::now();
    sdk.client.get(b"fast".to_vec(), T).await.unwrap();
    assert!(started.elapsed() < Duration::from_millis(300));

    // Beyond the SDK's timeout: it gives up with a timeout error.
    broker
        .faults()
        .set_rules(vec![RuleSpec {
            keys: "slow*".into(),
            delay_ms: Some(DelaySpec::Range("1500..2000".into())),
            ..RuleSpec::default()
        }])
        .unwrap();
    let late = sdk
        .client
        .get(b"slow-2".to_vec(), Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(is_timeout(&late), "{late:?}");
    assert_eq!(broker.faults().status().injected["delay"], 2);
    sdk.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_injected_error_maps_to_the_sdks_error_kind() {
    let broker = TestBroker::builder()
        .fault(RuleSpec {
            keys: "boom*".into(),
            error: Some("the quota has been exceeded".into()),
            ..RuleSpec::default()
        })
        .fault(RuleSpec {
            keys: "odd*".into(),
            error: Some("something the SDK never heard of".into()),
            ..RuleSpec::default()
        })
        .start()
        .await;
    let sdk = Sdk::connect(broker.addr(), "erring").await;
    let e = sdk
        .client
        .set(
            b"boom".to_vec(),
            b"v".to_vec(),
            T,
            None,
            SetOptions::default(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::ServiceError(ServiceError::KeyQuotaExceeded)
        ),
        "{e:?}"
    );
    assert_eq!(broker.key(b"boom"), None, "not executed");
    let e = sdk.client.get(b"odd".to_vec(), T).await.unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::ServiceError(ServiceError::Unknown(text)) if text == "something the SDK never heard of"),
        "{e:?}"
    );
    sdk.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_answer_to_set_nx_then_the_retry() {
    let broker = TestBroker::builder()
        .fault(RuleSpec {
            commands: vec!["SET".into()],
            keys: "lost*".into(),
            drop_response: Some("after".into()),
            ..RuleSpec::default()
        })
        .fault(RuleSpec {
            commands: vec!["SET".into()],
            keys: "never*".into(),
            drop_response: Some("before".into()),
            ..RuleSpec::default()
        })
        .start()
        .await;
    let sdk = Sdk::connect(broker.addr(), "dropped").await;
    let short = Duration::from_secs(1);
    for key in [&b"lost"[..], b"never"] {
        let e = sdk
            .client
            .set(key.to_vec(), b"mine".to_vec(), short, None, nx())
            .await
            .unwrap_err();
        assert!(is_timeout(&e), "{e:?}");
    }
    // "after" executed it, "before" did not: the retry (faults cleared)
    // finds the key already set by the first attempt, or sets it.
    broker.faults().clear_rules().unwrap();
    let retry = sdk
        .client
        .set(b"lost".to_vec(), b"mine".to_vec(), T, None, nx())
        .await
        .unwrap();
    assert!(!retry.response, "NX not applied: the lost attempt set it");
    assert_eq!(broker.key(b"lost").unwrap().value, b"mine");
    let retry = sdk
        .client
        .set(b"never".to_vec(), b"mine".to_vec(), T, None, nx())
        .await
        .unwrap();
    assert!(retry.response, "the dropped attempt never ran");
    sdk.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_renewals_are_late_loses_the_lease() {
    // A's requests on the lease arrive a second late: its renewals (every
    // 200 ms of a 600 ms lease) come after the lease expired.
    let broker = TestBroker::start().await;
    let a = Sdk::connect(broker.addr(), "holder-a").await;
    let b = Sdk::connect(broker.addr(), "holder-b").await;
    let lease_of = |sdk: &Sdk, holder: &str| {
        lease::Client::new(
            Arc::clone(&sdk.client),
            b"the-lease".to_vec(),
            holder.as_bytes().to_vec(),
        )
        .unwrap()
    };
    let (la, lb) = (lease_of(&a, "A"), lease_of(&b, "B"));
    la.acquire(
        Duration::from_millis(600),
        T,
        Some(Duration::from_millis(200)),
    )
    .await
    .unwrap();
    broker
        .faults()
        .add_rule(RuleSpec {
            commands: vec!["SET".into()],
            keys: "the-lease".into(),
            clients: "holder-a".into(),
            delay_ms: Some(DelaySpec::Fixed(1000)),
            ..RuleSpec::default()
        })
        .unwrap();
    // B tries until the lease is free, then holds it.
    let deadline = Instant::now() + Duration::from_secs(10);
    let token = loop {
        match lb.acquire(Duration::from_secs(30), T, None).await {
            Ok(token) => break token,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("B never got the lease: {e:?}"),
        }
    };
    assert_eq!(token.node_id, "statebroker");
    // A's late renewals do not take it back.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(lb.get_holder(T).await.unwrap(), Some(b"B".to_vec()));
    assert!(broker.faults().status().injected["delay"] >= 1);
    a.close().await;
    b.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_disconnect_during_an_observed_key() {
    let broker = TestBroker::start().await;
    let watcher = Sdk::connect(broker.addr(), "observer").await;
    let writer = Sdk::connect(broker.addr(), "writer").await;
    let mut observation = watcher
        .client
        .observe(b"door".to_vec(), T)
        .await
        .unwrap()
        .response;
    let set = |value: &'static [u8]| {
        let client = Arc::clone(&writer.client);
        async move {
            client
                .set(
                    b"door".to_vec(),
                    value.to_vec(),
                    T,
                    None,
                    SetOptions::default(),
                )
                .await
                .unwrap()
        }
    };
    set(b"open").await;
    let (n, ack) = tokio::time::timeout(T, observation.recv_notification())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n.operation, Operation::Set(b"open".to_vec()));
    // Acknowledge it now (dropping the token acks it from a spawned task,
    // which would race the disconnect below).
    if let Some(ack) = ack {
        ack.ack().await.unwrap().await.unwrap();
    }

    // The SDK ends its observations when its session monitor goes from
    // connected to disconnected, looked at again each time its notification
    // loop has handled something: let that loop go idle first (nothing to
    // wait on outside the SDK), or a disconnect and reconnect while it is
    // busy are missed. (For the same reason this test does not wait for
    // `monitor.disconnected()`: it returns at once only while disconnected.)
    tokio::time::sleep(Duration::from_millis(150)).await;
    // The broker drops the observer (MQTT 5 DISCONNECT 0x98 administrative
    // action); the SDK's session reconnects by itself.
    assert_eq!(broker.faults().disconnect("observer", 0x98), Ok(true));
    assert_eq!(broker.faults().disconnect("nobody", 0x98), Ok(false));
    // A KEYNOTIFY registration belongs to the connection that made it
    // (the broker drops it when the connection ends), and the SDK knows:
    // it ends the observation ("must be recreated"). If the PUBACK for
    // "open" was still on the wire when the broker dropped the connection,
    // the redelivery below (MQTT 4.4) may reach this observation before the
    // SDK ends it: once at most (seen in about 1 run in 10).
    let mut redelivered = 0;
    while let Some((n, _)) = tokio::time::timeout(T, observation.recv_notification())
        .await
        .expect("the observation ends")
    {
        assert_eq!(n.operation, Operation::Set(b"open".to_vec()));
        redelivered += 1;
        assert_eq!(redelivered, 1, "redelivered once at most");
    }
    // Observing anew, changes flow again.
    let mut observation = watcher
        .client
        .observe(b"door".to_vec(), T)
        .await
        .unwrap()
        .response;
    set(b"shut").await;
    // If the PUBACK for "open" was still on the wire when the broker dropped
    // the connection, MQTT (4.4) makes the broker send that QoS 1 message
    // again on the resumed session, and the SDK may route it to the new
    // observation instead: at most once, then the new change.
    let mut operation = None;
    for _ in 0..2 {
        let (n, _) = tokio::time::timeout(T, observation.recv_notification())
            .await
            .unwrap()
            .unwrap();
        if n.operation != Operation::Set(b"open".to_vec()) {
            operation = Some(n.operation);
            break;
        }
    }
    let operation = operation.expect("the change after the redelivery");
    assert_eq!(operation, Operation::Set(b"shut".to_vec()));
    // The client still works: its session reconnected.
    tokio::time::timeout(T, watcher.monitor.connected())
        .await
        .expect("the SDK reconnected");
    let got = watcher.client.get(b"door".to_vec(), T).await.unwrap();
    assert_eq!(got.response, Some(b"shut".to_vec()));
    assert_eq!(broker.faults().status().injected["disconnect"], 1);
    watcher.close().await;
    writer.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnected_after_n_requests() {
    let broker = TestBroker::builder()
        .fault(RuleSpec {
            commands: vec!["GET".into()],
            clients: "counted".into(),
            disconnect_after: Some(3),
            reason_code: Some(0x89),
            ..RuleSpec::default()
        })
        .start()
        .await;
    let sdk = Sdk::connect(broker.addr(), "counted").await;
    for _ in 0..2 {
        sdk.client.get(b"k".to_vec(), T).await.unwrap();
    }
    // The third is executed, and the connection ends before its answer
    // is written. The SDK's session outlives the connection, so the
    // broker keeps the answer for it and delivers it after the SDK
    // reconnects: the call succeeds, late.
    let third = sdk.client.get(b"k".to_vec(), T).await;
    assert!(third.is_ok(), "{third:?}");
    tokio::time::timeout(T, sdk.monitor.connected())
        .await
        .expect("the SDK reconnected");
    sdk.client.get(b"k".to_vec(), T).await.unwrap();
    assert_eq!(broker.faults().status().injected["disconnect"], 1);
    sdk.close().await;
}

/// A slow disk (`stall_disk`): a persisted SET is made at once but answered
/// only once it is on disk, so past the SDK's timeout the call fails with a
/// timeout though the change was made (every answer that could show it
/// waits too: none may show what a crash could take back; a GET of another
/// key is answered). When the disk is back,
/// persisted SETs are answered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persisted_set_on_a_stalled_disk() {
    let dir = tempfile::tempdir().unwrap();
    let broker = TestBroker::builder().data_dir(dir.path()).start().await;
    let sdk = Sdk::connect(broker.addr(), "slow-disk").await;
    let persist = SetOptions {
        persist: true,
        ..SetOptions::default()
    };
    // The SDK subscribes to its response topic with its first request (a
    // session change, which waits for the disk too): before the stall.
    // A SET, which also puts the store's first clock mark on disk (else
    // every answer would wait for the first mark, see `store/pending.rs`).
    let other = SetOptions::default();
    sdk.client
        .set(b"other".to_vec(), b"o".to_vec(), T, None, other)
        .await
        .unwrap();
    broker.faults().stall_disk(Duration::from_secs(60)).unwrap();
    let e = sdk
        .client
        .set(
            b"kept".to_vec(),
            b"v".to_vec(),
            Duration::from_secs(1),
            None,
            persist.clone(),
        )
        .await
        .unwrap_err();
    assert!(is_timeout(&e), "{e:?}");
    assert_eq!(
        broker.key(b"kept").unwrap().value,
        b"v",
        "made, not on disk"
    );
    // What cannot show the change is answered meanwhile.
    let other = sdk.client.get(b"other".to_vec(), T).await.unwrap();
    assert_eq!(other.response, Some(b"o".to_vec()));
    broker.faults().stall_disk(Duration::ZERO).unwrap();
    let again = sdk
        .client
        .set(b"kept".to_vec(), b"w".to_vec(), T, None, persist)
        .await
        .unwrap();
    assert!(again.response);
    assert_eq!(broker.faults().status().injected["disk_stall"], 1);
    sdk.close().await;
}
