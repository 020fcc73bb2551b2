//! QoS 2 publishes a node has had from other nodes, by their origin: the
//! publisher's client id and packet id, and a digest of the message.
//!
//! A publisher's node may die after forwarding its QoS 2 publish and
//! before its PUBREC. The publisher then resumes its session on another
//! node and sends the publish again, with DUP and the same packet id
//! (MQTT 5 4.3.3): that node's router, and every other node's, would take
//! it for a new message, and their subscribers would get it twice. So a
//! node forwards each QoS 2 publish with its origin (the User Property
//! [`crate::publisher::ORIGIN`], removed before anyone subscribed gets
//! it), the other nodes remember the last origin they had for each
//! publisher and packet id, and a publish sent again (DUP) with the same
//! origin goes no further there: not to its subscribers (the publisher's
//! new node answers PUBREC itself), and on to the other nodes still,
//! each of which may have missed the first copy.
//!
//! A node has a forwarded QoS 2 publish once the link's PUBREL released
//! it to the router (which holds a QoS 2 publish until then, router
//! patch 6): a first copy whose PUBREL died with its node was never
//! delivered, and the copy sent again must be. (Remembered at the
//! PUBLISH, a first version lost such messages in the fault run.)
//!
//! Packet ids are used again for new messages: the digest (the first 8
//! bytes of SHA-256 over topic and payload) tells the message sent again
//! from an older one on the same id whose first copy came when this
//! one's did not. A new message on the same id with the same topic and
//! payload, whose first copy was lost with its node, is taken for the
//! older one: its subscribers have that content once, not twice.
//! A publish without DUP is always new.
//!
//! Remembered: the last [`Origins::MAX`] origins (oldest forgotten first;
//! a publisher sends a publish again within seconds of its node's death,
//! and this holds far more than the QoS 2 publishes of those seconds).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use parking_lot::Mutex;

/// The [`crate::publisher::ORIGIN`] of `client`'s QoS 2 publish `pkid`
/// of `topic` and `payload` (`resent`: DUP).
pub fn origin(client: &str, pkid: u16, resent: bool, topic: &[u8], payload: &[u8]) -> String {
    format!(
        "{pkid} {} {:016x} {client}",
        u8::from(resent),
        digest(topic, payload)
    )
}

/// A message's digest: the first 8 bytes of SHA-256 over its topic (with
/// its length) and payload.
pub fn digest(topic: &[u8], payload: &[u8]) -> u64 {
    use sha2::Digest;
    let mut hash = sha2::Sha256::new();
    hash.update((topic.len() as u64).to_be_bytes());
    hash.update(topic);
    hash.update(payload);
    let digest = hash.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// A [`crate::publisher::ORIGIN`] read back.
pub fn parse_origin(value: &str) -> Option<Arrival<'_>> {
    let mut parts = value.splitn(4, ' ');
    let pkid = parts.next()?.parse().ok().filter(|&p: &u16| p > 0)?;
    let resent = match parts.next()? {
        "0" => false,
        "1" => true,
        _ => return None,
    };
    let digest = parts.next().filter(|d| d.len() == 16)?;
    let digest = u64::from_str_radix(digest, 16).ok()?;
    let client = parts.next()?;
    Some(Arrival {
        client,
        pkid,
        digest,
        resent,
    })
}

/// A QoS 2 publish that came from another node, as its origin says.
#[derive(Debug, PartialEq, Eq)]
pub struct Arrival<'a> {
    pub client: &'a str,
    pub pkid: u16,
    pub digest: u64,
    /// Sent again (DUP) by its publisher.
    pub resent: bool,
}

/// See the module's documentation.
#[derive(Default)]
pub struct Origins {
    seen: Mutex<Seen>,
}

#[derive(Default)]
struct Seen {
    /// The last message's digest, by publisher and packet id.
    last: HashMap<(Arc<str>, u16), u64>,
    /// The keys in the order they came, for forgetting the oldest.
    order: VecDeque<(Arc<str>, u16)>,
}

impl Origins {
    /// Origins remembered, at most.
    pub const MAX: usize = 65_536;

