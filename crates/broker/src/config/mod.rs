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

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use statestore::persist::PersistPolicy;
use std::time::Duration;

mod clustering;
mod http;
mod listeners;
mod sections;

pub use clustering::ClusteringSettings;
pub use http::HttpOptions;
pub use listeners::{Listener, TlsFiles, Transport};
pub use sections::{
    BrokerSection, ClusteringSection, LogSection, PersistenceSection, QuotaSection, StoreSection,
};
use sections::{KNOWN_SECTIONS, Sections, UNSUPPORTED};

/// Pushes `section.field` for each field of `$a` that differs in `$b`; the
/// pattern names every field, so that a new one cannot be forgotten.
macro_rules! changed_fields {
    ($names:ident, $section:literal, $ty:ident, $a:expr, $b:expr, [$($f:ident),*], reloaded[$($r:ident),*]) => {{
        let $ty { $($f: _,)* $($r: _,)* } = &$a;
        $(
            if $a.$f != $b.$f {
                $names.push(format!("{}.{}", $section, stringify!($f)));
            }
        )*
    }};
}

/// How far ahead of the clock the persisted clock mark runs (see
/// `statestore::persist`): at most one mark write per half of it. After a
/// crash the clock starts at the last mark, up to this far ahead of the
/// versions handed out: short, so that a crash loop does not push versions
/// (fencing tokens) ahead of real time faster than time passes (10 s made
/// eight quick restarts put them 70 s ahead, past the 60 s the clients and
/// the store allow). In `interval` mode at least four intervals, so that
/// a mark is on disk before the clock gets there.
const CLOCK_LEASE_MS: u64 = 1_000;

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
    /// Start even when the data directory has lost data (its journal
    /// deleted or damaged): `--accept-data-loss`, for one start.
    pub accept_data_loss: bool,
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

/// Everything the broker needs, resolved and validated.
#[derive(Debug, Clone)]
pub struct Settings {
    /// rumqttd's router id.
    pub router_id: usize,
    /// `[router]`
    pub router: router::RouterConfig,
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
    /// `[http] allow_edit`: the web view may set and delete keys.
    pub http_allow_edit: bool,
    /// `[http]`: the endpoint's bounds, the names the web view is served
    /// under.
    pub http_options: HttpOptions,
    /// `[log]`: applied by the binary, which owns logging.
    pub log: LogSection,
    /// `[broker] password_file`, resolved; reloaded on SIGHUP.
    pub password_file: Option<PathBuf>,
    /// `[broker] authorization` (the policy file), resolved; reloaded on SIGHUP.
    pub authorization: Option<PathBuf>,
    /// `[faults]`: off unless `enabled` (see [`crate::faults`]).
    pub faults: crate::faults::FaultsSection,
    /// `[clustering]`; `None`: a single node with its own store.
    pub clustering: Option<ClusteringSettings>,
}

/// What a state store request carries besides its key and value, at most
/// in practice: the PUBLISH header, the request topic, a Response Topic
/// of a long client id, Correlation Data, user properties (the SDK's
/// timestamp and invoker id), the RESP framing. An allowance, not a bound.
pub const REQUEST_OVERHEAD: usize = 1024;

