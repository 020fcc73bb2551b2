//! Who subscribes to what, and direct delivery.
//!
//! The router keeps subscriptions, but cannot be asked about them. The
//! broker sees every SUBSCRIBE and UNSUBSCRIBE on their way to the router, so
//! it keeps a mirror here, per client id, with the router's session rules: a
//! clean start drops the client's subscriptions, and so does the end of a
//! clean session's connection; a persistent session keeps them.
//!
//! With the mirror, the state store delivers its messages **directly** to
//! the connection that must get them, without the router:
//!
//! - a **notification** is private to the client it is for (see
//!   [`crate::topics`]), so it goes to that client's connection if one of its
//!   subscriptions matches, and nowhere else;
//! - a **response** goes directly to the requester when the requester is the
//!   only client whose subscriptions match the Response Topic; when anyone
//!   else's could (a `#` subscriber, a shared subscription), it goes through
//!   the router like any publish.
//!
//! Direct delivery skips the router's per-filter commit logs, which keep
//! every message until their segments rotate: request/response traffic then
//! costs no memory after delivery and cannot be skipped over by a log that
//! rotated past an unread message.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::RwLock;
use rumqttd::protocol::{self, PublishProperties};
use tokio::sync::mpsc;

use crate::topics;

/// What the broker tells a connection task.
#[derive(Debug)]
// Nearly every message is a delivery: boxing it would cost an allocation each.
#[allow(clippy::large_enum_variant)]
pub enum ToConnection {
    /// Deliver this publish.
    Deliver(Direct),
    /// Another connection took the client id over: end with "session taken over".
    TakenOver,
}

/// A publish for one client, delivered by its connection task.
#[derive(Debug, Clone)]
pub struct Direct {
    /// The topic.
    pub topic: Bytes,
    /// The payload.
    pub payload: Bytes,
    /// MQTT 5 properties (subscription identifiers are added on delivery).
    pub properties: PublishProperties,
    /// QoS 0 or 1.
    pub qos: u8,
}

/// A subscription as the mirror keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sub {
    /// Granted QoS.
    pub qos: u8,
    /// MQTT 5 subscription identifier.
    pub id: Option<usize>,
}

struct Live {
    connection: u64,
    clean_start: bool,
    tx: mpsc::UnboundedSender<ToConnection>,
}

#[derive(Default)]
struct Client {
    filters: HashMap<String, Sub>,
    live: Option<Live>,
}

#[derive(Default)]
struct Inner {
    clients: HashMap<Arc<str>, Client>,
    /// Filters without wildcards, by filter, outside the notification namespace.
    exact: HashMap<String, HashSet<Arc<str>>>,
    /// Other filters (wildcards, shared subscriptions), outside the namespace.
    wild: Vec<(String, Arc<str>)>,
}

/// The subscription mirror and direct delivery.
#[derive(Default)]
pub struct Sessions {
    inner: RwLock<Inner>,
}

/// Whether a filter can only ever match topics of the notification
/// namespace (which are private, so such filters never matter to others).
fn confined_to_namespace(filter: &str) -> bool {
    let mut levels = filter.split('/');
    topics::NOTIFY_NAMESPACE
        .split('/')
        .all(|expected| levels.next() == Some(expected))
}

impl Inner {
    fn index(&mut self, client: &Arc<str>, filter: &str) {
        if confined_to_namespace(filter) {
            return;
        }
        if protocol::has_wildcards(filter) || filter.starts_with("$share/") {
            self.wild.push((filter.to_owned(), Arc::clone(client)));
        } else {
            self.exact
                .entry(filter.to_owned())
                .or_default()
                .insert(Arc::clone(client));
        }
    }

    fn unindex(&mut self, client: &Arc<str>, filter: &str) {
        if let Some(set) = self.exact.get_mut(filter) {
            set.remove(client);
            if set.is_empty() {
                self.exact.remove(filter);
            }
        }
        self.wild.retain(|(f, c)| !(f == filter && c == client));
    }

