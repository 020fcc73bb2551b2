//! `statebroker healthcheck`: a container's HEALTHCHECK that follows the
//! broker's configuration, whatever flags, file or environment set it.
//!
//! With `STATEBROKER_HEALTH_FILE` set, the broker writes to that file, once
//! it has started, where its readiness is asked: `http ADDR` (the HTTP
//! endpoint's `/readyz`) or, with the endpoint off, `mqtt ADDR` (its first
//! MQTT listener accepts); it removes the file when it stops.
//! `statebroker healthcheck` reads the file and asks: exit status 0 ready,
//! 1 not (no file yet: starting or stopped; no answer; 503).

use std::io::{Read as _, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The environment variable naming the file.
pub const ENV: &str = "STATEBROKER_HEALTH_FILE";

/// How long one check may take, connecting and reading.
const TIMEOUT: Duration = Duration::from_secs(3);

/// Where the running broker's readiness is asked.
#[derive(Debug, PartialEq, Eq)]
pub enum Target {
    /// `GET /readyz` on the HTTP endpoint.
    Http(SocketAddr),
    /// A TCP connection to the first MQTT listener.
    Mqtt(SocketAddr),
}

impl Target {
    fn line(&self) -> String {
        match self {
            Target::Http(addr) => format!("http {addr}\n"),
            Target::Mqtt(addr) => format!("mqtt {addr}\n"),
        }
    }

    fn parse(text: &str) -> Option<Target> {
        let (kind, addr) = text.trim().split_once(' ')?;
        let addr: SocketAddr = addr.parse().ok()?;
        match kind {
            "http" => Some(Target::Http(addr)),
            "mqtt" => Some(Target::Mqtt(addr)),
            _ => None,
        }
    }
}

/// The health file of the environment, if set.
pub fn file_from_env() -> Option<PathBuf> {
    std::env::var_os(ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Once started: writes `target` to `path` (a failure is logged: the
/// broker serves anyway, the health check then says "not ready").
pub fn announce(path: &Path, target: &Target) {
    match std::fs::write(path, target.line()) {
        Ok(()) => tracing::debug!(file = %path.display(), "health file written"),
        Err(e) => tracing::warn!(
            file = %path.display(),
            error = %e,
            "cannot write the health file ({ENV}): `statebroker healthcheck` will say not ready"
        ),
    }
}

/// When stopping: the broker is no longer ready.
pub fn withdraw(path: &Path) {
    let _ = std::fs::remove_file(path);
}

/// A wildcard address is asked on loopback.
fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), addr.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), addr.port())
        }
        _ => addr,
    }
}

/// `statebroker healthcheck`: `Ok` with what answered, or why not ready.
pub fn check(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        format!(
            "{}: {e}: the broker has not started yet, or has stopped (or runs without {ENV})",
            path.display()
        )
    })?;
    let target = Target::parse(&text)
        .ok_or_else(|| format!("{}: not a health file: {text:?}", path.display()))?;
    match target {
        Target::Http(addr) => {
            let addr = reachable(addr);
            let mut stream = TcpStream::connect_timeout(&addr, TIMEOUT)
                .map_err(|e| format!("HTTP endpoint {addr}: {e}"))?;
            stream
                .set_read_timeout(Some(TIMEOUT))
                .and_then(|()| stream.set_write_timeout(Some(TIMEOUT)))
                .and_then(|()| stream.write_all(b"GET /readyz HTTP/1.0\r\nHost: localhost\r\n\r\n"))
                .map_err(|e| format!("HTTP endpoint {addr}: {e}"))?;
            let mut answer = Vec::new();
            let _ = stream.take(4096).read_to_end(&mut answer);
            let answer = String::from_utf8_lossy(&answer);
            let status = answer.lines().next().unwrap_or("no answer").to_owned();
            let body = answer.split("\r\n\r\n").nth(1).unwrap_or("").trim();
            if status.split_whitespace().nth(1) == Some("200") {
                Ok(format!("http://{addr}/readyz: {body}"))
            } else {
                Err(format!("http://{addr}/readyz: {status}: {body}"))
            }
        }
        Target::Mqtt(addr) => {
            let addr = reachable(addr);
            TcpStream::connect_timeout(&addr, TIMEOUT)
                .map(|_| format!("MQTT listener {addr} accepts (HTTP endpoint off)"))
                .map_err(|e| format!("MQTT listener {addr}: {e}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_round_trip_and_wildcards_are_asked_on_loopback() {
        for target in [
            Target::Http("0.0.0.0:9883".parse().unwrap()),
            Target::Mqtt("[::]:1883".parse().unwrap()),
        ] {
            assert_eq!(Target::parse(&target.line()), Some(target));
        }
        assert_eq!(Target::parse("ftp 1.2.3.4:5"), None);
        assert_eq!(
            reachable("0.0.0.0:9883".parse().unwrap()),
            "127.0.0.1:9883".parse().unwrap()
        );
        assert_eq!(
            reachable("[::]:1".parse().unwrap()),
            "[::1]:1".parse().unwrap()
        );
        assert_eq!(
            reachable("10.0.0.1:1".parse().unwrap()),
            "10.0.0.1:1".parse().unwrap()
        );
    }
}
