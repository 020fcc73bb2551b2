//! SIGHUP: what a reload changes while the broker runs, and what it refuses.
//!
//! A reload happens in two steps, like a start:
//! 1. `prepare` (`RunningBroker::prepare_reload`) reads and checks
//!    everything the new configuration names, exactly as a start would:
//!    the password file, the authorization policy, and the certificate,
//!    key and CA files of every TLS listener. Any error refuses the whole
//!    reload (each error names its setting and file): nothing changes, the
//!    running configuration stays in force.
//! 2. [`Prepared::apply`] then swaps in what changed, which cannot fail:
//!    the password file and the policy (enabled, changed to another file,
//!    disabled, or new content in the same file) and the TLS files of each
//!    TLS listener (other files, or new content). The password file and the
//!    certificates apply to new connections (those open keep what they
//!    were accepted with); the policy to every CONNECT, publish, subscribe
//!    and state store request from then on, of connected clients too
//!    (subscriptions already made stay).
//!
//! The log level is the binary's (`src/logging.rs`); it is checked in step
//! 1 and applied in step 2 alike.
//!
//! Everything else can only change with a restart. Those settings, when
//! changed, are listed in [`Prepared::needs_restart`]: the rest of the
//! reload applies, each of them gets an ERROR line naming it, the running
//! value stays, and the summary says the configuration was applied only in
//! part. An operator never reads "reloaded" for a change that did not
//! happen.

use std::path::Path;
use std::sync::Arc;

use crate::authentication::PasswordFile;
use crate::authorization::PolicyFile;
use crate::config::Settings;
use crate::shared::Shared;
use crate::tls::{Loaded, Tls};

/// A reload read and checked, not applied yet.
#[must_use = "a prepared reload changes nothing until applied"]
pub struct Prepared {
    shared: Arc<Shared>,
    passwords: Option<PasswordFile>,
    policy: Option<PolicyFile>,
    tls: Vec<(Arc<Tls>, Loaded)>,
    needs_restart: Vec<String>,
}

/// The files a configuration names, read and checked.
pub struct NamedFiles {
    passwords: PasswordFile,
    policy: PolicyFile,
    /// Each listener's TLS files, in the order of the listeners.
    tls: Vec<Option<Loaded>>,
}

/// Reads and checks every file `settings` names, as a start would: the
/// password file, the authorization policy, each TLS listener's files.
/// `Err`: one line per problem, each naming its setting and file (the
/// binary checks them before it starts: a configuration error, exit 2).
pub fn read_named_files(settings: &Settings) -> Result<NamedFiles, Vec<String>> {
    let mut errors = Vec::new();
    let shown = |path: Option<&Path>| path.map_or("none".to_owned(), |p| p.display().to_string());
    let passwords = match PasswordFile::read(settings.password_file.as_deref()) {
        Ok(file) => Some(file),
        Err(e) => {
            errors.push(format!(
                "[broker] password_file = {}: {e}",
                shown(settings.password_file.as_deref())
            ));
            None
        }
    };
    let policy = match PolicyFile::read(settings.authorization.as_deref()) {
        Ok(file) => Some(file),
        Err(e) => {
            errors.push(format!(
                "[broker] authorization = {}: {e}",
                shown(settings.authorization.as_deref())
            ));
            None
        }
    };
    // Every TLS listener's files, as a start would load them (on a
    // reload, those of a listener that needs a restart too: the next
    // start must not fail).
    let mut loaded: Vec<Option<Loaded>> = Vec::new();
    for listener in &settings.listeners {
        loaded.push(match &listener.tls {
            None => None,
            Some(files) => match Tls::read(files) {
                Ok(l) => Some(l),
                Err(e) => {
                    errors.push(format!("{}.tls ({}): {e}", listener.name, listener.addr));
                    None
                }
            },
        });
    }
    match (passwords, policy) {
        (Some(passwords), Some(policy)) if errors.is_empty() => Ok(NamedFiles {
            passwords,
            policy,
            tls: loaded,
        }),
        _ => Err(errors),
    }
}

