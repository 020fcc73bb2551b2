//! Which messages this node's router had for a session that moved here,
//! told by each message's stamp: the node that took it in from its
//! publisher, that node's run, and a number.
//!
//! While a session moves from node A to this one, both routers have it:
//! this one from the moment it took the session (its subscriptions
//! active), A until it has seen the claim and handed the session over.
//! A message published then reaches both copies, and A's came again in
//! the handover: before 2026-11-29 the client got it twice, even at QoS
//! 2. So:
//!
//! - each node stamps every publish of its clients as it forwards it
//!   ([`Stamps::stamp`], the User Property [`crate::publisher::STAMP`],
//!   on its own router's copy and on every link's; removed before a
//!   client gets it);
//! - each node notes, per origin, which numbers went to its router
//!   ([`Stamps::arrived`]; a QoS 2 publish at its PUBREL, when the router
//!   delivers it: [`Stamps::held`], [`Stamps::released`]), before the
//!   router has them;
//! - when it takes a session ([`Stamps::taken`], once its subscriptions
//!   are in the router) it notes how far each origin had come: its last
//!   number, and the numbers below it not come yet;
//! - a handed-over message ([`Stamps::judge`]) whose topic matches one of
//!   the session's subscriptions that is not shared (a shared one may
//!   have given it to another member here) is dropped when its number
//!   went to the router after that: the router gave it to the session
//!   ([`Verdict::Had`]). It is held back when the router holds a copy
//!   for its PUBREL ([`Verdict::Coming`], [`Stamps::hold_back`]: a QoS 2
//!   publish over a link may be released after the other node's handover
//!   came): dropped once that copy is released and delivered, delivered
//!   if it is discarded, forgotten, or not released in time
//!   ([`Stamps::give_back`]).
//!
//! What is not told (no stamp, an origin forgotten, a number lost on a
//! link or below the [`WINDOW`], a node started again) is delivered: a
//! duplicate, as before, never a loss. A QoS 2 message the old node had
//! sent without its exchange completed is always delivered, under the id
//! the client saw (the client takes it for the same message); if this
//! node's router gave the session the message too, the client gets it
//! twice (the old connection was still up while the session moved).
//!
//! Bounds: [`MAX_ORIGINS`] origins (a node's every run is one; the oldest
//! noted first is forgotten), [`MAX_TAKEN`] sessions taken and
//! [`MAX_HELD`] QoS 2 publishes waiting (the oldest first forgotten),
//! [`MAX_HELD_BACK`] messages held back (past it, delivered at once).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use hashlink::LinkedHashMap;
use parking_lot::Mutex;

use crate::sessions::Direct;

/// Origins remembered at most.
pub const MAX_ORIGINS: usize = 16;
/// Sessions taken remembered at most.
pub const MAX_TAKEN: usize = 10_000;
/// QoS 2 publishes from links waiting for their PUBREL, remembered at most.
pub const MAX_HELD: usize = 100_000;
/// How far below an origin's last number arrivals are told apart (a
/// message handed over from further below is delivered).
const WINDOW: u64 = 8_192;
/// Numbers not come yet noted per origin when a session is taken, at most
/// (the last ones).
const MAX_HOLES: usize = 16;
/// Handed-over messages held back at most (past it, delivered at once).
pub const MAX_HELD_BACK: usize = 10_000;

/// See the module's documentation.
pub struct Stamps {
    /// `<node id>/<run>`: this node's origin (node ids have no `/`).
    own: String,
    /// The last number given (numbers start at 1).
    given: AtomicU64,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Origin -> what this node's links passed on from it.
    arrived: LinkedHashMap<String, Arrived>,
    /// The number of the next origin noted.
    origins: u64,
    /// (Connection's client id, packet id) -> the stamp of a QoS 2
    /// publish waiting for its PUBREL (the router holds it until then).
    held: LinkedHashMap<(String, u16), String>,
    /// Stamp -> how many of `held` have it.
    holding: HashMap<String, usize>,
    /// Stamp -> handed-over messages held back until the router's own copy
    /// is released (see [`Stamps::hold_back`]).
    held_back: HashMap<String, Vec<HeldBack>>,
    /// How many `held_back` has.
    held_back_count: usize,
    /// Client id -> how far each origin had come when its session was
    /// taken here.
    taken: LinkedHashMap<String, Taken>,
    /// Stamp -> how many PUBRELs released with it (noted in `arrived`)
    /// are not in the router's queue yet (see [`Stamps::in_router`]).
    in_transit: HashMap<String, u32>,
}

