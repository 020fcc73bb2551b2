//! Deliveries of MQTT messages checked against what their publishers were
//! told: the check behind the cluster's MQTT fault runs (#29).
//!
//! Each publisher numbers its messages 0, 1, 2, ... and records how many it
//! sent ([`Published::sent`]) and which of them the broker acknowledged
//! (PUBACK at QoS 1, PUBREC at QoS 2: from then on the broker owns the
//! message). Each subscriber records, in arrival order, the (publisher,
//! number) of every message it took as new ([`Received`]; at QoS 2 a
//! PUBLISH resent for a packet id not yet released is not new). The check
//! ([`check`]) tells, per subscriber:
//!
//! - **lost**: acknowledged messages it should have had and never got
//!   (which ones it should have had is the caller's `must_have`: a
//!   subscriber whose node died loses what was queued there, by design);
//! - **duplicates**: messages received more than once (allowed at QoS 1,
//!   a violation of exactly once for a QoS 2 publisher's, counted apart);
//! - **reordered**: per publisher, a message received for the first time
//!   after a later-numbered one of the same publisher;
//! - **unknown**: numbers the publisher never sent (corruption).

use std::collections::{HashMap, HashSet};
use std::fmt;

/// What one publisher sent.
#[derive(Clone, Debug, Default)]
pub struct Published {
    /// Its name, as the subscribers record it.
    pub publisher: String,
    /// The QoS it published at (0, 1 or 2).
    pub qos: u8,
    /// It sent numbers `0..sent`, each at least once.
    pub sent: u64,
    /// The numbers the broker acknowledged, in any order.
    pub acknowledged: Vec<u64>,
    /// The numbers sent again (DUP) after a reconnection, unacknowledged
    /// when the connection ended: a node that died after forwarding one
    /// and before acknowledging it gave no way to tell (at QoS 2 too).
    pub resent: Vec<u64>,
    /// How many times it had to connect again (its node died or left it).
    pub reconnects: u32,
}

/// What one subscriber took as new, in arrival order.
#[derive(Clone, Debug, Default)]
pub struct Received {
    /// Its name.
    pub subscriber: String,
    /// (publisher, number, QoS it came at) of each message. A message that
    /// came at a lower QoS than its publisher's and the subscription's was
    /// queued for a session that moved between nodes (handed over at most
    /// at QoS 1).
    pub messages: Vec<(String, u64, u8)>,
    /// How many times it had to connect again.
    pub reconnects: u32,
}

/// What [`check`] found for one subscriber.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub subscriber: String,
    /// Messages received.
    pub received: usize,
    /// Acknowledged messages `must_have` asked for.
    pub expected: usize,
    /// Of those, never received.
    pub lost: usize,
    /// The first few lost, `(publisher, number)`.
    pub lost_sample: Vec<(String, u64)>,
    /// Receptions of a message already received, QoS 0/1 publishers.
    pub duplicates: usize,
    /// Receptions of a message already received, QoS 2 publishers, of a
    /// number the publisher never sent again.
    pub duplicates_qos2: usize,
    /// The first few of those, `(publisher, number)`.
    pub duplicates_qos2_sample: Vec<(String, u64)>,
    /// The same, of numbers sent again after a reconnection
    /// ([`Published::resent`]).
    pub duplicates_qos2_resent: usize,
    /// The same, of messages one copy of which came handed over from the
    /// node a session moved from (at QoS 1).
    pub duplicates_qos2_handed_over: usize,
    /// First receptions of a number lower than one the same publisher's
    /// messages already reached.
    pub reordered: usize,
    /// The first few, `(publisher, number, highest before it)`.
    pub reordered_sample: Vec<(String, u64, u64)>,
    /// Receptions of a number (or a publisher) never sent.
    pub unknown: usize,
}

