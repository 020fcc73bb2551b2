//! Configuration: rumqttd's own `rumqttd.toml` format plus statebroker's
//! sections (`[broker]`, `[statestore]`), layered with the `config` crate.
//!
//! Layers, lowest first:
//! 1. the embedded default (the repository's `rumqttd.toml`);
//! 2. the `--config` file, if any: it only needs what it changes, and if it
//!    defines any listener (`[v4.*]`, `[v5.*]`) those replace the default one;
//! 3. environment variables `STATEBROKER__<SECTION>__<KEY>`;
//! 4. `--listen ADDR` (once or more), which replaces the listeners with the
//!    first one's settings on each address given.
//!
//! Every problem is reported at start, naming the field.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use statestore::persist::PersistPolicy;
use std::time::Duration;

mod sections;

pub use sections::{BrokerSection, LogSection, PersistenceSection, QuotaSection, StoreSection};
use sections::{KNOWN_SECTIONS, Sections, UNSUPPORTED};

/// How far ahead of the clock the persisted clock mark runs (see
/// `statestore::persist`): at most one mark write per half of it.
const CLOCK_LEASE_MS: u64 = 10_000;

/// The embedded default configuration.
pub const DEFAULT_CONFIG: &str = include_str!("../../../../rumqttd.toml");

/// Environment variable prefix for overrides.
pub const ENV_PREFIX: &str = "STATEBROKER";

/// When a write counts as durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// fsync before acknowledging (grouped).
    Fsync,
    /// fsync at this interval; acknowledge once written to the journal.
    Interval(Duration),
}

/// Where and how to persist.
#[derive(Debug, Clone)]
pub struct PersistenceSettings {
    /// The data directory.
    pub data_dir: PathBuf,
    /// The durability mode.
    pub mode: Mode,
}

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read or is not TOML.
    #[error("cannot read config file {path}: {message}")]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A field is missing, has the wrong type, or is unknown.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

fn invalid(message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid(message.into())
}

/// Deserializes the layered configuration, naming the full path of a bad field.
fn deserialize<T: serde::de::DeserializeOwned>(layered: &config::Config) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(layered.clone()).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        if path == "." || inner.contains(&format!("`{path}`")) {
            invalid(inner)
        } else {
            invalid(format!("{path}: {inner}"))
        }
    })
}

/// One address the broker listens on.
#[derive(Debug, Clone)]
pub struct Listener {
    /// The section name (`v5.1`).
    pub name: String,
    /// The address.
    pub addr: SocketAddr,
    /// Time a new socket has to send CONNECT, milliseconds.
    pub connect_timeout_ms: u64,
    /// Largest packet accepted, bytes.
    pub max_packet_size: usize,
    /// Receive Maximum announced to MQTT 5 clients.
    pub receive_maximum: u16,
    /// username -> password; `None` for no authentication.
    pub auth: Option<HashMap<String, String>>,
}

/// Everything the broker needs, resolved and validated.
#[derive(Debug, Clone)]
pub struct Settings {
    /// rumqttd's router id.
    pub router_id: usize,
    /// `[router]`
    pub router: rumqttd::RouterConfig,
    /// The listeners, at least one.
    pub listeners: Vec<Listener>,
    /// `[broker]`
    pub broker: BrokerSection,
    /// `[statestore]`
    pub statestore: StoreSection,
    /// Where and how to persist; `None`: memory only.
    pub persistence: Option<PersistenceSettings>,
    /// Keys persisted by configuration.
    pub persist_policy: PersistPolicy,
    /// Where the HTTP endpoint (metrics, health) listens; `None`: nowhere.
    pub http: Option<SocketAddr>,
    /// `[log]`: applied by the binary, which owns logging.
    pub log: LogSection,
}

impl Settings {
    /// The embedded default, listening on `addr` only and keeping
    /// everything in memory (no data directory): for tests and tools.
    pub fn listening_on(addr: SocketAddr) -> Settings {
        let mut settings = Settings::load_with_env(None, &[addr], std::iter::empty())
            .expect("the embedded default configuration is valid");
        settings.persistence = None;
        settings.http = None;
        settings
    }

    /// Loads the layers described in the module docs.
    pub fn load(file: Option<&Path>, listen: &[SocketAddr]) -> Result<Settings, ConfigError> {
        Settings::load_with_env(file, listen, std::env::vars())
    }

