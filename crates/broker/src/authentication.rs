//! Authentication: who is connecting.
//!
//! In order:
//! 1. A client certificate (TLS listener with `capath`): its subject `CN` is
//!    the username and its subject fields the attributes; no password asked.
//! 2. A username and password: checked against `[broker] password_file`
//!    (mosquitto's format, [`crate::passwords`]). A wrong one is refused
//!    "bad username or password" (MQTT 5 0x86, 3.1.1 0x04). Without a
//!    password file there is nobody to check against: the username is not
//!    trusted (the client counts as anonymous).
//! 3. Anonymous: allowed where the listener's `allow_anonymous` is true
//!    (default: loopback listeners only), else refused "not authorized"
//!    (0x87 / 0x05).
//!
//! Whom a client's state store quotas count against (its KEYNOTIFY
//! registrations): [`quota_owner`], the verified username, or the source
//! address of a client without one.
//!
//! Failed attempts are slowed per source address ([`Throttle`]): after a
//! failure each further attempt from that address waits its turn, longer
//! with every failure (up to 5 s), so guessing runs at a few attempts a
//! second instead of thousands. A success clears the address.
//!
//! Verifying a PBKDF2 hash costs about a millisecond of CPU: it runs on
//! tokio's blocking pool, not on a connection's worker thread.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use crate::authorization::Principal;
use crate::passwords::Passwords;
use crate::tls::CertIdentity;

/// Why authentication failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// A username with a wrong password, or an unknown user.
    BadCredentials,
    /// No usable identity where anonymous clients are not allowed.
    Anonymous,
}

/// What a client presented.
pub struct Presented<'a> {
    /// Its client id.
    pub client_id: &'a str,
    /// The CONNECT's username and password.
    pub login: Option<(&'a str, &'a str)>,
    /// Its verified certificate's identity.
    pub certificate: Option<&'a CertIdentity>,
    /// Whether the listener lets anonymous clients in.
    pub allow_anonymous: bool,
    /// Where it connects from.
    pub source: IpAddr,
}

/// The password file in use, and the throttle of failed attempts.
#[derive(Default)]
pub struct Authenticator {
    /// The file and what it holds, changed together.
    file: RwLock<PasswordFile>,
    throttle: Mutex<Throttle>,
}

/// A password file read and checked (or none), ready to be used.
#[derive(Default, PartialEq, Eq)]
pub struct PasswordFile {
    path: Option<PathBuf>,
    passwords: Option<Arc<Passwords>>,
}

impl PasswordFile {
    /// Reads and checks the file at `path` (`None`: no password file).
    pub fn read(path: Option<&Path>) -> Result<PasswordFile, String> {
        Ok(PasswordFile {
            path: path.map(Path::to_owned),
            passwords: path.map(Passwords::load).transpose()?.map(Arc::new),
        })
    }

    /// The file.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// How many users it holds (`None`: no file).
    pub fn users(&self) -> Option<usize> {
        self.passwords.as_ref().map(|p| p.len())
    }
}

impl Authenticator {
    /// Loads the password file, if any.
    pub fn load(path: Option<&Path>) -> Result<Authenticator, String> {
        let authenticator = Authenticator::default();
        authenticator.switch(path)?;
        Ok(authenticator)
    }

    /// Uses the password file at `path` from now on (`None`: none, so
    /// credentials are not checked), read now; on error the file in use
    /// stays as it was. Returns the number of users.
    pub fn switch(&self, path: Option<&Path>) -> Result<Option<usize>, String> {
        let file = PasswordFile::read(path)?;
        let users = file.users();
        self.install(file);
        Ok(users)
    }

    /// Whether `file` differs from the one in use (another file, none, or
    /// other users or passwords in the same file).
    pub fn differs(&self, file: &PasswordFile) -> bool {
        *self.file.read() != *file
    }

    /// Checks every CONNECT from now on against `file` (read and checked
    /// before: this cannot fail).
    pub fn install(&self, file: PasswordFile) {
        *self.file.write() = file;
    }

    /// The password file in use.
    pub fn path(&self) -> Option<PathBuf> {
        self.file.read().path.clone()
    }

    /// Whether a password file is in use.
    pub fn has_password_file(&self) -> bool {
        self.file.read().path.is_some()
    }

    /// Checks a username and password directly (for the HTTP endpoint).
    pub async fn verify(&self, source: IpAddr, user: &str, password: &str) -> bool {
        let Some(passwords) = self.file.read().passwords.clone() else {
            return false;
        };
        self.checked(source, passwords, user, password).await
    }

