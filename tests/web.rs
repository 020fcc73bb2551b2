//! The live web view in a real headless browser (Debian's `chromium`,
//! driven over the DevTools protocol): the page shows a key a client sets
//! without being reloaded, and the request in the live list.
//!
//! `STATEBROKER_SCREENSHOT=FILE` saves what the browser shows (the README's
//! picture is made so).

mod common;

use std::time::Duration;

use common::raw::Raw;
use common::start_broker_with;
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio_tungstenite::tungstenite::Message;

/// A page of a headless chromium, driven over the DevTools protocol.
struct Browser {
    _process: tokio::process::Child,
    _profile: tempfile::TempDir,
    page: tokio_tungstenite::WebSocketStream<
        tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
    >,
    next_id: u64,
}

impl Browser {
    async fn start() -> Browser {
        let profile = tempfile::tempdir().unwrap();
        let mut process = tokio::process::Command::new("chromium")
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
            ])
            .args([
                "--hide-scrollbars",
                "--window-size=1280,640",
                "--remote-debugging-port=0",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("chromium runs (apt-get install chromium; .ci/run installs it)");
        let mut lines = BufReader::new(process.stderr.take().unwrap()).lines();
        let port: u16 = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if let Some(url) = line.strip_prefix("DevTools listening on ws://127.0.0.1:") {
                    return url.split('/').next().unwrap().parse().unwrap();
                }
            }
            panic!("chromium exited without a DevTools endpoint");
        })
        .await
        .expect("chromium starts");
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let targets: Value = serde_json::from_str(&http_get(port, "/json/list").await).unwrap();
        let page_url = targets
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["type"] == "page")
            .and_then(|t| t["webSocketDebuggerUrl"].as_str())
            .expect("a page target")
            .to_owned();
        let (page, _) = tokio_tungstenite::connect_async(page_url.as_str())
            .await
            .unwrap_or_else(|e| panic!("DevTools page {page_url}: {e}"));
        Browser {
            _process: process,
            _profile: profile,
            page,
            next_id: 0,
        }
    }

    /// Calls a DevTools method; returns its result.
    async fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let message = json!({ "id": id, "method": method, "params": params }).to_string();
        self.page.send(Message::text(message)).await.unwrap();
        loop {
            let message = tokio::time::timeout(Duration::from_secs(10), self.page.next())
                .await
                .expect("DevTools answers")
                .unwrap()
                .unwrap();
            if let Message::Text(text) = message {
                let value: Value = serde_json::from_str(&text).unwrap();
                if value["id"] == id {
                    return value["result"].clone();
                }
            }
        }
    }

    /// Runs `expression` in the page.
    async fn eval(&mut self, expression: &str) -> Value {
        self.call("Runtime.evaluate", json!({ "expression": expression }))
            .await
    }

    /// The text of the element `id`.
    async fn text_of(&mut self, id: &str) -> String {
        let result = self
            .eval(&format!("document.getElementById('{id}')?.innerText ?? ''"))
            .await;
        result["result"]["value"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Waits until the element `id` contains every one of `needles`.
    async fn wait_for(&mut self, id: &str, needles: &[&str]) -> String {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            let text = self.text_of(id).await;
            if needles.iter().all(|n| text.contains(n)) {
                return text;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "#{id} never showed {needles:?}: {text:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A plain HTTP GET (DevTools' target list), read by its Content-Length
/// (DevTools keeps the connection open).
async fn http_get(port: u16, path: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let n = stream.read(&mut buf).await.unwrap();
            assert!(n > 0, "DevTools closed before answering");
            response.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&response);
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let length = head
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse::<usize>().unwrap())
                    })
                    .unwrap_or(0);
                if body.len() >= length {
                    return body.to_owned();
                }
            }
        }
    })
    .await
    .expect("DevTools answers /json/list")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_keys_and_requests_as_they_happen() {
    let broker = start_broker_with(|s| {
        s.http = Some("127.0.0.1:0".parse().unwrap());
        s.http_allow_edit = true;
    })
    .await;
    let http = broker.http_addr().unwrap();
    let mut browser = Browser::start().await;
    browser
        .call("Page.navigate", json!({ "url": format!("http://{http}/") }))
        .await;
    browser.wait_for("keycount", &["0 shown"]).await;

    // A client sets a key: the page shows it, and the request, unreloaded.
    let mut client = Raw::connect(broker.local_addr(), "web-test-client").await;
    let set = client.request(&[b"SET", b"door", b"open"]).await;
    assert_eq!(&set.payload[..], b"+OK\r\n");
    let keys = browser
        .wait_for("keys", &["door", "open", ":statebroker"])
        .await;
    assert!(keys.contains("door"), "{keys}");
    browser
        .wait_for("log", &["web-test-client", "SET", "door", "ok"])
        .await;
    // An error shows as such.
    client.request(&[b"GET", b""]).await;
    browser.wait_for("log", &["the key length is zero"]).await;
    browser
        .wait_for("clients", &["web-test-client", "connected"])
        .await;
    let summary = browser.wait_for("summary", &["1 keys"]).await;
    assert!(summary.starts_with("statebroker "), "{summary}");
    browser
        .wait_for("clients", &["MQTT 5 (v5.1)", "127.0.0.1:"])
        .await;

    // The edit form ([http] allow_edit): set a key from the page; the
    // client reads it, the live list shows who set it.
    browser
        .eval(
            "document.getElementById('edit-key').value = 'window'; \
             document.getElementById('edit-value').value = 'shut'; \
             document.getElementById('edit-set').click()",
        )
        .await;
    browser.wait_for("edit-answer", &["+OK"]).await;
    browser.wait_for("keys", &["window", "shut"]).await;
    browser
        .wait_for("log", &["statebroker-web", "SET", "window"])
        .await;
    let get = client.request(&[b"GET", b"window"]).await;
    assert_eq!(&get.payload[..], b"$4\r\nshut\r\n");

    if let Ok(path) = std::env::var("STATEBROKER_SCREENSHOT") {
        use base64::Engine;
        let shot = browser
            .call("Page.captureScreenshot", json!({ "format": "png" }))
            .await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap())
            .unwrap();
        std::fs::write(path, png).unwrap();
    }
}