impl Report {
    /// Nothing lost, nothing received twice at QoS 2, in order, nothing
    /// made up (QoS 1 duplicates are allowed).
    pub fn is_valid(&self) -> bool {
        self.lost == 0 && self.duplicates_qos2 == 0 && self.reordered == 0 && self.unknown == 0
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} received, {} of {} expected lost, {} duplicates (QoS 1), {} duplicates (QoS 2; {} more of messages resent after a reconnection, {} of messages handed over with a session), {} reordered, {} unknown",
            self.subscriber,
            self.received,
            self.lost,
            self.expected,
            self.duplicates,
            self.duplicates_qos2,
            self.duplicates_qos2_resent,
            self.duplicates_qos2_handed_over,
            self.reordered,
            self.unknown
        )?;
        if !self.lost_sample.is_empty() {
            write!(f, "; lost e.g. {:?}", self.lost_sample)?;
        }
        if !self.duplicates_qos2_sample.is_empty() {
            write!(f, "; QoS 2 twice e.g. {:?}", self.duplicates_qos2_sample)?;
        }
        if !self.reordered_sample.is_empty() {
            write!(
                f,
                "; reordered e.g. (publisher, number, after) {:?}",
                self.reordered_sample
            )?;
        }
        Ok(())
    }
}

/// How many lost, and how many reordered, messages a [`Report`] names.
const SAMPLE: usize = 8;

