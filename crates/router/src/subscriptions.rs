//! Who subscribes to what, by client id: the router's answer to "who
//! receives this message" (statebroker patch 16).
//!
//! The router thread is the only writer: it changes the index as it applies
//! a SUBSCRIBE or UNSUBSCRIBE, starts or ends a session, or restores one
//! after a restart, under the same rules as the rest of its session state
//! (a clean start or the end of a session that does not outlive its
//! connection drops the client's subscriptions; a persistent session keeps
//! them). Anyone may read it, from any thread, through
//! [`crate::RouterHandle::subscriptions`]: the broker asks it whether a
//! message can go straight to a client's connection (the client is the
//! only subscriber of the topic) and at which QoS, without a trip through
//! the router thread. Inside the router, it says which persistent sessions
//! a publish reaches (their copy is saved, see [`crate::Journal`]) and what
//! a persistent session's saved record holds.
//!
//! Filters of the notification-style private namespaces are indexed like
//! any other: whether a client may subscribe to a filter is the broker's
//! business, decided before the SUBSCRIBE reaches the router.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::protocol::{self, Filter, QoS};
use crate::topic_tree::{bare, is_wild, WildFilters};

/// A subscription's options, as the router applies them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SubOptions {
    /// Granted QoS.
    pub qos: u8,
    /// MQTT 5 Subscription Identifier.
    pub id: Option<usize>,
    /// No Local: the client's own publishes do not come back.
    pub no_local: bool,
    /// Retain As Published: forwarded publishes keep their RETAIN flag.
    pub retain_as_published: bool,
}

impl SubOptions {
    /// The options of `filter` in a SUBSCRIBE, with its identifier `id`.
    pub fn of(filter: &Filter, id: Option<usize>) -> SubOptions {
        SubOptions {
            qos: filter.qos as u8,
            id,
            no_local: filter.nolocal,
            retain_as_published: filter.preserve_retain,
        }
    }

    /// The QoS as the protocol's type.
    pub fn qos(&self) -> QoS {
        protocol::qos(self.qos.min(2)).unwrap_or(QoS::AtMostOnce)
    }
}

/// A persistent session as it is saved: whenever it changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRecord {
    /// Session Expiry Interval, seconds (`u32::MAX`: never).
    pub expiry: u32,
    /// When its connection ended (Unix ms); `None` while connected.
    pub disconnected_at_ms: Option<u64>,
    /// Its subscriptions, sorted by filter.
    pub filters: Vec<(String, SubOptions)>,
    /// What a publish does when it would push out of a log a message this
    /// session has not had (`None`: the router's setting).
    pub queue_full: Option<crate::QueueFull>,
}

/// What the highest-QoS matching subscriptions of one client grant a
/// message on `topic`: that QoS, and the Subscription Identifiers of every
/// matching subscription; `None` if none matches. Shared subscriptions
/// count only with `shared`.
pub fn granted<'a>(
    filters: impl IntoIterator<Item = (&'a String, &'a SubOptions)>,
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

#[derive(Debug, Default)]
struct Client {
    filters: HashMap<String, SubOptions>,
    /// The router keeps this client's session after its connection (a
    /// live connection with a Session Expiry Interval above 0, or a kept
    /// session): a clean start must discard it, and a QoS 1/2 publish that
    /// reaches it is saved for it.
    kept: bool,
}

#[derive(Debug, Default)]
struct Index {
    clients: HashMap<Arc<str>, Client>,
    /// Filters without wildcards, by filter.
    exact: HashMap<String, HashSet<Arc<str>>>,
    /// Wildcard and shared filters.
    wild: WildFilters,
    /// How many clients are `kept` (while none is, no publish reaches a
    /// kept session, and nobody need look).
    kept: usize,
}

impl Index {
    fn key(&self, client: &str) -> Arc<str> {
        self.clients
            .get_key_value(client)
            .map_or_else(|| Arc::from(client), |(k, _)| Arc::clone(k))
    }