    /// [`Settings::load`] with the environment given explicitly.
    pub fn load_with_env(
        file: Option<&Path>,
        listen: &[SocketAddr],
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Settings, ConfigError> {
        let base_dir = match file.and_then(Path::parent) {
            Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
            _ => PathBuf::from("."),
        };
        let mut base: toml::Table = DEFAULT_CONFIG.parse().expect("embedded default is TOML");
        let mut builder = config::Config::builder();
        if let Some(path) = file {
            let file_error = |message: String| ConfigError::File {
                path: path.to_owned(),
                message,
            };
            let text = std::fs::read_to_string(path).map_err(|e| file_error(e.to_string()))?;
            let user: toml::Table = text
                .parse()
                .map_err(|e: toml::de::Error| file_error(e.to_string()))?;
            if ["v4", "v5", "ws"].iter().any(|k| user.contains_key(*k)) {
                for key in ["v4", "v5", "ws"] {
                    base.remove(key);
                }
            }
            builder = builder
                .add_source(config::File::from_str(
                    &base.to_string(),
                    config::FileFormat::Toml,
                ))
                .add_source(config::File::from_str(&text, config::FileFormat::Toml));
        } else {
            builder = builder.add_source(config::File::from_str(
                DEFAULT_CONFIG,
                config::FileFormat::Toml,
            ));
        }
        let env: HashMap<String, String> = env
            .into_iter()
            .filter(|(k, _)| k.starts_with(&format!("{ENV_PREFIX}__")))
            .collect();
        builder = builder.add_source(
            config::Environment::with_prefix(ENV_PREFIX)
                .prefix_separator("__")
                .separator("__")
                .try_parsing(true)
                .list_separator(",")
                .with_list_parse_key("persistence.keys")
                .source(Some(env)),
        );
        let layered = builder.build().map_err(|e| invalid(e.to_string()))?;
        Settings::resolve(layered, listen, &base_dir)
    }

    fn resolve(
        layered: config::Config,
        listen: &[SocketAddr],
        base_dir: &Path,
    ) -> Result<Settings, ConfigError> {
        let root: HashMap<String, config::Value> = layered
            .clone()
            .try_deserialize()
            .map_err(|e| invalid(e.to_string()))?;
        let mut unknown: Vec<&String> = root
            .keys()
            .filter(|k| !KNOWN_SECTIONS.contains(&k.as_str()))
            .collect();
        unknown.sort();
        if let Some(key) = unknown.first() {
            return Err(invalid(format!(
                "unknown section or key `{key}` (known: {})",
                KNOWN_SECTIONS.join(", ")
            )));
        }
        let mut unsupported: Vec<_> = UNSUPPORTED
            .iter()
            .filter(|(section, _)| root.contains_key(*section))
            .collect();
        unsupported.sort();
        if let Some((section, why)) = unsupported.first() {
            return Err(invalid(format!("[{section}]: {why}")));
        }
        let rumqttd: rumqttd::Config = deserialize(&layered)?;
        let Sections {
            broker,
            statestore,
            persistence: persistence_section,
            http: http_section,
            log,
        } = deserialize(&layered)?;
        if !matches!(log.format.as_str(), "text" | "json") {
            return Err(invalid(format!(
                "log.format: `{}` is neither `text` nor `json`",
                log.format
            )));
        }
        let http = match http_section.listen.trim() {
            "" => None,
            addr => Some(addr.parse::<SocketAddr>().map_err(|e| {
                invalid(format!(
                    "http.listen: `{addr}` is not an address like 127.0.0.1:9883 ({e}); use \"\" to turn the endpoint off"
                ))
            })?),
        };
        let persist_policy = PersistPolicy::parse(&persistence_section.keys)
            .map_err(|e| invalid(format!("persistence.keys: {e}")))?;
        let mode = match persistence_section.mode.as_str() {
            "fsync" => Mode::Fsync,
            "interval" if persistence_section.interval_ms > 0 => {
                Mode::Interval(Duration::from_millis(persistence_section.interval_ms))
            }
            "interval" => return Err(invalid("persistence.interval_ms must be at least 1")),
            other => {
                return Err(invalid(format!(
                    "persistence.mode: `{other}` is neither `fsync` nor `interval`"
                )));
            }
        };
        let persistence = (!persistence_section.data_dir.is_empty()).then(|| PersistenceSettings {
            data_dir: base_dir.join(&persistence_section.data_dir),
            mode,
        });

        let router = rumqttd.router.clone();
        if router.max_connections == 0 {
            return Err(invalid("router.max_connections must be at least 1"));
        }
        if router.max_segment_size < 1024 {
            return Err(invalid(
                "router.max_segment_size must be at least 1024 (bytes)",
            ));
        }
        if router.max_segment_count < 1 {
            return Err(invalid("router.max_segment_count must be at least 1"));
        }
        if router.max_outgoing_packet_count == 0 {
            return Err(invalid(
                "router.max_outgoing_packet_count must be at least 1",
            ));
        }
        if statestore.scan_page_size == 0 {
            return Err(invalid("statestore.scan_page_size must be at least 1"));
        }
        if statestore.node_id.is_empty() || statestore.node_id.contains(':') {
            return Err(invalid(
                "statestore.node_id must be non-empty and without ':'",
            ));
        }
        let mut listeners = Vec::new();
        for (version, servers) in [("v4", &rumqttd.v4), ("v5", &rumqttd.v5)] {
            let sorted: BTreeMap<_, _> = servers.iter().flatten().collect();
            for (key, server) in sorted {
                let name = format!("{version}.{key}");
                if server.tls.is_some() {
                    return Err(invalid(format!(
                        "{name}.tls: TLS listeners are not supported yet"
                    )));
                }
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
                listeners.push(Listener {
                    name,
                    addr: server.listen,
                    connect_timeout_ms: u64::from(c.connection_timeout_ms),
                    max_packet_size: c.max_payload_size,
                    receive_maximum: u16::try_from(c.max_inflight_count.clamp(1, 65535))
                        .unwrap_or(u16::MAX),
                    auth: c.auth.clone(),
                });
            }
        }
        if !listen.is_empty() {
            let Some(first) = listeners.first().cloned() else {
                return Err(invalid("no listener to apply --listen to"));
            };
            listeners = listen
                .iter()
                .map(|&addr| Listener {
                    addr,
                    ..first.clone()
                })
                .collect();
        }
        // One socket per address: v4 and v5 sections on one port are one listener.
        let mut seen = std::collections::HashSet::new();
        listeners.retain(|l| seen.insert(l.addr));
        if listeners.is_empty() {
            return Err(invalid(
                "no listener configured: add a [v5.1] section with `listen`",
            ));
        }
        Ok(Settings {
            router_id: rumqttd.id,
            router,
            listeners,
            broker,
            statestore,
            persistence,
            persist_policy,
            http,
            log,
        })
    }

    /// What differs between `self` (running) and `new` (just read) that
    /// only a restart applies: named for the reload log line.
    pub fn needs_restart(&self, new: &Settings) -> Vec<&'static str> {
        fn differs<T: std::fmt::Debug>(a: &T, b: &T) -> bool {
            format!("{a:?}") != format!("{b:?}")
        }
        let mut names = Vec::new();
        if differs(&self.listeners, &new.listeners) {
            names.push("listeners ([v4.*], [v5.*], --listen)");
        }
        if differs(&self.router, &new.router) || self.router_id != new.router_id {
            names.push("[router]");
        }
        if self.broker != new.broker {
            names.push("[broker]");
        }
        if self.statestore != new.statestore {
            names.push("[statestore]");
        }
        if differs(&self.persistence, &new.persistence)
            || differs(&self.persist_policy, &new.persist_policy)
        {
            names.push("[persistence]");
        }
        if self.http != new.http {
            names.push("[http]");
        }
        if self.log.format != new.log.format {
            names.push("log.format");
        }
        names
    }