/// What the links passed on to the router from one origin: the numbers
/// in the [`WINDOW`] up to the last.
struct Arrived {
    /// The origin's number among those noted here (a forgotten origin
    /// heard of again is a new one).
    id: u64,
    /// The last (highest) number.
    last: u64,
    /// Bit `n % WINDOW`: number `n` came (for `n` in the window).
    came: [u64; (WINDOW / 64) as usize],
}

impl Arrived {
    fn new(id: u64) -> Arrived {
        Arrived {
            id,
            last: 0,
            came: [0; (WINDOW / 64) as usize],
        }
    }

    fn in_window(&self, number: u64) -> bool {
        number <= self.last && number + WINDOW > self.last
    }

    fn came(&self, number: u64) -> bool {
        let bit = number % WINDOW;
        self.in_window(number) && self.came[(bit / 64) as usize] & (1 << (bit % 64)) != 0
    }

    fn note(&mut self, number: u64) {
        if number > self.last {
            // The numbers between (not come yet) enter the window.
            if number - self.last >= WINDOW {
                self.came = [0; (WINDOW / 64) as usize];
            } else {
                for n in self.last + 1..number {
                    let bit = n % WINDOW;
                    self.came[(bit / 64) as usize] &= !(1 << (bit % 64));
                }
            }
            self.last = number;
        } else if !self.in_window(number) {
            return;
        }
        let bit = number % WINDOW;
        self.came[(bit / 64) as usize] |= 1 << (bit % 64);
    }

    /// The last numbers in the window not come yet (at most [`MAX_HOLES`]).
    fn holes(&self) -> Vec<u64> {
        let low = self.last.saturating_sub(WINDOW - 1).max(1);
        let mut holes = Vec::new();
        let mut n = self.last;
        while n >= low && holes.len() < MAX_HOLES {
            let bit = n % WINDOW;
            // A word of numbers all come: skip it.
            if bit % 64 == 63 && self.came[(bit / 64) as usize] == u64::MAX {
                n = n.saturating_sub(64);
                continue;
            }
            if !self.came(n) {
                holes.push(n);
            }
            n -= 1;
        }
        holes
    }
}

/// How far one origin had come when a session was taken.
struct Seen {
    /// Its [`Arrived::id`].
    id: u64,
    /// Its last number then.
    last: u64,
    /// Numbers below it not come then.
    holes: Vec<u64>,
}

struct Taken {
    /// The origins heard of then.
    seen: Vec<Seen>,
    /// The session's subscriptions that are not shared.
    filters: Vec<String>,
}

/// A handed-over message held back: for `client`.
pub struct HeldBack {
    pub client: String,
    pub message: Direct,
}

/// What to do with a message handed over for a session (see
/// [`Stamps::judge`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The router here gave it to the session: drop it.
    Had,
    /// The router here holds a copy for its PUBREL, which will give it to
    /// the session: hold it back until then ([`Stamps::hold_back`]).
    Coming,
    /// Deliver it.
    New,
}

/// A stamp read back: its origin and number. Read from the end, in one
/// pass over the number: every publish from a link has one.
fn parse(stamp: &str) -> Option<(&str, u64)> {
    let bytes = stamp.as_bytes();
    let (mut number, mut scale, mut at) = (0u64, 1u64, bytes.len());
    while at > 0 && bytes[at - 1] != b'/' {
        let digit = bytes[at - 1].wrapping_sub(b'0');
        if digit > 9 || bytes.len() - at >= 19 {
            return None;
        }
        number += u64::from(digit) * scale;
        scale = scale.wrapping_mul(10);
        at -= 1;
    }
    // At the slash before the number, one at least in the origin before it.
    let origin = stamp.get(..at.checked_sub(1)?)?;
    (number > 0 && at < bytes.len() && origin.as_bytes().contains(&b'/'))
        .then_some((origin, number))
}

impl Stamps {
    /// The stamps of node `node_id` in this run of its process
    /// (`run`: unique to it, the start time).
    pub fn new(node_id: &str, run: u64) -> Stamps {
        Stamps {
            own: format!("{node_id}/{run:x}"),
            given: AtomicU64::new(0),
            state: Mutex::new(State::default()),
        }
    }

    /// The next stamp of this node's clients' publishes: called in the
    /// order the links carry them.
    pub fn stamp(&self) -> String {
        self.numbered().0
    }

    /// [`Stamps::stamp`], with its number.
    pub fn numbered(&self) -> (String, u64) {
        let number = self.given.fetch_add(1, Ordering::Relaxed) + 1;
        let mut digits = itoa::Buffer::new();
        let digits = digits.format(number);
        let mut text = String::with_capacity(self.own.len() + 1 + digits.len());
        text.push_str(&self.own);
        text.push('/');
        text.push_str(digits);
        (text, number)
    }

