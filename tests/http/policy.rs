//! The web view under an authorization policy: each request acts as the
//! user it logged in as, and sees and changes what the policy gives that
//! user; the broker's activity is for operators (Subscribe `$SYS/#`).

use std::net::SocketAddr;

use base64::Engine;
use serde_json::{Value, json};

use super::client::send_with;
use crate::common::start_broker_with;

const POLICY: &str = r#"
rules:
  - principals:
      usernames: ["admin"]
    brokerResources:
      - method: Connect
      - method: Subscribe
        topics: ["$SYS/#"]
    stateStoreResources:
      - keyType: Pattern
        keys: ["*"]
        method: ReadWrite
  - principals:
      usernames: ["bob"]
    brokerResources:
      - method: Connect
    stateStoreResources:
      - keyType: Pattern
        keys: ["bob-*"]
        method: Read
"#;

/// `method path` as `user` (HTTP Basic; `None`: no credentials).
async fn as_user(
    http: SocketAddr,
    user: Option<&str>,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, String) {
    let auth = user.map(|u| {
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{u}:pw-{u}"));
        format!("Basic {token}")
    });
    let mut headers = vec![("Host", "localhost")];
    if let Some(auth) = &auth {
        headers.push(("Authorization", auth));
    }
    let body = body.map(|b| b.to_string());
    let content = body.as_deref().map(|b| ("application/json", b));
    send_with(http, method, path, &headers, content).await
}

fn listed(body: &str) -> Vec<String> {
    let page: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    page["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["key"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_view_shows_each_user_what_the_policy_gives_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut passwords = String::new();
    for user in ["admin", "bob"] {
        passwords =
            broker::passwords::set_user(&passwords, user, format!("pw-{user}").as_bytes()).unwrap();
    }
    let password_file = dir.path().join("passwd");
    std::fs::write(&password_file, passwords).unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let broker = start_broker_with(|s| {
        s.http = Some("127.0.0.1:0".parse().unwrap());
        s.http_allow_edit = true;
        s.password_file = Some(password_file);
        s.authorization = Some(policy);
    })
    .await;
    let http = broker.http_addr().unwrap();

    // With a policy and users, loopback asks for a user too.
    let (status, _) = as_user(http, None, "GET", "/api/keys", None).await;
    assert_eq!(status, 401);
    let set = |key: &str, value: &str| json!({ "key": key, "value": value });
    for (key, value) in [("secret", "s3cret"), ("bob-door", "open")] {
        let (status, body) = as_user(
            http,
            Some("admin"),
            "POST",
            "/api/set",
            Some(set(key, value)),
        )
        .await;
        assert_eq!(
            (status, body.as_str()),
            (200, r#"{"answer":"+OK","ok":true}"#)
        );
    }
    let (_, body) = as_user(http, Some("admin"), "GET", "/api/keys", None).await;
    let mut all = listed(&body);
    all.sort();
    assert_eq!(all, ["bob-door", "secret"]);

    // bob reads his keys only, and may change none.
    let (status, body) = as_user(http, Some("bob"), "GET", "/api/keys", None).await;
    assert_eq!((status, listed(&body)), (200, vec!["bob-door".to_owned()]));
    for (path, form) in [
        ("/api/set", set("secret", "mine")),
        ("/api/del", json!({ "key": "secret" })),
    ] {
        let (status, body) = as_user(http, Some("bob"), "POST", path, Some(form)).await;
        assert_eq!(
            (status, body.as_str()),
            (200, r#"{"answer":"-ERR not authorized","ok":false}"#),
            "{path}"
        );
    }
    let secret = broker
        .store()
        .with_store(|s| s.view(&b"secret"[..]).unwrap().value);
    assert_eq!(secret, b"s3cret");

    // The broker's activity is the operator's.
    for path in [
        "/api/clients",
        "/api/summary",
        "/api/rates",
        "/api/events",
        "/api/faults",
    ] {
        let (status, body) = as_user(http, Some("bob"), "GET", path, None).await;
        assert_eq!(status, 403, "{path}: {body}");
        assert!(body.contains("$SYS/#"), "{path}: {body}");
    }
    for path in ["/api/clients", "/api/summary", "/api/rates"] {
        let (status, body) = as_user(http, Some("admin"), "GET", path, None).await;
        assert_eq!(status, 200, "{path}: {body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_of_large_values_sends_the_start_of_each() {
    let broker = start_broker_with(|s| {
        s.http = Some("127.0.0.1:0".parse().unwrap());
        s.http_allow_edit = true;
    })
    .await;
    let http = broker.http_addr().unwrap();
    // 2,000 bytes of text whose 1,024th byte is inside a character.
    let value = format!("a{}", "é".repeat(1000));
    let (status, _) = as_user(
        http,
        None,
        "POST",
        "/api/set",
        Some(json!({ "key": "big", "value": value })),
    )
    .await;
    assert_eq!(status, 200);
    let (_, body) = as_user(http, None, "GET", "/api/keys", None).await;
    let page: Value = serde_json::from_str(&body).unwrap();
    let big = &page["keys"][0];
    assert_eq!(big["value_len"], value.len());
    let shown = big["value"].as_str().unwrap();
    assert!(
        value.starts_with(shown) && shown.len() == 1023,
        "{}",
        shown.len()
    );
    assert_eq!(big["value_hex"], Value::Null, "still text");
}