    /// The store's configuration.
    pub fn store_config(&self) -> statestore::Config {
        let s = &self.statestore;
        statestore::Config {
            node_id: s.node_id.clone(),
            max_clock_skew_ms: s.max_clock_skew_ms,
            scan_page_size: s.scan_page_size,
            max_watches_per_client: s.max_watches_per_client,
            max_watch_bytes_per_client: s.max_watch_bytes_per_client,
            max_watches: s.max_watches,
            max_watch_bytes: s.max_watch_bytes,
            quota: statestore::Quota {
                max_keys: s.quota.max_keys,
                max_bytes: s.quota.max_bytes,
                max_key_size: s.quota.max_key_size,
                max_value_size: s.quota.max_value_size,
            },
            persist_policy: self.persist_policy.clone(),
            clock_lease_ms: self.persistence.as_ref().map(|_| CLOCK_LEASE_MS),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn no_env() -> Vec<(String, String)> {
        Vec::new()
    }

    fn file(text: &str) -> tempfile::TempPath {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f.into_temp_path()
    }

    #[test]
    fn embedded_default() {
        let s = Settings::load_with_env(None, &[], no_env()).unwrap();
        assert_eq!(s.listeners.len(), 1);
        assert_eq!(s.listeners[0].addr, "0.0.0.0:1883".parse().unwrap());
        assert_eq!(s.statestore.node_id, "statebroker");
        assert!(s.broker.legacy_2023_topic);
        assert_eq!(s.store_config().scan_page_size, 100);
        let p = s.persistence.unwrap();
        assert_eq!(p.data_dir, Path::new("./statebroker-data"));
        assert_eq!(p.mode, Mode::Fsync);
    }

    #[test]
    fn persistence_settings() {
        let f = file("[persistence]\nmode = \"interval\"\ninterval_ms = 50\nkeys = [\"all\"]\n");
        let s = Settings::load_with_env(Some(&f), &[], no_env()).unwrap();
        let p = s.persistence.clone().unwrap();
        assert_eq!(p.mode, Mode::Interval(Duration::from_millis(50)));
        assert_eq!(
            p.data_dir,
            f.parent().unwrap().join("statebroker-data"),
            "next to the config"
        );
        assert!(s.persist_policy.persists(b"anything"));
        let env = vec![(
            "STATEBROKER__PERSISTENCE__KEYS".to_owned(),
            "exact:a,glob:b*".to_owned(),
        )];
        let s = Settings::load_with_env(None, &[], env).unwrap();
        assert!(s.persist_policy.persists(b"a") && s.persist_policy.persists(b"bee"));
        assert!(!s.persist_policy.persists(b"c"));
        let f = file("[persistence]\ndata_dir = \"\"\n");
        assert!(
            Settings::load_with_env(Some(&f), &[], no_env())
                .unwrap()
                .persistence
                .is_none()
        );
        assert!(
            Settings::listening_on("127.0.0.1:0".parse().unwrap())
                .persistence
                .is_none()
        );
        let e = error_of("[persistence]\nmode = \"sometimes\"\n");
        assert!(e.contains("persistence.mode"), "{e}");
        let e = error_of("[persistence]\nkeys = [\"regex:x\"]\n");
        assert!(e.contains("persistence.keys"), "{e}");
    }

    #[test]
    fn listen_override() {
        let addr = "127.0.0.1:0".parse().unwrap();
        let s = Settings::load_with_env(None, &[addr], no_env()).unwrap();
        assert_eq!(s.listeners[0].addr, addr);
        let two: [SocketAddr; 2] = [
            "127.0.0.1:7001".parse().unwrap(),
            "[::1]:7002".parse().unwrap(),
        ];
        let s = Settings::load_with_env(None, &two, no_env()).unwrap();
        let addrs: Vec<SocketAddr> = s.listeners.iter().map(|l| l.addr).collect();
        assert_eq!(addrs, two, "one listener per --listen");
        assert!(s.listeners.iter().all(|l| l.max_packet_size == 1_048_576));
    }

    #[test]
    fn a_reload_names_what_needs_a_restart() {
        // Files in one directory: the data directory is relative to it.
        let f = file("");
        let running = Settings::load_with_env(Some(&f), &[], no_env()).unwrap();
        let f = file("[log]\nlevel = \"debug\"\n");
        let new = Settings::load_with_env(Some(&f), &[], no_env()).unwrap();
        assert_eq!(new.log.level, "debug");
        assert!(running.needs_restart(&new).is_empty(), "the level reloads");
        let f = file("[statestore]\nnode_id = \"other\"\n[http]\nlisten = \"\"\n");
        let new = Settings::load_with_env(Some(&f), &[], no_env()).unwrap();
        assert_eq!(running.needs_restart(&new), vec!["[statestore]", "[http]"]);
        let e = error_of("[log]\nformat = \"xml\"\n");
        assert!(e.contains("log.format"), "{e}");
    }

    #[test]
    fn a_file_changes_only_what_it_names() {
        let f = file("[statestore]\nnode_id = \"edge-7\"\n");
        let s = Settings::load_with_env(Some(&f), &[], no_env()).unwrap();
        assert_eq!(s.statestore.node_id, "edge-7");
        assert_eq!(s.statestore.max_clock_skew_ms, 60_000);
        assert_eq!(s.listeners[0].addr, "0.0.0.0:1883".parse().unwrap());
    }

    #[test]
    fn file_listeners_replace_the_default() {
        let f = file(
            "[v4.1]\nname = \"a\"\nlisten = \"127.0.0.1:2883\"\nnext_connection_delay_ms = 0\n\
             [v4.1.connections]\nconnection_timeout_ms = 100\nmax_payload_size = 5000\nmax_inflight_count = 10\n",
        );
        let s = Settings::load_with_env(Some(&f), &[], no_env()).unwrap();
        assert_eq!(s.listeners.len(), 1);
        assert_eq!(s.listeners[0].addr, "127.0.0.1:2883".parse().unwrap());
        assert_eq!(s.listeners[0].max_packet_size, 5000);
    }

    #[test]
    fn environment_overrides() {
        let env = vec![
            (
                "STATEBROKER__STATESTORE__NODE_ID".to_owned(),
                "from-env".to_owned(),
            ),
            (
                "STATEBROKER__ROUTER__MAX_CONNECTIONS".to_owned(),
                "7".to_owned(),
            ),
            ("UNRELATED".to_owned(), "x".to_owned()),
        ];
        let s = Settings::load_with_env(None, &[], env).unwrap();
        assert_eq!(s.statestore.node_id, "from-env");
        assert_eq!(s.router.max_connections, 7);
    }

    fn error_of(text: &str) -> String {
        let f = file(text);
        Settings::load_with_env(Some(&f), &[], no_env())
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn errors_name_the_field() {
        let e = error_of("[statestore]\nnode_id = 5\nmax_clock_skew_ms = \"soon\"\n");
        assert!(e.contains("max_clock_skew_ms"), "{e}");
        let e = error_of("[statestore]\nnode_idd = \"x\"\n");
        assert!(e.contains("node_idd"), "{e}");
        let e = error_of("[statstore]\nnode_id = \"x\"\n");
        assert!(e.contains("unknown section or key `statstore`"), "{e}");
        let e = error_of("[statestore.quota]\nmax_keys = \"many\"\n");
        assert!(e.contains("statestore.quota.max_keys"), "{e}");
        let e = error_of("[router]\nmax_segment_size = 10\n");
        assert!(e.contains("router.max_segment_size"), "{e}");
        let e = error_of("[v5.1]\nlisten = \"not an address\"\n");
        assert!(e.contains("listen") || e.contains("v5"), "{e}");
        let e = error_of("[broker]\ntopic_alias_max = -1\n");
        assert!(e.contains("topic_alias_max"), "{e}");
        let e = error_of("this is = not toml [");
        assert!(e.contains("cannot read config file"), "{e}");
        let missing =
            Settings::load_with_env(Some(Path::new("/nonexistent/x.toml")), &[], no_env());
        assert!(
            missing
                .unwrap_err()
                .to_string()
                .contains("/nonexistent/x.toml")
        );
    }

    #[test]
    fn unimplemented_sections_are_refused_not_ignored() {
        for (text, section) in [
            ("[prometheus]\nport = 9042\n", "[prometheus]"),
            ("[metrics.alerts]\npush_interval = 1\n", "[metrics]"),
            ("[console]\nlisten = \"127.0.0.1:3030\"\n", "[console]"),
            (
                "[ws.1]\nname = \"ws\"\nlisten = \"127.0.0.1:8083\"\n",
                "[ws]",
            ),
            ("[bridge]\nname = \"b\"\n", "[bridge]"),
        ] {
            let e = error_of(text);
            assert!(e.contains(section), "{text}: {e}");
            assert!(e.contains("not"), "{text}: {e}");
        }
    }
}
