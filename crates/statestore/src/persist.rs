//! What is kept on disk, and in what form.
//!
//! A key is **persisted** when a SET carried the user property
//! `aio-persistence: true`, or when the configured [`PersistPolicy`] names it;
//! once persisted it stays so (later SETs keep it on disk) until it is
//! deleted or expires. The store does no I/O: every [`crate::Outcome`] lists
//! the [`Write`]s the broker must make durable before it answers, and on
//! start the broker hands the saved [`Record`]s back to
//! [`crate::Store::restore`].
//!
//! Versions must keep rising across restarts, including the versions of keys
//! that were never persisted. So the store also persists a **clock mark**: a
//! wall time that no version it hands out reaches. When the clock comes
//! within half a lease of the mark, the store raises the mark a lease ahead
//! ([`Write::ClockMark`]); after a restart the clock starts above the last
//! mark. While the store has handed out a version at or above the last mark
//! on disk, the broker holds every response until the next mark is on disk
//! too, so no version above a mark is ever seen before that mark is.
//!
//! Each [`crate::Outcome`] also says what its answer can show of the store
//! ([`Observed`]): one key, every key, or nothing. The broker holds an
//! answer only until what it can show is durable: a GET of a key nobody
//! changed since the last fsync is answered at once, however many
//! persisted changes to other keys wait for the disk.

use crate::glob::Pattern;
use crate::hlc::{Hlc, Version};

/// One durable change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    /// A persisted key was written.
    Put(Record),
    /// A persisted key was deleted or expired.
    Delete(Vec<u8>),
    /// No version will reach this wall time (ms) before a new mark is written.
    ClockMark(u64),
}

/// What an answer can show of the store, and so which durable changes it
/// must wait for (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Observed {
    /// Nothing but the clock: PING, and requests that did not parse.
    #[default]
    Nothing,
    /// One key: its value, version, fencing token or absence (GET, SET,
    /// DEL, VDEL, KEYNOTIFY). The key is `request.payload[range]`, so that
    /// saying so costs no copy.
    Key(std::ops::Range<usize>),
    /// Any key: SCAN (a page of keys) and INFO (how many there are).
    All,
}

impl Observed {
    /// `key`, which must lie within `payload`, as a range of it; [`Observed::All`]
    /// if it does not (a caller that cannot say which key must wait for all).
    pub(crate) fn key_in(payload: &[u8], key: &[u8]) -> Observed {
        let start = (key.as_ptr() as usize).wrapping_sub(payload.as_ptr() as usize);
        match start.checked_add(key.len()) {
            Some(end) if end <= payload.len() => Observed::Key(start..end),
            _ => Observed::All,
        }
    }
}

/// A persisted key as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The key.
    pub key: Vec<u8>,
    /// The value.
    pub value: Vec<u8>,
    /// Its version.
    pub version: Version,
    /// The fencing token protecting it.
    pub fencing_token: Option<Hlc>,
    /// Absolute expiry, milliseconds since the Unix epoch.
    pub expires_at: Option<u64>,
}

/// A stored record that cannot be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CorruptRecord;

const FORMAT: u8 = 1;

impl Record {
    /// The stored form of everything but the key:
    /// `format u8 | wall_ms u64 | counter u32 | expires_at u64 (0: none) |
    /// token_len u16 | token (HLC text) | value`, integers big-endian.
    pub fn encode_value(&self) -> Vec<u8> {
        let token = self
            .fencing_token
            .as_ref()
            .map(Hlc::to_string)
            .unwrap_or_default();
        let mut out = Vec::with_capacity(23 + token.len() + self.value.len());
        out.push(FORMAT);
        out.extend_from_slice(&self.version.wall_ms.to_be_bytes());
        out.extend_from_slice(&self.version.counter.to_be_bytes());
        out.extend_from_slice(&self.expires_at.unwrap_or(0).to_be_bytes());
        out.extend_from_slice(&(token.len() as u16).to_be_bytes());
        out.extend_from_slice(token.as_bytes());
        out.extend_from_slice(&self.value);
        out
    }

