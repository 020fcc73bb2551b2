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
//! So the decision is taken again at each PUBREL ([`Origins::released`]),
//! and the node may hold both copies at once: the first, its PUBREL late
//! (its node paused past its lease, its link's connection broken, the
//! PUBREL sent again on the link's next connection), and the copy sent
//! again through the publisher's new node, or by the publisher itself
//! to this node. The second of them released is discarded (router patch
//! 35: its PUBREL goes to the router marked [`router::DISCARD`]). A late
//! first copy is told by where it comes from: not the connection the
//! copy sent again came on, which is the one the publisher's next
//! messages come on; and within [`Origins::LATE`], while the first
//! node's link session may keep it here. The origins held until their
//! PUBREL are kept by the connection's client id, not by the
//! connection, for the PUBREL sent again on a link's next connection.
//!
//! Packet ids are used again for new messages: the digest (the first 8
//! bytes of SHA-256 over topic and payload) tells the message sent again
//! from an older one on the same id whose first copy came when this
//! one's did not. A new message on the same id with the same topic and
//! payload, whose first copy was lost with its node, is taken for the
//! older one: its subscribers have that content once, not twice.
//! A publish without DUP is always new.
//!
//! Remembered: the last [`Origins::MAX`] origins, and as many held
//! (oldest forgotten first; a publisher sends a publish again within
//! seconds of its node's death, and this holds far more than the QoS 2
//! publishes of those seconds).

use std::hash::RandomState;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hashlink::LinkedHashMap;
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
pub struct Origins {
    seen: Mutex<Seen>,
}

/// Publisher and packet id.
type Key = (Arc<str>, u16);

struct Seen {
    /// The last message released here, by publisher and packet id
    /// (oldest first, forgotten past [`Origins::MAX`]).
    last: LinkedHashMap<Key, Last, RandomState>,
    /// The origins of QoS 2 publishes held until their PUBREL, by the
    /// connection's client id (a link's, or a client's) and packet id
    /// (oldest first, forgotten past [`Origins::MAX`]). Kept here, not by
    /// the connection: a link that breaks sends its PUBRELs again on its
    /// next connection (a paused node's, after the pause).
    held: LinkedHashMap<Key, String, RandomState>,
}

/// The last message released on a publisher's packet id.
struct Last {
    digest: u64,
    /// Released from a copy sent again (DUP) whose first copy had not
    /// been released here: that first copy may still come (its PUBREL
    /// late), through `via`'s connection it did not come on.
    resent: Option<Resent>,
}

struct Resent {
    via: Arc<str>,
    at: Instant,
}

impl Default for Origins {
    fn default() -> Self {
        Origins {
            seen: Mutex::new(Seen {
                last: LinkedHashMap::with_hasher(RandomState::new()),
                held: LinkedHashMap::with_hasher(RandomState::new()),
            }),
        }
    }
}

impl Origins {
    /// Origins remembered, at most (and as many held).
    pub const MAX: usize = 65_536;

    /// How long after a copy sent again its late first copy is taken for
    /// it: while the first node's link session may keep that copy on
    /// this node (the link's session expiry, and its keep-alive's grace).
    pub const LATE: Duration = Duration::from_secs(super::peers::LINK_SESSION_EXPIRY as u64 + 15);

    /// A QoS 2 publish `pkid` came on `via`'s connection (another node's
    /// link, or a client of this node) with `origin` (a client's: one it
    /// sent again, DUP), to wait for its PUBREL; `None` forgets an older
    /// one on that packet id.
    pub fn hold(&self, via: &str, pkid: u16, origin: Option<String>) {
        let mut seen = self.seen.lock();
        let key = (Arc::from(via), pkid);
        match origin {
            Some(origin) => {
                seen.held.insert(key, origin);
                if seen.held.len() > Self::MAX {
                    seen.held.pop_front();
                }
            }
            None => {
                seen.held.remove(&key);
            }
        }
    }

    /// The PUBREL of `via`'s QoS 2 publish `pkid` came: whether its
    /// router is to deliver it (see [`Origins::release`]); `true` for one
    /// without a held origin.
    pub fn released(&self, via: &str, pkid: u16) -> bool {
        let origin = self.seen.lock().held.remove(&(Arc::from(via), pkid));
        match origin.as_deref().map(|o| (o, parse_origin(o))) {
            Some((_, Some(arrival))) => self.release(&arrival, via),
            Some((origin, None)) => {
                tracing::debug!(origin, "a held publish's origin cannot be read");
                true
            }
            None => true,
        }
    }