    fn clear_filters(&mut self, client: &Arc<str>) {
        let filters: Vec<String> = match self.clients.get_mut(client) {
            Some(c) => c.filters.drain().map(|(f, _)| f).collect(),
            None => return,
        };
        for filter in filters {
            self.unindex(client, &filter);
        }
    }

    fn key(&self, client: &str) -> Arc<str> {
        self.clients
            .get_key_value(client)
            .map_or_else(|| Arc::from(client), |(k, _)| Arc::clone(k))
    }

    fn forget_if_empty(&mut self, client: &str) {
        if self
            .clients
            .get(client)
            .is_some_and(|c| c.filters.is_empty() && c.live.is_none())
        {
            self.clients.remove(client);
        }
    }
}

impl Sessions {
    /// A connection of `client` was accepted; its task reads `tx`.
    pub fn connected(
        &self,
        client: &str,
        connection: u64,
        clean_start: bool,
        tx: mpsc::UnboundedSender<ToConnection>,
    ) {
        let mut inner = self.inner.write();
        let key = inner.key(client);
        // Taking over a clean session starts afresh too (the router keeps
        // nothing of a clean session it disconnects).
        let takes_over_clean = inner
            .clients
            .get(client)
            .and_then(|c| c.live.as_ref())
            .is_some_and(|l| l.clean_start);
        if clean_start || takes_over_clean {
            inner.clear_filters(&key);
        }
        let previous = inner.clients.entry(key).or_default().live.replace(Live {
            connection,
            clean_start,
            tx,
        });
        if let Some(previous) = previous {
            let _ = previous.tx.send(ToConnection::TakenOver);
        }
    }

    /// A connection of `client` ended. A clean session ends with it.
    pub fn disconnected(&self, client: &str, connection: u64, clean_start: bool) {
        let mut inner = self.inner.write();
        let Some(state) = inner.clients.get_mut(client) else {
            return;
        };
        if state
            .live
            .as_ref()
            .is_none_or(|l| l.connection != connection)
        {
            return; // taken over: the new connection owns the session now
        }
        state.live = None;
        if clean_start {
            let key = inner.key(client);
            inner.clear_filters(&key);
        }
        inner.forget_if_empty(client);
    }

    /// `client` subscribed to `filter` (as the router will record it).
    pub fn subscribe(&self, client: &str, filter: &str, sub: Sub) {
        let mut inner = self.inner.write();
        let key = inner.key(client);
        let previous = inner
            .clients
            .entry(Arc::clone(&key))
            .or_default()
            .filters
            .insert(filter.to_owned(), sub);
        if previous.is_none() {
            inner.index(&key, filter);
        }
    }

    /// `client` unsubscribed from `filter`.
    pub fn unsubscribe(&self, client: &str, filter: &str) {
        let mut inner = self.inner.write();
        let key = inner.key(client);
        let removed = inner
            .clients
            .get_mut(client)
            .and_then(|c| c.filters.remove(filter))
            .is_some();
        if removed {
            inner.unindex(&key, filter);
        }
    }

