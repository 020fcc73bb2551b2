//! Which `Host` (and `Origin`) the web view answers: the defence against
//! DNS rebinding. A page of `http://evil.example:9883/` whose name is made
//! to resolve to 127.0.0.1 reaches the endpoint as same-origin, but its
//! requests still say `Host: evil.example:9883`; refusing names the
//! endpoint does not serve under keeps them away from the keys.
//!
//! Served: `localhost` and names ending in `.localhost` (RFC 6761: they
//! never leave the machine), any IP literal (`127.0.0.1`, `[::1]`; a
//! rebinding page cannot make its browser send one), and the names of
//! `[http] allowed_hosts`; each with or without a port, compared without
//! regard to case or a trailing dot.

use std::net::{Ipv4Addr, Ipv6Addr};

/// The names (beyond `localhost` and IP literals) the view is served
/// under, as [`crate::config::Settings`] normalized them (lower case, no
/// trailing dot).
#[derive(Debug, Clone, Default)]
pub(crate) struct AllowedHosts {
    names: Vec<String>,
}

/// The host part of a `Host` header or an origin.
#[derive(Debug, PartialEq, Eq)]
enum Host {
    Ip,
    /// Lower case, without a trailing dot.
    Name(String),
}

impl AllowedHosts {
    pub(crate) fn new(names: &[String]) -> AllowedHosts {
        AllowedHosts {
            names: names.to_vec(),
        }
    }

    /// Whether a `Host` header value (`name[:port]`, `v4[:port]`,
    /// `[v6][:port]`) is one the endpoint serves.
    pub(crate) fn allows_host(&self, value: &str) -> bool {
        parse_authority(value).is_some_and(|host| self.serves(&host))
    }

    /// Whether an `Origin` header value (`scheme://host[:port]`) names a
    /// host the endpoint serves; `null` (an opaque origin) does not.
    pub(crate) fn allows_origin(&self, value: &str) -> bool {
        let Some((scheme, authority)) = value.trim().split_once("://") else {
            return false;
        };
        let scheme_ok = !scheme.is_empty()
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
        // An origin is scheme, host and port only: no path, no user.
        scheme_ok && !authority.contains(['/', '@', '?', '#']) && self.allows_host(authority)
    }

    fn serves(&self, host: &Host) -> bool {
        match host {
            Host::Ip => true,
            Host::Name(name) => {
                name == "localhost"
                    || name.ends_with(".localhost")
                    || self.names.iter().any(|n| n == name)
            }
        }
    }
}

/// `host[:port]` as HTTP sends it (RFC 9110 7.2): `None` when it is not
/// one (empty, a bad port, an IPv6 address without brackets, a zone id).
fn parse_authority(value: &str) -> Option<Host> {
    let value = value.trim();
    if let Some(rest) = value.strip_prefix('[') {
        let (inside, after) = rest.split_once(']')?;
        inside.parse::<Ipv6Addr>().ok()?;
        return (after.is_empty() || port(after.strip_prefix(':')?)).then_some(Host::Ip);
    }
    let host = match value.rsplit_once(':') {
        Some((host, p)) if port(p) => host,
        Some(_) => return None,
        None => value,
    };
    let host = host.strip_suffix('.').unwrap_or(host);
    if host.is_empty() || host.contains([':', '[', ']', '@', '/', ' ']) {
        return None;
    }
    if host.parse::<Ipv4Addr>().is_ok() {
        return Some(Host::Ip);
    }
    Some(Host::Name(host.to_ascii_lowercase()))
}

/// A port: 1 to 5 digits (`host:` with nothing after is not one).
fn port(text: &str) -> bool {
    (1..=5).contains(&text.len()) && text.bytes().all(|b| b.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(names: &[&str]) -> AllowedHosts {
        AllowedHosts::new(&names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn host_headers_are_split_into_host_and_port() {
        let name = |n: &str| Some(Host::Name(n.into()));
        assert_eq!(parse_authority("localhost"), name("localhost"));
        assert_eq!(parse_authority("LocalHost:9883"), name("localhost"));
        assert_eq!(parse_authority("localhost.:9883"), name("localhost"));
        assert_eq!(parse_authority(" broker.example "), name("broker.example"));
        assert_eq!(parse_authority("127.0.0.1"), Some(Host::Ip));
        assert_eq!(parse_authority("127.0.0.1:9883"), Some(Host::Ip));
        assert_eq!(parse_authority("[::1]"), Some(Host::Ip));
        assert_eq!(parse_authority("[::1]:9883"), Some(Host::Ip));
        assert_eq!(parse_authority("[fe80::1%25eth0]:1"), None);
        assert_eq!(parse_authority("::1"), None, "IPv6 needs brackets");
        assert_eq!(parse_authority("[::1]x"), None);
        assert_eq!(parse_authority("[::1]:"), None);
        assert_eq!(parse_authority("[not-ip]:80"), None);
        assert_eq!(parse_authority("localhost:"), None);
        assert_eq!(parse_authority("localhost:http"), None);
        assert_eq!(parse_authority("localhost:123456"), None);
        assert_eq!(parse_authority(""), None);
        assert_eq!(parse_authority(":80"), None);
        assert_eq!(parse_authority("."), None);
        assert_eq!(parse_authority("user@localhost"), None);
        // Not an IP literal: a name, served only if configured.
        assert_eq!(parse_authority("2130706433"), name("2130706433"));
        assert_eq!(
            parse_authority("127.0.0.1.evil.example"),
            name("127.0.0.1.evil.example")
        );
    }

    #[test]
    fn the_view_serves_localhost_ip_literals_and_configured_names() {
        let none = hosts(&[]);
        for ok in [
            "localhost",
            "localhost:9883",
            "LOCALHOST.",
            "view.localhost:80",
            "127.0.0.1:9883",
            "10.1.2.3",
            "[::1]:9883",
            "[2001:db8::7]",
        ] {
            assert!(none.allows_host(ok), "{ok}");
        }
        for refused in [
            "evil.example",
            "evil.example:9883",
            "localhost.evil.example",
            "evillocalhost",
            "127.0.0.1.nip.io",
            "",
            "::1",
        ] {
            assert!(!none.allows_host(refused), "{refused}");
        }
        let some = hosts(&["broker.example"]);
        assert!(some.allows_host("broker.example:9883"));
        assert!(some.allows_host("Broker.Example."));
        assert!(!some.allows_host("sub.broker.example"));
        assert!(!some.allows_host("broker.example.evil"));
    }

    #[test]
    fn origins_name_a_served_host() {
        let some = hosts(&["broker.example"]);
        for ok in [
            "http://localhost:9883",
            "http://127.0.0.1:9883",
            "https://[::1]",
            "http://broker.example",
            "HTTPS://BROKER.EXAMPLE:443",
        ] {
            assert!(some.allows_origin(ok), "{ok}");
        }
        for refused in [
            "null",
            "",
            "http://evil.example",
            "http://evil.example:9883",
            "localhost:9883",
            "://localhost",
            "http://localhost/path",
            "http://user@localhost",
            "file://",
        ] {
            assert!(!some.allows_origin(refused), "{refused}");
        }
    }
}