    /// This node's origin: `<node id>/<run>`.
    pub fn origin(&self) -> &str {
        &self.own
    }

    /// A QoS 0 or 1 publish with `stamp` goes to the router (called
    /// before the router has it): one of this node's clients, or one a link
    /// passes on.
    pub fn arrived(&self, stamp: &str) {
        let Some((origin, number)) = parse(stamp) else {
            return;
        };
        self.state.lock().note(origin, number);
    }

    /// QoS 2 publish `pkid` with `stamp` goes to the router on connection
    /// `via` (a client's, or a link's): the router holds it until its
    /// PUBREL ([`Stamps::released`]). Returns the messages held back for
    /// a stamp forgotten to make room: to deliver.
    #[must_use]
    pub fn held(&self, via: &str, pkid: u16, stamp: &str) -> Vec<HeldBack> {
        let mut state = self.state.lock();
        let mut deliver = Vec::new();
        if state.held.len() >= MAX_HELD
            && let Some((_, old)) = state.held.pop_front()
        {
            deliver = state.unhold(&old);
        }
        if let Some(old) = state.held.replace((via.to_owned(), pkid), stamp.to_owned()) {
            deliver.extend(state.unhold(&old));
        }
        *state.holding.entry(stamp.to_owned()).or_default() += 1;
        deliver
    }

    /// The PUBREL of QoS 2 publish `pkid` on connection `via` goes to the
    /// router, which `delivers` it or not (a copy of one it had, see
    /// `super::origins`). Returns the handed-over messages held back for
    /// it that are to be delivered after all (the router does not deliver
    /// its copy); those it delivers are dropped (counted).
    ///
    /// The stamp of a PUBREL the router delivers goes to `sending` (and
    /// counts as in transit until [`Stamps::sent`] is told).
    #[must_use]
    pub fn released(
        &self,
        via: &str,
        pkid: u16,
        delivers: bool,
        sending: &mut Vec<String>,
    ) -> Vec<HeldBack> {
        let mut state = self.state.lock();
        let Some(stamp) = state.held.remove(&(via.to_owned(), pkid)) else {
            return Vec::new();
        };
        if let Some((origin, number)) = parse(&stamp).filter(|_| delivers) {
            state.note(origin, number);
            *state.in_transit.entry(stamp.clone()).or_default() += 1;
            sending.push(stamp.clone());
        }
        let back = state.unhold(&stamp);
        if !delivers {
            return back;
        }
        // The router gives the session this copy: none held back goes,
        // even while another copy is held.
        let back = back.len() + state.take_back(&stamp).len();
        for _ in 0..back {
            crate::metrics::handed_over_had();
        }
        Vec::new()
    }

    /// Holds `message`, handed over for `client` with `stamp`, back until
    /// the router's own copy is released (see [`Verdict::Coming`]);
    /// returns it if it is not (too many are, or no copy is held now), to
    /// deliver now.
    #[must_use]
    pub fn hold_back(&self, stamp: &str, client: &str, message: Direct) -> Option<Direct> {
        let mut state = self.state.lock();
        if state.held_back_count >= MAX_HELD_BACK || !state.holding.contains_key(stamp) {
            return Some(message);
        }
        state.held_back_count += 1;
        state
            .held_back
            .entry(stamp.to_owned())
            .or_default()
            .push(HeldBack {
                client: client.to_owned(),
                message,
            });
        None
    }

    /// The messages held back for `stamp`, to deliver: its copy here was
    /// not released in time.
    #[must_use]
    pub fn give_back(&self, stamp: &str) -> Vec<HeldBack> {
        self.state.lock().take_back(stamp)
    }

