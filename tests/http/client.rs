//! A plain HTTP/1.1 client on a TCP socket: every header as written (a
//! `Host` of any name, or none), one request per connection.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The value of the sample `series` (name with labels, as rendered) in a
/// Prometheus text page.
pub fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|line| {
        let (name, value) = line.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok())?
    })
}

/// The value of `series` at `/metrics` of the endpoint `addr` (0 when
/// absent).
pub async fn metric(addr: SocketAddr, series: &str) -> f64 {
    let (status, metrics) = get(addr, "/metrics").await;
    assert_eq!(status, 200);
    sample(&metrics, series).unwrap_or(0.0)
}

/// GET `path` (`Host: localhost`): the status code and the body.
pub async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    send(addr, "GET", path, None).await
}

/// POST a JSON `body` to `path` (`Host: localhost`).
pub async fn post(addr: SocketAddr, path: &str, body: serde_json::Value) -> (u16, String) {
    let body = body.to_string();
    send(addr, "POST", path, Some(("application/json", &body))).await
}

/// `method path` (`Host: localhost`) with an optional (content type, body).
pub async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    content: Option<(&str, &str)>,
) -> (u16, String) {
    send_with(addr, method, path, &[("Host", "localhost")], content).await
}

/// GET `path` with `Host: host`.
pub async fn get_as(addr: SocketAddr, host: &str, path: &str) -> (u16, String) {
    send_with(addr, "GET", path, &[("Host", host)], None).await
}

/// POST a JSON `body` to `path` with these `headers` (and no others but
/// the body's).
pub async fn post_with(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: serde_json::Value,
) -> (u16, String) {
    let body = body.to_string();
    send_with(
        addr,
        "POST",
        path,
        headers,
        Some(("application/json", &body)),
    )
    .await
}

/// `method path` with exactly these `headers` (plus `Connection: close`
/// and the body's).
pub async fn send_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    content: Option<(&str, &str)>,
) -> (u16, String) {
    let mut head: String = headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect();
    let body = match content {
        Some((kind, body)) => {
            head += &format!("Content-Type: {kind}\r\nContent-Length: {}\r\n", body.len());
            body
        }
        None => "",
    };
    exchange(
        addr,
        &format!("{method} {path} HTTP/1.1\r\n{head}Connection: close\r\n\r\n{body}"),
    )
    .await
}

/// Sends `request` as written and reads the answer to the end: the status
/// code and the body.
pub async fn exchange(addr: SocketAddr, request: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut response))
        .await
        .expect("an answer within 5 s")
        .unwrap();
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}
