//! The live web view in a real headless browser (Debian's `chromium`,
//! driven over the DevTools protocol): the page shows a key a client sets
//! without being reloaded, and the request in the live list.
//!
//! `STATEBROKER_SCREENSHOT=FILE` saves what the browser shows at the end of
//! `the_page_reads_at_a_glance` (the README's picture is made so).

mod common;

use std::time::Duration;

use common::raw::{NOTIFY_NAMESPACE, Raw};
use common::start_broker_with;
use futures_util::{SinkExt, StreamExt};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5 as packets;
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

    /// Saves what the browser shows to `STATEBROKER_SCREENSHOT`, if set.
    async fn screenshot_if_asked(&mut self) {
        use base64::Engine;
        let Ok(path) = std::env::var("STATEBROKER_SCREENSHOT") else {
            return;
        };
        let shot = self
            .call("Page.captureScreenshot", json!({ "format": "png" }))
            .await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap())
            .unwrap();
        std::fs::write(path, png).unwrap();
    }

    /// The value of `expression` (JSON-serializable) in the page.
    async fn value_of(&mut self, expression: &str) -> Value {
        let result = self
            .call(
                "Runtime.evaluate",
                json!({ "expression": expression, "returnByValue": true }),
            )
            .await;
        result["result"]["value"].clone()
    }

    /// Waits until `expression` is true in the page.
    async fn wait_until(&mut self, what: &str, expression: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while self.value_of(expression).await != Value::Bool(true) {
            assert!(tokio::time::Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
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
    let log = browser.wait_for("log", &["the key length is zero"]).await;
    assert!(
        log.lines()
            .any(|l| l.contains("GET") && l.contains("the key length is zero")),
        "a refused request named by its verb: {log}"
    );
    browser
        .wait_for("clients", &["web-test-client", "connected"])
        .await;
    let summary = browser.wait_for("summary", &["1 keys"]).await;
    assert!(summary.starts_with("statebroker "), "{summary}");
    browser
        .wait_for("clients", &["MQTT 5", "v5.1", "127.0.0.1:"])
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
}

/// The page's cells whose text breaks over more than one line: keys,
/// client ids, versions, addresses, times, commands (a Range over a text
/// node has rectangles on as many lines as the text takes; one cut with
/// an ellipsis has two on the same line).
const WRAPPED_TOKENS: &str = "Array.from(document.querySelectorAll('td.token')).filter((td) => { \
     const texts = document.createTreeWalker(td, NodeFilter.SHOW_TEXT); let text; \
     while ((text = texts.nextNode())) { const range = document.createRange(); \
     range.selectNodeContents(text); const tops = Array.from(range.getClientRects(), \
     (r) => Math.round(r.top)); if (new Set(tops).size > 1) return true; } \
     return false; }).map((td) => td.innerText)";

/// Issue #32 item 8, what a person sees at a glance: the requests made
/// before the page was opened; tokens that do not break inside; the
/// header counting what the table lists; the state store's own
/// subscriptions as two labels, not long filters; protocol and listener
/// apart; a chart of requests and messages per second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_reads_at_a_glance() {
    let broker = start_broker_with(|s| s.http = Some("127.0.0.1:0".parse().unwrap())).await;
    let http = broker.http_addr().unwrap();
    let addr = broker.local_addr();
    // Before anyone opens the page.
    let mut early = Raw::connect(addr, "early-bird").await;
    early.request(&[b"SET", b"set-before-the-page", b"1"]).await;
    // A session kept without its connection.
    let (mut kept, _) = Raw::connect_with(addr, "kept-session", |c| {
        c.0.clean_start = false;
        let mut properties = packets::ConnectProperties::new();
        properties.session_expiry_interval = Some(3600);
        c.0.properties = Some(properties);
    })
    .await;
    kept.subscribe("sensors/#", QoS::AtLeastOnce).await;
    kept.send(packets::Packet::Disconnect(packets::Disconnect::new(
        packets::DisconnectReasonCode::NormalDisconnection,
    )))
    .await;
    drop(kept);
    // A long client id with an ordinary subscription and the state
    // store's two (answers, key notifications).
    const LONG_ID: &str = "a-client-with-a-rather-long-identifier-0123456789abcdef";
    const LONG_KEY: &[u8] = b"a-key-with-a-rather-long-name-0123456789abcdefghijklmnop";
    let mut long = Raw::connect(addr, LONG_ID).await;
    long.subscribe("sensors/#", QoS::AtLeastOnce).await;
    let notify = format!(
        "{NOTIFY_NAMESPACE}/{}/command/notify/#",
        hex::encode_upper(LONG_ID)
    );
    long.subscribe(&notify, QoS::AtLeastOnce).await;
    long.request(&[b"KEYNOTIFY", LONG_KEY]).await;
    long.request(&[b"SET", LONG_KEY, b"a value"]).await;

    let mut browser = Browser::start().await;
    browser
        .call("Page.navigate", json!({ "url": format!("http://{http}/") }))
        .await;
    // The live list has what happened before the page was open.
    browser
        .wait_for("log", &["early-bird", "set-before-the-page", "KEYNOTIFY"])
        .await;
    // The header counts what the table lists.
    browser
        .wait_for("clientcount", &["2 connected", "1 session kept"])
        .await;
    let table = browser
        .wait_for(
            "clients",
            &[
                "kept-session",
                "session kept",
                "sensors/#",
                "state store answers",
                "key notifications",
            ],
        )
        .await;
    assert!(
        !table.contains("clients/"),
        "no internal filter shown whole: {table}"
    );
    let rows = browser
        .value_of(
            "document.querySelectorAll('#clients tr').length + ' ' + \
             document.querySelectorAll('#clients tr td:nth-child(2)').length",
        )
        .await;
    assert_eq!(rows, json!("3 3"));
    // Protocol and listener in their own columns.
    let cells = browser
        .value_of(&format!(
            "Array.from(document.querySelectorAll('#clients tr')).find((tr) => \
             tr.cells[0].querySelector('[title=\"{LONG_ID}\"]'))?.cells[2].innerText + '|' + \
             Array.from(document.querySelectorAll('#clients tr')).find((tr) => \
             tr.cells[0].querySelector('[title=\"{LONG_ID}\"]'))?.cells[3].innerText"
        ))
        .await;
    assert_eq!(cells, json!("MQTT 5|v5.1"));
    // No token breaks inside, in a narrow window too.
    browser.wait_for("keys", &["a value"]).await;
    for width in [1280, 900] {
        browser
            .call(
                "Emulation.setDeviceMetricsOverride",
                json!({ "width": width, "height": 640, "deviceScaleFactor": 1, "mobile": false }),
            )
            .await;
        let wrapped = browser.value_of(WRAPPED_TOKENS).await;
        assert_eq!(wrapped, json!([]), "at {width} px");
    }
    // The chart: a second with requests in it.
    browser
        .wait_until(
            "the requests line above the floor",
            "(document.getElementById('chart-requests').getAttribute('points') || '')\
             .split(' ').some((p) => p && parseFloat(p.split(',')[1]) < 88)",
        )
        .await;
    browser
        .wait_for("rates-legend", &["requests/s", "messages in/s", "peak"])
        .await;
    browser
        .call(
            "Emulation.setDeviceMetricsOverride",
            json!({ "width": 1280, "height": 640, "deviceScaleFactor": 1, "mobile": false }),
        )
        .await;
    browser.screenshot_if_asked().await;
}