impl Settings {
    /// Settings that work but probably not as meant, each a sentence for a
    /// WARN line at start.
    pub fn advisories(&self) -> Vec<String> {
        let value = self.statestore.quota.max_value_size;
        self.listeners
            .iter()
            .filter(|l| l.max_packet_size < value.saturating_add(REQUEST_OVERHEAD))
            .map(|l| {
                format!(
                    "statestore.quota.max_value_size = {value} cannot be reached through listener \
                     {name} ({}): it accepts packets up to {} bytes \
                     ({name}.connections.max_payload_size) and a SET of such a value needs about \
                     {} more; raise max_payload_size or lower max_value_size",
                    l.addr,
                    l.max_packet_size,
                    REQUEST_OVERHEAD,
                    name = l.name,
                )
            })
            .collect()
    }

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
                let template = listener_template(&base);
                for key in ["v4", "v5", "ws"] {
                    base.remove(key);
                    // Each listener of the file over the default's values:
                    // rumqttd's parser wants every field, a file need only
                    // give `listen`.
                    if let Some(toml::Value::Table(sections)) = user.get(key) {
                        let mut defaults = toml::Table::new();
                        for (n, section) in sections {
                            if section.is_table() {
                                let mut filled = template.clone();
                                filled.insert("name".into(), format!("{key}.{n}").into());
                                defaults.insert(n.clone(), filled.into());
                            }
                        }
                        base.insert(key.into(), defaults.into());
                    }
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
                .with_list_parse_key("http.allowed_hosts")
                .with_list_parse_key("clustering.etcd_endpoints")
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
        let rumqttd: router::Config = deserialize(&layered)?;
        let Sections {
            broker,
            statestore,
            persistence: persistence_section,
            http: http_section,
            log,
            faults,
            clustering,
        } = deserialize(&layered)?;
        crate::faults::Faults::new(&faults).map_err(|e| invalid(e.to_string()))?;
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
        let http_options = HttpOptions::resolve(&http_section)?;
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
            accept_data_loss: false,
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
        let clustering = ClusteringSettings::resolve(clustering, statestore.max_clock_skew_ms)?;
        let listeners = listeners::resolve(&rumqttd, &root, listen, base_dir)?;
        let file_setting = |value: &str| {
            let value = value.trim();
            (!value.is_empty()).then(|| base_dir.join(value))
        };
        let password_file = file_setting(&broker.password_file);
        let authorization = file_setting(&broker.authorization);
        Ok(Settings {
            router_id: rumqttd.id,
            router,
            listeners,
            broker,
            statestore,
            persistence,
            persist_policy,
            http,
            http_allow_edit: http_section.allow_edit,
            http_options,
            log,
            password_file,
            authorization,
            faults,
            clustering,
        })
    }

    /// What differs between `self` (running) and `new` (just read) that
    /// only a restart applies, one name per setting, for the reload's
    /// ERROR lines. What a reload applies is left out: `[broker]
    /// password_file` and `authorization`, `[log] level`, and the files of
    /// a TLS listener that stays a TLS listener.
    pub fn needs_restart(&self, new: &Settings) -> Vec<String> {
        fn differs<T: std::fmt::Debug>(a: &T, b: &T) -> bool {
            format!("{a:?}") != format!("{b:?}")
        }
        // Every field named, so that a new one cannot be forgotten here.
        let Settings {
            router_id,
            router,
            listeners,
            broker,
            statestore,
            persistence,
            persist_policy,
            http,
            http_allow_edit,
            http_options,
            log: LogSection { level: _, format },
            password_file: _,
            authorization: _,
            faults,
            clustering,
        } = self;
        let mut names = listeners_needing_restart(listeners, &new.listeners);
        if differs(router, &new.router) || *router_id != new.router_id {
            names.push("[router]".to_owned());
        }
        changed_fields!(
            names,
            "broker",
            BrokerSection,
            broker,
            new.broker,
            [
                max_keep_alive_secs,
                max_session_expiry_secs,
                max_kept_sessions,
                max_retained_messages,
                max_retained_bytes,
                max_unreleased_qos2_bytes,
                max_unreleased_qos2_bytes_total,
                topic_alias_max,
                legacy_2023_topic,
                max_queued_messages,
                max_queued_bytes,
                queue_full,
                allow_session_refuse,
                sys_interval
            ],
            reloaded[password_file, authorization]
        );
        changed_fields!(
            names,
            "statestore",
            StoreSection,
            statestore,
            new.statestore,
            [
                node_id,
                max_clock_skew_ms,
                scan_page_size,
                max_watches_per_client,
                max_watch_bytes_per_client,
                max_watches_per_user,
                max_watch_bytes_per_user,
                max_watches,
                max_watch_bytes,
                quota
            ],
            reloaded[]
        );
        if differs(persistence, &new.persistence) || differs(persist_policy, &new.persist_policy) {
            names.push("[persistence]".to_owned());
        }
        if *faults != new.faults {
            names.push("[faults]".to_owned());
        }
        if *clustering != new.clustering {
            names.push("[clustering]".to_owned());
        }
        if *http != new.http
            || *http_allow_edit != new.http_allow_edit
            || *http_options != new.http_options
        {
            names.push("[http]".to_owned());
        }
        if *format != new.log.format {
            names.push("log.format".to_owned());
        }
        names
    }

