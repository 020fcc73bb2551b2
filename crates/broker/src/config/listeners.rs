//! Listeners: rumqttd's `[v4.N]`, `[v5.N]` and `[ws.N]` sections, with their
//! `tls` tables, resolved into [`Listener`]s.
//!
//! ```toml
//! [v5.2]
//! name = "mqtts"
//! listen = "0.0.0.0:8883"
//! allow_anonymous = false        # statebroker's; default: true on loopback only
//!   [v5.2.tls]
//!   certpath = "server.pem"      # the chain, leaf first (PEM)
//!   keypath = "server.key"       # its key (PEM: PKCS#8, PKCS#1 or SEC1)
//!   capath = "clients-ca.pem"    # optional: require client certificates
//! ```

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{ConfigError, invalid};

/// How MQTT packets travel on a listener's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// MQTT straight over TCP (or TLS).
    Tcp,
    /// MQTT in binary WebSocket messages (subprotocol `mqtt`), over TCP or TLS.
    WebSocket,
}

/// The files of a TLS listener (paths resolved against the config's directory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain, PEM, leaf first.
    pub cert: PathBuf,
    /// The private key, PEM.
    pub key: PathBuf,
    /// CA certificates (PEM) that client certificates must be signed by;
    /// with it, a client without such a certificate is refused.
    pub ca: Option<PathBuf>,
}

/// One address the broker listens on.
#[derive(Debug, Clone)]
pub struct Listener {
    /// The section name (`v5.1`).
    pub name: String,
    /// The address.
    pub addr: SocketAddr,
    /// TCP or WebSocket.
    pub transport: Transport,
    /// TLS, if the section has a `tls` table.
    pub tls: Option<TlsFiles>,
    /// Whether clients without a username (nor a client certificate) may
    /// connect: `allow_anonymous` in the section, else true only on a
    /// loopback address.
    pub allow_anonymous: bool,
    /// Time a new socket has to send CONNECT, milliseconds.
    pub connect_timeout_ms: u64,
    /// Largest packet accepted, bytes.
    pub max_packet_size: usize,
    /// Receive Maximum announced to MQTT 5 clients.
    pub receive_maximum: u16,
}

impl Listener {
    /// `mqtt`, `mqtts`, `ws` or `wss`: for logs.
    pub fn scheme(&self) -> &'static str {
        match (self.transport, self.tls.is_some()) {
            (Transport::Tcp, false) => "mqtt",
            (Transport::Tcp, true) => "mqtts",
            (Transport::WebSocket, false) => "ws",
            (Transport::WebSocket, true) => "wss",
        }
    }
}

/// statebroker's own keys in a listener section (rumqttd's parser ignores them).
#[derive(Deserialize, Default)]
struct Extra {
    allow_anonymous: Option<bool>,
}

/// A listener before `--listen` and the anonymous default apply.
struct Resolved {
    listener: Listener,
    allow_anonymous: Option<bool>,
}

/// Resolves the listener sections; `listen` (from `--listen`) replaces them
/// with the first one's settings on each address.
pub(super) fn resolve(
    rumqttd: &router::Config,
    root: &HashMap<String, config::Value>,
    listen: &[SocketAddr],
    base_dir: &Path,
) -> Result<Vec<Listener>, ConfigError> {
    let mut resolved = Vec::new();
    for (version, servers, transport) in [
        ("v4", &rumqttd.v4, Transport::Tcp),
        ("v5", &rumqttd.v5, Transport::Tcp),
        ("ws", &rumqttd.ws, Transport::WebSocket),
    ] {
        let extras: HashMap<String, Extra> = match root.get(version) {
            Some(value) => value
                .clone()
                .try_deserialize()
                .map_err(|e| invalid(format!("{version}: {e}")))?,
            None => HashMap::new(),
        };
        let sorted: BTreeMap<_, _> = servers.iter().flatten().collect();
        for (key, server) in sorted {
            let name = format!("{version}.{key}");
            let listener = one(&name, server, transport, base_dir)?;
            resolved.push(Resolved {
                listener,
                allow_anonymous: extras.get(key).and_then(|e| e.allow_anonymous),
            });
        }
    }
    if !listen.is_empty() {
        let Some(first) = resolved.into_iter().next() else {
            return Err(invalid("no listener to apply --listen to"));
        };
        resolved = listen
            .iter()
            .map(|&addr| Resolved {
                listener: Listener {
                    addr,
                    ..first.listener.clone()
                },
                allow_anonymous: first.allow_anonymous,
            })
            .collect();
    }
    // One socket per address: v4 and v5 sections on one port are one listener.
    let mut seen = std::collections::HashSet::new();
    resolved.retain(|r| seen.insert(r.listener.addr));
    if resolved.is_empty() {
        return Err(invalid(
            "no listener configured: add a [v5.1] section with `listen`",
        ));
    }
    Ok(resolved
        .into_iter()
        .map(|r| Listener {
            allow_anonymous: r
                .allow_anonymous
                .unwrap_or_else(|| r.listener.addr.ip().is_loopback()),
            ..r.listener
        })
        .collect())
}

fn one(
    name: &str,
    server: &router::ServerSettings,
    transport: Transport,
    base_dir: &Path,
) -> Result<Listener, ConfigError> {
    let c = &server.connections;
    if c.max_payload_size == 0 {
        return Err(invalid(format!(
            "{name}.connections.max_payload_size must be at least 1"
        )));
    }
    if c.connection_timeout_ms == 0 {
        return Err(invalid(format!(
            "{name}.connections.connection_timeout_ms must be at least 1"
        )));
    }
    if c.auth.is_some() {
        return Err(invalid(format!(
            "{name}.connections.auth: passwords in plain text are not accepted; \
             write them hashed with `statebroker passwd FILE USER` and set \
             [broker] password_file = \"FILE\""
        )));
    }
    let tls = match &server.tls {
        None => None,
        Some(router::TlsConfig::Rustls {
            capath,
            certpath,
            keypath,
        }) => Some(TlsFiles {
            cert: base_dir.join(certpath),
            key: base_dir.join(keypath),
            ca: capath.as_ref().map(|ca| base_dir.join(ca)),
        }),
        Some(router::TlsConfig::NativeTls { .. }) => {
            return Err(invalid(format!(
                "{name}.tls: PKCS#12 (pkcs12path) is not supported; give PEM files as certpath, keypath and, for client certificates, capath"
            )));
        }
    };
    Ok(Listener {
        name: name.to_owned(),
        addr: server.listen,
        transport,
        tls,
        allow_anonymous: false,
        connect_timeout_ms: u64::from(c.connection_timeout_ms),
        max_packet_size: c.max_payload_size,
        receive_maximum: u16::try_from(c.max_inflight_count.clamp(1, 65535)).unwrap_or(u16::MAX),
    })
}
