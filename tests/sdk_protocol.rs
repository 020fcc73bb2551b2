//! The whole protocol through the official SDK: versions, fencing tokens,
//! expiry with notifications, and SCAN (`list_keys`) across pages.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use azure_iot_operations_protocol::common::hybrid_logical_clock::HybridLogicalClock;
use azure_iot_operations_services::state_store::{ErrorKind, Operation, ServiceError, SetOptions};
use common::{SdkClient, T, next_notification, start_broker, start_broker_with};

fn hlc(s: &str) -> HybridLogicalClock {
    s.parse().unwrap()
}

fn service_error<T: std::fmt::Debug>(
    result: Result<T, azure_iot_operations_services::state_store::Error>,
) -> String {
    match result {
        Err(e) => match e.kind() {
            ErrorKind::ServiceError(s) => format!("{s:?}"),
            other => panic!("not a service error: {other:?}"),
        },
        Ok(v) => panic!("expected an error, got {v:?}"),
    }
}

fn later(a: &HybridLogicalClock, b: &HybridLogicalClock) -> bool {
    (a.timestamp, a.counter) > (b.timestamp, b.counter)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_reports_the_right_version() {
    let broker = start_broker_with(|s| s.statestore.node_id = "edge-7".into()).await;
    let c = SdkClient::connect(broker.local_addr(), "sdk-versions").await;
    let ss = &c.client;
    let v1 = c.set(b"k", b"1").await.version.unwrap();
    assert_eq!(v1.node_id, "edge-7");
    let v2 = c.set(b"k", b"2").await.version.unwrap();
    assert!(later(&v2, &v1));
    assert_eq!(
        ss.get(b"k".to_vec(), T).await.unwrap().version,
        Some(v2.clone())
    );
    let del = ss.del(b"k".to_vec(), None, T).await.unwrap();
    assert_eq!(
        del.version,
        Some(v2.clone()),
        "DEL: the version the key had"
    );
    // Commands without a key version report the store's clock, which is not behind.
    let clock = ss.get(b"k".to_vec(), T).await.unwrap().version.unwrap();
    assert!(!later(&v2, &clock));
    let v3 = c.set(b"k", b"3").await.version.unwrap();
    assert!(later(&v3, &v2));
    c.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_on_set_del_vdel() {
    let broker = start_broker().await;
    let c = SdkClient::connect(broker.local_addr(), "sdk-fencing").await;
    let ss = &c.client;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let older = hlc(&format!("{now}:0:lock"));
    let token = hlc(&format!("{now}:5:lock"));
    let newer = hlc(&format!("{now}:9:lock"));
    let set = |ft: Option<HybridLogicalClock>, v: &'static [u8]| {
        ss.set(b"res".to_vec(), v.to_vec(), T, ft, SetOptions::default())
    };
    assert!(
        set(Some(token.clone()), b"a").await.unwrap().response,
        "SET with __ft on a key without a token"
    );

    let required = format!("{:?}", ServiceError::MissingFencingToken);
    let lower = format!("{:?}", ServiceError::FencingTokenLowerVersion);
    assert_eq!(service_error(set(None, b"b").await), required);
    assert_eq!(service_error(set(Some(older.clone()), b"b").await), lower);
    assert_eq!(
        service_error(ss.del(b"res".to_vec(), None, T).await),
        required
    );
    assert_eq!(
        service_error(ss.del(b"res".to_vec(), Some(older.clone()), T).await),
        lower
    );
    assert_eq!(
        service_error(ss.vdel(b"res".to_vec(), b"a".to_vec(), None, T).await),
        required
    );
    assert_eq!(
        service_error(
            ss.vdel(b"res".to_vec(), b"a".to_vec(), Some(older.clone()), T)
                .await
        ),
        lower
    );

    assert!(
        set(Some(token.clone()), b"equal").await.unwrap().response,
        "equal token"
    );
    assert!(
        set(Some(newer.clone()), b"newer").await.unwrap().response,
        "newer token"
    );
    assert_eq!(
        service_error(set(Some(token.clone()), b"stale").await),
        lower,
        "SET kept the newer token"
    );
    assert_eq!(
        ss.vdel(b"res".to_vec(), b"x".to_vec(), Some(newer.clone()), T)
            .await
            .unwrap()
            .response,
        -1
    );
    assert_eq!(
        ss.vdel(b"res".to_vec(), b"newer".to_vec(), Some(newer.clone()), T)
            .await
            .unwrap()
            .response,
        1
    );
    assert!(
        set(Some(older.clone()), b"fresh").await.unwrap().response,
        "the token went with the key"
    );
    assert_eq!(
        ss.del(b"res".to_vec(), Some(older), T)
            .await
            .unwrap()
            .response,
        1
    );

    let far = hlc(&format!("{}:0:lock", now + 120_000));
    assert_eq!(
        service_error(set(Some(far), b"x").await),
        format!("{:?}", ServiceError::FencingTokenSkew)
    );
    c.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_deletes_and_notifies() {
    let broker = start_broker().await;
    let c = SdkClient::connect(broker.local_addr(), "sdk-expiry").await;
    let ss = &c.client;
    let mut observation = ss.observe(b"ttl".to_vec(), T).await.unwrap().response;
    let options = SetOptions {
        expires: Some(Duration::from_millis(300)),
        ..SetOptions::default()
    };
    let set = ss
        .set(b"ttl".to_vec(), b"v".to_vec(), T, None, options)
        .await
        .unwrap();
    let n = next_notification(&mut observation).await;
    assert_eq!(n.operation, Operation::Set(b"v".to_vec()));
    assert_eq!(
        ss.get(b"ttl".to_vec(), T).await.unwrap().response,
        Some(b"v".to_vec())
    );
    let started = std::time::Instant::now();
    // Nobody touches the key: the broker's expiry timer removes it and tells the watcher.
    let n = next_notification(&mut observation).await;
    assert_eq!(n.operation, Operation::Del);
    assert_eq!(
        Some(n.version),
        set.version,
        "DELETE carries the version the key had"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(ss.get(b"ttl".to_vec(), T).await.unwrap().response, None);
    assert_eq!(
        broker.store().with_store(|s| s.len()),
        0,
        "removed, not just hidden"
    );
    c.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_keys_pages_through_hundreds_of_keys_with_deletes_between_pages() {
    let broker = start_broker_with(|s| s.statestore.scan_page_size = 25).await;
    let c = SdkClient::connect(broker.local_addr(), "sdk-scan").await;
    let ss = &c.client;
    for i in 0..300 {
        c.set(format!("sensor/{i:03}").as_bytes(), b"v").await;
        c.set(format!("other/{i:03}").as_bytes(), b"v").await;
    }
    let mut pager = ss.list_keys(b"sensor/*".to_vec(), T).unwrap();
    let mut seen = Vec::new();
    let mut deleted = HashSet::new();
    let mut pages = 0;
    while let Some(page) = pager.next().await.unwrap() {
        pages += 1;
        for key in &page {
            assert!(key.starts_with(b"sensor/"), "{key:?} does not match");
            assert!(
                !deleted.contains(key),
                "{key:?} was deleted before its page"
            );
        }
        seen.extend(page);
        // Between pages, delete five keys that have not been listed yet.
        for i in (0..300).rev() {
            let key = format!("sensor/{i:03}").into_bytes();
            if deleted.len() >= pages * 5 {
                break;
            }
            if !seen.contains(&key) && !deleted.contains(&key) {
                assert_eq!(ss.del(key.clone(), None, T).await.unwrap().response, 1);
                deleted.insert(key);
            }
        }
        assert!(pages < 1000, "the scan must end");
    }
    assert!(pages > 10, "{pages} pages");
    let unique: HashSet<_> = seen.iter().cloned().collect();
    assert_eq!(unique.len(), seen.len(), "no key twice");
    assert_eq!(
        seen.len() + deleted.len(),
        300,
        "every key either listed or deleted first"
    );
    c.close().await;
}

/// The official client's own SCAN pattern cases (its
/// `state_store_client_test.rs`), run through the SDK: the same keys come
/// back as from the real broker, `[^0-9]` included (a digit or `^`, not a
/// negation as in Redis).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_keys_follows_the_official_clients_glob() {
    let broker = start_broker().await;
    let c = SdkClient::connect(broker.local_addr(), "sdk-glob").await;
    let p = "pattern-";
    let seeded: Vec<String> = ["", "a", "b", "c", "1", "2", "ab", "abc", ".x", "*lit"]
        .iter()
        .map(|s| format!("{p}{s}"))
        .collect();
    for key in &seeded {
        c.set(key.as_bytes(), b"v").await;
    }
    let keys = |suffixes: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = suffixes.iter().map(|s| format!("{p}{s}")).collect();
        v.sort();
        v
    };
    let cases = [
        (
            "*",
            keys(&["", "a", "b", "c", "1", "2", "ab", "abc", ".x", "*lit"]),
        ),
        ("?", keys(&["a", "b", "c", "1", "2"])),
        ("??", keys(&["ab", ".x"])),
        ("[ab]", keys(&["a", "b"])),
        ("[0-9]", keys(&["1", "2"])),
        ("[!0-9]", keys(&["a", "b", "c"])),
        ("[^0-9]", keys(&["1", "2"])),
        ("*c", keys(&["c", "abc"])),
        ("[*]lit", keys(&["*lit"])),
        ("nomatch*", keys(&[])),
    ];
    for (suffix, expected) in cases {
        let pattern = format!("{p}{suffix}");
        let mut pager = c.client.list_keys(pattern.clone().into_bytes(), T).unwrap();
        let mut got = Vec::new();
        while let Some(page) = pager.next().await.unwrap() {
            got.extend(page.into_iter().map(|k| String::from_utf8(k).unwrap()));
        }
        got.sort();
        assert_eq!(got, expected, "pattern {pattern}");
    }
    c.close().await;
}
