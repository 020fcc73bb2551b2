//! `[http]` beyond `listen` and `allow_edit`: the web view's bounds and
//! the host names it answers under, checked.

use std::time::Duration;

use super::sections::HttpSection;
use super::{ConfigError, invalid};

/// `[http]` beyond `listen` and `allow_edit`: the endpoint's bounds and
/// names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpOptions {
    /// `allowed_hosts`: names the web view answers under besides
    /// `localhost` and IP literals; lower case, without a trailing dot.
    pub allowed_hosts: Vec<String>,
    /// `allow_anonymous`: on a non-loopback address the web view's reads
    /// (GET, HEAD) need no password; changes still need a user of the
    /// password file.
    pub allow_anonymous: bool,
    /// `max_connections`: HTTP connections open at once (apart from
    /// MQTT's); more are closed at accept.
    pub max_connections: usize,
    /// `header_timeout_ms`: a request's headers must arrive within this
    /// of its first byte (the first request's: of the connection).
    pub header_timeout: Duration,
    /// `idle_timeout_ms`: a connection with no byte either way this long
    /// is closed.
    pub idle_timeout: Duration,
}

/// A configured host name (`allowed_hosts`), lower case and without a
/// trailing dot; `None` for an empty entry.
fn host_name(entry: &str) -> Result<Option<String>, ConfigError> {
    let trimmed = entry.trim();
    let name = trimmed.strip_suffix('.').unwrap_or(trimmed);
    if trimmed.is_empty() {
        return Ok(None);
    }
    let valid = !name.is_empty()
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    if !valid {
        return Err(invalid(format!(
            "http.allowed_hosts: `{entry}` is not a host name like broker.example (the name only: no scheme, port, path or wildcard; localhost and IP addresses are always served)"
        )));
    }
    Ok(Some(name.to_ascii_lowercase()))
}

impl HttpOptions {
    /// `[http]`'s bounds and names, checked.
    pub(super) fn resolve(http: &HttpSection) -> Result<HttpOptions, ConfigError> {
        let mut allowed_hosts = Vec::new();
        for entry in &http.allowed_hosts {
            if let Some(name) = host_name(entry)? {
                allowed_hosts.push(name);
            }
        }
        if http.max_connections == 0 {
            return Err(invalid("http.max_connections must be at least 1"));
        }
        for (key, ms) in [
            ("header_timeout_ms", http.header_timeout_ms),
            ("idle_timeout_ms", http.idle_timeout_ms),
        ] {
            if ms == 0 {
                return Err(invalid(format!("http.{key} must be at least 1")));
            }
        }
        Ok(HttpOptions {
            allowed_hosts,
            allow_anonymous: http.allow_anonymous,
            max_connections: http.max_connections,
            header_timeout: Duration::from_millis(http.header_timeout_ms),
            idle_timeout: Duration::from_millis(http.idle_timeout_ms),
        })
    }
}