    fn index(&mut self, client: &Arc<str>, filter: &str) {
        if is_wild(filter) {
            self.wild.insert(filter, client);
        } else {
            self.exact
                .entry(filter.to_owned())
                .or_default()
                .insert(Arc::clone(client));
        }
    }

    fn unindex(&mut self, client: &Arc<str>, filter: &str) {
        if is_wild(filter) {
            self.wild.remove(filter, client);
        } else if let Some(set) = self.exact.get_mut(filter) {
            set.remove(client);
            if set.is_empty() {
                self.exact.remove(filter);
            }
        }
    }

    /// Sets whether `client`'s session is kept, keeping the count.
    fn set_kept(&mut self, client: &Arc<str>, kept: bool) {
        let entry = self.clients.entry(Arc::clone(client)).or_default();
        match (entry.kept, kept) {
            (false, true) => self.kept += 1,
            (true, false) => self.kept -= 1,
            _ => {}
        }
        entry.kept = kept;
    }

    /// Forgets `client` when nothing of it is left.
    fn forget_if_empty(&mut self, client: &str) {
        if self
            .clients
            .get(client)
            .is_some_and(|c| c.filters.is_empty() && !c.kept)
        {
            self.clients.remove(client);
        }
    }
}

/// The index; see the module's documentation.
#[derive(Debug, Default)]
pub struct Subscriptions {
    index: RwLock<Index>,
    /// Counts the changes of who subscribes to what (statebroker patch
    /// 36), for answers kept from one look at the index to the next.
    changes: AtomicU64,
}

/// How many clients and subscriptions the index holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Clients with subscriptions or a kept session.
    pub clients: usize,
    /// Their subscriptions.
    pub subscriptions: usize,
}

impl Index {
    /// Whether `client` is the only one whose subscriptions could match
    /// `topic` (a shared subscription, its own included, may deliver to
    /// others).
    fn only_subscriber(&self, client: &str, topic: &str) -> bool {
        if let Some(set) = self.exact.get(topic)
            && set.iter().any(|c| &**c != client)
        {
            return false;
        }
        !self.wild.candidates(topic).into_iter().any(|(filter, c)| {
            if &**c == client && !filter.starts_with("$share/") {
                return false;
            }
            protocol::matches(topic, bare(filter))
        })
    }
}

impl Subscriptions {
    /// Whether `client` is the only one whose subscriptions could match
    /// `topic` (a shared subscription, its own included, may deliver to
    /// others).
    pub fn only_subscriber(&self, client: &str, topic: &str) -> bool {
        self.index.read().only_subscriber(client, topic)
    }

    /// What `client`'s subscriptions grant a message on `topic` (see
    /// [`granted`]) when `client` is its only subscriber: one look at the
    /// index for the question every state store answer asks.
    pub fn sole_grant(&self, client: &str, topic: &str) -> Option<(u8, Vec<usize>)> {
        let index = self.index.read();
        if !index.only_subscriber(client, topic) {
            return None;
        }
        granted(&index.clients.get(client)?.filters, topic, true)
    }

    /// What `client`'s subscriptions grant a message on `topic` (see
    /// [`granted`]), shared ones included.
    pub fn granted(&self, client: &str, topic: &str) -> Option<(u8, Vec<usize>)> {
        let index = self.index.read();
        granted(&index.clients.get(client)?.filters, topic, true)
    }

    /// Whether the router keeps a session of `client` that outlives its
    /// connection (live or not): a clean start must discard it.
    pub fn has_kept_session(&self, client: &str) -> bool {
        self.index
            .read()
            .clients
            .get(client)
            .is_some_and(|c| c.kept)
    }

    /// Whether the index has `client` (with subscriptions or a kept
    /// session).
    pub fn knows(&self, client: &str) -> bool {
        self.index.read().clients.contains_key(client)
    }

    /// `client`'s subscription filters, sorted.
    pub fn filters(&self, client: &str) -> Vec<String> {
        let index = self.index.read();
        let mut filters: Vec<String> = index
            .clients
            .get(client)
            .map(|c| c.filters.keys().cloned().collect())
            .unwrap_or_default();
        filters.sort();
        filters
    }

