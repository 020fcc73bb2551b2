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
//!
//! With a data directory, every change of a persistent session (its
//! subscriptions, its expiry, when its connection ended) goes to a
//! [`Journal`] (see [`crate::durable`]), so the session survives a restart.

mod acknowledged;
mod census;
mod mailbox;
mod recipients;
mod wild;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::RwLock;
use router::protocol;

pub use acknowledged::{Acknowledged, SharedAcknowledged};
pub use census::{Census, ClientView, ConnectionView, Peer};
pub use mailbox::{Direct, Mailbox, QueueBound, ToConnection, Undelivered};
pub use recipients::granted;

use crate::topics;

/// A subscription as the mirror keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sub {
    /// Granted QoS.
    pub qos: u8,
    /// MQTT 5 subscription identifier.
    pub id: Option<usize>,
    /// No Local: the client's own publishes do not come back.
    pub no_local: bool,
    /// Retain As Published: forwarded publishes keep their RETAIN flag.
    pub retain_as_published: bool,
}

/// A persistent session as it is saved: whenever it changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedSession {
    /// Session Expiry Interval, seconds (`u32::MAX`: never).
    pub expiry: u32,
    /// When its connection ended (Unix ms); `None` while connected.
    pub disconnected_at_ms: Option<u64>,
    /// Its subscriptions, sorted by filter.
    pub filters: Vec<(String, Sub)>,
}

/// Where persistent sessions are saved (see [`crate::durable`]).
pub trait Journal: Send + Sync {
    /// `client`'s persistent session is now `session`. Returns the
    /// persistence sequence number to wait for before acknowledging what
    /// changed it.
    fn save(&self, client: &str, session: &SavedSession) -> u64;
    /// `client`'s session ended.
    fn remove(&self, client: &str);
}

struct Live {
    connection: u64,
    /// Session Expiry Interval: above 0, the session outlives the connection.
    expiry: u32,
    mailbox: Mailbox,
    peer: Arc<Peer>,
}

#[derive(Default)]
struct Client {
    filters: HashMap<String, Sub>,
    live: Option<Live>,
    /// With no live connection: until when the session is kept (`None`:
    /// for ever).
    kept_until: Option<Instant>,
    /// The session is saved in the journal.
    journaled: bool,
    /// The state store requests its connections acknowledged.
    acknowledged: SharedAcknowledged,
}

impl Client {
    fn saved(&self, expiry: u32, disconnected_at_ms: Option<u64>) -> SavedSession {
        let mut filters: Vec<(String, Sub)> =
            self.filters.iter().map(|(f, s)| (f.clone(), *s)).collect();
        filters.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        SavedSession {
            expiry,
            disconnected_at_ms,
            filters,
        }
    }
}

#[derive(Default)]
struct Inner {
    clients: HashMap<Arc<str>, Client>,
    /// Filters without wildcards, by filter, outside the notification namespace.
    exact: HashMap<String, HashSet<Arc<str>>>,
    /// Other filters (wildcards, shared subscriptions), outside the namespace.
    wild: wild::WildFilters,
}

/// The subscription mirror and direct delivery.
#[derive(Default)]
pub struct Sessions {
    inner: RwLock<Inner>,
    journal: OnceLock<Arc<dyn Journal>>,
    /// How many clients are `journaled`: while none is, no publish can
    /// reach a persistent session, and nobody asks the mirror.
    journaled: AtomicUsize,
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
        if wild::is_wild(filter) {
            self.wild.insert(filter, client);
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
        if wild::is_wild(filter) {
            self.wild.remove(filter, client);
        }
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

    /// Forgets `client` (returned) if it has no subscription, no connection
    /// and no session kept after one (a clean start must discard that).
    fn forget_if_empty(&mut self, client: &str) -> Option<Client> {
        if self.clients.get(client).is_some_and(|c| {
            c.filters.is_empty()
                && c.live.is_none()
                && c.kept_until.is_some_and(|at| at <= Instant::now())
        }) {
            self.clients.remove(client)
        } else {
            None
        }
    }
}

impl Sessions {
    /// Saves persistent sessions to `journal` from now on.
    pub fn set_journal(&self, journal: Arc<dyn Journal>) {
        let _ = self.journal.set(journal);
    }