    async fn checked(
        &self,
        source: IpAddr,
        passwords: Arc<Passwords>,
        user: &str,
        password: &str,
    ) -> bool {
        self.wait_turn(source).await;
        let (user, password) = (user.to_owned(), password.to_owned());
        let ok = tokio::task::spawn_blocking(move || passwords.verify(&user, password.as_bytes()))
            .await
            .unwrap_or(false);
        let mut throttle = self.throttle.lock();
        if ok {
            throttle.succeeded(source);
        } else {
            throttle.failed(source, Instant::now());
        }
        ok
    }

    /// Waits until an attempt from `source` may be looked at.
    async fn wait_turn(&self, source: IpAddr) {
        let wait = self.throttle.lock().turn(source, Instant::now());
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }

    /// Decides who the client is.
    pub async fn authenticate(&self, presented: Presented<'_>) -> Result<Principal, Failure> {
        let mut principal = Principal {
            client_id: presented.client_id.to_owned(),
            ..Principal::default()
        };
        if let Some(cert) = presented.certificate {
            principal.username = cert.common_name.clone();
            principal.attributes = cert.attributes.clone();
            return Ok(principal);
        }
        let passwords = self.file.read().passwords.clone();
        if let (Some((user, password)), Some(passwords)) = (presented.login, passwords) {
            if self
                .checked(presented.source, passwords, user, password)
                .await
            {
                principal.username = Some(user.to_owned());
                return Ok(principal);
            }
            return Err(Failure::BadCredentials);
        }
        if presented.allow_anonymous {
            Ok(principal)
        } else {
            // Counts as a failure too: probing anonymously is slowed alike.
            self.wait_turn(presented.source).await;
            self.throttle
                .lock()
                .failed(presented.source, Instant::now());
            Err(Failure::Anonymous)
        }
    }
}

/// Whom a client's state store quotas count against
/// (`statestore::Caller::owner`): the verified username (password file or
/// client certificate), or for a client without one (anonymous) the
/// address it connects from, without the port. Every connection and client
/// id of one user, or of one anonymous address, shares that user's quota.
/// The two kinds are told apart by their prefix, so no username can pass
/// for an address.
pub fn quota_owner(principal: &Principal, source: IpAddr) -> String {
    match &principal.username {
        Some(user) => format!("user:{user}"),
        // An IPv4 client on a dual-stack socket (::ffff:a.b.c.d) is the
        // same address as over IPv4.
        None => format!("addr:{}", source.to_canonical()),
    }
}

/// The most source addresses remembered (oldest forgotten first).
const MAX_SOURCES: usize = 65_536;
/// A source's failures are forgotten after this long without one.
const FORGET_AFTER: Duration = Duration::from_secs(600);
/// The longest wait between two attempts of one source.
const MAX_STEP: Duration = Duration::from_secs(5);

/// Failed attempts per source address.
#[derive(Default)]
pub struct Throttle {
    sources: HashMap<IpAddr, Source>,
}

struct Source {
    failures: u32,
    /// When the next attempt may be checked.
    next: Instant,
    last_failure: Instant,
}

impl Throttle {
    /// How long an attempt from `source` must wait before being checked
    /// (and takes its turn, so parallel attempts queue one after another).
    pub fn turn(&mut self, source: IpAddr, now: Instant) -> Duration {
        let Some(s) = self.sources.get_mut(&source) else {
            return Duration::ZERO;
        };
        if now.duration_since(s.last_failure) > FORGET_AFTER {
            self.sources.remove(&source);
            return Duration::ZERO;
        }
        let slot = s.next.max(now);
        s.next = slot + step(s.failures);
        slot - now
    }

    /// Records a failed attempt.
    pub fn failed(&mut self, source: IpAddr, now: Instant) {
        if self.sources.len() >= MAX_SOURCES && !self.sources.contains_key(&source) {
            self.sources
                .retain(|_, s| now.duration_since(s.last_failure) <= FORGET_AFTER);
            if self.sources.len() >= MAX_SOURCES
                && let Some(oldest) = self
                    .sources
                    .iter()
                    .min_by_key(|(_, s)| s.last_failure)
                    .map(|(ip, _)| *ip)
            {
                self.sources.remove(&oldest);
            }
        }
        let s = self.sources.entry(source).or_insert(Source {
            failures: 0,
            next: now,
            last_failure: now,
        });
        s.failures = s.failures.saturating_add(1);
        s.last_failure = now;
        s.next = s.next.max(now + step(s.failures));
    }

    /// Forgets a source's failures.
    pub fn succeeded(&mut self, source: IpAddr) {
        self.sources.remove(&source);
    }
}

