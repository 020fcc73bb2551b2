//! What was published while no node held a dead node's sessions.
//!
//! When a node dies, its persistent sessions are held by nobody until
//! their client reconnects to another node or another node adopts them
//! (see [`super::orphans`]: the lease's TTL and a few etcd round trips).
//! Every node had what was published meanwhile (each publish goes to
//! every node), but no router had those sessions' subscriptions: before
//! this module (2026-11-30), it was lost for them.
//!
//! So each node keeps the QoS 1/2 publishes its router had in the last
//! seconds ([`Recent::note`]: bounded in bytes and age), each with its
//! stamp (origin and number, see [`super::stamps`]). When a node's link
//! to another breaks or closes, it notes how far that node had its
//! publishes (every one up to a number acknowledged, see
//! [`super::confirmations::State::had_up_to`]) and tells every other
//! node, on its links, after what it forwarded to them
//! ([`crate::publisher::HAD`]). A node that takes a session of a dead
//! node from etcd ([`Recent::replay`]) gives it, after what etcd kept
//! for it, the publishes of the log its subscriptions match that the
//! dead node did not have: from every live origin, those after the
//! number that origin said. The dead node's own clients' publishes are
//! not given again (its router had them all), nor those of an origin
//! that has said nothing within [`PATIENCE`] (its node is dead too, or
//! its word was lost: counted, WARN).
//!
//! What it does not give: what the dead node had and had not written to
//! etcd yet (queued less than an etcd round trip and 100 ms before it
//! died, see [`super::queue`]); what is older than the log; a will; what
//! reached the router between the look and the take (see [`after_take`]),
//! a QoS 2 publish counted from when its PUBREL is in the router's queue
//! (`super::stamps::Stamps::in_router`: one whose PUBREL had been read and
//! not yet passed on was given, and the router gave it again).
//!
//! Liveness (the links' lock) is asked before the log's lock is taken,
//! never under it (see [`Recent::live_nodes`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use router::protocol::{Publish, PublishProperties, QoS};
use router::{Message, MessageId, RestoredSession, SessionRecord};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::publisher::stamp_of;

/// How long a node taking a dead node's session waits, at most, for the
/// live nodes to say how far the dead one had their publishes.
pub const PATIENCE: Duration = Duration::from_secs(1);
/// Nodes whose link breaks are remembered at most (the oldest forgotten).
const MAX_NODES: usize = 64;
/// Origins remembered per node at most.
const MAX_ORIGINS: usize = 64;
/// A word older than this before this node's own link to the node broke
/// is from an earlier break.
const FRESH: Duration = Duration::from_secs(5);
/// What an entry costs besides its topic, payload and User Properties.
const ENTRY_OVERHEAD: usize = 160;

/// See the module's documentation.
pub struct Recent {
    max_bytes: usize,
    max_age: Duration,
    state: Mutex<State>,
    /// Told when a node says how far another had its publishes.
    said: Notify,
}

#[derive(Default)]
struct State {
    log: VecDeque<Entry>,
    bytes: usize,
    /// The number of the next entry.
    next: u64,
    /// Node whose link broke -> origin -> how far it had that origin's
    /// publishes, and when that was said.
    had: HashMap<String, HashMap<String, (u64, Instant)>>,
    /// Node -> when this node's own link to it last broke or closed.
    down: HashMap<String, Instant>,
    /// Node -> when this node's own link to it last came up.
    up: HashMap<String, Instant>,
}

impl State {
    /// How far `dead` had `origin`'s publishes, as said since its last
    /// break: a word from more than [`FRESH`] before this node's own link
    /// to `dead` last broke is from an earlier break.
    ///
    /// Nor is a word from before this node's own link to `dead` last came
    /// up: that was of an earlier break, or of an earlier run of `dead`,
    /// and says nothing of what the node that died now had. (A node that
    /// took a session of a paused node as its lease ended, its own link
    /// to that node not yet closed, took the word said when that node
    /// had stopped and started again 20 s before, and gave the session
    /// all it had had since: 7,542 messages, 2026-11-30.)
    fn word(&self, dead: &str, origin: &str) -> Option<u64> {
        let (up_to, at) = self.had.get(dead)?.get(origin)?;
        let since = self.down.get(dead).and_then(|down| down.checked_sub(FRESH));
        let current = self.up.get(dead).is_none_or(|up| at >= up);
        (current && since.is_none_or(|since| *at >= since)).then_some(*up_to)
    }
}