    /// Sets whether `state` is saved in the journal, keeping the count;
    /// returns whether it was.
    fn set_journaled(&self, state: &mut Client, on: bool) -> bool {
        let was = std::mem::replace(&mut state.journaled, on);
        match (was, on) {
            (false, true) => self.journaled.fetch_add(1, Ordering::AcqRel),
            (true, false) => self.journaled.fetch_sub(1, Ordering::AcqRel),
            _ => 0,
        };
        was
    }

    /// A journaled client's state is gone.
    fn forgot(&self, state: &Client) {
        if state.journaled {
            self.journaled.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Saves `client`'s session (if it persists) or removes it (if it was
    /// saved and no longer persists). Returns what to wait for (0: nothing).
    fn journal(&self, client: &str, state: &mut Client, expiry: u32, ended_at: Option<u64>) -> u64 {
        let Some(journal) = self.journal.get() else {
            return 0;
        };
        if expiry > 0 {
            self.set_journaled(state, true);
            journal.save(client, &state.saved(expiry, ended_at))
        } else {
            if self.set_journaled(state, false) {
                journal.remove(client);
            }
            0
        }
    }

    /// A session saved before a restart: `client` has `filters`, and the
    /// session is kept `remaining` longer (`None`: for ever).
    pub fn restore(&self, client: &str, filters: Vec<(String, Sub)>, remaining: Option<Duration>) {
        let mut inner = self.inner.write();
        let key = inner.key(client);
        for (filter, _) in &filters {
            inner.index(&key, filter);
        }
        let state = inner.clients.entry(key).or_default();
        state.filters = filters.into_iter().collect();
        state.kept_until = remaining.map(|r| Instant::now() + r);
        self.set_journaled(state, true);
    }

    /// Whether the router may hold a session of `client` that a clean start
    /// must discard at CONNECT: one with subscriptions, one kept after its
    /// connection, or one whose live connection will keep it.
    pub fn has_session_to_discard(&self, client: &str) -> bool {
        self.inner.read().clients.get(client).is_some_and(|c| {
            !c.filters.is_empty() || c.live.as_ref().is_none_or(|live| live.expiry > 0)
        })
    }

    /// A connection of `client` was accepted; its task reads `mailbox`.
    /// `session_expiry`: how long the session outlives it (seconds); `peer`:
    /// what the web view shows of it. Returns the session's [`Acknowledged`].
    pub fn connected(
        &self,
        client: &str,
        connection: u64,
        clean_start: bool,
        session_expiry: u32,
        mailbox: Mailbox,
        peer: Arc<Peer>,
    ) -> SharedAcknowledged {
        let mut inner = self.inner.write();
        let key = inner.key(client);
        // Taking over a session that ends with its connection starts afresh
        // too (the router keeps nothing of it), and so does an expired one.
        let ended = inner.clients.get(client).is_some_and(|c| match &c.live {
            Some(live) => live.expiry == 0,
            None => c.kept_until.is_some_and(|at| at <= Instant::now()),
        });
        let fresh = clean_start || ended;
        if fresh {
            inner.clear_filters(&key);
        }
        let state = inner.clients.entry(key).or_default();
        if fresh {
            state.acknowledged = SharedAcknowledged::default();
            if self.set_journaled(state, false)
                && let Some(journal) = self.journal.get()
            {
                // The old session ends with everything saved for it.
                journal.remove(client);
            }
        }
        state.kept_until = None;
        let previous = state.live.replace(Live {
            connection,
            expiry: session_expiry,
            mailbox,
            peer,
        });
        if let Some(previous) = previous {
            let _ = previous.mailbox.tx.send(ToConnection::TakenOver);
        }
        let acknowledged = Arc::clone(&state.acknowledged);
        self.journal(client, state, session_expiry, None);
        acknowledged
    }

    /// Tells `client`'s connection to end with DISCONNECT `reason` (a
    /// fault, see [`crate::faults`]); `false` if it is not connected.
    pub fn disconnect(&self, client: &str, reason: protocol::DisconnectReasonCode) -> bool {
        let inner = self.inner.read();
        let live = inner.clients.get(client).and_then(|c| c.live.as_ref());
        live.is_some_and(|l| l.mailbox.tx.send(ToConnection::Disconnect(reason)).is_ok())
    }

    /// Whether `connection` is `client`'s live connection.
    pub fn is_live(&self, client: &str, connection: u64) -> bool {
        let inner = self.inner.read();
        let live = inner.clients.get(client).and_then(|c| c.live.as_ref());
        live.is_some_and(|l| l.connection == connection)
    }

    /// A connection of `client` ended; its session is kept `session_expiry`
    /// seconds (0: it ends now; `u32::MAX`: for ever).
    pub fn disconnected(&self, client: &str, connection: u64, session_expiry: u32) {
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
        state.kept_until = (session_expiry != u32::MAX)
            .then(|| Instant::now() + Duration::from_secs(u64::from(session_expiry)));
        self.journal(client, state, session_expiry, Some(crate::clock::now_ms()));
        if session_expiry == 0 {
            let key = inner.key(client);
            inner.clear_filters(&key);
        }
        if let Some(state) = inner.forget_if_empty(client) {
            self.forgot(&state);
        }
    }

    /// Forgets the sessions whose expiry passed (the router ends them too).
    /// Returns how many.
    pub fn end_expired(&self) -> usize {
        let now = Instant::now();
        let mut inner = self.inner.write();
        let expired: Vec<Arc<str>> = inner
            .clients
            .iter()
            .filter(|(_, c)| c.live.is_none() && c.kept_until.is_some_and(|at| at <= now))
            .map(|(k, _)| Arc::clone(k))
            .collect();
        for client in &expired {
            inner.clear_filters(client);
            if let Some(state) = inner.clients.remove(client) {
                self.forgot(&state);
                if state.journaled
                    && let Some(journal) = self.journal.get()
                {
                    journal.remove(client);
                }
            }
        }
        expired.len()
    }

    /// `client` subscribed to `filters` (as the router will record them).
    /// Returns what to wait for before the SUBACK (0: nothing).
    pub fn subscribe(&self, client: &str, filters: &[(&str, Sub)]) -> u64 {
        let mut inner = self.inner.write();
        let key = inner.key(client);
        for (filter, sub) in filters {
            let previous = inner
                .clients
                .entry(Arc::clone(&key))
                .or_default()
                .filters
                .insert((*filter).to_owned(), *sub);
            if previous.is_none() {
                inner.index(&key, filter);
            }
        }
        self.changed(&mut inner, client)
    }

    /// `client` unsubscribed from `filters`. Returns what to wait for
    /// before the UNSUBACK (0: nothing).
    pub fn unsubscribe(&self, client: &str, filters: &[&str]) -> u64 {
        let mut inner = self.inner.write();
        let key = inner.key(client);
        for filter in filters {
            let removed = inner
                .clients
                .get_mut(client)
                .and_then(|c| c.filters.remove(*filter))
                .is_some();
            if removed {
                inner.unindex(&key, filter);
            }
        }
        self.changed(&mut inner, client)
    }

    /// Saves the connected `client`'s persistent session after a change.
    fn changed(&self, inner: &mut Inner, client: &str) -> u64 {
        match inner.clients.get_mut(client) {
            Some(state) => match state.live.as_ref().map(|l| l.expiry) {
                Some(expiry) if expiry > 0 => self.journal(client, state, expiry, None),
                _ => 0,
            },
            None => 0,
        }
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
    use bytes::Bytes;
    use router::protocol::PublishProperties;
    use tokio::sync::mpsc;

    fn msg() -> Direct {
        Direct {
            topic: Bytes::from_static(b"resp/a"),
            payload: Bytes::new(),
            properties: PublishProperties::default(),
            qos: 1,
        }
    }

    /// An unbounded mailbox on `tx` (also for `recipients.rs`'s tests).
    pub(super) fn mailbox(tx: mpsc::UnboundedSender<ToConnection>) -> Mailbox {
        Mailbox::new(tx, QueueBound::new(usize::MAX, usize::MAX))
    }

    /// A loopback MQTT 5 client's peer (also for `recipients.rs`'s tests).
    pub(super) fn peer() -> Arc<Peer> {
        Arc::new(Peer {
            protocol: "MQTT 5",
            address: "127.0.0.1:50000".parse().unwrap(),
            listener: "v5.1".into(),
            in_flight: AtomicUsize::new(0),
        })
    }

    /// A plain subscription at `qos`.
    pub(super) fn sub(qos: u8) -> Sub {
        Sub {
            qos,
            ..Sub::default()
        }
    }

    #[test]
    fn delivers_only_to_live_matching_subscribers() {
        let s = Sessions::default();
        let (tx, mut rx) = mpsc::unbounded_channel();
        assert!(s.deliver("a", msg()).is_err(), "unknown client");
        let (old_tx, mut old_rx) = mpsc::unbounded_channel();
        s.connected("a", 0, true, 0, mailbox(old_tx), peer());
        s.connected("a", 1, true, 0, mailbox(tx), peer());
        assert!(s.deliver("a", msg()).is_err(), "no subscription");
        let sub7 = Sub {
            qos: 0,
            id: Some(7),
            ..Sub::default()
        };
        s.subscribe("a", &[("resp/+", sub7)]);
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
        s.unsubscribe("a", &["resp/+"]);
        assert!(s.deliver("a", msg()).is_err());
    }

    #[test]
    fn only_subscriber() {
        let s = Sessions::default();
        s.subscribe("a", &[("clients/a/response", sub(1))]);
        assert!(s.only_subscriber("a", "clients/a/response"));
        s.subscribe("b", &[("clients/a/response", sub(1))]);
        assert!(
            !s.only_subscriber("a", "clients/a/response"),
            "b listens too"
        );
        s.unsubscribe("b", &["clients/a/response"]);
        assert!(s.only_subscriber("a", "clients/a/response"));
        s.subscribe("spy", &[("#", sub(0))]);
        assert!(!s.only_subscriber("a", "clients/a/response"));
        s.unsubscribe("spy", &["#"]);
        s.subscribe("a", &[("$share/g/clients/a/response", sub(1))]);
        assert!(
            !s.only_subscriber("a", "clients/a/response"),
            "a shared group may deliver elsewhere"
        );
        s.unsubscribe("a", &["$share/g/clients/a/response"]);
        // Filters inside the notification namespace never count.
        s.subscribe(
            "c",
            &[(
                &format!("{}/+/command/notify/+", topics::NOTIFY_NAMESPACE),
                sub(1),
            )],
        );
        assert!(s.only_subscriber("a", "clients/a/response"));
    }

    #[test]
    fn session_rules() {
        let s = Sessions::default();
        let (tx, _rx) = mpsc::unbounded_channel();
        s.connected("p", 1, false, u32::MAX, mailbox(tx.clone()), peer());
        s.subscribe("p", &[("x", sub(1))]);
        s.disconnected("p", 1, u32::MAX);
        assert!(
            !s.only_subscriber("q", "x"),
            "a persistent session keeps its subscriptions"
        );
        s.connected("p", 2, true, 0, mailbox(tx.clone()), peer());
        assert!(s.only_subscriber("q", "x"), "a clean start drops them");
        s.subscribe("p", &[("x", sub(1))]);
        // Taking over a clean session: nothing is resumed.
        s.connected("p", 3, false, u32::MAX, mailbox(tx.clone()), peer());
        assert!(s.only_subscriber("q", "x"));
        s.subscribe("p", &[("x", sub(1))]);
        // Taking over a persistent session keeps its subscriptions, and the
        // old connection's end does not touch the new one.
        s.connected("p", 4, false, u32::MAX, mailbox(tx.clone()), peer());
        s.disconnected("p", 3, u32::MAX);
        assert!(!s.only_subscriber("q", "x"));
        s.disconnected("p", 4, 0);
        assert!(s.only_subscriber("q", "x"));
        assert_eq!(s.tracked(), 0);
    }

    #[test]
    fn a_full_queue_drops_and_tells_the_connection_once() {
        let s = Sessions::default();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let bound = QueueBound::new(2, 1000);
        s.connected(
            "q",
            1,
            true,
            0,
            Mailbox::new(tx, Arc::clone(&bound)),
            peer(),
        );
        s.subscribe("q", &[("resp/+", sub(1))]);
        s.deliver("q", msg()).unwrap();
        s.deliver("q", msg()).unwrap();
        assert!(matches!(s.deliver("q", msg()), Err(Undelivered::Overflow)));
        assert!(matches!(s.deliver("q", msg()), Err(Undelivered::Overflow)));
        let received: Vec<_> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
        assert_eq!(received.len(), 3, "two deliveries and one overflow notice");
        assert!(matches!(received[2], ToConnection::Overflow));
        assert_eq!(bound.held(), (2, 2 * msg().size()));
        bound.release(msg().size());
        assert_eq!(bound.held(), (1, msg().size()));
        // Bytes count too.
        let big = QueueBound::new(100, 10);
        assert!(big.reserve(10));
        assert!(!big.reserve(1));
    }
}