    /// Every client with subscriptions or a kept session, with its
    /// filters (sorted) and whether its session is kept.
    pub fn clients(&self) -> Vec<(String, Vec<String>, bool)> {
        let index = self.index.read();
        index
            .clients
            .iter()
            .map(|(id, c)| {
                let mut filters: Vec<String> = c.filters.keys().cloned().collect();
                filters.sort();
                (id.to_string(), filters, c.kept)
            })
            .collect()
    }

    /// How many clients and subscriptions there are (one pass).
    pub fn counts(&self) -> Counts {
        let index = self.index.read();
        Counts {
            clients: index.clients.len(),
            subscriptions: index.clients.values().map(|c| c.filters.len()).sum(),
        }
    }

    /// `client` subscribed to `filter` with `options` (new, or replacing
    /// the filter's options).
    pub(crate) fn subscribe(&self, client: &str, filter: &str, options: SubOptions) {
        let mut index = self.index.write();
        let key = index.key(client);
        let previous = index
            .clients
            .entry(Arc::clone(&key))
            .or_default()
            .filters
            .insert(filter.to_owned(), options);
        if previous.is_none() {
            index.index(&key, filter);
        }
        self.changed();
    }

    /// `client` unsubscribed from `filter`; whether it had subscribed.
    pub(crate) fn unsubscribe(&self, client: &str, filter: &str) -> bool {
        let mut index = self.index.write();
        let key = index.key(client);
        let removed = index
            .clients
            .get_mut(client)
            .and_then(|c| c.filters.remove(filter))
            .is_some();
        if removed {
            index.unindex(&key, filter);
            index.forget_if_empty(client);
            self.changed();
        }
        removed
    }

    /// `client`'s session ends: its subscriptions go, and it is no longer
    /// kept.
    pub(crate) fn end_session(&self, client: &str) {
        let mut index = self.index.write();
        let key = index.key(client);
        if let Some(c) = index.clients.remove(client) {
            index.kept -= usize::from(c.kept);
            for filter in c.filters.keys() {
                index.unindex(&key, filter);
            }
            self.changed();
        }
    }

    /// How many times who subscribes to what has changed (statebroker
    /// patch 36): what [`Subscriptions::sole_grant`] or
    /// [`Subscriptions::granted`] answered holds while this stays the same
    /// (read it before asking them: a change made while they look is
    /// counted after it is made).
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    /// Counts a change, made under the index's write lock (so that one
    /// who read the count before looking sees a later count).
    fn changed(&self) {
        self.changes.fetch_add(1, Ordering::Release);
    }

    /// Whether the router keeps `client`'s session after its connection.
    pub(crate) fn set_kept(&self, client: &str, kept: bool) {
        let mut index = self.index.write();
        if kept || index.clients.contains_key(client) {
            let key = index.key(client);
            index.set_kept(&key, kept);
            index.forget_if_empty(client);
        }
    }

    /// `client`'s saved record: its subscriptions, with `expiry`,
    /// `queue_full` and `disconnected_at_ms`.
    pub(crate) fn record(
        &self,
        client: &str,
        expiry: u32,
        queue_full: Option<crate::QueueFull>,
        disconnected_at_ms: Option<u64>,
    ) -> SessionRecord {
        let index = self.index.read();
        let mut filters: Vec<(String, SubOptions)> = index
            .clients
            .get(client)
            .map(|c| c.filters.iter().map(|(f, o)| (f.clone(), *o)).collect())
            .unwrap_or_default();
        filters.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        SessionRecord {
            expiry,
            disconnected_at_ms,
            filters,
            queue_full,
        }
    }