    /// Decodes what [`Record::encode_value`] wrote for `key`.
    ///
    /// ```
    /// use statestore::persist::Record;
    /// use statestore::hlc::Version;
    /// let r = Record {
    ///     key: b"k".to_vec(),
    ///     value: b"v".to_vec(),
    ///     version: Version { wall_ms: 5, counter: 1 },
    ///     fencing_token: Some("4:0:lock".parse().unwrap()),
    ///     expires_at: Some(9),
    /// };
    /// assert_eq!(Record::decode(b"k", &r.encode_value()), Ok(r));
    /// assert!(Record::decode(b"k", b"\x01short").is_err());
    /// ```
    pub fn decode(key: &[u8], stored: &[u8]) -> Result<Record, CorruptRecord> {
        let (&format, rest) = stored.split_first().ok_or(CorruptRecord)?;
        if format != FORMAT || rest.len() < 22 {
            return Err(CorruptRecord);
        }
        let wall_ms = u64::from_be_bytes(rest[0..8].try_into().map_err(|_| CorruptRecord)?);
        let counter = u32::from_be_bytes(rest[8..12].try_into().map_err(|_| CorruptRecord)?);
        let expires = u64::from_be_bytes(rest[12..20].try_into().map_err(|_| CorruptRecord)?);
        let token_len = usize::from(u16::from_be_bytes([rest[20], rest[21]]));
        let token = rest.get(22..22 + token_len).ok_or(CorruptRecord)?;
        let fencing_token = if token.is_empty() {
            None
        } else {
            let text = std::str::from_utf8(token).map_err(|_| CorruptRecord)?;
            Some(text.parse().map_err(|_| CorruptRecord)?)
        };
        Ok(Record {
            key: key.to_vec(),
            value: rest[22 + token_len..].to_vec(),
            version: Version { wall_ms, counter },
            fencing_token,
            expires_at: (expires != 0).then_some(expires),
        })
    }
}

/// Which keys are persisted without asking (configuration).
///
/// Rules are strings: `all`; `exact:<key>`; `hex:<key as hex>` (binary
/// keys); `glob:<pattern>` (see [`crate::glob`]).
#[derive(Debug, Clone, Default)]
pub struct PersistPolicy {
    all: bool,
    exact: Vec<Vec<u8>>,
    patterns: Vec<Pattern>,
}

impl PersistPolicy {
    /// Parses rules; the error names the rule that is wrong.
    ///
    /// ```
    /// use statestore::persist::PersistPolicy;
    /// let p = PersistPolicy::parse(&["exact:lock", "hex:00ff", "glob:cfg/*"]).unwrap();
    /// assert!(p.persists(b"lock") && p.persists(b"\x00\xff") && p.persists(b"cfg/a"));
    /// assert!(!p.persists(b"other"));
    /// assert!(PersistPolicy::parse(&["glob"]).is_err());
    /// ```
    pub fn parse<S: AsRef<str>>(rules: &[S]) -> Result<PersistPolicy, String> {
        let mut policy = PersistPolicy::default();
        for rule in rules {
            let rule = rule.as_ref();
            match rule.split_once(':') {
                _ if rule == "all" => policy.all = true,
                Some(("exact", key)) if !key.is_empty() => {
                    policy.exact.push(key.as_bytes().to_vec())
                }
                Some(("hex", hex)) => policy.exact.push(decode_hex(hex).ok_or_else(|| {
                    format!("`{rule}`: hex keys need an even number of hex digits")
                })?),
                Some(("glob", pattern)) if !pattern.is_empty() => {
                    policy.patterns.push(Pattern::new(pattern.as_bytes()))
                }
                _ => {
                    return Err(format!(
                        "`{rule}` is not a persistence rule (all, exact:KEY, hex:HEX, glob:PATTERN)"
                    ));
                }
            }
        }
        Ok(policy)
    }

    /// Whether `key` is persisted by configuration.
    pub fn persists(&self, key: &[u8]) -> bool {
        self.all
            || self.exact.iter().any(|k| k == key)
            || self.patterns.iter().any(|p| p.matches(key))
    }
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if hex.is_empty() || !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        for (token, expires, value) in [
            (None, None, &b""[..]),
            (Some("1:2:n"), Some(u64::MAX), b"\x00\r\n"),
        ] {
            let r = Record {
                key: b"key".to_vec(),
                value: value.to_vec(),
                version: Version {
                    wall_ms: u64::MAX,
                    counter: u32::MAX,
                },
                fencing_token: token.map(|t| t.parse().unwrap()),
                expires_at: expires,
            };
            assert_eq!(Record::decode(b"key", &r.encode_value()), Ok(r));
        }
    }

    #[test]
    fn corrupt_records_are_errors_not_panics() {
        let good = Record {
            key: vec![],
            value: b"value".to_vec(),
            version: Version::default(),
            fencing_token: Some("1:2:n".parse().unwrap()),
            expires_at: None,
        }
        .encode_value();
        for len in 0..good.len() {
            let _ = Record::decode(b"k", &good[..len]);
        }
        assert!(Record::decode(b"k", &[2; 40]).is_err(), "unknown format");
        let mut bad_token = good.clone();
        bad_token[23] = b'x';
        assert!(Record::decode(b"k", &bad_token).is_err());
    }

    #[test]
    fn policy_rules() {
        assert!(
            PersistPolicy::parse(&["all"])
                .unwrap()
                .persists(b"anything")
        );
        assert!(!PersistPolicy::default().persists(b"anything"));
        for bad in ["exact:", "hex:abc", "hex:zz", "glob:", "nope", "regex:x"] {
            assert!(PersistPolicy::parse(&[bad]).is_err(), "{bad}");
        }
    }
}
