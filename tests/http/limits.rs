//! The endpoint's bounds (`[http] max_connections`, `header_timeout_ms`,
//! `idle_timeout_ms`): a socket that sends nothing, half a request, or
//! nothing more after a response is closed, at most `max_connections`
//! are open at once without costing MQTT its clients, and the web view's
//! event stream outlives the timeouts.

use std::time::Duration;

use broker::RunningBroker;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::client::{get, metric};
use crate::common::raw::Raw;
use crate::common::start_broker_with;

/// Longest any test waits for the endpoint to close a socket.
const CAP: Duration = Duration::from_secs(10);

/// A broker whose endpoint has these bounds (milliseconds).
async fn broker(max_connections: usize, header_ms: u64, idle_ms: u64) -> RunningBroker {
    start_broker_with(|s| {
        s.http = Some("127.0.0.1:0".parse().unwrap());
        s.http_options.max_connections = max_connections;
        s.http_options.header_timeout = Duration::from_millis(header_ms);
        s.http_options.idle_timeout = Duration::from_millis(idle_ms);
    })
    .await
}

/// Reads until the endpoint closes `stream` (end of file or reset),
/// within [`CAP`]: what it sent before.
async fn until_closed(stream: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let closed = tokio::time::timeout(CAP, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "still open after {CAP:?}");
    String::from_utf8_lossy(&got).into_owned()
}

/// Sends a keep-alive `GET /healthz` on `stream` and reads its answer.
async fn healthz_kept_alive(stream: &mut TcpStream) {
    let request = "GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n";
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    tokio::time::timeout(CAP, async {
        while !got.ends_with(b"\r\n\r\nok\n") {
            let n = stream.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .expect("an answer");
    assert!(got.starts_with(b"HTTP/1.1 200"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_must_arrive_within_the_header_timeout() {
    let broker = broker(256, 300, 60_000).await;
    let http = broker.http_addr().unwrap();
    // Nothing sent.
    let started = Instant::now();
    let mut silent = TcpStream::connect(http).await.unwrap();
    assert_eq!(until_closed(&mut silent).await, "");
    assert!(started.elapsed() >= Duration::from_millis(250));
    // Half the headers.
    let mut half = TcpStream::connect(http).await.unwrap();
    half.write_all(b"GET /healthz HTTP/1.1\r\nHost: loc")
        .await
        .unwrap();
    until_closed(&mut half).await;
    // A byte every 50 ms: moving, but the headers never complete.
    let mut trickle = TcpStream::connect(http).await.unwrap();
    let (mut read, mut write) = trickle.split();
    let drip = async {
        for byte in b"GET /healthz HTTP/1.1\r\nX-Slow: ".iter().cycle() {
            if write.write_all(&[*byte]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let closed = async {
        let mut buf = [0u8; 64];
        while let Ok(n) = read.read(&mut buf).await
            && n > 0
        {}
    };
    tokio::time::timeout(CAP, async {
        tokio::select! {
            () = drip => {}
            () = closed => {}
        }
    })
    .await
    .expect("a trickled request is closed at its header timeout");
    // A request in time is answered.
    assert_eq!(get(http, "/healthz").await, (200, "ok\n".to_owned()));
    let timed_out = r#"statebroker_http_connections_timed_out_total{reason="header_timeout"}"#;
    assert!(metric(http, timed_out).await >= 3.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() {
    // Idle may last longer than a request's headers may take.
    let broker = broker(256, 300, 3_000).await;
    let http = broker.http_addr().unwrap();
    let mut kept = TcpStream::connect(http).await.unwrap();
    healthz_kept_alive(&mut kept).await;
    // Past the header timeout, within the idle one: still served.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    healthz_kept_alive(&mut kept).await;
    let answered = Instant::now();
    assert_eq!(until_closed(&mut kept).await, "");
    let idle = answered.elapsed();
    assert!(
        idle >= Duration::from_millis(2_500),
        "closed after {idle:?}"
    );
    let timed_out = r#"statebroker_http_connections_timed_out_total{reason="idle_timeout"}"#;
    assert!(metric(http, timed_out).await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_most_max_connections_and_mqtt_still_connects() {
    // Timeouts far away: only the limit closes anything here.
    let broker = broker(4, 60_000, 60_000).await;
    let http = broker.http_addr().unwrap();
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(TcpStream::connect(http).await.unwrap());
    }
    // Accepted in order: the fifth finds four open, and is closed at once.
    let started = Instant::now();
    let mut fifth = TcpStream::connect(http).await.unwrap();
    let said = until_closed(&mut fifth).await;
    assert!(
        said.is_empty() || said.starts_with("HTTP/1.1 503"),
        "{said}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    // MQTT has its own limit: a client still gets its CONNACK.
    let mut client = Raw::connect(broker.local_addr(), "while-http-is-full").await;
    assert_eq!(
        &client.request(&[b"SET", b"k", b"v"]).await.payload[..],
        b"+OK\r\n"
    );
    // Once the held sockets go, the endpoint answers again.
    held.clear();
    let deadline = Instant::now() + CAP;
    loop {
        let mut probe = TcpStream::connect(http).await.unwrap();
        let request = "GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
        probe.write_all(request.as_bytes()).await.unwrap();
        if until_closed(&mut probe).await.ends_with("\r\n\r\nok\n") {
            break;
        }
        assert!(Instant::now() < deadline, "/healthz never answered again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let refused = metric(http, "statebroker_http_connections_refused_total").await;
    assert!(refused >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_stream_outlives_the_timeouts() {
    let broker = broker(4, 300, 1_000).await;
    let http = broker.http_addr().unwrap();
    let mut events = TcpStream::connect(http).await.unwrap();
    let request = "GET /api/events HTTP/1.1\r\nHost: localhost\r\n\r\n";
    events.write_all(request.as_bytes()).await.unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    let mut read_until = async |seen: &mut String, what: &str| {
        tokio::time::timeout(CAP, async {
            while !seen.contains(what) {
                let n = events.read(&mut buf).await.unwrap();
                assert!(n > 0, "the stream ended: {seen}");
                seen.push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no {what} in {seen}"));
    };
    read_until(&mut seen, "text/event-stream").await;
    // Longer than the idle timeout with no event: kept alive.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let mut client = Raw::connect(broker.local_addr(), "sse-writer").await;
    assert_eq!(
        &client.request(&[b"SET", b"sse-key", b"v"]).await.payload[..],
        b"+OK\r\n"
    );
    read_until(&mut seen, "sse-key").await;
    assert!(seen.contains("\n:"), "keep-alive comments: {seen}");
}
