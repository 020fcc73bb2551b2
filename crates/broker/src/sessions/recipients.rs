//! Who receives a message, asked of the subscription mirror: direct
//! delivery to one client, whether a client is a topic's only subscriber,
//! and which persistent sessions a publish reaches.

use std::sync::Arc;

use rumqttd::protocol;

use super::{Direct, Mailbox, Sessions, ToConnection, Undelivered};

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
        let mut granted = None;
        let mut ids = Vec::new();
        for (filter, sub) in &state.filters {
            let bare = filter
                .strip_prefix("$share/")
                .and_then(|rest| rest.split_once('/'))
                .map_or(filter.as_str(), |(_, f)| f);
            if protocol::matches(topic, bare) {
                granted = granted.max(Some(sub.qos));
                ids.extend(sub.id);
            }
        }
        let Some(granted) = granted else {
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
        match tx.send(ToConnection::Deliver(message)) {
            Err(tokio::sync::mpsc::error::SendError(ToConnection::Deliver(message))) => {
                bound.release(size);
                no_recipient(message)
            }
            _ => Ok(()),
        }
    }

    /// The clients with a saved persistent session that a QoS 1/2 publish
    /// of `publisher` on `topic` reaches: through a subscription of QoS 1
    /// or 2 (not a shared one; not with No Local if they published it).
    pub fn persistent_recipients(&self, publisher: &str, topic: &str) -> Vec<Arc<str>> {
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
        for (filter, client) in &inner.wild {
            if !filter.starts_with("$share/")
                && !found.contains(client)
                && protocol::matches(topic, filter)
                && reaches(client, filter)
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
        !inner.wild.iter().any(|(filter, c)| {
            if &**c == client && !filter.starts_with("$share/") {
                return false;
            }
            let bare = filter
                .strip_prefix("$share/")
                .and_then(|rest| rest.split_once('/'))
                .map_or(filter.as_str(), |(_, f)| f);
            protocol::matches(topic, bare)
        })
    }
}