    /// Delivers to `client` if it is connected and one of its subscriptions
    /// matches the message's topic, at the smaller of the message's QoS and
    /// the subscription's. Returns `Err` with the message when it could not
    /// be delivered.
    pub fn deliver(&self, client: &str, mut message: Direct) -> Result<(), Box<Direct>> {
        let inner = self.inner.read();
        let Some(state) = inner.clients.get(client) else {
            return Err(Box::new(message));
        };
        let Some(live) = &state.live else {
            return Err(Box::new(message));
        };
        let Ok(topic) = std::str::from_utf8(&message.topic) else {
            return Err(Box::new(message));
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
            return Err(Box::new(message));
        };
        message.qos = message.qos.min(granted).min(1);
        message.properties.subscription_identifiers = ids;
        match live.tx.send(ToConnection::Deliver(message)) {
            Err(mpsc::error::SendError(ToConnection::Deliver(message))) => Err(Box::new(message)),
            _ => Ok(()),
        }
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

    /// Number of client ids with state.
    #[cfg(test)]
    fn tracked(&self) -> usize {
        self.inner.read().clients.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg() -> Direct {
        Direct {
            topic: Bytes::from_static(b"resp/a"),
            payload: Bytes::new(),
            properties: PublishProperties::default(),
            qos: 1,
        }
    }

    fn sub(qos: u8) -> Sub {
        Sub { qos, id: None }
    }

    #[test]
    fn delivers_only_to_live_matching_subscribers() {
        let s = Sessions::default();
        let (tx, mut rx) = mpsc::unbounded_channel();
        assert!(s.deliver("a", msg()).is_err(), "unknown client");
        let (old_tx, mut old_rx) = mpsc::unbounded_channel();
        s.connected("a", 0, true, old_tx);
        s.connected("a", 1, true, tx);
        assert!(s.deliver("a", msg()).is_err(), "no subscription");
        s.subscribe(
            "a",
            "resp/+",
            Sub {
                qos: 0,
                id: Some(7),
            },
        );
        assert!(
            matches!(old_rx.try_recv(), Ok(ToConnection::TakenOver)),
            "the older connection is told"
        );
        s.deliver("a", msg()).unwrap();
        let Ok(ToConnection::Deliver(got)) = rx.try_recv() else {
            panic!("not delivered")
        };
        assert_eq!(
            (got.qos, got.properties.subscription_identifiers),
            (0, vec![7]),
            "QoS capped by the subscription"
        );
        s.unsubscribe("a", "resp/+");
        assert!(s.deliver("a", msg()).is_err());
    }

    #[test]
    fn only_subscriber() {
        let s = Sessions::default();
        s.subscribe("a", "clients/a/response", sub(1));
        assert!(s.only_subscriber("a", "clients/a/response"));
        s.subscribe("b", "clients/a/response", sub(1));
        assert!(
            !s.only_subscriber("a", "clients/a/response"),
            "b listens too"
        );
        s.unsubscribe("b", "clients/a/response");
        assert!(s.only_subscriber("a", "clients/a/response"));
        s.subscribe("spy", "#", sub(0));
        assert!(!s.only_subscriber("a", "clients/a/response"));
        s.unsubscribe("spy", "#");
        s.subscribe("a", "$share/g/clients/a/response", sub(1));
        assert!(
            !s.only_subscriber("a", "clients/a/response"),
            "a shared group may deliver elsewhere"
        );
        s.unsubscribe("a", "$share/g/clients/a/response");
        // Filters inside the notification namespace never count.
        s.subscribe(
            "c",
            &format!("{}/+/command/notify/+", topics::NOTIFY_NAMESPACE),
            sub(1),
        );
        assert!(s.only_subscriber("a", "clients/a/response"));
    }

    #[test]
    fn session_rules() {
        let s = Sessions::default();
        let (tx, _rx) = mpsc::unbounded_channel();
        s.connected("p", 1, false, tx.clone());
        s.subscribe("p", "x", sub(1));
        s.disconnected("p", 1, false);
        assert!(
            !s.only_subscriber("q", "x"),
            "a persistent session keeps its subscriptions"
        );
        s.connected("p", 2, true, tx.clone());
        assert!(s.only_subscriber("q", "x"), "a clean start drops them");
        s.subscribe("p", "x", sub(1));
        // Taking over a clean session: nothing is resumed.
        s.connected("p", 3, false, tx.clone());
        assert!(s.only_subscriber("q", "x"));
        s.subscribe("p", "x", sub(1));
        // Taking over a persistent session keeps its subscriptions, and the
        // old connection's end does not touch the new one.
        s.connected("p", 4, false, tx.clone());
        s.disconnected("p", 3, false);
        assert!(!s.only_subscriber("q", "x"));
        s.disconnected("p", 4, true);
        assert!(s.only_subscriber("q", "x"));
        assert_eq!(s.tracked(), 0);
    }
}
