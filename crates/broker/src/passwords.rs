//! The password file, in mosquitto's `mosquitto_passwd` format, so that a
//! mosquitto user's file works unchanged:
//!
//! ```text
//! # comment
//! alice:$7$101$<salt, base64>$<PBKDF2-HMAC-SHA512 of the password, base64>
//! bob:$6$<salt, base64>$<SHA-512 of password then salt, base64>
//! ```
//!
//! `$7$` (mosquitto 2) is PBKDF2-HMAC-SHA512 with the iteration count in the
//! line, a 12-byte salt and a 64-byte hash; `$6$` (mosquitto 1.x) is one
//! salted SHA-512, read so that old files keep working; [`hash`] writes
//! `$7$` (with more iterations than mosquitto's 101: verification costs
//! about a millisecond, which makes guessing a thousand times dearer).
//! Comparisons are constant-time. The crates: RustCrypto's `pbkdf2` and
//! `sha2` (well kept, pure Rust), `base64`, `getrandom` for the salt.

use std::collections::HashMap;
use std::path::Path;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use sha2::{Digest, Sha512};
use subtle::ConstantTimeEq;

/// PBKDF2 iterations of the entries [`hash`] writes.
pub const ITERATIONS: u32 = 10_000;

/// One stored password.
#[derive(Clone, PartialEq, Eq)]
enum Entry {
    Pbkdf2 {
        iterations: u32,
        salt: Vec<u8>,
        hash: Vec<u8>,
    },
    Sha512 {
        salt: Vec<u8>,
        hash: Vec<u8>,
    },
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Entry::Pbkdf2 { .. } => "$7$…",
            Entry::Sha512 { .. } => "$6$…",
        })
    }
}

impl Entry {
    fn parse(text: &str) -> Result<Entry, String> {
        let b64 = |s: &str, what: &str| {
            STANDARD
                .decode(s)
                .map_err(|e| format!("the {what} is not base64 ({e})"))
        };
        let parts: Vec<&str> = text.split('$').collect();
        match parts.as_slice() {
            ["", "7", iterations, salt, hash] => {
                let iterations: u32 = iterations
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or("the iteration count is not a positive number")?;
                Ok(Entry::Pbkdf2 {
                    iterations,
                    salt: b64(salt, "salt")?,
                    hash: b64(hash, "hash")?,
                })
            }
            ["", "6", salt, hash] => Ok(Entry::Sha512 {
                salt: b64(salt, "salt")?,
                hash: b64(hash, "hash")?,
            }),
            _ => Err(
                "not a $7$ (PBKDF2-SHA512) or $6$ (SHA-512) hash as mosquitto_passwd writes them; \
                 passwords in plain text are not accepted"
                    .to_owned(),
            ),
        }
    }

    fn verify(&self, password: &[u8]) -> bool {
        let (computed, stored) = match self {
            Entry::Pbkdf2 {
                iterations,
                salt,
                hash,
            } => {
                let mut out = vec![0u8; hash.len()];
                pbkdf2::pbkdf2_hmac::<Sha512>(password, salt, *iterations, &mut out);
                (out, hash)
            }
            Entry::Sha512 { salt, hash } => {
                let mut digest = Sha512::new();
                digest.update(password);
                digest.update(salt);
                (digest.finalize().to_vec(), hash)
            }
        };
        computed.len() == stored.len() && bool::from(computed.ct_eq(stored))
    }
}

/// Users and their password hashes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Passwords {
    users: HashMap<String, Entry>,
}

impl Passwords {
    /// Parses a password file's text; an error names the line.
    pub fn parse(text: &str) -> Result<Passwords, String> {
        let mut users = HashMap::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() || line.starts_with('#') {
                continue;
            }
            let (user, hash) = line
                .split_once(':')
                .ok_or_else(|| format!("line {}: not USER:HASH", n + 1))?;
            if user.is_empty() {
                return Err(format!("line {}: empty user name", n + 1));
            }
            let entry = Entry::parse(hash).map_err(|e| format!("line {} ({user}): {e}", n + 1))?;
            users.insert(user.to_owned(), entry);
        }
        Ok(Passwords { users })
    }

    /// Reads a password file.
    pub fn load(path: &Path) -> Result<Passwords, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read password file {}: {e}", path.display()))?;
        Passwords::parse(&text).map_err(|e| format!("password file {}: {e}", path.display()))
    }

    /// Whether `user` exists and `password` is theirs.
    pub fn verify(&self, user: &str, password: &[u8]) -> bool {
        self.users
            .get(user)
            .is_some_and(|entry| entry.verify(password))
    }

    /// How many users the file has.
    pub fn len(&self) -> usize {
        self.users.len()
    }

    /// Whether the file has no user.
    pub fn is_empty(&self) -> bool {
        self.users.is_empty()
    }
}