/// A publish the router had.
struct Entry {
    /// Its place in the log.
    seq: u64,
    at: Instant,
    /// The origin's length in its stamp (`<origin>/<number>`, a User
    /// Property of `properties`).
    origin: usize,
    number: u64,
    publish: Publish,
    properties: Option<PublishProperties>,
    size: usize,
}

impl Entry {
    fn stamp(&self) -> &str {
        stamp_of(self.properties.as_ref()).unwrap_or_default()
    }

    fn origin(&self) -> &str {
        &self.stamp()[..self.origin]
    }

    fn topic(&self) -> &str {
        std::str::from_utf8(&self.publish.topic).unwrap_or("")
    }

    /// Whether one of `session`'s subscriptions (not a shared one) takes
    /// it, at QoS 1 or 2.
    fn taken_by(&self, session: &SessionRecord) -> bool {
        let filters = session.filters.iter().map(|(f, s)| (f, s));
        router::granted(filters, self.topic(), false).is_some_and(|(qos, _)| qos > 0)
    }

    fn node(&self) -> &str {
        let origin = self.origin();
        origin.rsplit_once('/').map_or(origin, |(node, _)| node)
    }
}

/// The publishes a taken session is to get (see [`Recent::replay`]).
pub struct Replay {
    /// In the order the router had them.
    pub messages: Vec<Message>,
    /// The log's place they reach: what came after it may have reached the
    /// router after the session (see [`Recent::since`]).
    pub upto: u64,
    /// Origins that said nothing in time (their publishes not given).
    pub silent: Vec<String>,
}

/// `<number>\n<origin>\n<node>`: how far `node` had `origin`'s publishes
/// (node ids and origins have no line breaks).
pub fn said(node: &str, origin: &str, up_to: u64) -> String {
    format!("{up_to}\n{origin}\n{node}")
}

fn parse_said(value: &str) -> Option<(&str, &str, u64)> {
    let mut parts = value.splitn(3, '\n');
    let up_to = parts.next()?.parse().ok()?;
    let origin = parts.next()?;
    let node = parts.next()?;
    (!origin.is_empty() && !node.is_empty()).then_some((node, origin, up_to))
}

/// `<origin>/<number>`: the origin's length and the number.
fn parse_stamp(stamp: &str) -> Option<(usize, u64)> {
    let (origin, number) = stamp.rsplit_once('/')?;
    Some((origin.len(), number.parse().ok()?))
}

impl Recent {
    /// A log of `max_bytes` at most (0: none kept), each publish kept
    /// `max_age` at most.
    pub fn new(max_bytes: usize, max_age: Duration) -> Recent {
        Recent {
            max_bytes,
            max_age,
            state: Mutex::new(State::default()),
            said: Notify::new(),
        }
    }

    /// The router has (or is about to have) `publish`, its stamp among its
    /// `properties`: a client's of this node, or one another node's link
    /// passed on.
    pub fn note(&self, publish: &Publish, properties: Option<&PublishProperties>) {
        if self.max_bytes == 0 || publish.qos == QoS::AtMostOnce {
            return;
        }
        let Some((origin, number)) = stamp_of(properties).and_then(parse_stamp) else {
            return;
        };
        let size = ENTRY_OVERHEAD
            + publish.topic.len()
            + publish.payload.len()
            + properties.map_or(0, |p| {
                p.user_properties
                    .iter()
                    .map(|(k, v)| k.len() + v.len() + 32)
                    .sum::<usize>()
                    + p.content_type.as_ref().map_or(0, |c| c.len())
                    + p.response_topic.as_ref().map_or(0, |t| t.len())
                    + p.correlation_data.as_ref().map_or(0, |c| c.len())
            });
        let now = Instant::now();
        let mut state = self.state.lock();
        let seq = state.next;
        state.next += 1;
        state.bytes += size;
        state.log.push_back(Entry {
            seq,
            at: now,
            origin,
            number,
            publish: publish.clone(),
            properties: properties.cloned(),
            size,
        });
        while state.bytes > self.max_bytes
            || state
                .log
                .front()
                .is_some_and(|e| now.duration_since(e.at) > self.max_age)
        {
            let Some(old) = state.log.pop_front() else {
                break;
            };
            state.bytes -= old.size;
        }
    }

