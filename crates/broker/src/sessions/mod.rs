//! The broker's clients: the way to each client's live connection, and
//! what the broker keeps of a session besides the router's state.
//!
//! Sessions themselves (subscriptions, clean start, expiry, what is queued)
//! are the router's (see [`router::Subscriptions`]). Here, per client id:
//!
//! - its **live connection**: the [`Mailbox`] the connection task reads
//!   (direct deliveries, takeover and fault notices) and what the web view
//!   shows of it ([`Peer`]). A new connection with the same client id takes
//!   over: the old one is told to end;
//! - the state store requests its session **acknowledged**
//!   ([`Acknowledged`]), so that one resent after a reconnect runs once;
//! - the messages another cluster node **handed over** for its session
//!   that no connection has acknowledged yet
//!   ([`Sessions::keep_handed_over`]): the session's alone, for its next
//!   connection here or the next node it moves to;
//! - the block of **packet ids** its router deliveries take
//!   ([`PacketIdBlock`]) is chosen at CONNECT and kept by the connection
//!   (and, on a cluster node, by the session's records in etcd).
//!
//! With the router's answer to "who subscribes to what", the state store
//! delivers its messages **directly** to the connection that must get them
//! ([`recipients`]): a notification (private to its watcher) or a response
//! whose Response Topic only the requester subscribes to goes straight to
//! that connection's mailbox, without the router and its per-filter commit
//! logs (which keep every message until their segments rotate): request and
//! response traffic then costs no memory after delivery.

mod acknowledged;
mod answer;
mod census;
mod mailbox;
mod packet_ids;
mod recipients;
mod route;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLock;
use router::Subscriptions;
use router::protocol;

pub use acknowledged::{SharedAcknowledged, Wait};
pub use answer::{Answer, Correlation};
pub use census::{Census, Peer};
pub use mailbox::{
    Direct, DirectProperties, FixedProperties, Mailbox, QueueBound, ToConnection, Undelivered,
};
// Made by a cluster node only (see `cluster::awaited`).
#[cfg(any(test, feature = "cluster"))]
pub use mailbox::OnDone;
pub use packet_ids::{PacketIdBlock, Resumed};
pub use route::Route;

/// What a connection asks before it sends its client a QoS 2 delivery
/// the router numbered for persistent sessions, or the PUBREL of one
/// (client id, which): what to wait for first, if anything (a cluster
/// node: the message's copy in etcd marked in flight, then gone, see
/// `cluster::queue`).
pub type BeforeSending = std::sync::Arc<
    dyn Fn(&str, Sending<'_>) -> Option<tokio::sync::oneshot::Receiver<()>> + Send + Sync,
>;

/// What [`BeforeSending`] is asked about (read by a cluster node's queue).
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
pub enum Sending<'a> {
    /// A QoS 2 delivery: the router's number for it, and the packet.
    Publish {
        number: router::MessageId,
        publish: &'a router::protocol::Publish,
        properties: Option<&'a router::protocol::PublishProperties>,
    },
    /// The PUBREL of the delivery under this packet id (the client has
    /// the message).
    PubRel(u16),
}

struct Live {
    connection: u64,
    mailbox: Mailbox,
    peer: Arc<Peer>,
}

#[derive(Default)]
struct Client {
    live: Option<Live>,
    /// The state store requests its session's connections acknowledged.
    acknowledged: SharedAcknowledged,
    /// Messages another cluster node handed over for the session that a
    /// connection ended without acknowledging: for its next connection
    /// (or the next node it moves to). At most [`HANDED_OVER_MAX`].
    handed_over: Vec<Direct>,
}

/// Handed-over messages one session keeps, and one handover sends, at
/// most: past them the oldest go (as a subscriber that falls behind the
/// router's log loses the oldest), with a WARN.
pub const HANDED_OVER_MAX: usize = 10_000;

/// Drops the oldest of `messages` (oldest first) past
/// [`HANDED_OVER_MAX`]; returns how many it dropped.
pub fn bound_handed_over<T>(messages: &mut Vec<T>) -> usize {
    let over = messages.len().saturating_sub(HANDED_OVER_MAX);
    messages.drain(..over);
    over
}

