//! A state store key as kept in etcd: one etcd key per store key, under
//! `<prefix>K/`, whose value is the record below.
//!
//! A deleted key leaves a **tombstone** carrying the last version it had,
//! for [`crate::cluster`]'s `tombstone_ttl`: the next SET of the key, on
//! any node, takes that version in before it hands out its own, so the
//! key's versions keep increasing across nodes whose clocks differ.
//!
//! Each record also carries the identity of the request that wrote it (a
//! hash of the client id and the request's Correlation Data), so that a
//! write whose result etcd could not confirm is recognised when it did
//! land.

use statestore::db::{Entry, Extras};
use statestore::hlc::{Hlc, Version};

/// A record's value could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a record in etcd that is not a statebroker record")]
pub struct Corrupt;

const FORMAT: u8 = 1;
const TOMBSTONE: u8 = 1;
const AFTER_EXPIRY: u8 = 2;

/// One key's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The key was deleted (or expired); `value` is empty.
    pub tombstone: bool,
    /// The write found the key's record before it expired and not reaped
    /// yet: its watchers get that expiry's DELETE first, as on a single
    /// node.
    pub after_expiry: bool,
    /// The version of the write (for a tombstone: the deleted entry's).
    pub version: Version,
    /// The node that handed the version out.
    pub node: String,
    /// Absolute expiry, milliseconds since the Unix epoch.
    pub expires_at: Option<u64>,
    /// The fencing token protecting the key.
    pub fencing_token: Option<Hlc>,
    /// The request that wrote the record (see [`request_id`]).
    pub request: u64,
    /// The value.
    pub value: Vec<u8>,
}

impl Record {
    /// `format u8 | flags u8 | wall_ms u64 | counter u32 | expires_at u64
    /// (0: none) | request u64 | node_len u8 | node | token_len u16 |
    /// token (HLC text) | value`, integers big-endian.
    pub fn encode(&self) -> Vec<u8> {
        let token = self
            .fencing_token
            .as_ref()
            .map(Hlc::to_string)
            .unwrap_or_default();
        let node = &self.node.as_bytes()[..self.node.len().min(255)];
        let mut out = Vec::with_capacity(33 + node.len() + token.len() + self.value.len());
        out.push(FORMAT);
        let mut flags = 0;
        if self.tombstone {
            flags |= TOMBSTONE;
        }
        if self.after_expiry {
            flags |= AFTER_EXPIRY;
        }
        out.push(flags);
        out.extend_from_slice(&self.version.wall_ms.to_be_bytes());
        out.extend_from_slice(&self.version.counter.to_be_bytes());
        out.extend_from_slice(&self.expires_at.unwrap_or(0).to_be_bytes());
        out.extend_from_slice(&self.request.to_be_bytes());
        out.push(node.len() as u8);
        out.extend_from_slice(node);
        out.extend_from_slice(&(token.len() as u16).to_be_bytes());
        out.extend_from_slice(token.as_bytes());
        out.extend_from_slice(&self.value);
        out
    }

    /// The length of an encoded record ([`Record::encode`]) of a node id
    /// of `node` bytes (at most 255 are kept), a fencing token whose text
    /// has `token` bytes, and a value of `value` bytes.
    pub fn encoded_len(node: usize, token: usize, value: usize) -> usize {
        33 + node.min(255) + token + value
    }

    /// Decodes what [`Record::encode`] wrote.
    pub fn decode(stored: &[u8]) -> Result<Record, Corrupt> {
        let mut r = Reader(stored);
        if r.u8()? != FORMAT {
            return Err(Corrupt);
        }
        let flags = r.u8()?;
        let wall_ms = u64::from_be_bytes(r.array()?);
        let counter = u32::from_be_bytes(r.array()?);
        let expires_at = u64::from_be_bytes(r.array()?);
        let request = u64::from_be_bytes(r.array()?);
        let node_len = usize::from(r.u8()?);
        let node = std::str::from_utf8(r.take(node_len)?).map_err(|_| Corrupt)?;
        let token_len = usize::from(u16::from_be_bytes(r.array()?));
        let token = r.take(token_len)?;
        let fencing_token = if token.is_empty() {
            None
        } else {
            let text = std::str::from_utf8(token).map_err(|_| Corrupt)?;
            Some(text.parse().map_err(|_| Corrupt)?)
        };
        Ok(Record {
            tombstone: flags & TOMBSTONE != 0,
            after_expiry: flags & AFTER_EXPIRY != 0,
            version: Version { wall_ms, counter },
            node: node.to_owned(),
            expires_at: (expires_at != 0).then_some(expires_at),
            fencing_token,
            request,
            value: r.0.to_vec(),
        })
    }

