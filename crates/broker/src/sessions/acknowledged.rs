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
//! - at QoS 1, the last requests run, each with its packet id, its
//!   correlation data and the persistence batch its answer waits for: a
//!   PUBLISH with DUP 1 is the newest of them with its packet id if its
//!   correlation data is the same. Running one costs a ring entry (no
//!   map: only a resent request looks them through).
//!
//! The record is shared by the session's connections (the new connection
//! may read the resent request before the old one has ended), starts empty
//! with a new session, and ends with it. Only unacknowledged publishes are
//! resent, and a client may have at most the Receive Maximum of them, so
//! the QoS 1 part keeps the last that many requests (the listener's
//! `receive_maximum`, 1,000 by default; the same for 3.1.1 clients); the
//! QoS 2 part holds at most one entry per packet id.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::persistence::Batch;

/// What a request's answer waits for: a batch, or nothing (it is out).
pub type Wait = Option<Batch>;

/// A session's record, shared by its connections.
pub type SharedAcknowledged = Arc<Mutex<Acknowledged>>;

/// What a session remembers of the requests it acknowledged.
#[derive(Debug, Default)]
pub struct Acknowledged {
    /// QoS 1: the last requests run, oldest first. Looked through only
    /// when a request comes with DUP 1, after a reconnect.
    qos1: VecDeque<Ran>,
    /// QoS 2: acknowledged with PUBREC, waiting for PUBREL, with what the
    /// answer waits for.
    awaiting_pubrel: HashMap<u16, Wait>,
}

/// A QoS 1 request that ran.
#[derive(Debug, Clone, Copy)]
struct Ran {
    pkid: u16,
    correlation: Correlation,
    /// What its answer waits for.
    wait: Wait,
}

/// Correlation data as kept: up to 16 bytes as they are (the SDK's are
/// 16), longer ones as a digest (SipHash with fixed keys: a client can
/// only make its own requests collide).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Correlation {
    len: u8,
    bytes: [u8; 16],
}

impl Correlation {
    fn of(data: &[u8]) -> Correlation {
        let mut bytes = [0; 16];
        match u8::try_from(data.len()) {
            Ok(len) if data.len() <= bytes.len() => {
                bytes[..data.len()].copy_from_slice(data);
                Correlation { len, bytes }
            }
            _ => {
                let digest = BuildHasherDefault::<DefaultHasher>::default().hash_one(data);
                bytes[..8].copy_from_slice(&digest.to_le_bytes());
                Correlation {
                    len: u8::MAX,
                    bytes,
                }
            }
        }
    }
}

impl Acknowledged {
    /// A QoS 1 request with `pkid` and `correlation` data ran; its answer
    /// waits for `wait`. The last `keep` are remembered.
    pub fn ran(&mut self, pkid: u16, correlation: &[u8], wait: Wait, keep: usize) {
        while self.qos1.len() >= keep.max(1) {
            self.qos1.pop_front();
        }
        self.qos1.push_back(Ran {
            pkid,
            correlation: Correlation::of(correlation),
            wait,
        });
    }

    /// Whether a QoS 1 PUBLISH with DUP 1, `pkid` and `correlation` is the
    /// request that ran last with that packet id: then what its answer
    /// waits for.
    pub fn resent(&self, pkid: u16, correlation: &[u8]) -> Option<Wait> {
        let last = self.qos1.iter().rev().find(|ran| ran.pkid == pkid)?;
        (last.correlation == Correlation::of(correlation)).then_some(last.wait)
    }

    /// A QoS 2 request with `pkid` was acknowledged with PUBREC.
    pub fn received(&mut self, pkid: u16) {
        self.awaiting_pubrel.entry(pkid).or_insert(None);
    }

    /// The QoS 2 request `pkid` ran; its answer waits for `wait`.
    pub fn ran_qos2(&mut self, pkid: u16, wait: Wait) {
        if let Some(waits_for) = self.awaiting_pubrel.get_mut(&pkid) {
            *waits_for = wait;
        }
    }

    /// Whether a QoS 2 request with `pkid` was acknowledged and not yet
    /// released (a PUBLISH with it is a retransmission): then what its
    /// answer waits for.
    pub fn received_waiting(&self, pkid: u16) -> Option<Wait> {
        self.awaiting_pubrel.get(&pkid).copied()
    }

