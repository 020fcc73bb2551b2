//! Logging of the binary: a `tracing` subscriber writing text or JSON lines
//! to stderr, whose filter a SIGHUP can change.
//!
//! The filter is `[log] level` from the configuration unless the RUST_LOG
//! environment variable is set, which then wins (at start and at reloads).

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

/// Parses a filter, naming where it came from in the error.
fn filter(level: &str, source: &str) -> Result<EnvFilter, String> {
    EnvFilter::try_new(level).map_err(|e| format!("{source}: `{level}` is not a log filter ({e})"))
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