    /// This node's link to `node` broke or closed: `node` had every
    /// publish of `origin` (this node's) up to `up_to`.
    pub fn own_link_down(&self, node: &str, origin: &str, up_to: u64) {
        self.state
            .lock()
            .down
            .insert(node.to_owned(), Instant::now());
        self.had(node, origin, up_to);
    }

    /// This node's link to `node` came up (a word said before is of an
    /// earlier break, see `State::word`).
    pub fn link_up(&self, node: &str) {
        let mut state = self.state.lock();
        if !state.up.contains_key(node) && state.up.len() >= MAX_NODES {
            let oldest = state
                .up
                .iter()
                .min_by_key(|(_, at)| **at)
                .map(|(n, _)| n.clone());
            if let Some(oldest) = oldest {
                state.up.remove(&oldest);
            }
        }
        state.up.insert(node.to_owned(), Instant::now());
    }

    /// Another node's word (see [`said`]); `false`: it cannot be read.
    pub fn heard(&self, value: &str) -> bool {
        let Some((node, origin, up_to)) = parse_said(value) else {
            return false;
        };
        self.had(node, origin, up_to);
        true
    }

    fn had(&self, node: &str, origin: &str, up_to: u64) {
        let mut state = self.state.lock();
        if !state.had.contains_key(node) && state.had.len() >= MAX_NODES {
            // The node heard of least recently.
            let oldest = state
                .had
                .iter()
                .filter_map(|(n, o)| Some((o.values().map(|(_, at)| *at).max()?, n.clone())))
                .min();
            if let Some((_, oldest)) = oldest {
                state.had.remove(&oldest);
                state.down.remove(&oldest);
            }
        }
        let origins = state.had.entry(node.to_owned()).or_default();
        if !origins.contains_key(origin) && origins.len() >= MAX_ORIGINS {
            let oldest = origins
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(o, _)| o.clone());
            if let Some(oldest) = oldest {
                origins.remove(&oldest);
            }
        }
        origins.insert(origin.to_owned(), (up_to, Instant::now()));
        drop(state);
        self.said.notify_waiters();
    }

    /// The publishes of the log that `session` (taken from `dead`, which
    /// died) is to get: those its subscriptions match (not the shared
    /// ones) that `dead` did not have, from every origin but `dead`'s,
    /// whose node `live` says is a member (this node's own included),
    /// without those with a stamp in `had` (read back from etcd), and
    /// QoS 2 ones only once `released` says the router had them (their
    /// PUBREL in its queue; one released later reaches the session through
    /// the router, and one whose PUBREL reaches the router's queue
    /// between this look and the take is not given: see [`after_take`]).
    /// Waits [`PATIENCE`] at most for the live origins' word.
    pub async fn replay(
        &self,
        dead: &str,
        session: &SessionRecord,
        had: &HashSet<String>,
        live: impl Fn(&str) -> bool,
        released: impl Fn(&str) -> bool,
    ) -> Replay {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let said = self.said.notified();
            let replay = self.collect(dead, session, had, &live, &released);
            if replay.silent.is_empty() || Instant::now() >= deadline {
                return replay;
            }
            let _ = tokio::time::timeout_at(deadline, said).await;
        }
    }

    fn collect(
        &self,
        dead: &str,
        session: &SessionRecord,
        had: &HashSet<String>,
        live: &impl Fn(&str) -> bool,
        released: &impl Fn(&str) -> bool,
    ) -> Replay {
        let live = self.live_nodes(live);
        let state = self.state.lock();
        let up_to = |origin: &str| state.word(dead, origin);
        let mut messages = Vec::new();
        let mut silent: Vec<String> = Vec::new();
        let mut upto = state.next;
        for entry in &state.log {
            upto = entry.seq + 1;
            let node = entry.node();
            if node == dead || !live.contains(node) {
                continue;
            }
            if !entry.taken_by(session) {
                continue;
            }
            match up_to(entry.origin()) {
                Some(up_to) if entry.number <= up_to => continue,
                Some(_) => {}
                None => {
                    if !silent.iter().any(|o| o == entry.origin()) {
                        silent.push(entry.origin().to_owned());
                    }
                    continue;
                }
            }
            if had.contains(entry.stamp())
                || (entry.publish.qos == QoS::ExactlyOnce && !released(entry.stamp()))
            {
                continue;
            }
            let mut message = Message {
                publish: entry.publish.clone(),
                properties: entry.properties.clone(),
            };
            message.publish.retain = false;
            if crate::durable::for_session(session, &mut message) {
                messages.push(message);
            }
        }
        Replay {
            messages,
            upto,
            silent,
        }
    }

    /// What [`Recent::replay`] would have given `session` of what came
    /// after `after` (the log's place it reached): each one's stamp and
    /// topic, for the caller to tell those the router gave the session
    /// once it had taken it (see [`super::stamps`]).
    pub fn since(
        &self,
        after: u64,
        dead: &str,
        session: &SessionRecord,
        live: impl Fn(&str) -> bool,
    ) -> Vec<(String, String)> {
        let live = self.live_nodes(&live);
        let state = self.state.lock();
        state
            .log
            .iter()
            .filter(|e| e.seq >= after)
            .filter(|entry| {
                let node = entry.node();
                let known = state.word(dead, entry.origin());
                node != dead
                    && live.contains(node)
                    && known.is_some_and(|up_to| entry.number > up_to)
                    && entry.taken_by(session)
            })
            .map(|entry| (entry.stamp().to_owned(), entry.topic().to_owned()))
            .collect()
    }

    /// The nodes of the log's entries that `live` says are members.
    /// `live` is not called with the log locked: it reads the links'
    /// lock, which the peers hold (written, when a node leaves and its
    /// link closes: `Peers::follow_members`) while they note here how far
    /// that node had this one's publishes (`own_link_down`), the opposite
    /// order. Before (2026-11-30), a node that adopted a session of the
    /// node that had just left, as it closed the link to it, stopped
    /// answering for good: each of its two runtime threads held one lock
    /// and waited for the other (1 in 16 short fault runs; the nodes it
    /// linked to saw its keep-alive end).
    fn live_nodes(&self, live: &impl Fn(&str) -> bool) -> HashSet<String> {
        let nodes: HashSet<String> = {
            let state = self.state.lock();
            let mut nodes = HashSet::new();
            for entry in &state.log {
                if !nodes.contains(entry.node()) {
                    nodes.insert(entry.node().to_owned());
                }
            }
            nodes
        };
        nodes.into_iter().filter(|node| live(node)).collect()
    }

    /// The log's size: entries and bytes.
    #[cfg(test)]
    fn len(&self) -> (usize, usize) {
        let state = self.state.lock();
        (state.log.len(), state.bytes)
    }
}