/// Reads and checks what `new` (the configuration read again) names, and
/// sees what differs from what runs. `Err`: why the reload is refused, one
/// line per problem, each naming its setting; nothing has changed.
pub(crate) fn prepare(shared: &Arc<Shared>, new: &Settings) -> Result<Prepared, Vec<String>> {
    let NamedFiles {
        passwords,
        policy,
        tls: mut loaded,
    } = read_named_files(new)?;
    let needs_restart = shared.settings.needs_restart(new);
    let mut tls = Vec::new();
    for running in &shared.tls {
        let index = running.listener();
        // Listeners moved, added or removed: their files wait for the
        // restart too (named in `needs_restart`).
        let same_listener = new.listeners.len() == shared.settings.listeners.len()
            && new.listeners[index].name == shared.settings.listeners[index].name
            && new.listeners[index].addr == shared.settings.listeners[index].addr;
        if !same_listener {
            continue;
        }
        if let Some(l) = loaded[index].take()
            && running.differs(&l)
        {
            tls.push((Arc::clone(running), l));
        }
    }
    let passwords = Some(passwords).filter(|p| shared.authenticator.differs(p));
    let policy = Some(policy).filter(|p| shared.authorizer.differs(p));
    Ok(Prepared {
        shared: Arc::clone(shared),
        passwords,
        policy,
        tls,
        needs_restart,
    })
}

impl Prepared {
    /// The settings that changed but only a restart applies.
    pub fn needs_restart(&self) -> &[String] {
        &self.needs_restart
    }

    /// Applies what changed (this cannot fail) and logs each at INFO;
    /// returns the names of the settings changed.
    pub fn apply(self) -> Vec<String> {
        let shared = &self.shared;
        let mut changed = Vec::new();
        let shown =
            |path: Option<&Path>| path.map_or("none".to_owned(), |p| p.display().to_string());
        if let Some(file) = self.passwords {
            let before = shared.authenticator.path();
            let how = how(before.as_deref(), file.path());
            let after = shown(file.path());
            let users = file.users();
            shared.authenticator.install(file);
            match users {
                Some(users) => tracing::info!(
                    "SIGHUP: [broker] password_file {how}: {after} ({users} users); every new connection's password is checked against it"
                ),
                None => tracing::info!(
                    "SIGHUP: [broker] password_file {how}: passwords are no longer checked (clients with a username count as anonymous)"
                ),
            }
            changed.push("password_file".to_owned());
        }
        if let Some(file) = self.policy {
            let before = shared.authorizer.path();
            let how = how(before.as_deref(), file.path());
            let after = shown(file.path());
            let rules = file.rules();
            shared.authorizer.install(file);
            match rules {
                Some(rules) => {
                    tracing::info!("SIGHUP: [broker] authorization {how}: {after} ({rules} rules)");
                }
                None => tracing::info!(
                    "SIGHUP: [broker] authorization {how}: no policy, everything is allowed"
                ),
            }
            changed.push("authorization".to_owned());
        }
        for (tls, loaded) in self.tls {
            let name = &shared.settings.listeners[tls.listener()].name;
            let before = tls.files();
            tls.install(loaded);
            let after = tls.files();
            let how = if before == after {
                "read again (new content)"
            } else {
                "changed"
            };
            tracing::info!(
                "SIGHUP: {name}.tls {how}: certpath {}, keypath {}, capath {}; new connections get it",
                after.cert.display(),
                after.key.display(),
                shown(after.ca.as_deref())
            );
            changed.push(format!("{name}.tls"));
        }
        if changed
            .iter()
            .any(|c| c == "password_file" || c.ends_with(".tls"))
        {
            let mut listeners = shared.settings.listeners.clone();
            for tls in &shared.tls {
                listeners[tls.listener()].tls = Some(tls.files());
            }
            crate::listener::warn_unreachable(&listeners, shared.authenticator.has_password_file());
        }
        changed
    }
}

/// How a file setting changed.
fn how(before: Option<&Path>, after: Option<&Path>) -> &'static str {
    match (before, after) {
        (None, Some(_)) => "enabled",
        (Some(_), None) => "disabled",
        (Some(b), Some(a)) if b == a => "read again (new content)",
        _ => "changed",
    }
}