    /// The kept sessions that a QoS 1/2 publish of `publisher` on `topic`
    /// reaches: through a subscription of QoS 1 or 2 (not a shared one;
    /// not with No Local if they published it).
    pub(crate) fn kept_recipients(&self, publisher: &str, topic: &str) -> Vec<Arc<str>> {
        let index = self.index.read();
        let reaches = |client: &Arc<str>, filter: &str| {
            index.clients.get(client).is_some_and(|c| {
                c.kept
                    && c.filters
                        .get(filter)
                        .is_some_and(|sub| sub.qos > 0 && !(sub.no_local && &**client == publisher))
            })
        };
        let mut found: Vec<Arc<str>> = Vec::new();
        // Each client once: a set, not a look through `found` for each
        // candidate (with 200,000 kept sessions on `fleet/+/config`, one
        // publish to `fleet/all/config` took minutes; statebroker patch 24).
        let mut seen: HashSet<&str> = HashSet::new();
        if let Some(set) = index.exact.get(topic) {
            for client in set.iter().filter(|c| reaches(c, topic)) {
                seen.insert(client);
                found.push(Arc::clone(client));
            }
        }
        for (filter, client) in index.wild.candidates(topic) {
            if !filter.starts_with("$share/")
                && !seen.contains(&**client)
                && reaches(client, filter)
                && protocol::matches(topic, filter)
            {
                seen.insert(client);
                found.push(Arc::clone(client));
            }
        }
        found
    }

    /// How many sessions are kept beyond their connection: of connected
    /// clients with a Session Expiry Interval above 0, and of clients gone
    /// whose session has not expired (statebroker patch 22).
    pub fn kept_sessions(&self) -> usize {
        self.index.read().kept
    }