/// The stamps of `messages`.
pub fn stamps_of<'a>(messages: impl IntoIterator<Item = &'a Message>) -> HashSet<String> {
    messages
        .into_iter()
        .filter_map(|m| stamp_of(m.properties.as_ref()).map(str::to_owned))
        .collect()
}

/// What a node taking a dead node's session from etcd works with (see
/// [`before_take`], [`after_take`]).
pub struct Taking<'a> {
    pub recent: &'a Recent,
    /// Whether a node is a member (this one, or one it links to).
    pub live: &'a (dyn Fn(&str) -> bool + Sync),
    pub stamps: &'a super::stamps::Stamps,
    pub queue: &'a Arc<super::Queue>,
    /// The node that had the session, dead.
    pub dead: &'a str,
    pub client_id: &'a str,
}

/// What [`before_take`] gave the session: the log's place it reached, and
/// the messages to keep in etcd once the session is taken.
pub struct Given {
    /// The session's subscriptions, as the look took them.
    session: SessionRecord,
    upto: u64,
    kept: Vec<(MessageId, Message)>,
    /// The origins that said nothing in time.
    silent: Vec<String>,
}

/// Before `session` goes into the router (`restored`, with what etcd kept
/// for it): the publishes of the log it is to get (see [`Recent::replay`])
/// go after those, numbered as read back.
pub async fn before_take(taking: &Taking<'_>, restored: &mut RestoredSession) -> Given {
    let session = record_of(restored);
    let had = stamps_of(restored.waiting.iter().map(|(_, m)| m));
    let stamps = taking.stamps;
    let replay = taking
        .recent
        .replay(taking.dead, &session, &had, taking.live, |stamp| {
            stamps.in_router(stamp)
        })
        .await;
    // Nothing slow from the look to the take (see [`after_take`]).
    let mut kept = Vec::with_capacity(replay.messages.len());
    for message in replay.messages {
        let number = taking.queue.restored_number();
        tracing::trace!(
            client_id = taking.client_id,
            number = number.0,
            stamp = stamp_of(message.properties.as_ref()).unwrap_or_default(),
            topic = %String::from_utf8_lossy(&message.publish.topic),
            payload = %String::from_utf8_lossy(&message.publish.payload[..message.publish.payload.len().min(32)]),
            "clustering: a publish the dead node had not had goes to the session"
        );
        kept.push((number, message.clone()));
        restored.waiting.push((number, message));
    }
    Given {
        session,
        upto: replay.upto,
        kept,
        silent: replay.silent,
    }
}