    /// A QoS 2 publish with `arrival`'s origin is released here through
    /// `via`'s connection: whether it is to be delivered. Not if this
    /// node had the message already: a copy sent again (DUP) of the last
    /// message released on its publisher's packet id, or the first copy
    /// of one whose copy sent again was released first, coming late
    /// through another connection (its node paused, or its PUBREL late).
    /// A publish without DUP through the connection its copy sent again
    /// came on is a new message. Otherwise it is the last message on its
    /// publisher's packet id from now on.
    pub fn release(&self, arrival: &Arrival<'_>, via: &str) -> bool {
        let mut seen = self.seen.lock();
        let key = (Arc::from(arrival.client), arrival.pkid);
        if let Some(last) = seen.last.get_mut(&key)
            && last.digest == arrival.digest
        {
            if arrival.resent {
                return false;
            }
            if let Some(resent) = &last.resent
                && *resent.via != *via
                && resent.at.elapsed() < Self::LATE
            {
                last.resent = None;
                return false;
            }
        }
        let resent = arrival.resent.then(|| Resent {
            via: Arc::from(via),
            at: Instant::now(),
        });
        seen.last.insert(
            key,
            Last {
                digest: arrival.digest,
                resent,
            },
        );
        if seen.last.len() > Self::MAX {
            seen.last.pop_front();
        }
        true
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

    /// Whether `client`'s QoS 2 publish `pkid` with `digest`, which it
    /// sends again here (DUP) after its node died, came from that node.
    pub fn had(&self, client: &str, pkid: u16, digest: u64) -> bool {
        self.seen
            .lock()
            .last
            .get(&(Arc::from(client), pkid))
            .is_some_and(|last| last.digest == digest)
    }

    /// How many are remembered, and how many held.
    #[cfg(test)]
    fn len(&self) -> (usize, usize) {
        let seen = self.seen.lock();
        (seen.last.len(), seen.held.len())
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
        assert!(o.release(&arrival("p", 7, b"a", false), "link-a"));
        assert!(o.had("p", 7, d(b"a")));
        assert!(o.had_copy(&value(b"a", true)), "sent again: had");
        assert!(!o.had_copy(&value(b"a", false)), "without DUP: new");
        assert!(
            !o.had_copy(&value(b"b", true)),
            "sent again, its first copy never came (an older one on the id did)"
        );
        assert!(o.release(&arrival("p", 7, b"b", true), "link-b"));
        assert!(o.had("p", 7, d(b"b")), "now the last on the id");
        assert!(!o.had("p", 7, d(b"a")));
        assert!(!o.had("q", 7, d(b"b")), "another publisher's");
        assert!(!o.had_copy("garbage"));
    }

    /// Two copies of one message held at once, released in either order:
    /// the second released is not delivered.
    #[test]
    fn the_second_copy_released_of_a_message_is_not_delivered() {
        // The first copy's PUBREL first, then the copy sent again's.
        let o = Origins::default();
        assert!(o.release(&arrival("p", 7, b"m", false), "link-a"));
        assert!(!o.release(&arrival("p", 7, b"m", true), "link-b"));
        // The copy sent again first, then the first copy's, late, through
        // the first node's link.
        let o = Origins::default();
        assert!(o.release(&arrival("p", 7, b"m", true), "link-b"));
        assert!(!o.release(&arrival("p", 7, b"m", false), "link-a"));
        // Taken for the late first copy once only: the same message again
        // on the id, through either connection, is new.
        assert!(o.release(&arrival("p", 7, b"m", false), "link-a"));
        assert!(o.release(&arrival("p", 7, b"m", false), "link-b"));
        // The publisher's next message with the same content on the id,
        // through the connection its copy sent again came on, is new too.
        let o = Origins::default();
        assert!(o.release(&arrival("p", 7, b"m", true), "p"));
        assert!(o.release(&arrival("p", 7, b"m", false), "p"));
        // A first copy of another message, or another publisher's, is new.
        let o = Origins::default();
        assert!(o.release(&arrival("p", 7, b"m", true), "link-b"));
        assert!(o.release(&arrival("p", 7, b"n", false), "link-a"));
        assert!(o.release(&arrival("q", 7, b"m", false), "link-a"));
    }

    /// What waits for its PUBREL is kept by connection and packet id, so
    /// that a PUBREL on the connection's next connection finds it.
    #[test]
    fn a_held_origin_decides_at_its_pubrel() {
        let o = Origins::default();
        o.hold("link-a", 1, Some(origin("p", 7, false, b"t", b"m")));
        o.hold("link-b", 1, Some(origin("p", 7, true, b"t", b"m")));
        assert!(o.released("link-b", 1), "the copy sent again, first");
        assert!(!o.released("link-a", 1), "the first copy, late");
        assert!(o.released("link-a", 1), "nothing held: released as it is");
        o.hold("p", 3, Some(origin("p", 3, true, b"t", b"x")));
        o.hold("p", 3, None);
        assert!(o.released("p", 3));
        assert!(
            !o.had("p", 3, digest(b"t", b"x")),
            "forgotten, not released"
        );
        o.hold("link-a", 2, Some("garbage".into()));
        assert!(o.released("link-a", 2), "an origin that cannot be read");
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
            let pkid = (n % 60_000) as u16 + 1;
            o.release(&arrival(&client, pkid, b"m", false), "link");
            o.hold(
                &client,
                pkid,
                Some(origin(&client, pkid, false, b"t", b"m")),
            );
        }
        assert_eq!(o.len(), (Origins::MAX, Origins::MAX));
        let d = digest(b"t", b"m");
        assert!(!o.had("c0", 1, d), "the oldest went");
        assert!(o.had("c0", 2, d));
        assert!(o.had("c1", (Origins::MAX % 60_000) as u16 + 1, d));
    }
}
