//! SIGHUP: what a reload changes while the broker runs, and what it refuses.
//!
//! Applied at once, each to new connections (those made before keep what
//! they were accepted with): the password file and the authorization
//! policy (enabled, changed to another file, disabled, or read again), and
//! the TLS certificates of each TLS listener (read again from their files).
//! The log level is the binary's (`src/logging.rs`).
//!
//! Everything else can only change with a restart: a reload that changes
//! it is refused for that setting, with an ERROR line naming it, and the
//! running value stays. So is a file that cannot be read or parsed (the
//! one in use stays). An operator never reads "reloaded" for a change that
//! did not happen.

use std::path::{Path, PathBuf};

use crate::config::Settings;
use crate::shared::Shared;

/// What a reload did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Reloaded {
    /// What changed, one line each.
    pub applied: Vec<String>,
    /// What could not change, one line each (each logged as an ERROR).
    pub refused: Vec<String>,
    /// The settings that changed but only a restart applies.
    pub needs_restart: Vec<&'static str>,
}

impl Reloaded {
    /// Whether everything asked for was applied.
    pub fn is_complete(&self) -> bool {
        self.refused.is_empty() && self.needs_restart.is_empty()
    }
}

/// Applies `new` (the configuration read again) to the running broker;
/// `running` is what it started with.
pub(crate) fn reload(shared: &Shared, running: &Settings, new: &Settings) -> Reloaded {
    let mut done = Reloaded::default();
    file(
        &mut done,
        ("password file", "[broker] password_file"),
        "users",
        shared.authenticator.path(),
        new.password_file.as_deref(),
        |path| shared.authenticator.switch(path),
    );
    file(
        &mut done,
        ("authorization policy", "[broker] authorization"),
        "rules",
        shared.authorizer.path(),
        new.authorization.as_deref(),
        |path| shared.authorizer.switch(path),
    );
    for tls in &shared.tls {
        match tls.reload() {
            Ok(()) => done
                .applied
                .push(format!("TLS certificate {} read again", tls.describe())),
            Err(e) => done.refused.push(format!(
                "TLS certificate {} not reloaded, the one in use stays: {e}",
                tls.describe()
            )),
        }
    }
    done.needs_restart = running.needs_restart(new);
    for line in &done.applied {
        tracing::info!("SIGHUP: {line}");
    }
    for line in &done.refused {
        tracing::error!("SIGHUP: {line}");
    }
    for setting in &done.needs_restart {
        tracing::error!(
            setting,
            "SIGHUP: {setting} changed, but it cannot change while the broker runs: the running value stays until a restart"
        );
    }
    done
}

/// A file setting (`what`, and its key in the configuration): enabled,
/// changed, disabled, or read again.
fn file(
    done: &mut Reloaded,
    (what, key): (&str, &str),
    counted: &str,
    before: Option<PathBuf>,
    after: Option<&Path>,
    switch: impl FnOnce(Option<&Path>) -> Result<Option<usize>, String>,
) {
    let shown = |path: Option<&Path>| path.map_or("none".to_owned(), |p| p.display().to_string());
    match switch(after) {
        Ok(count) => {
            let how = match (&before, after) {
                (Some(b), Some(a)) if b == a => "reloaded",
                (None, Some(_)) => "enabled",
                (Some(_), Some(_)) => "changed",
                (Some(_), None) => "disabled",
                (None, None) => return,
            };
            let count = count.map_or(String::new(), |n| format!(", {n} {counted}"));
            done.applied
                .push(format!("{what} {how} ({key}: {}{count})", shown(after)));
        }
        Err(e) => done.refused.push(format!(
            "{what} not reloaded ({key}: {}): {e}; the one in use stays ({})",
            shown(after),
            shown(before.as_deref())
        )),
    }
}