    /// Whether any session is kept (while none is, no publish needs saving).
    pub(crate) fn any_kept(&self) -> bool {
        self.index.read().kept > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sub(qos: u8) -> SubOptions {
        SubOptions {
            qos,
            ..SubOptions::default()
        }
    }

    /// Patch 36: every change of who subscribes to what is counted, and
    /// nothing else: a grant kept with the count holds while it stays.
    #[test]
    fn changes_of_who_subscribes_are_counted() {
        let s = Subscriptions::default();
        let mut last = s.changes();
        let mut changed = |s: &Subscriptions, what: &str| {
            assert!(s.changes() > last, "{what} is a change");
            last = s.changes();
        };
        s.subscribe("a", "clients/a/response", sub(1));
        changed(&s, "a subscription");
        let grant = s.sole_grant("a", "clients/a/response");
        s.subscribe("a", "clients/a/response", sub(0));
        changed(&s, "a subscription's options replaced");
        assert_ne!(s.sole_grant("a", "clients/a/response"), grant);
        s.subscribe("b", "clients/#", sub(1));
        changed(&s, "another client's wildcard");
        assert_eq!(s.sole_grant("a", "clients/a/response"), None);
        assert!(s.unsubscribe("b", "clients/#"));
        changed(&s, "an unsubscription");
        s.end_session("a");
        changed(&s, "a session's end");
        let before = s.changes();
        assert!(!s.unsubscribe("a", "nothing"));
        s.set_kept("c", true);
        s.end_session("nobody");
        assert_eq!(s.changes(), before, "nothing changed who subscribes");
    }

    #[test]
    fn only_subscriber() {
        let s = Subscriptions::default();
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
        assert!(s.only_subscriber("a", "clients/a/response"));
        assert!(s.only_subscriber("x", "nobody/listens"), "vacuously");
        assert_eq!(s.sole_grant("a", "clients/a/response"), Some((1, vec![])));
        assert_eq!(s.sole_grant("x", "nobody/listens"), None, "no grant");
        s.subscribe("b", "clients/+/response", sub(0));
        assert_eq!(s.sole_grant("a", "clients/a/response"), None, "b too");
    }

    #[test]
    fn granted_is_the_highest_qos_with_every_identifier() {
        let s = Subscriptions::default();
        assert_eq!(s.granted("c", "t/1"), None, "unknown client");
        let with_id = |qos, id| SubOptions {
            qos,
            id: Some(id),
            ..SubOptions::default()
        };
        s.subscribe("c", "t/+", with_id(0, 7));
        s.subscribe("c", "t/1", with_id(1, 9));
        s.subscribe("c", "other", sub(2));
        let (qos, mut ids) = s.granted("c", "t/1").unwrap();
        ids.sort();
        assert_eq!((qos, ids), (1, vec![7, 9]));
        assert_eq!(s.granted("c", "t/2"), Some((0, vec![7])));
        assert_eq!(s.granted("c", "nope"), None);
    }

    #[test]
    fn kept_sessions_and_their_recipients() {
        let s = Subscriptions::default();
        s.subscribe("clean", "a/#", sub(1));
        assert!(
            s.kept_recipients("p", "a/1").is_empty(),
            "a clean session is never saved for"
        );
        s.set_kept("r", true);
        s.subscribe("r", "a/+", sub(2));
        s.subscribe("r", "zero/#", sub(0));
        assert_eq!(names(s.kept_recipients("p", "a/1")), ["r"]);
        assert!(s.kept_recipients("p", "zero/x").is_empty(), "QoS 0");
        s.set_kept("n", true);
        let no_local = SubOptions {
            no_local: true,
            ..sub(1)
        };
        s.subscribe("n", "a/1", no_local);
        s.subscribe("n", "$share/g/a/1", sub(1));
        assert_eq!(names(s.kept_recipients("p", "a/1")), ["n", "r"]);
        assert_eq!(
            names(s.kept_recipients("n", "a/1")),
            ["r"],
            "No Local: not its own publish"
        );
        assert!(s.has_kept_session("r") && !s.has_kept_session("clean"));
        let record = s.record("r", 60, None, Some(5));
        assert_eq!(
            record
                .filters
                .iter()
                .map(|(f, _)| f.as_str())
                .collect::<Vec<_>>(),
            ["a/+", "zero/#"],
            "sorted"
        );
        s.end_session("r");
        s.end_session("n");
        assert!(s.kept_recipients("p", "a/1").is_empty());
        assert!(!s.has_kept_session("r"));
        assert_eq!(
            s.counts(),
            Counts {
                clients: 1,
                subscriptions: 1
            },
            "only the clean one is left"
        );
        assert!(!s.any_kept());
        s.set_kept("k", true);
        s.set_kept("k", true);
        assert!(s.any_kept());
        s.set_kept("k", false);
        assert!(!s.any_kept(), "counted once");
        assert_eq!(s.kept_sessions(), 0);
        s.set_kept("k", true);
        s.set_kept("j", true);
        assert_eq!(s.kept_sessions(), 2);
        s.end_session("k");
        assert_eq!(s.kept_sessions(), 1);
        s.end_session("j");
        s.unsubscribe("clean", "a/#");
        assert_eq!(s.counts(), Counts::default(), "nothing left behind");
    }

    /// Many kept sessions on one wildcard filter (statebroker patch 24):
    /// each is a recipient once, however many of its filters match, and
    /// each leaves the index when its session ends.
    #[test]
    fn many_kept_sessions_on_one_wildcard() {
        let s = Subscriptions::default();
        let n = 10_000;
        for i in 0..n {
            let client = format!("device-{i}");
            s.set_kept(&client, true);
            s.subscribe(&client, &format!("devices/{client}/cmd"), sub(1));
            s.subscribe(&client, "fleet/+/config", sub(1));
            s.subscribe(&client, "fleet/#", sub(1));
        }
        let all = names(s.kept_recipients("operator", "fleet/all/config"));
        assert_eq!(all.len(), n);
        all.windows(2)
            .for_each(|w| assert_ne!(w[0], w[1], "each once"));
        assert_eq!(
            names(s.kept_recipients("operator", "devices/device-7/cmd")),
            ["device-7"]
        );
        for i in 0..n {
            s.end_session(&format!("device-{i}"));
        }
        assert!(s.kept_recipients("operator", "fleet/all/config").is_empty());
        assert_eq!(s.counts(), Counts::default(), "nothing left behind");
    }

    fn names(clients: Vec<Arc<str>>) -> Vec<String> {
        let mut names: Vec<String> = clients.iter().map(|c| c.to_string()).collect();
        names.sort();
        names
    }
}