/// The `$7$` hash of `password` with a fresh random salt, as a password
/// file line's part after `USER:`.
pub fn hash(password: &[u8]) -> String {
    let mut salt = [0u8; 12];
    getrandom::fill(&mut salt).expect("the system has a random source");
    let mut out = [0u8; 64];
    pbkdf2::pbkdf2_hmac::<Sha512>(password, &salt, ITERATIONS, &mut out);
    format!(
        "$7${ITERATIONS}${}${}",
        STANDARD.encode(salt),
        STANDARD.encode(out)
    )
}

/// Adds or replaces `user` in the password file text `existing` (keeping
/// every other line, comments included, in order); returns the new text.
pub fn set_user(existing: &str, user: &str, password: &[u8]) -> Result<String, String> {
    if user.is_empty() || user.contains(':') || user.contains(['\n', '\r']) {
        return Err("a user name must be non-empty, without ':' or line breaks".to_owned());
    }
    let line = format!("{user}:{}", hash(password));
    let mut out = String::new();
    let mut replaced = false;
    for l in existing.lines() {
        if l.split_once(':').is_some_and(|(u, _)| u == user) && !l.starts_with('#') {
            if !replaced {
                out.push_str(&line);
                out.push('\n');
                replaced = true;
            }
            continue;
        }
        out.push_str(l);
        out.push('\n');
    }
    if !replaced {
        out.push_str(&line);
        out.push('\n');
    }
    Passwords::parse(&out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Written by mosquitto_passwd 2.0 (`mosquitto_passwd -b -c f alice secret`).
    const MOSQUITTO_7: &str = "alice:$7$101$i2B0fp3qEFmi9b3Y$L/uutGnvGqaqKlZPYhKhFyyRs4ucjtHTXc7RaRL0Ejua+xJYM2dwhVxNFAhIsNQGqUhGOoS9iMdCYjiXpgS0+g==";

    fn sha512_line(user: &str, password: &str, salt: &[u8]) -> String {
        let mut d = Sha512::new();
        d.update(password.as_bytes());
        d.update(salt);
        format!(
            "{user}:$6${}${}",
            STANDARD.encode(salt),
            STANDARD.encode(d.finalize())
        )
    }

    #[test]
    fn reads_what_mosquitto_passwd_writes() {
        let p = Passwords::parse(&format!("# users\n\n{MOSQUITTO_7}\n")).unwrap();
        assert!(p.verify("alice", b"secret"));
        assert!(!p.verify("alice", b"Secret"));
        assert!(!p.verify("alice", b""));
        assert!(!p.verify("bob", b"secret"));
        assert_eq!(p.len(), 1);
    }

    #[test]
    fn reads_the_older_salted_sha512() {
        let p = Passwords::parse(&sha512_line("bob", "hunter2", b"0123456789ab")).unwrap();
        assert!(p.verify("bob", b"hunter2"));
        assert!(!p.verify("bob", b"hunter3"));
    }

    #[test]
    fn refuses_plain_text_and_names_the_line() {
        let e = Passwords::parse("# x\nalice:secret\n").unwrap_err();
        assert!(e.contains("line 2") && e.contains("plain text"), "{e}");
        let e = Passwords::parse("nocolon\n").unwrap_err();
        assert!(e.contains("line 1"), "{e}");
        let e = Passwords::parse("a:$7$x$AAAA$AAAA\n").unwrap_err();
        assert!(e.contains("iteration"), "{e}");
        let e = Passwords::parse("a:$7$10$@@@$AAAA\n").unwrap_err();
        assert!(e.contains("salt"), "{e}");
    }

    #[test]
    fn writes_entries_that_verify_and_keeps_the_rest() {
        let text = set_user(&format!("# keep me\n{MOSQUITTO_7}\n"), "carol", b"pw").unwrap();
        let text = set_user(&text, "alice", b"new").unwrap();
        assert!(text.starts_with("# keep me\nalice:$7$10000$"), "{text}");
        let p = Passwords::parse(&text).unwrap();
        assert!(p.verify("carol", b"pw"));
        assert!(p.verify("alice", b"new"));
        assert!(!p.verify("alice", b"secret"));
        assert_eq!(p.len(), 2);
        assert_ne!(hash(b"pw"), hash(b"pw"), "a fresh salt each time");
        assert!(set_user("", "a:b", b"x").is_err());
    }
}