/// The broker's clients, by client id.
pub struct Sessions {
    clients: RwLock<HashMap<Arc<str>, Client>>,
    /// The router's subscriptions, which say who receives what.
    subscriptions: Arc<Subscriptions>,
    /// Counts the changes of clients' live connections (see [`Route`]).
    live_changes: AtomicU64,
}

impl Sessions {
    /// Clients whose subscriptions the router's `subscriptions` know.
    pub fn new(subscriptions: Arc<Subscriptions>) -> Sessions {
        Sessions {
            clients: RwLock::new(HashMap::new()),
            subscriptions,
            live_changes: AtomicU64::new(0),
        }
    }

    /// Whether the router keeps a session of `client` that a clean start
    /// must discard at CONNECT (one kept after its connection, or held by
    /// a persistent connection a new one takes over).
    pub fn has_session_to_discard(&self, client: &str) -> bool {
        self.subscriptions.has_kept_session(client)
    }

    /// A connection of `client` was accepted; its task reads `mailbox`.
    /// `resumed`: the router resumed the client's session (Session Present
    /// 1), else the session starts afresh; `peer`: what the web view shows
    /// of it. Returns the session's [`Acknowledged`].
    pub fn connected(
        &self,
        client: &str,
        connection: u64,
        resumed: bool,
        mailbox: Mailbox,
        peer: Arc<Peer>,
    ) -> SharedAcknowledged {
        let mut clients = self.clients.write();
        let key = clients
            .get_key_value(client)
            .map_or_else(|| Arc::from(client), |(k, _)| Arc::clone(k));
        let state = clients.entry(key).or_default();
        if !resumed {
            state.acknowledged = SharedAcknowledged::default();
            state.handed_over = Vec::new();
        }
        let previous = state.live.replace(Live {
            connection,
            mailbox,
            peer,
        });
        self.live_changes.fetch_add(1, Ordering::Release);
        if let Some(previous) = previous {
            let _ = previous.mailbox.tx.send(ToConnection::TakenOver);
        }
        Arc::clone(&state.acknowledged)
    }

    /// Tells `client`'s connection that its session's previous node has
    /// handed over everything (see [`ToConnection::HandoverDone`]); nothing
    /// if it is not connected.
    pub fn handover_done(&self, client: &str) {
        self.tell(client, ToConnection::HandoverDone);
    }

    /// Tells `client`'s connection that answers it may hold
    /// acknowledgements for are out elsewhere (see
    /// [`ToConnection::AnswersOut`]); nothing if it is not connected.
    pub fn answers_out(&self, client: &str) {
        self.tell(client, ToConnection::AnswersOut);
    }

    /// Tells `client`'s connection to end with DISCONNECT `reason` (a
    /// fault, see [`crate::faults`]); `false` if it is not connected.
    pub fn disconnect(&self, client: &str, reason: protocol::DisconnectReasonCode) -> bool {
        self.tell(client, ToConnection::Disconnect(reason))
    }

    /// Sends `client`'s live connection `message`; `false` if it is not
    /// connected.
    fn tell(&self, client: &str, message: ToConnection) -> bool {
        let clients = self.clients.read();
        let live = clients.get(client).and_then(|c| c.live.as_ref());
        live.is_some_and(|l| l.mailbox.tx.send(message).is_ok())
    }

    /// Ends `client`'s connection `connection` with DISCONNECT 0x8E
    /// (session taken over: the client connected to another cluster
    /// node); `false` if that is not its live connection.
    pub fn take_over(&self, client: &str, connection: u64) -> bool {
        let clients = self.clients.read();
        let live = clients.get(client).and_then(|c| c.live.as_ref());
        live.is_some_and(|l| {
            l.connection == connection && l.mailbox.tx.send(ToConnection::TakenOver).is_ok()
        })
    }

    /// Tells every connection accepted before stop number `epoch` to end:
    /// the node stopped serving (a cluster node that lost its
    /// membership); how many were told. One accepted since (the node
    /// serves again) stays.
    pub fn send_all_away(&self, epoch: u64) -> usize {
        let clients = self.clients.read();
        clients
            .values()
            .filter_map(|c| c.live.as_ref())
            .filter(|l| l.peer.epoch < epoch)
            .filter(|l| l.mailbox.tx.send(ToConnection::SendAway).is_ok())
            .count()
    }