    /// `client_id`'s session, with `filters` (all of its subscriptions),
    /// is in the router's queue (`router::RouterHandle::replace_session_then`):
    /// how far each origin had come. What is noted after this reaches the
    /// router after the session.
    pub fn taken<'a>(&self, client_id: &str, filters: impl IntoIterator<Item = &'a str>) {
        let filters = filters
            .into_iter()
            .filter(|f| !f.starts_with("$share/"))
            .map(str::to_owned)
            .collect();
        let mut state = self.state.lock();
        let taken = Taken {
            seen: state
                .arrived
                .values()
                .map(|a| Seen {
                    id: a.id,
                    last: a.last,
                    holes: a.holes(),
                })
                .collect(),
            filters,
        };
        state.taken.remove(client_id);
        if state.taken.len() >= MAX_TAKEN {
            state.taken.pop_front();
        }
        state.taken.insert(client_id.to_owned(), taken);
    }

    /// Whether the PUBREL of the QoS 2 publish with `stamp` is in the
    /// router's queue (or processed) already: released (noted as come,
    /// see `State::came`) and sent ([`Stamps::sent`]). A session that goes
    /// into the router after this does not get it from the router; one
    /// released and not sent yet reaches the router after the session,
    /// which the router gives it to (a publish the dead node did not have
    /// given to a session taken here, see `super::recent`, came twice at
    /// QoS 2 when it was taken for one the router had: 1 in 8 short fault
    /// runs, 2026-11-30).
    pub fn in_router(&self, stamp: &str) -> bool {
        let state = self.state.lock();
        state.came(stamp) && !state.in_transit.contains_key(stamp)
    }

    /// The PUBRELs [`Stamps::released`] put in `sent` are in the router's
    /// queue now (or will never be: the connection ended).
    pub fn sent(&self, sent: &mut Vec<String>) {
        if sent.is_empty() {
            return;
        }
        let mut state = self.state.lock();
        for stamp in sent.drain(..) {
            if let Some(count) = state.in_transit.get_mut(&stamp) {
                *count -= 1;
                if *count == 0 {
                    state.in_transit.remove(&stamp);
                }
            }
        }
    }

    /// `client_id`'s session was not taken after all.
    pub fn forget(&self, client_id: &str) {
        self.state.lock().taken.remove(client_id);
    }

    /// What to do with the message of `topic` with `stamp` that another
    /// node hands over for `client_id` (see the module's documentation).
    pub fn judge(&self, client_id: &str, stamp: &str, topic: &str) -> Verdict {
        let Some((origin, number)) = parse(stamp) else {
            return Verdict::New;
        };
        let state = self.state.lock();
        let Some(taken) = state.taken.get(client_id) else {
            return Verdict::New;
        };
        if !taken
            .filters
            .iter()
            .any(|f| router::protocol::matches(topic, f))
        {
            return Verdict::New;
        }
        let arrived = state.arrived.get(origin);
        if let Some(a) = arrived.filter(|a| a.came(number)) {
            // Come since the session was taken: above the last number
            // then, or one not come then.
            let since = taken
                .seen
                .iter()
                .find(|s| s.id == a.id)
                .is_none_or(|s| number > s.last || s.holes.contains(&number));
            return if since { Verdict::Had } else { Verdict::New };
        }
        // Held for its PUBREL (after the session was taken, as it has not
        // come): the router gives it to the session at the release.
        if state.holding.contains_key(stamp) {
            return Verdict::Coming;
        }
        Verdict::New
    }

    /// Whether the router here gave `client_id`'s session the handed-over
    /// message of `topic` with `stamp` (see [`Stamps::judge`]).
    #[cfg(test)]
    fn had(&self, client_id: &str, stamp: &str, topic: &str) -> bool {
        self.judge(client_id, stamp, topic) == Verdict::Had
    }
}

impl State {
    /// Whether the publish with `stamp` went to the router (a QoS 2 one:
    /// released, see [`Stamps::released`]), as far as the [`WINDOW`] tells.
    fn came(&self, stamp: &str) -> bool {
        let Some((origin, number)) = parse(stamp) else {
            return false;
        };
        self.arrived.get(origin).is_some_and(|a| a.came(number))
    }

    /// A copy with `stamp` is no longer held: what was held back for it if
    /// no copy is now.
    fn unhold(&mut self, stamp: &str) -> Vec<HeldBack> {
        match self.holding.get_mut(stamp) {
            Some(n) if *n > 1 => {
                *n -= 1;
                Vec::new()
            }
            _ => {
                self.holding.remove(stamp);
                self.take_back(stamp)
            }
        }
    }

    /// What was held back for `stamp`.
    fn take_back(&mut self, stamp: &str) -> Vec<HeldBack> {
        let back = self.held_back.remove(stamp).unwrap_or_default();
        self.held_back_count -= back.len();
        back
    }

    fn note(&mut self, origin: &str, number: u64) {
        if let Some(a) = self.arrived.get_mut(origin) {
            a.note(number);
            return;
        }
        if self.arrived.len() >= MAX_ORIGINS {
            self.arrived.pop_front();
        }
        self.origins += 1;
        let mut a = Arrived::new(self.origins);
        a.note(number);
        self.arrived.insert(origin.to_owned(), a);
    }
}

#[cfg(test)]
mod tests;