/// Checks one subscriber's receptions against the publishers' records;
/// `must_have(publisher, number)` says which acknowledged messages it
/// should have received (e.g. every one, for a subscriber that stayed on
/// a live node from before the first publish).
pub fn check(
    published: &[Published],
    received: &Received,
    must_have: impl Fn(&Published, u64) -> bool,
) -> Report {
    let by_name: HashMap<&str, &Published> = published
        .iter()
        .map(|p| (p.publisher.as_str(), p))
        .collect();
    let mut report = Report {
        subscriber: received.subscriber.clone(),
        received: received.messages.len(),
        ..Report::default()
    };
    // Per publisher: how many times each number came, and the highest
    // number seen so far.
    let mut seen: HashMap<&str, (HashMap<u64, u32>, Option<u64>)> = HashMap::new();
    let resent: HashMap<&str, HashSet<u64>> = published
        .iter()
        .map(|p| (p.publisher.as_str(), p.resent.iter().copied().collect()))
        .collect();
    // QoS 2 publishers' messages that came at a lower QoS: handed over.
    let handed_over: HashSet<(&str, u64)> = received
        .messages
        .iter()
        .filter(|(p, _, qos)| by_name.get(p.as_str()).is_some_and(|p| p.qos > *qos))
        .map(|(p, n, _)| (p.as_str(), *n))
        .collect();
    for (publisher, n, _) in &received.messages {
        let Some(p) = by_name.get(publisher.as_str()) else {
            report.unknown += 1;
            continue;
        };
        if *n >= p.sent {
            report.unknown += 1;
            continue;
        }
        let (counts, highest) = seen.entry(p.publisher.as_str()).or_default();
        let count = counts.entry(*n).or_insert(0);
        *count += 1;
        if *count > 1 {
            if p.qos == 2 && resent[p.publisher.as_str()].contains(n) {
                report.duplicates_qos2_resent += 1;
            } else if p.qos == 2 && handed_over.contains(&(p.publisher.as_str(), *n)) {
                report.duplicates_qos2_handed_over += 1;
            } else if p.qos == 2 {
                report.duplicates_qos2 += 1;
                if report.duplicates_qos2_sample.len() < SAMPLE {
                    report
                        .duplicates_qos2_sample
                        .push((p.publisher.clone(), *n));
                }
            } else {
                report.duplicates += 1;
            }
            continue;
        }
        match highest {
            Some(h) if *h > *n => {
                report.reordered += 1;
                if report.reordered_sample.len() < SAMPLE {
                    report.reordered_sample.push((p.publisher.clone(), *n, *h));
                }
            }
            _ => *highest = Some(*n),
        }
    }
    for p in published {
        let counts = seen.get(p.publisher.as_str()).map(|(c, _)| c);
        for &n in &p.acknowledged {
            if !must_have(p, n) {
                continue;
            }
            report.expected += 1;
            if !counts.is_some_and(|c| c.contains_key(&n)) {
                report.lost += 1;
                if report.lost_sample.len() < SAMPLE {
                    report.lost_sample.push((p.publisher.clone(), n));
                }
            }
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn publisher(name: &str, qos: u8, sent: u64, acknowledged: &[u64]) -> Published {
        Published {
            publisher: name.into(),
            qos,
            sent,
            acknowledged: acknowledged.to_vec(),
            resent: Vec::new(),
            reconnects: 0,
        }
    }

    /// Messages at QoS 2 (the subscriptions' and the publishers' at most).
    fn received(messages: &[(&str, u64)]) -> Received {
        Received {
            subscriber: "s".into(),
            messages: messages
                .iter()
                .map(|(p, n)| (p.to_string(), *n, 2))
                .collect(),
            reconnects: 0,
        }
    }

    #[test]
    fn every_acknowledged_message_once_in_order_is_valid() {
        let published = [
            publisher("a", 1, 3, &[0, 1, 2]),
            publisher("b", 2, 2, &[1, 0]),
        ];
        let report = check(
            &published,
            &received(&[("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2)]),
            |_, _| true,
        );
        assert!(report.is_valid(), "{report}");
        assert_eq!((report.received, report.expected), (5, 5));
    }

    #[test]
    fn an_acknowledged_message_missing_is_lost_unless_not_required() {
        let published = [publisher("a", 1, 4, &[0, 1, 2])];
        let got = received(&[("a", 0), ("a", 2), ("a", 3)]);
        let report = check(&published, &got, |_, _| true);
        assert_eq!(report.lost, 1);
        assert_eq!(report.lost_sample, vec![("a".to_string(), 1)]);
        assert!(!report.is_valid());
        // Not acknowledged (3) was never required; 1 not required here.
        let report = check(&published, &got, |_, n| n != 1);
        assert!(report.is_valid(), "{report}");
        assert_eq!(report.expected, 2);
    }

    #[test]
    fn duplicates_are_allowed_at_qos_1_and_flagged_at_qos_2() {
        let published = [publisher("a", 1, 2, &[0, 1]), publisher("b", 2, 2, &[0, 1])];
        let report = check(
            &published,
            &received(&[("a", 0), ("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 1)]),
            |_, _| true,
        );
        assert_eq!((report.duplicates, report.duplicates_qos2), (1, 1));
        assert_eq!(report.duplicates_qos2_sample, [("b".to_owned(), 1)]);
        assert!(
            report.to_string().contains("QoS 2 twice e.g. [(\"b\", 1)]"),
            "{report}"
        );
        assert!(!report.is_valid());
        // A QoS 2 message its publisher had to send again to another node
        // is counted apart, and allowed.
        let mut published = published;
        published[1].resent = vec![1];
        let report = check(
            &published,
            &received(&[("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 1)]),
            |_, _| true,
        );
        assert_eq!(
            (report.duplicates_qos2, report.duplicates_qos2_resent),
            (0, 1)
        );
        assert!(report.is_valid(), "{report}");
    }

    #[test]
    fn a_message_first_received_after_a_later_one_is_reordered() {
        let published = [
            publisher("a", 1, 4, &[0, 1, 2, 3]),
            publisher("b", 1, 1, &[0]),
        ];
        // A redelivery of 1 after 2 is a duplicate, not a reordering; 0
        // after 3 is one; another publisher's numbers do not count.
        let report = check(
            &published,
            &received(&[("a", 1), ("b", 0), ("a", 2), ("a", 1), ("a", 3), ("a", 0)]),
            |_, _| true,
        );
        assert_eq!((report.reordered, report.duplicates), (1, 1));
        assert_eq!(report.reordered_sample, vec![("a".to_string(), 0, 3)]);
        assert!(!report.is_valid());
    }

    #[test]
    fn numbers_or_publishers_never_sent_are_unknown() {
        let published = [publisher("a", 1, 1, &[0])];
        let report = check(
            &published,
            &received(&[("a", 0), ("a", 1), ("z", 0)]),
            |_, _| true,
        );
        assert_eq!(report.unknown, 2);
        assert!(!report.is_valid());
    }
}
