//! Who receives a message, asked of the subscription mirror: direct
//! delivery to one client, whether a client is a topic's only subscriber,
//! and which persistent sessions a publish reaches.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use router::protocol;

use super::wild::bare;
use super::{Direct, Mailbox, Sessions, Sub, ToConnection, Undelivered};

/// What the subscriptions `filters` grant a message on `topic`: the
/// highest QoS of those that match it, and their Subscription
/// Identifiers; `None` if none matches. Shared subscriptions count only
/// with `shared`.
pub fn granted<'a>(
    filters: impl IntoIterator<Item = (&'a String, &'a Sub)>,
    topic: &str,
    shared: bool,
) -> Option<(u8, Vec<usize>)> {
    let mut granted = None;
    let mut ids = Vec::new();
    for (filter, sub) in filters {
        // An exact filter equal to the topic (a response topic, typically)
        // matches without splitting both into levels.
        let bare = bare(filter);
        if (shared || !filter.starts_with("$share/"))
            && (bare == topic || protocol::matches(topic, bare))
        {
            granted = granted.max(Some(sub.qos));
            ids.extend(sub.id);
        }
    }
    granted.map(|qos| (qos, ids))
}

impl Sessions {
    /// Delivers to `client` if it is connected and one of its subscriptions
    /// matches the message's topic, at the smaller of the message's QoS and
    /// the subscription's. Returns `Err` with the message when it could not
    /// be delivered, or that it was dropped because the client's queue is
    /// full.
    pub fn deliver(&self, client: &str, mut message: Direct) -> Result<(), Undelivered> {
        let no_recipient = |message| Err(Undelivered::NoRecipient(Box::new(message)));
        let inner = self.inner.read();
        let Some(state) = inner.clients.get(client) else {
            return no_recipient(message);
        };
        let Some(live) = &state.live else {
            return no_recipient(message);
        };
        let Ok(topic) = std::str::from_utf8(&message.topic) else {
            return no_recipient(message);
        };
        let Some((granted, ids)) = granted(&state.filters, topic, true) else {
            return no_recipient(message);
        };
        message.qos = message.qos.min(granted).min(1);
        message.properties.subscription_identifiers = ids;
        let Mailbox { tx, bound } = &live.mailbox;
        let size = message.size();
        if !bound.reserve(size) {
            crate::metrics::dropped(crate::metrics::DropReason::QueueFull, 1);
            if bound.overflow_once() {
                let _ = tx.send(ToConnection::Overflow);
            }
            return Err(Undelivered::Overflow);
        }
        match tx.send(ToConnection::Deliver(Box::new(message))) {
            Err(tokio::sync::mpsc::error::SendError(ToConnection::Deliver(message))) => {
                bound.release(size);
                Err(Undelivered::NoRecipient(message))
            }
            _ => Ok(()),
        }
    }

    /// The clients with a saved persistent session that a QoS 1/2 publish
    /// of `publisher` on `topic` reaches: through a subscription of QoS 1
    /// or 2 (not a shared one; not with No Local if they published it).
    pub fn persistent_recipients(&self, publisher: &str, topic: &str) -> Vec<Arc<str>> {
        if self.journaled.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        let inner = self.inner.read();
        let reaches = |client: &Arc<str>, filter: &str| {
            inner.clients.get(client).is_some_and(|c| {
                c.journaled
                    && c.filters
                        .get(filter)
                        .is_some_and(|sub| sub.qos > 0 && !(sub.no_local && &**client == publisher))
            })
        };
        let mut found: Vec<Arc<str>> = Vec::new();
        if let Some(set) = inner.exact.get(topic) {
            found.extend(set.iter().filter(|c| reaches(c, topic)).cloned());
        }
        for (filter, client) in inner.wild.candidates(topic) {
            if !filter.starts_with("$share/")
                && !found.contains(client)
                && reaches(client, filter)
                && protocol::matches(topic, filter)
            {
                found.push(Arc::clone(client));
            }
        }
        found
    }

    /// Whether `client` is the only one whose subscriptions could match
    /// `topic` (outside the notification namespace).
    pub fn only_subscriber(&self, client: &str, topic: &str) -> bool {
        let inner = self.inner.read();
        if let Some(set) = inner.exact.get(topic)
            && set.iter().any(|c| &**c != client)
        {
            return false;
        }
        !inner.wild.candidates(topic).into_iter().any(|(filter, c)| {
            if &**c == client && !filter.starts_with("$share/") {
                return false;
            }
            protocol::matches(topic, bare(filter))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sessions::tests::{mailbox, peer, sub};
    use crate::sessions::{Journal, SavedSession};
    use tokio::sync::mpsc;

    /// A journal that keeps nothing.
    struct NoDisk;
    impl Journal for NoDisk {
        fn save(&self, _: &str, _: &SavedSession) -> u64 {
            0
        }
        fn remove(&self, _: &str) {}
    }

    #[test]
    fn persistent_recipients_follow_the_journal() {
        let s = Sessions::default();
        s.set_journal(Arc::new(NoDisk));
        let (tx, _rx) = mpsc::unbounded_channel();
        let reached = |publisher, topic| {
            let mut names: Vec<String> = s
                .persistent_recipients(publisher, topic)
                .iter()
                .map(|c| c.to_string())
                .collect();
            names.sort();
            names
        };
        s.connected("clean", 1, true, 0, mailbox(tx.clone()), peer());
        s.subscribe("clean", &[("a/#", sub(1))]);
        assert!(
            reached("p", "a/1").is_empty(),
            "a clean session is never saved for"
        );
        // Restored after a restart, not reconnected yet.
        s.restore(
            "r",
            vec![("a/+".into(), sub(2)), ("zero/#".into(), sub(0))],
            None,
        );
        assert_eq!(reached("p", "a/1"), ["r"]);
        assert!(reached("p", "zero/x").is_empty(), "a QoS 0 subscription");
        s.connected("n", 2, true, 60, mailbox(tx.clone()), peer());
        let no_local = Sub {
            no_local: true,
            ..sub(1)
        };
        s.subscribe("n", &[("a/1", no_local), ("$share/g/a/1", sub(1))]);
        assert_eq!(reached("p", "a/1"), ["n", "r"]);
        assert_eq!(reached("n", "a/1"), ["r"], "No Local: not its own publish");
        // Clean starts end both sessions: nobody is left to save for.
        s.connected("r", 3, true, 0, mailbox(tx.clone()), peer());
        s.connected("n", 4, true, 0, mailbox(tx.clone()), peer());
        assert!(reached("p", "a/1").is_empty());
        assert_eq!(s.journaled.load(Ordering::Acquire), 0);
    }
}