    /// PUBREL `pkid`: whether it released a request acknowledged here (then
    /// it gets its PUBCOMP here; otherwise it is the router's).
    pub fn release(&mut self, pkid: u16) -> bool {
        self.awaiting_pubrel.remove(&pkid).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sessions::Sessions;
    use crate::sessions::tests::{mailbox, peer};
    use tokio::sync::mpsc;

    /// Waits for batch `n` (0: for nothing).
    fn b(n: u64) -> Wait {
        Batch::new(n)
    }

    #[test]
    fn a_qos1_request_is_known_by_packet_id_and_correlation_data() {
        let mut seen = Acknowledged::default();
        assert_eq!(seen.resent(7, b"a"), None);
        seen.ran(7, b"a", b(3), 10);
        assert_eq!(seen.resent(7, b"a"), Some(b(3)));
        assert_eq!(seen.resent(7, b"b"), None, "another request with that id");
        assert_eq!(seen.resent(8, b"a"), None);
        seen.ran(7, b"b", b(0), 10);
        assert_eq!(seen.resent(7, b"a"), None, "the id was used again");
        assert_eq!(seen.resent(7, b"b"), Some(b(0)));
    }

    #[test]
    fn only_the_last_requests_are_remembered() {
        let mut seen = Acknowledged::default();
        for pkid in 1..=5 {
            seen.ran(pkid, b"c", b(0), 3);
        }
        assert_eq!(seen.resent(2, b"c"), None, "older than the last 3");
        assert_eq!(seen.resent(3, b"c"), Some(b(0)));
        // An id used again stays with its newer request.
        seen.ran(3, b"d", b(0), 3);
        seen.ran(6, b"c", b(0), 3);
        seen.ran(7, b"c", b(0), 3);
        assert_eq!(
            seen.resent(3, b"d"),
            Some(b(0)),
            "not evicted with its old use"
        );
        assert_eq!(seen.qos1.len(), 3);
    }

    #[test]
    fn long_correlation_data_is_compared_by_digest() {
        let mut seen = Acknowledged::default();
        let long = [7u8; 40];
        let mut other = long;
        other[39] = 8;
        seen.ran(1, &long, b(0), 10);
        assert_eq!(seen.resent(1, &long), Some(b(0)));
        assert_eq!(seen.resent(1, &other), None);
        assert_eq!(seen.resent(1, &long[..16]), None, "16 bytes as they are");
    }

    #[test]
    fn a_qos2_request_is_known_until_released() {
        let mut seen = Acknowledged::default();
        assert_eq!(seen.received_waiting(5), None);
        seen.received(5);
        assert_eq!(seen.received_waiting(5), Some(b(0)));
        seen.ran_qos2(5, b(9));
        seen.received(5); // acknowledged again: still waits for batch 9
        assert_eq!(seen.received_waiting(5), Some(b(9)));
        assert!(!seen.release(6), "not acknowledged here");
        assert!(seen.release(5));
        assert_eq!(seen.received_waiting(5), None);
        assert!(!seen.release(5));
    }

    /// (Before the router owned sessions, this test also checked the
    /// broker's copy of the session rules; whether a session is kept is
    /// now the router's, checked in `router::subscriptions` and end to end
    /// in `tests/mqtt5.rs`.)
    #[test]
    fn a_session_keeps_its_record_of_requests_while_the_router_resumes_it() {
        let s = Sessions::new(Arc::default());
        let (tx, _rx) = mpsc::unbounded_channel();
        let first = s.connected("r", 1, false, mailbox(tx.clone()), peer());
        let taken_over = s.connected("r", 2, true, mailbox(tx.clone()), peer());
        assert!(Arc::ptr_eq(&first, &taken_over), "taken over: shared");
        s.disconnected("r", 2, 60);
        let resumed = s.connected("r", 3, true, mailbox(tx.clone()), peer());
        assert!(Arc::ptr_eq(&first, &resumed), "resumed");
        let clean = s.connected("r", 4, false, mailbox(tx.clone()), peer());
        assert!(!Arc::ptr_eq(&first, &clean), "a new session starts afresh");
        s.disconnected("r", 4, 0);
        assert_eq!(s.tracked(), 0, "ends with its connection");
    }
}