    /// A live record whose expiry has come by `now_ms` (a read finds the
    /// key absent; the reaper has not replaced it yet).
    pub fn expired(&self, now_ms: u64) -> bool {
        !self.tombstone && self.expires_at.is_some_and(|at| at <= now_ms)
    }

    /// The live entry of `key` at `now_ms`: `None` for a tombstone or a
    /// record that has expired (expiry is exact on read; the reaper only
    /// tidies up and notifies).
    pub fn entry(&self, key: &[u8], now_ms: u64) -> Option<Entry> {
        if self.tombstone || self.expired(now_ms) {
            return None;
        }
        let extras = Extras {
            expires_at: self.expires_at,
            fencing_token: self.fencing_token.clone(),
            persisted: false,
        };
        Some(Entry::new(key, &self.value, self.version, extras))
    }

    /// The version as the wire shows it, with the node that made it.
    pub fn version_text(&self) -> statestore::hlc::Stamp {
        self.version.format(&self.node)
    }
}

/// A request's identity in records: the first 8 bytes of SHA-256 over the
/// client id and the Correlation Data.
pub fn request_id(client_id: &str, correlation: &[u8]) -> u64 {
    use sha2::Digest;
    let mut hash = sha2::Sha256::new();
    hash.update((client_id.len() as u64).to_be_bytes());
    hash.update(client_id.as_bytes());
    hash.update(correlation);
    let digest = hash.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Corrupt> {
        if self.0.len() < n {
            return Err(Corrupt);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, Corrupt> {
        Ok(self.take(1)?[0])
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Corrupt> {
        self.take(N)?.try_into().map_err(|_| Corrupt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Record {
        Record {
            tombstone: false,
            after_expiry: true,
            version: Version {
                wall_ms: 1_700_000_000_000,
                counter: 3,
            },
            node: "sb2".into(),
            expires_at: Some(1_700_000_005_000),
            fencing_token: Some("1700000000000:1:sb1".parse().unwrap()),
            request: 42,
            value: b"busy".to_vec(),
        }
    }

    #[test]
    fn records_round_trip() {
        let r = record();
        assert_eq!(Record::decode(&r.encode()), Ok(r.clone()));
        let token = r.fencing_token.as_ref().unwrap().to_string().len();
        assert_eq!(
            Record::encoded_len(r.node.len(), token, r.value.len()),
            r.encode().len()
        );
        let tomb = Record {
            tombstone: true,
            after_expiry: false,
            value: Vec::new(),
            fencing_token: None,
            expires_at: None,
            ..r
        };
        assert_eq!(Record::decode(&tomb.encode()), Ok(tomb));
    }

    #[test]
    fn damaged_records_are_errors_not_panics() {
        let bytes = record().encode();
        for cut in 0..bytes.len() - 4 {
            assert!(Record::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut other = bytes.clone();
        other[0] = 9;
        assert_eq!(Record::decode(&other), Err(Corrupt));
        assert_eq!(Record::decode(b""), Err(Corrupt));
    }

    #[test]
    fn tombstones_and_expired_records_read_as_absent() {
        let r = record();
        let at = r.expires_at.unwrap();
        assert_eq!(r.entry(b"k", at - 1).unwrap().value(), b"busy");
        assert!(r.entry(b"k", at).is_none());
        assert!(!r.expired(at - 1) && r.expired(at));
        let tomb = Record {
            tombstone: true,
            ..record()
        };
        assert!(tomb.entry(b"k", 0).is_none());
        assert!(!tomb.expired(at), "a tombstone is deleted, not expired");
        assert_eq!(r.version_text(), "001700000000000:00003:sb2");
    }

    #[test]
    fn request_ids_separate_clients_and_requests() {
        let a = request_id("c1", b"x");
        assert_eq!(a, request_id("c1", b"x"));
        assert_ne!(a, request_id("c1", b"y"));
        assert_ne!(a, request_id("c2", b"x"));
        assert_ne!(request_id("c1", b"1x"), request_id("c11", b"x"));
    }
}
