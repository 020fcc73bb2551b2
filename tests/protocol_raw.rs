//! Protocol answers for requests the SDK never sends, over a real broker.

mod common;

use common::raw::{LEGACY_REQUEST_TOPIC, REQUEST_TOPIC, Raw, now_hlc, user_property};
use common::{start_broker, start_broker_with};
use statestore::resp3::encode_request;

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn err(text: &str) -> Vec<u8> {
    format!("-ERR {text}\r\n").into_bytes()
}

async fn ask(c: &mut Raw, args: &[&str], user: &[(&str, &str)]) -> (Vec<u8>, String) {
    let r = c
        .request_raw(REQUEST_TOPIC, &encode_request(args), user)
        .await;
    let ts = user_property(&r, "__ts").unwrap_or("").to_owned();
    (r.payload.to_vec(), ts)
}

#[tokio::test]
async fn timestamps_skewed_malformed_and_missing() {
    let broker = start_broker().await;
    let mut c = Raw::connect(broker.local_addr(), "clocks").await;
    let skew = err(
        "the request timestamp is too far in the future; ensure that the client and broker system clocks are synchronized",
    );
    let ahead = format!("{}:0:clocks", now_ms() + 90_000);
    assert_eq!(
        ask(&mut c, &["SET", "k", "v"], &[("__ts", &ahead)]).await.0,
        skew
    );
    assert_eq!(
        ask(&mut c, &["GET", "k"], &[("__ts", &ahead)]).await.0,
        skew
    );
    let behind = format!("{}:0:clocks", now_ms() - 86_400_000);
    assert_eq!(
        ask(&mut c, &["SET", "k", "v"], &[("__ts", &behind)])
            .await
            .0,
        b"+OK\r\n"
    );
    for bad in ["yesterday", "1:2", "a:b:c", ""] {
        assert_eq!(
            ask(&mut c, &["SET", "k", "v"], &[("__ts", bad)]).await.0,
            err("malformed timestamp"),
            "{bad:?}"
        );
        let ts = now_hlc("clocks");
        assert_eq!(
            ask(&mut c, &["SET", "k", "v"], &[("__ts", &ts), ("__ft", bad)])
                .await
                .0,
            err("malformed timestamp"),
            "__ft {bad:?}"
        );
    }
    assert_eq!(
        ask(&mut c, &["SET", "k", "v"], &[]).await.0,
        err("missing timestamp")
    );
    let ts = now_hlc("clocks");
    let ft_ahead = format!("{}:0:lock", now_ms() + 90_000);
    assert_eq!(
        ask(
            &mut c,
            &["SET", "k", "v"],
            &[("__ts", &ts), ("__ft", &ft_ahead)]
        )
        .await
        .0,
        err(
            "the request fencing token timestamp is too far in the future; ensure that the client and broker system clocks are synchronized"
        )
    );
}

#[tokio::test]
async fn configured_skew_limit() {
    let broker = start_broker_with(|s| s.statestore.max_clock_skew_ms = 1_000).await;
    let mut c = Raw::connect(broker.local_addr(), "tight").await;
    let ahead = format!("{}:0:tight", now_ms() + 5_000);
    assert!(
        ask(&mut c, &["SET", "k", "v"], &[("__ts", &ahead)])
            .await
            .0
            .starts_with(b"-ERR the request timestamp")
    );
}

#[tokio::test]
async fn versions_are_greater_than_the_request_timestamp() {
    let broker = start_broker().await;
    let mut c = Raw::connect(broker.local_addr(), "ahead").await;
    let wall = now_ms() + 30_000;
    let ts = format!("{wall:015}:00041:ahead");
    let (answer, version) = ask(&mut c, &["SET", "k", "v"], &[("__ts", &ts)]).await;
    assert_eq!(answer, b"+OK\r\n");
    assert_eq!(version, format!("{wall:015}:00042:statebroker"));
    // The store's clock stays ahead afterwards, even for a request timestamped now.
    let (_, next) = ask(&mut c, &["SET", "k2", "v"], &[("__ts", &now_hlc("ahead"))]).await;
    assert!(next > version, "{next} > {version}");
}

#[tokio::test]
async fn arity_unknown_verbs_and_options() {
    let broker = start_broker().await;
    let mut c = Raw::connect(broker.local_addr(), "arity").await;
    let ts = now_hlc("arity");
    let user = [("__ts", ts.as_str())];
    for (args, answer) in [
        (&["GET"][..], err("wrong number of arguments")),
        (&["GET", "a", "b"], err("wrong number of arguments")),
        (&["SET", "a"], err("wrong number of arguments")),
        (&["VDEL", "a"], err("wrong number of arguments")),
        (
            &["KEYNOTIFY", "a", "STOP", "x"],
            err("wrong number of arguments"),
        ),
        (&["SCAN"], err("wrong number of arguments")),
        (&["FLUSHALL"], err("unknown command")),
        (&["SET", "a", "v", "EX", "5"], err("syntax error")),
        (&["SET", "a", "v", "PX"], err("syntax error")),
        (&["SET", "a", "v", "PX", "0"], err("syntax error")),
        (&["SET", "a", "v", "NX", "NEX"], err("syntax error")),
        (&["KEYNOTIFY", "a", "START"], err("syntax error")),
        (&["GET", ""], err("the key length is zero")),
        (&["set", "a", "v", "nx"], b"+OK\r\n".to_vec()),
        (&["GeT", "a"], b"$1\r\nv\r\n".to_vec()),
    ] {
        assert_eq!(ask(&mut c, args, &user).await.0, answer, "{args:?}");
    }
}

