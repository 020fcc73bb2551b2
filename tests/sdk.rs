//! The official Rust SDK (`azure_iot_operations_services`) against
//! statebroker, unchanged: the acceptance test for client developers.

mod common;

use std::time::Duration;

use azure_iot_operations_services::state_store::{Operation, SetCondition, SetOptions};
use common::{SdkClient, T, next_notification, start_broker};

fn opts(condition: SetCondition) -> SetOptions {
    SetOptions {
        set_condition: condition,
        ..SetOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_get_del_vdel_on_new_existing_and_missing_keys() {
    let broker = start_broker().await;
    let c = SdkClient::connect(broker.local_addr(), "sdk-basic").await;
    let ss = &c.client;

    // missing
    assert_eq!(ss.get(b"k".to_vec(), T).await.unwrap().response, None);
    assert_eq!(ss.del(b"k".to_vec(), None, T).await.unwrap().response, 0);
    assert_eq!(
        ss.vdel(b"k".to_vec(), b"v".to_vec(), None, T)
            .await
            .unwrap()
            .response,
        0
    );

    // new
    let set = c.set(b"k", b"v1").await;
    assert!(set.response);
    let v1 = set.version.expect("SET returns a version");
    let get = ss.get(b"k".to_vec(), T).await.unwrap();
    assert_eq!(get.response, Some(b"v1".to_vec()));
    assert_eq!(
        get.version,
        Some(v1.clone()),
        "GET returns the key's version"
    );

    // existing
    let set = c.set(b"k", b"v2").await;
    let v2 = set.version.unwrap();
    assert!(
        (v2.timestamp, v2.counter) > (v1.timestamp, v1.counter),
        "versions rise"
    );
    assert_eq!(
        ss.get(b"k".to_vec(), T).await.unwrap().response,
        Some(b"v2".to_vec())
    );
    assert_eq!(
        ss.vdel(b"k".to_vec(), b"other".to_vec(), None, T)
            .await
            .unwrap()
            .response,
        -1
    );
    let vdel = ss
        .vdel(b"k".to_vec(), b"v2".to_vec(), None, T)
        .await
        .unwrap();
    assert_eq!(vdel.response, 1);
    assert_eq!(
        vdel.version,
        Some(v2),
        "VDEL returns the version the key had"
    );
    assert_eq!(ss.get(b"k".to_vec(), T).await.unwrap().response, None);

    c.set(b"k", b"v3").await;
    assert_eq!(ss.del(b"k".to_vec(), None, T).await.unwrap().response, 1);
    assert_eq!(ss.del(b"k".to_vec(), None, T).await.unwrap().response, 0);

    // binary keys and values
    let key = b"\x00\r\n\xff".to_vec();
    let value = b"\r\n\x00 \xfe".to_vec();
    c.set(&key, &value).await;
    assert_eq!(ss.get(key, T).await.unwrap().response, Some(value));
    c.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nx_and_nex_outcomes() {
    let broker = start_broker().await;
    let c = SdkClient::connect(broker.local_addr(), "sdk-conditions").await;
    let ss = &c.client;
    // Key "nx" is set with NX, key "nex" with NEX: (key, value, whether the
    // SET is done), in order.
    for (key, value, done) in [
        ("nx", "a", true),
        ("nx", "b", false),
        ("nex", "a", true),
        ("nex", "a", true),
        ("nex", "b", false),
    ] {
        let condition = match key {
            "nx" => SetCondition::OnlyIfDoesNotExist,
            _ => SetCondition::OnlyIfEqualOrDoesNotExist,
        };
        let set = ss
            .set(key.into(), value.into(), T, None, opts(condition))
            .await
            .unwrap();
        assert_eq!(
            set.response,
            done,
            "SET {key} {value} {}",
            key.to_uppercase()
        );
    }
    for key in ["nx", "nex"] {
        assert_eq!(
            ss.get(key.into(), T).await.unwrap().response,
            Some(b"a".to_vec())
        );
    }
    c.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_notify_unobserve_and_observe_again() {
    let broker = start_broker().await;
    let watcher = SdkClient::connect(broker.local_addr(), "sdk-watcher").await;
    let writer = SdkClient::connect(broker.local_addr(), "sdk-writer").await;
    let key = b"door".to_vec();

    let mut observation = watcher
        .client
        .observe(key.clone(), T)
        .await
        .unwrap()
        .response;

    // The watcher's own change notifies it.
    let set = watcher.set(&key, b"open").await;
    let n = next_notification(&mut observation).await;
    assert_eq!(n.key, key);
    assert_eq!(n.operation, Operation::Set(b"open".to_vec()));
    assert_eq!(
        Some(n.version),
        set.version,
        "the notification carries the key's version"
    );

    // A second client's SET and DEL notify the first.
    writer.set(&key, b"closed").await;
    let n = next_notification(&mut observation).await;
    assert_eq!(n.operation, Operation::Set(b"closed".to_vec()));
    assert_eq!(
        writer
            .client
            .del(key.clone(), None, T)
            .await
            .unwrap()
            .response,
        1
    );
    let n = next_notification(&mut observation).await;
    assert_eq!(n.operation, Operation::Del);

    // VDEL notifies too.
    writer.set(&key, b"x").await;
    next_notification(&mut observation).await;
    writer
        .client
        .vdel(key.clone(), b"x".to_vec(), None, T)
        .await
        .unwrap();
    let n = next_notification(&mut observation).await;
    assert_eq!(n.operation, Operation::Del);

    // Unobserve: true the first time, false the second.
    assert!(
        watcher
            .client
            .unobserve(key.clone(), T)
            .await
            .unwrap()
            .response
    );
    assert!(
        !watcher
            .client
            .unobserve(key.clone(), T)
            .await
            .unwrap()
            .response
    );
    writer.set(&key, b"quiet").await;

    // Observe again: notifications resume (and none from the quiet period).
    let mut observation = watcher
        .client
        .observe(key.clone(), T)
        .await
        .unwrap()
        .response;
    writer.set(&key, b"loud").await;
    let n = next_notification(&mut observation).await;
    assert_eq!(n.operation, Operation::Set(b"loud".to_vec()));

    watcher.close().await;
    writer.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_does_not_hear_another_clients_keys() {
    let broker = start_broker().await;
    let a = SdkClient::connect(broker.local_addr(), "sdk-a").await;
    let b = SdkClient::connect(broker.local_addr(), "sdk-b").await;
    let mut a_obs = a
        .client
        .observe(b"a-key".to_vec(), T)
        .await
        .unwrap()
        .response;
    let mut b_obs = b
        .client
        .observe(b"b-key".to_vec(), T)
        .await
        .unwrap()
        .response;
    a.set(b"b-key", b"1").await;
    let n = next_notification(&mut b_obs).await;
    assert_eq!(n.key, b"b-key");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), a_obs.recv_notification())
            .await
            .is_err(),
        "a does not watch b-key"
    );
    a.close().await;
    b.close().await;
}