    /// Whether `connection` is `client`'s live connection.
    pub fn is_live(&self, client: &str, connection: u64) -> bool {
        let clients = self.clients.read();
        let live = clients.get(client).and_then(|c| c.live.as_ref());
        live.is_some_and(|l| l.connection == connection)
    }

    /// A connection of `client` ended; its session is kept `session_expiry`
    /// seconds (0: it ends now).
    pub fn disconnected(&self, client: &str, connection: u64, session_expiry: u32) {
        let mut clients = self.clients.write();
        let Some(state) = clients.get_mut(client) else {
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
        self.live_changes.fetch_add(1, Ordering::Release);
        if session_expiry == 0 {
            clients.remove(client);
        }
    }

    /// Keeps `messages` (handed over by another cluster node, not
    /// acknowledged by the connection that ended) for `client`'s session,
    /// which a later connection or node gets ([`Sessions::take_handed_over`]):
    /// they are the session's alone, not to publish on their topics again.
    pub fn keep_handed_over(&self, client: &str, messages: Vec<Direct>) {
        let mut clients = self.clients.write();
        // A session the router keeps with no connection here yet (adopted
        // from a node that stopped, see `cluster::orphans`).
        if !clients.contains_key(client) && self.subscriptions.has_kept_session(client) {
            clients.insert(Arc::from(client), Client::default());
        }
        let Some(state) = clients.get_mut(client) else {
            tracing::warn!(
                client_id = client,
                dropped = messages.len(),
                "messages handed over for a session that ended are dropped"
            );
            return;
        };
        state.handed_over.extend(messages);
        let over = bound_handed_over(&mut state.handed_over);
        if over > 0 {
            tracing::warn!(
                client_id = client,
                dropped = over,
                kept = HANDED_OVER_MAX,
                "more handed-over messages kept for a session than allowed: the oldest are dropped"
            );
        }
    }

    /// The handed-over messages kept for `client`'s session (see
    /// [`Sessions::keep_handed_over`]), in order; none are kept after.
    pub fn take_handed_over(&self, client: &str) -> Vec<Direct> {
        let mut clients = self.clients.write();
        clients
            .get_mut(client)
            .map(|state| std::mem::take(&mut state.handed_over))
            .unwrap_or_default()
    }

    /// Forgets the clients without a connection whose session the router
    /// no longer keeps (it expired). Returns how many.
    pub fn end_expired(&self) -> usize {
        let mut clients = self.clients.write();
        let before = clients.len();
        clients.retain(|id, c| c.live.is_some() || self.subscriptions.has_kept_session(id));
        before - clients.len()
    }

    /// Number of client ids with state.
    #[cfg(test)]
    fn tracked(&self) -> usize {
        self.clients.read().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::sync::atomic::AtomicUsize;
    use tokio::sync::mpsc;

    /// An unbounded mailbox on `tx` (also for `recipients.rs`'s tests).
    pub(super) fn mailbox(tx: mpsc::UnboundedSender<ToConnection>) -> Mailbox {
        Mailbox::new(tx, QueueBound::new(usize::MAX, usize::MAX))
    }

    /// A loopback MQTT 5 client's peer (also for `recipients.rs`'s tests).
    pub(super) fn peer() -> Arc<Peer> {
        peer_in(0)
    }

    /// The same, accepted after `epoch` stops of the node.
    fn peer_in(epoch: u64) -> Arc<Peer> {
        Arc::new(Peer {
            protocol: "MQTT 5",
            address: "127.0.0.1:50000".parse().unwrap(),
            listener: "v5.1".into(),
            in_flight: AtomicUsize::new(0),
            epoch,
        })
    }

    /// Every move of a delivery copies it: past 256 bytes glibc's memcpy
    /// takes its slower path (a 32-byte field made a `Direct` 272 bytes,
    /// and cost a state store request ~390 instructions more in copies,
    /// by callgrind, on 2026-11-29).
    #[test]
    fn a_direct_delivery_stays_within_256_bytes() {
        let direct = std::mem::size_of::<Direct>();
        assert!(direct <= 256, "Direct is {direct} bytes");
    }

    /// A stop of the node sends away the connections accepted before it,
    /// not one accepted after the node served again (before the send-away
    /// task ran: it used to end it too).
    #[test]
    fn a_stop_sends_away_only_the_connections_accepted_before_it() {
        let s = Sessions::new(Arc::default());
        let (old_tx, mut old_rx) = mpsc::unbounded_channel();
        let (new_tx, mut new_rx) = mpsc::unbounded_channel();
        s.connected("old", 1, false, mailbox(old_tx), peer_in(0));
        s.connected("new", 2, false, mailbox(new_tx), peer_in(1));
        assert_eq!(s.send_all_away(1), 1);
        assert!(matches!(old_rx.try_recv(), Ok(ToConnection::SendAway)));
        assert!(new_rx.try_recv().is_err(), "accepted after the stop");
        assert_eq!(s.send_all_away(2), 2, "a later stop sends both away");
    }

    #[test]
    fn a_new_connection_takes_over_and_the_old_ones_end_changes_nothing() {
        let s = Sessions::new(Arc::default());
        let (old_tx, mut old_rx) = mpsc::unbounded_channel();
        let (tx, _rx) = mpsc::unbounded_channel();
        s.connected("a", 1, false, mailbox(old_tx), peer());
        s.connected("a", 2, true, mailbox(tx), peer());
        assert!(
            matches!(old_rx.try_recv(), Ok(ToConnection::TakenOver)),
            "the older connection is told"
        );
        assert!(s.is_live("a", 2) && !s.is_live("a", 1));
        s.disconnected("a", 1, 0);
        assert!(
            s.is_live("a", 2),
            "the old connection's end: not the session's"
        );
        assert!(s.disconnect("a", protocol::DisconnectReasonCode::UseAnotherServer));
        s.disconnected("a", 2, 0);
        assert!(!s.is_live("a", 2));
        assert_eq!(s.tracked(), 0, "a session without expiry leaves nothing");
        assert!(!s.disconnect("a", protocol::DisconnectReasonCode::UseAnotherServer));
    }

    /// One bound for what a session keeps and what a handover sends (the
    /// two had 10,000 each, and a handover sent the kept ones on top of
    /// 10,000 drained ones): past it the oldest go.
    #[test]
    fn handed_over_messages_are_bounded_oldest_dropped() {
        let s = Sessions::new(Arc::default());
        let (tx, _rx) = mpsc::unbounded_channel();
        s.connected("h", 1, false, mailbox(tx), peer());
        let direct = |n: usize| Direct {
            topic: Bytes::from(n.to_string()),
            payload: Bytes::new(),
            properties: DirectProperties::Publish(Default::default()),
            qos: 1,
            handed_over: true,
            retain: false,
            kept_pkid: None,
            on_done: None,
        };
        s.keep_handed_over("h", (0..HANDED_OVER_MAX - 1).map(direct).collect());
        s.keep_handed_over(
            "h",
            (HANDED_OVER_MAX - 1..HANDED_OVER_MAX + 2)
                .map(direct)
                .collect(),
        );
        let kept = s.take_handed_over("h");
        assert_eq!(kept.len(), HANDED_OVER_MAX);
        assert_eq!(kept[0].topic, "2", "the two oldest went");
        assert_eq!(
            kept[HANDED_OVER_MAX - 1].topic,
            (HANDED_OVER_MAX + 1).to_string()
        );
        assert!(s.take_handed_over("h").is_empty(), "taken once");

        // A handover: the kept ones, then the drained ones, bounded together.
        let mut sent: Vec<usize> = (0..HANDED_OVER_MAX + 5).collect();
        assert_eq!(bound_handed_over(&mut sent), 5);
        assert_eq!((sent.len(), sent[0]), (HANDED_OVER_MAX, 5));
        let mut few = vec![1, 2];
        assert_eq!(bound_handed_over(&mut few), 0);
        assert_eq!(few, [1, 2]);
    }

    #[test]
    fn clients_whose_session_the_router_no_longer_keeps_are_forgotten() {
        let s = Sessions::new(Arc::default());
        let (tx, _rx) = mpsc::unbounded_channel();
        s.connected("p", 1, false, mailbox(tx.clone()), peer());
        s.connected("q", 2, false, mailbox(tx), peer());
        s.disconnected("p", 1, 60);
        assert_eq!(s.tracked(), 2, "p's session may still be kept");
        assert_eq!(s.end_expired(), 1, "the router keeps none of p");
        assert_eq!(s.tracked(), 1, "q is connected");
    }
}