/// The session is in the router (with `filters`; the stamps noted how far
/// each origin had come): the messages [`before_take`] gave it are kept in
/// etcd until the client has them. Those that came between its look and
/// the take (its router did not give them to the session: it had them
/// before the session) are not given: they would reach the client after
/// newer ones, which the router gives at once (tried: 2 of 5 runs of
/// `a_subscribers_session_survives_its_node_killed_under_load` had one
/// out of order); counted in a log line.
pub fn after_take(taking: &Taking<'_>, given: Given) {
    for (number, message) in &given.kept {
        taking.queue.keep(&[taking.client_id], *number, message);
    }
    if !given.silent.is_empty() {
        crate::metrics::cluster_replay_unknown(given.silent.len());
        tracing::warn!(
            client_id = taking.client_id,
            dead = taking.dead,
            origins = ?given.silent,
            "clustering: nodes did not say in time how far a dead node had their publishes: what they published before its session was taken here is not given to it"
        );
    }
    if !given.kept.is_empty() {
        crate::metrics::cluster_replayed(given.kept.len());
        tracing::info!(
            client_id = taking.client_id,
            dead = taking.dead,
            count = given.kept.len(),
            "clustering: publishes the dead node had not had went to its session after what etcd kept"
        );
    }
    let late = taking
        .recent
        .since(given.upto, taking.dead, &given.session, taking.live);
    let missed = late
        .iter()
        .filter(|(stamp, topic)| {
            taking.stamps.judge(taking.client_id, stamp, topic) == super::stamps::Verdict::New
        })
        .count();
    if missed > 0 {
        tracing::info!(
            client_id = taking.client_id,
            dead = taking.dead,
            count = missed,
            "clustering: publishes that came while the session was being taken, after this node looked at its log, are not given to it (they would come after newer ones)"
        );
    }
}

/// The session `restored` is, as its record says (its subscriptions).
fn record_of(restored: &RestoredSession) -> SessionRecord {
    SessionRecord {
        expiry: 0,
        disconnected_at_ms: None,
        filters: restored.filters.clone(),
        queue_full: restored.queue_full,
    }
}

#[cfg(test)]
mod tests;