    /// The store's configuration.
    pub fn store_config(&self) -> statestore::Config {
        let s = &self.statestore;
        statestore::Config {
            node_id: self
                .clustering
                .as_ref()
                .map_or_else(|| s.node_id.clone(), |c| c.node_id.clone()),
            max_clock_skew_ms: s.max_clock_skew_ms,
            scan_page_size: s.scan_page_size,
            max_watches_per_client: s.max_watches_per_client,
            max_watch_bytes_per_client: s.max_watch_bytes_per_client,
            max_watches_per_user: s.max_watches_per_user,
            max_watch_bytes_per_user: s.max_watch_bytes_per_user,
            max_watches: s.max_watches,
            max_watch_bytes: s.max_watch_bytes,
            quota: statestore::Quota {
                max_keys: s.quota.max_keys,
                max_bytes: s.quota.max_bytes,
                max_key_size: s.quota.max_key_size,
                max_value_size: s.quota.max_value_size,
            },
            persist_policy: self.persist_policy.clone(),
            // A cluster's keys are in etcd, not in the data directory: no
            // clock marks (versions come after every version in etcd).
            clock_lease_ms: self
                .persistence
                .as_ref()
                .filter(|_| self.clustering.is_none())
                .map(|p| match p.mode {
                    Mode::Fsync => CLOCK_LEASE_MS,
                    Mode::Interval(every) => {
                        let every = u64::try_from(every.as_millis()).unwrap_or(u64::MAX);
                        CLOCK_LEASE_MS.max(every.saturating_mul(4))
                    }
                }),
        }
    }
}

/// The listener settings that differ and only a restart applies (by
/// position: the same sections in the same order keep their sockets).
fn listeners_needing_restart(running: &[Listener], new: &[Listener]) -> Vec<String> {
    let same_sections = running.len() == new.len()
        && running
            .iter()
            .zip(new)
            .all(|(a, b)| a.name == b.name && a.addr == b.addr);
    if !same_sections {
        return vec![
            "listeners ([v4.*], [v5.*], [ws.*] added, removed or moved, --listen)".to_owned(),
        ];
    }
    let mut names = Vec::new();
    for (a, b) in running.iter().zip(new) {
        let Listener {
            name,
            addr: _,
            transport,
            tls,
            allow_anonymous,
            connect_timeout_ms,
            max_packet_size,
            receive_maximum,
        } = a;
        let mut differs = |what: bool, key: &str| {
            if what {
                names.push(format!("{name}.{key}"));
            }
        };
        differs(*transport != b.transport, "(transport)");
        differs(
            tls.is_some() != b.tls.is_some(),
            "tls (TLS turned on or off)",
        );
        differs(*allow_anonymous != b.allow_anonymous, "allow_anonymous");
        differs(
            *connect_timeout_ms != b.connect_timeout_ms,
            "connections.connection_timeout_ms",
        );
        differs(
            *max_packet_size != b.max_packet_size,
            "connections.max_payload_size",
        );
        differs(
            *receive_maximum != b.receive_maximum,
            "connections.max_inflight_count",
        );
    }
    names
}

/// The fields of the embedded default's first listener that a listener of
/// a file may leave out (all but `name`, `listen`, `allow_anonymous` and
/// `tls`): `next_connection_delay_ms` and `connections.*`.
fn listener_template(base: &toml::Table) -> toml::Table {
    let mut template = base
        .get("v5")
        .and_then(|v| v.get("1"))
        .and_then(toml::Value::as_table)
        .cloned()
        .expect("the embedded default has [v5.1]");
    for own in ["name", "listen", "allow_anonymous", "tls"] {
        template.remove(own);
    }
    template
}

#[cfg(test)]
mod tests;