#[tokio::test]
async fn quotas_are_enforced() {
    let broker = start_broker_with(|s| {
        s.statestore.quota.max_keys = 3;
        s.statestore.quota.max_key_size = 8;
        s.statestore.quota.max_value_size = 16;
        s.statestore.quota.max_bytes = 40;
    })
    .await;
    let mut c = Raw::connect(broker.local_addr(), "quota").await;
    let ts = now_hlc("quota");
    let user = [("__ts", ts.as_str())];
    let quota = err("the quota has been exceeded");
    assert_eq!(
        ask(&mut c, &["SET", "a-very-long-key", "v"], &user).await.0,
        quota
    );
    assert_eq!(
        ask(&mut c, &["SET", "k", "0123456789abcdefX"], &user)
            .await
            .0,
        quota
    );
    for k in ["k1", "k2", "k3"] {
        assert_eq!(
            ask(&mut c, &["SET", k, "0123456789"], &user).await.0,
            b"+OK\r\n"
        );
    }
    assert_eq!(
        ask(&mut c, &["SET", "k4", "v"], &user).await.0,
        quota,
        "max_keys"
    );
    assert_eq!(
        ask(&mut c, &["SET", "k1", "0123456789abcdef"], &user)
            .await
            .0,
        quota,
        "max_bytes"
    );
    assert_eq!(broker.store().with_store(|s| (s.len(), s.bytes())), (3, 36));
}

#[tokio::test]
async fn the_2023_topic_and_its_case_rules() {
    let broker = start_broker().await;
    let mut c = Raw::connect(broker.local_addr(), "legacy").await;
    let ts = now_hlc("legacy");
    let user = [("__ts", ts.as_str())];
    let mut legacy = async |args: &[&str]| {
        c.request_raw(LEGACY_REQUEST_TOPIC, &encode_request(args), &user)
            .await
            .payload
            .to_vec()
    };
    assert_eq!(
        legacy(&["set", "k", "v", "NX", "PX", "60000"]).await,
        b"+OK\r\n"
    );
    assert_eq!(legacy(&["set", "k", "w", "NX"]).await, b":-1\r\n");
    assert_eq!(legacy(&["set", "k", "w", "nx"]).await, err("syntax error"));
    assert_eq!(legacy(&["set", "k", "w", "Nx"]).await, err("syntax error"));
    assert_eq!(legacy(&["SET", "k", "w"]).await, err("unknown command"));
    assert_eq!(legacy(&["seT", "k", "w"]).await, err("unknown command"));
    assert_eq!(legacy(&["get", "k"]).await, b"$1\r\nv\r\n");
    assert_eq!(legacy(&["Get", "k"]).await, err("unknown command"));
    assert_eq!(legacy(&["keynotify", "k"]).await, err("unknown command"));
    assert_eq!(legacy(&["vdel", "k", "v"]).await, b":1\r\n");
    assert_eq!(legacy(&["del", "k"]).await, b":0\r\n");
}

/// Issue #33 item 9: with the default configuration a value of exactly
/// `statestore.quota.max_value_size` (1 MiB) can be set and read back (the
/// default packet limit leaves room for the request around it); one byte
/// more is refused by the quota, not by the packet limit.
#[tokio::test]
async fn the_largest_value_fits_the_default_packet_limit() {
    let broker = start_broker().await;
    let mut c = Raw::connect(broker.local_addr(), "largest").await;
    let ts = now_hlc("largest");
    let user = [("__ts", ts.as_str())];
    let largest = "v".repeat(1 << 20);
    assert_eq!(
        ask(&mut c, &["SET", "largest", &largest], &user).await.0,
        b"+OK\r\n"
    );
    let (answer, _) = ask(&mut c, &["GET", "largest"], &user).await;
    let mut want = format!("${}\r\n", largest.len()).into_bytes();
    want.extend_from_slice(largest.as_bytes());
    want.extend_from_slice(b"\r\n");
    assert!(answer == want, "GET answered {} bytes", answer.len());
    let over = "v".repeat((1 << 20) + 1);
    assert_eq!(
        ask(&mut c, &["SET", "over", &over], &user).await.0,
        err("the quota has been exceeded")
    );
    // Refused by the quota, not by the packet limit: the connection stays.
    assert_eq!(ask(&mut c, &["GET", "over"], &user).await.0, b"$-1\r\n");
}
