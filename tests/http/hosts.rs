//! DNS rebinding: the web view, its API and the fault routes answer only
//! requests for a host the endpoint serves (`localhost`, IP literals,
//! `[http] allowed_hosts`), and a change only from no page or a page of
//! such a host; `/metrics`, `/healthz` and `/readyz` answer any `Host`.

use serde_json::json;

use crate::client::{exchange, get, get_as, post, post_with};
use crate::common::start_broker_with;
use crate::sample;

/// The keys the view lists (asked with a good `Host`), sorted.
async fn listed(http: std::net::SocketAddr) -> Vec<String> {
    let (status, body) = get(http, "/api/keys").await;
    assert_eq!(status, 200, "{body}");
    let keys: serde_json::Value = serde_json::from_str(&body).unwrap();
    let mut names: Vec<String> = keys["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["key"].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_view_answers_only_the_hosts_it_serves() {
    let broker = start_broker_with(|s| {
        s.http = Some("127.0.0.1:0".parse().unwrap());
        s.http_allow_edit = true;
    })
    .await;
    let http = broker.http_addr().unwrap();
    let port = http.port();
    let (status, _) = post(
        http,
        "/api/set",
        json!({ "key": "secret", "value": "hunter2" }),
    )
    .await;
    assert_eq!(status, 200);

    // What a rebound page of evil.example:PORT sends: refused, nothing shown.
    for host in [
        "evil.example".to_owned(),
        format!("evil.example:{port}"),
        format!("EVIL.example.:{port}"),
        format!("localhost.evil.example:{port}"),
        format!("127.0.0.1.nip.io:{port}"),
    ] {
        for path in [
            "/api/keys",
            "/",
            "/api/clients",
            "/api/summary",
            "/api/events",
        ] {
            let (status, body) = get_as(http, &host, path).await;
            assert_eq!(status, 421, "{host} {path}: {body}");
            assert!(!body.contains("hunter2") && !body.contains("secret"));
            assert!(body.contains("allowed_hosts"), "{body}");
        }
    }
    // Without a Host (HTTP/1.0): refused too.
    let (status, body) = exchange(http, "GET /api/keys HTTP/1.0\r\n\r\n").await;
    assert_eq!(status, 421, "{body}");
    // Two Host headers, or an absolute-form target naming another host.
    let two = "GET /api/keys HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\nConnection: close\r\n\r\n";
    assert_eq!(exchange(http, two).await.0, 421);
    let absolute =
        "GET http://evil.example/api/keys HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    assert_eq!(exchange(http, absolute).await.0, 421);

    // The names the endpoint serves.
    for host in [
        "localhost".to_owned(),
        format!("localhost:{port}"),
        format!("LocalHost.:{port}"),
        format!("view.localhost:{port}"),
        format!("127.0.0.1:{port}"),
        "127.0.0.1".to_owned(),
        format!("[::1]:{port}"),
        "[::1]".to_owned(),
    ] {
        let (status, body) = get_as(http, &host, "/api/keys").await;
        assert_eq!(status, 200, "{host}: {body}");
        assert!(body.contains("hunter2"), "{host}: {body}");
    }

    // Scrapers and probes use whatever name they know the host by.
    for path in ["/metrics", "/healthz", "/readyz"] {
        let (status, _) = get_as(http, "evil.example", path).await;
        assert_eq!(status, 200, "{path}");
    }
    // What the Dockerfile's HEALTHCHECK sends: HTTP/1.0, no Host.
    let (status, body) = exchange(http, "GET /readyz HTTP/1.0\r\n\r\n").await;
    assert_eq!((status, body.as_str()), (200, "ready\n"));
    let (_, metrics) = get_as(http, "prometheus.internal:9883", "/metrics").await;
    let refused = sample(
        &metrics,
        r#"statebroker_http_requests_refused_total{reason="host"}"#,
    );
    assert!(refused.is_some_and(|n| n >= 25.0), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_need_a_served_host_and_origin() {
    let broker = start_broker_with(|s| {
        s.http = Some("127.0.0.1:0".parse().unwrap());
        s.http_allow_edit = true;
        s.faults.enabled = true;
    })
    .await;
    let http = broker.http_addr().unwrap();
    let own = format!("http://127.0.0.1:{}", http.port());
    let set = |key: &str| json!({ "key": key, "value": "written" });

    let (status, body) = post_with(http, "/api/set", &[("Host", "evil.example")], set("a")).await;
    assert_eq!(status, 421, "{body}");
    let foreign = format!("http://evil.example:{}", http.port());
    for origin in [foreign.as_str(), "null", "http://localhost.evil.example"] {
        let headers = [("Host", "localhost"), ("Origin", origin)];
        let (status, body) = post_with(http, "/api/set", &headers, set("b")).await;
        assert_eq!(status, 403, "{origin}: {body}");
        assert!(body.contains("Origin"), "{body}");
        let (status, _) = post_with(http, "/api/del", &headers, json!({ "key": "b" })).await;
        assert_eq!(status, 403);
    }
    assert!(listed(http).await.is_empty(), "nothing was written");

    // The page itself (Origin of its own host), and tools (no Origin).
    let headers = [("Host", "127.0.0.1"), ("Origin", own.as_str())];
    let (status, body) = post_with(http, "/api/set", &headers, set("from-page")).await;
    assert_eq!(
        (status, body.contains(r#""ok":true"#)),
        (200, true),
        "{body}"
    );
    let (status, _) = post_with(http, "/api/set", &[("Host", "localhost")], set("from-curl")).await;
    assert_eq!(status, 200);
    assert_eq!(listed(http).await, ["from-curl", "from-page"]);

    // The fault routes, behind the same guard.
    let rule = json!({ "keys": "x*", "error": "the quota has been exceeded" });
    let (status, _) = post_with(
        http,
        "/api/faults/rules",
        &[("Host", "evil.example")],
        rule.clone(),
    )
    .await;
    assert_eq!(status, 421);
    let headers = [("Host", "localhost"), ("Origin", foreign.as_str())];
    assert_eq!(
        post_with(http, "/api/faults/rules", &headers, rule.clone())
            .await
            .0,
        403
    );
    assert_eq!(get_as(http, "evil.example", "/api/faults").await.0, 421);
    let status: serde_json::Value =
        serde_json::from_str(&get(http, "/api/faults").await.1).unwrap();
    assert_eq!(
        status["rules"],
        json!([]),
        "no fault was accepted: {status}"
    );
    assert_eq!(post(http, "/api/faults/rules", rule).await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowed_hosts_open_the_view_under_a_name() {
    let broker = start_broker_with(|s| {
        s.http = Some("127.0.0.1:0".parse().unwrap());
        s.http_allow_edit = true;
        s.http_options.allowed_hosts = vec!["broker.example".into()];
    })
    .await;
    let http = broker.http_addr().unwrap();
    let named = format!("broker.example:{}", http.port());
    assert_eq!(get_as(http, &named, "/api/keys").await.0, 200);
    assert_eq!(get_as(http, "Broker.Example.", "/").await.0, 200);
    assert_eq!(get_as(http, "other.example", "/api/keys").await.0, 421);
    assert_eq!(get_as(http, "sub.broker.example", "/api/keys").await.0, 421);
    let origin = format!("http://{named}");
    let headers = [("Host", named.as_str()), ("Origin", origin.as_str())];
    let body = json!({ "key": "named", "value": "v" });
    assert_eq!(post_with(http, "/api/set", &headers, body).await.0, 200);
    assert_eq!(listed(http).await, ["named"]);
}

/// The binary: `allowed_hosts` from the environment, and a refusal's log
/// line naming the host and the peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_reads_allowed_hosts_and_logs_refusals() {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_statebroker"));
    command
        .args([
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--in-memory",
        ])
        .env(
            "STATEBROKER__HTTP__ALLOWED_HOSTS",
            "broker.example,Other.Example.",
        );
    let (_child, _, log) = crate::common::spawn_command(command).await;
    let http: std::net::SocketAddr = {
        let line = log
            .lock()
            .iter()
            .find(|l| l.contains("HTTP endpoint"))
            .cloned()
            .expect("the endpoint logs its address before the listeners");
        let rest = line.split("addr=").nth(1).unwrap();
        rest.split_whitespace().next().unwrap().parse().unwrap()
    };
    assert_eq!(get_as(http, "broker.example", "/api/keys").await.0, 200);
    assert_eq!(get_as(http, "other.example:1", "/api/keys").await.0, 200);
    assert_eq!(get_as(http, "evil.example:1234", "/api/keys").await.0, 421);
    crate::common::eventually("the refusal is logged", || {
        log.lock().iter().any(|l| {
            l.contains("INFO")
                && l.contains("host=evil.example:1234")
                && l.contains("peer=127.0.0.1:")
        })
    })
    .await;
}