    /// A QoS 2 publish from another node was released to this node's
    /// router (its PUBREL came: the router delivers it now): the last
    /// message on its publisher's packet id.
    pub fn release(&self, arrival: &Arrival<'_>) {
        let mut seen = self.seen.lock();
        let key = (Arc::from(arrival.client), arrival.pkid);
        if seen.last.insert(key.clone(), arrival.digest).is_none() {
            seen.order.push_back(key);
            if seen.order.len() > Self::MAX
                && let Some(oldest) = seen.order.pop_front()
            {
                seen.last.remove(&oldest);
            }
        }
    }

    /// Whether a publish forwarded with the [`crate::publisher::ORIGIN`]
    /// `value` is one sent again (DUP) whose first copy this node had.
    pub fn had_copy(&self, value: &str) -> bool {
        match parse_origin(value) {
            Some(arrival) => {
                arrival.resent && self.had(arrival.client, arrival.pkid, arrival.digest)
            }
            None => {
                tracing::debug!(
                    origin = value,
                    "a forwarded publish's origin cannot be read"
                );
                false
            }
        }
    }

    /// [`Origins::release`] for a publish forwarded with the
    /// [`crate::publisher::ORIGIN`] `value`.
    pub fn released(&self, value: &str) {
        if let Some(arrival) = parse_origin(value) {
            self.release(&arrival);
        }
    }

    /// Whether `client`'s QoS 2 publish `pkid` with `digest`, which it
    /// sends again here (DUP) after its node died, came from that node.
    pub fn had(&self, client: &str, pkid: u16, digest: u64) -> bool {
        self.seen.lock().last.get(&(Arc::from(client), pkid)) == Some(&digest)
    }

    /// How many are remembered.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.seen.lock().order.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arrival<'a>(client: &'a str, pkid: u16, payload: &[u8], resent: bool) -> Arrival<'a> {
        Arrival {
            client,
            pkid,
            digest: digest(b"t", payload),
            resent,
        }
    }

    #[test]
    fn a_publish_sent_again_is_had_once_its_first_copy_came() {
        let o = Origins::default();
        let d = |payload: &[u8]| digest(b"t", payload);
        let value = |payload: &[u8], resent| origin("p", 7, resent, b"t", payload);
        assert!(!o.had("p", 7, d(b"a")));
        assert!(!o.had_copy(&value(b"a", true)), "its first copy never came");
        o.released(&value(b"a", false));
        assert!(o.had("p", 7, d(b"a")));
        assert!(o.had_copy(&value(b"a", true)), "sent again: had");
        assert!(!o.had_copy(&value(b"a", false)), "without DUP: new");
        assert!(
            !o.had_copy(&value(b"b", true)),
            "sent again, its first copy never came (an older one on the id did)"
        );
        o.released(&value(b"b", true));
        assert!(o.had("p", 7, d(b"b")), "now the last on the id");
        assert!(!o.had("p", 7, d(b"a")));
        assert!(!o.had("q", 7, d(b"b")), "another publisher's");
        assert!(!o.had_copy("garbage"));
    }

    #[test]
    fn an_origin_reads_back() {
        let value = origin("a client", 513, true, b"t", b"x");
        assert_eq!(
            parse_origin(&value),
            Some(Arrival {
                client: "a client",
                pkid: 513,
                digest: digest(b"t", b"x"),
                resent: true
            })
        );
        assert_ne!(
            digest(b"t", b"x"),
            digest(b"tx", b""),
            "the topic's length counts"
        );
        for bad in [
            "",
            "1",
            "1 1",
            "0 0 0000000000000000 c",
            "1 2 0000000000000000 c",
            "70000 0 0000000000000000 c",
            "1 0 00 c",
            "1 0 000000000000000g c",
            "1 0 0000000000000000",
        ] {
            assert_eq!(parse_origin(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_oldest_origins_are_forgotten_past_the_bound() {
        let o = Origins::default();
        for n in 0..=Origins::MAX {
            let client = format!("c{}", n / 60_000);
            o.release(&arrival(&client, (n % 60_000) as u16 + 1, b"m", false));
        }
        assert_eq!(o.len(), Origins::MAX);
        let d = digest(b"t", b"m");
        assert!(!o.had("c0", 1, d), "the oldest went");
        assert!(o.had("c0", 2, d));
        assert!(o.had("c1", (Origins::MAX % 60_000) as u16 + 1, d));
    }
}
