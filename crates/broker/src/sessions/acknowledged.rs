//! State store requests a session has run, so that one its client sends
//! again after reconnecting is acknowledged again, not run again.
//!
//! A client whose QoS 1 or 2 PUBLISH was not acknowledged before its
//! connection broke sends it again once reconnected to its session, with
//! DUP 1 and the same packet id (MQTT 4.4). Ordinary publishes are the
//! router's: it keeps QoS 2 packet ids until PUBREL, and QoS 1 is at least
//! once. A state store request is run by the broker, and run twice it is
//! not the same request: a `SET NX` answers `:-1` the second time, and any
//! SET moves the key's version again, so a lock holder's fencing token goes
//! stale. The acknowledgement of a persisted change also waits for the disk
//! (see `connection/hold.rs`), which widens the window.
//!
//! So the session remembers, for the requests of its connections:
//!
//! - at QoS 2, the packet ids acknowledged with PUBREC and not yet released
//!   by PUBREL (the session state MQTT 4.3.3 requires): a PUBLISH with one
//!   of them is the same request, a PUBREL for one gets its PUBCOMP;
//! - at QoS 1, for each packet id, a digest of the correlation data of the
//!   last request run with it, and the persistence batch its answer waits
//!   for: a PUBLISH with DUP 1, that packet id and that correlation data is
//!   that request again.
//!
//! The record is shared by the session's connections (the new connection
//! may read the resent request before the old one has ended), starts empty
//! with a new session, and ends with it. It holds at most one entry per
//! packet id (65,535) of each kind.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
use std::sync::Arc;

use parking_lot::Mutex;

/// A session's record, shared by its connections.
pub type SharedAcknowledged = Arc<Mutex<Acknowledged>>;

/// What a session remembers of the requests it acknowledged.
#[derive(Debug, Default)]
pub struct Acknowledged {
    /// QoS 1: packet id -> (digest of the correlation data, batch).
    qos1: HashMap<u16, (u64, u64)>,
    /// QoS 2: acknowledged with PUBREC, waiting for PUBREL.
    awaiting_pubrel: HashSet<u16>,
}

/// The digest of a request's correlation data (SipHash with fixed keys: a
/// client can only make its own requests collide).
fn digest(correlation: &[u8]) -> u64 {
    BuildHasherDefault::<DefaultHasher>::default().hash_one(correlation)
}

impl Acknowledged {
    /// A QoS 1 request with `pkid` and `correlation` data ran; its answer
    /// waits for persistence batch `seq` (0: none).
    pub fn ran(&mut self, pkid: u16, correlation: &[u8], seq: u64) {
        self.qos1.insert(pkid, (digest(correlation), seq));
    }

    /// Whether a QoS 1 PUBLISH with DUP 1, `pkid` and `correlation` is the
    /// request that ran last with that packet id: then the batch its answer
    /// waits for (0: none).
    pub fn resent(&self, pkid: u16, correlation: &[u8]) -> Option<u64> {
        match self.qos1.get(&pkid) {
            Some(&(seen, seq)) if seen == digest(correlation) => Some(seq),
            _ => None,
        }
    }

    /// A QoS 2 request with `pkid` was acknowledged with PUBREC.
    pub fn received(&mut self, pkid: u16) {
        self.awaiting_pubrel.insert(pkid);
    }

    /// Whether a QoS 2 request with `pkid` was acknowledged and not yet
    /// released (a PUBLISH with it is a retransmission).
    pub fn is_received(&self, pkid: u16) -> bool {
        self.awaiting_pubrel.contains(&pkid)
    }

    /// PUBREL `pkid`: whether it released a request acknowledged here (then
    /// it gets its PUBCOMP here; otherwise it is the router's).
    pub fn release(&mut self, pkid: u16) -> bool {
        self.awaiting_pubrel.remove(&pkid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_qos1_request_is_known_by_packet_id_and_correlation_data() {
        let mut seen = Acknowledged::default();
        assert_eq!(seen.resent(7, b"a"), None);
        seen.ran(7, b"a", 3);
        assert_eq!(seen.resent(7, b"a"), Some(3));
        assert_eq!(seen.resent(7, b"b"), None, "another request with that id");
        assert_eq!(seen.resent(8, b"a"), None);
        seen.ran(7, b"b", 0);
        assert_eq!(seen.resent(7, b"a"), None, "the id was used again");
        assert_eq!(seen.resent(7, b"b"), Some(0));
    }

    #[test]
    fn a_qos2_request_is_known_until_released() {
        let mut seen = Acknowledged::default();
        assert!(!seen.is_received(5));
        seen.received(5);
        assert!(seen.is_received(5));
        assert!(!seen.release(6), "not acknowledged here");
        assert!(seen.release(5));
        assert!(!seen.is_received(5));
        assert!(!seen.release(5));
    }
}