/// 100 ms after the first failure, doubling, at most [`MAX_STEP`].
fn step(failures: u32) -> Duration {
    let ms = 100u64.saturating_mul(1 << failures.saturating_sub(1).min(16));
    Duration::from_millis(ms).min(MAX_STEP)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_space_out_attempts_per_source() {
        let mut t = Throttle::default();
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let now = Instant::now();
        assert_eq!(
            t.turn(a, now),
            Duration::ZERO,
            "a first attempt waits for nothing"
        );
        t.failed(a, now);
        t.failed(a, now);
        t.failed(a, now);
        // Three failures: the next attempt waits, and parallel ones queue.
        let first = t.turn(a, now);
        let second = t.turn(a, now);
        assert!(first >= Duration::from_millis(400), "{first:?}");
        assert!(second > first, "{second:?} after {first:?}");
        assert_eq!(t.turn(b, now), Duration::ZERO, "other sources unaffected");
        for _ in 0..40 {
            t.failed(a, now);
        }
        assert!(step(40) == MAX_STEP);
        t.succeeded(a);
        assert_eq!(t.turn(a, now), Duration::ZERO, "a success clears");
        t.failed(b, now);
        assert_eq!(
            t.turn(b, now + FORGET_AFTER * 2),
            Duration::ZERO,
            "forgotten"
        );
    }

    #[test]
    fn quotas_count_against_the_user_or_the_address() {
        let named = |username: Option<&str>| Principal {
            client_id: "any".into(),
            username: username.map(str::to_owned),
            ..Principal::default()
        };
        let v4: IpAddr = "192.0.2.7".parse().unwrap();
        let mapped: IpAddr = "::ffff:192.0.2.7".parse().unwrap();
        let v6: IpAddr = "2001:db8::1".parse().unwrap();
        assert_eq!(quota_owner(&named(Some("alice")), v4), "user:alice");
        assert_eq!(quota_owner(&named(Some("alice")), v6), "user:alice");
        assert_eq!(quota_owner(&named(None), v4), "addr:192.0.2.7");
        assert_eq!(quota_owner(&named(None), mapped), "addr:192.0.2.7");
        assert_eq!(quota_owner(&named(None), v6), "addr:2001:db8::1");
        // A username that looks like an address is still a user.
        assert_ne!(
            quota_owner(&named(Some("192.0.2.7")), v6),
            quota_owner(&named(None), v4)
        );
    }

    #[tokio::test]
    async fn certificate_then_password_then_anonymous() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("passwd");
        std::fs::write(
            &file,
            crate::passwords::set_user("", "alice", b"pw").unwrap(),
        )
        .unwrap();
        let auth = Authenticator::load(Some(&file)).unwrap();
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let presented = |login, allow_anonymous| Presented {
            client_id: "c",
            login,
            certificate: None,
            allow_anonymous,
            source: ip,
        };
        let p = auth
            .authenticate(presented(Some(("alice", "pw")), false))
            .await
            .unwrap();
        assert_eq!(p.username.as_deref(), Some("alice"));
        assert_eq!(
            auth.authenticate(presented(Some(("alice", "no")), true))
                .await,
            Err(Failure::BadCredentials)
        );
        assert_eq!(
            auth.authenticate(presented(Some(("mallory", "pw")), true))
                .await,
            Err(Failure::BadCredentials)
        );
        assert_eq!(
            auth.authenticate(presented(None, false)).await,
            Err(Failure::Anonymous)
        );
        assert_eq!(
            auth.authenticate(presented(None, true))
                .await
                .unwrap()
                .username,
            None
        );
        let cert = CertIdentity {
            common_name: Some("device-1".into()),
            attributes: [
                ("CN".into(), "device-1".into()),
                ("O".into(), "plant".into()),
            ]
            .into(),
        };
        let p = auth
            .authenticate(Presented {
                certificate: Some(&cert),
                ..presented(None, false)
            })
            .await
            .unwrap();
        assert_eq!(p.username.as_deref(), Some("device-1"));
        assert_eq!(p.attributes["O"], "plant");
        // Without a password file a username is not trusted.
        let none = Authenticator::load(None).unwrap();
        let p = none
            .authenticate(presented(Some(("alice", "x")), true))
            .await
            .unwrap();
        assert_eq!(p.username, None);
        assert_eq!(
            none.authenticate(presented(Some(("alice", "x")), false))
                .await,
            Err(Failure::Anonymous)
        );
        // Reload: a broken file keeps the old users.
        std::fs::write(&file, "alice:plain\n").unwrap();
        assert!(auth.switch(Some(&file)).is_err());
        assert!(
            auth.authenticate(presented(Some(("alice", "pw")), false))
                .await
                .is_ok()
        );
    }
}
