//! Logging of the binary: a `tracing` subscriber writing text or JSON lines
//! to stderr, whose filter a SIGHUP can change.
//!
//! The filter is `[log] level` from the configuration unless the RUST_LOG
//! environment variable is set, which then wins (at start and at reloads).
//! Either way the targets of [`QUIET`] keep their own level unless the
//! filter names them: `info` or `debug` alone does not bring the storage
//! engine's recovery notes or the router's line per packet.

use std::io::IsTerminal;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Registry, fmt, reload};

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Human-readable lines (coloured on a terminal).
    Text,
    /// One JSON object per line: timestamp, level, target, fields, spans.
    Json,
}

impl Format {
    /// The configuration's `log.format` (already validated).
    pub fn from_config(name: &str) -> Format {
        if name == "json" {
            Format::Json
        } else {
            Format::Text
        }
    }
}

/// The installed subscriber's filter, for reloads.
pub struct Logging {
    handle: reload::Handle<EnvFilter, Registry>,
    from_env: bool,
    /// The `[log] level` in force (or last asked for, with RUST_LOG set).
    level: std::sync::Mutex<String>,
}

/// What a reload's `[log] level` means, checked before anything applies.
pub enum Level {
    /// The same as before.
    Same,
    /// Another filter, to apply.
    New(String, Box<EnvFilter>),
    /// Another level, but RUST_LOG is set and wins over it: not applied.
    Overridden,
}

/// Targets that a filter leaves at these levels unless it names them (or,
/// for the last, a target it belongs to):
/// - `router`: rumqttd's router logs a line per connection and per packet
///   at INFO (name it, e.g. `info,router=debug`, to see them);
/// - `lsm_tree`, `fjall`: the storage engine logs its recovery at INFO (13
///   lines at every restart);
/// - but `fjall::journal::batch_reader` says at DEBUG when it cut a torn
///   journal tail after a crash: kept.
const QUIET: &[(&str, &str)] = &[
    ("router", "warn"),
    ("lsm_tree", "warn"),
    ("fjall", "warn"),
    ("fjall::journal::batch_reader", "debug"),
];

/// The target a directive names (`None`: a bare level, for every target).
fn directive_target(directive: &str) -> Option<&str> {
    let (target, _) = directive.split_once('=')?;
    let target = target.split('[').next().unwrap_or("").trim();
    (!target.is_empty()).then_some(target)
}

/// `level` with the directives of [`QUIET`] that it does not override.
fn with_quiet_targets(level: &str) -> String {
    let named: Vec<&str> = level.split(',').filter_map(directive_target).collect();
    let mut filter = level.trim().to_owned();
    for (target, quiet) in QUIET {
        let overridden = named.iter().any(|n| {
            n == target
                || target
                    .strip_prefix(n)
                    .is_some_and(|rest| rest.starts_with("::"))
        });
        if !overridden {
            if !filter.is_empty() {
                filter.push(',');
            }
            filter.push_str(&format!("{target}={quiet}"));
        }
    }
    filter
}

/// Parses a filter, naming where it came from in the error.
fn filter(level: &str, source: &str) -> Result<EnvFilter, String> {
    EnvFilter::try_new(with_quiet_targets(level))
        .map_err(|e| format!("{source}: `{level}` is not a log filter ({e})"))
}

impl Logging {
    /// Installs the process-wide subscriber.
    pub fn init(format: Format, level: &str) -> Result<Logging, String> {
        let env = std::env::var("RUST_LOG").ok().filter(|v| !v.is_empty());
        let from_env = env.is_some();
        let initial = match env {
            Some(env) => filter(&env, "RUST_LOG")?,
            None => filter(level, "log.level")?,
        };
        let (filter_layer, handle) = reload::Layer::new(initial);
        let text = (format == Format::Text).then(|| {
            fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::stderr().is_terminal())
        });
        let json = (format == Format::Json).then(|| {
            fmt::layer()
                .json()
                .flatten_event(true)
                .with_writer(std::io::stderr)
        });
        tracing_subscriber::registry()
            .with(filter_layer)
            .with(text)
            .with(json)
            .try_init()
            .map_err(|e| format!("cannot install the logger: {e}"))?;
        Ok(Logging {
            handle,
            from_env,
            level: std::sync::Mutex::new(level.to_owned()),
        })
    }

    fn level(&self) -> std::sync::MutexGuard<'_, String> {
        self.level
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Checks a reloaded `[log] level` as a start would (changes nothing).
    pub fn prepare(&self, level: &str) -> Result<Level, String> {
        if *self.level() == level {
            return Ok(Level::Same);
        }
        if self.from_env {
            return Ok(Level::Overridden);
        }
        Ok(Level::New(
            level.to_owned(),
            Box::new(filter(level, "[log] level")?),
        ))
    }

    /// Applies what [`Logging::prepare`] checked; says whether it changed.
    pub fn apply(&self, level: Level) -> Result<bool, String> {
        match level {
            Level::Same | Level::Overridden => Ok(false),
            Level::New(level, filter) => {
                self.handle
                    .reload(*filter)
                    .map_err(|e| format!("cannot change the log filter: {e}"))?;
                *self.level() = level;
                Ok(true)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::with_quiet_targets;

    #[test]
    fn the_quiet_targets_stay_quiet_unless_named() {
        assert_eq!(
            with_quiet_targets("info"),
            "info,router=warn,lsm_tree=warn,fjall=warn,fjall::journal::batch_reader=debug"
        );
        assert_eq!(
            with_quiet_targets("debug,router=debug"),
            "debug,router=debug,lsm_tree=warn,fjall=warn,fjall::journal::batch_reader=debug"
        );
        // Naming fjall decides for its journal reader too.
        assert_eq!(
            with_quiet_targets("info,fjall=trace"),
            "info,fjall=trace,router=warn,lsm_tree=warn"
        );
        // A module of the router named: the rest of it stays quiet.
        assert_eq!(
            with_quiet_targets("info,router::routing[x]=debug"),
            "info,router::routing[x]=debug,router=warn,lsm_tree=warn,fjall=warn,fjall::journal::batch_reader=debug"
        );
        assert_eq!(
            with_quiet_targets(""),
            "router=warn,lsm_tree=warn,fjall=warn,fjall::journal::batch_reader=debug"
        );
    }
}
