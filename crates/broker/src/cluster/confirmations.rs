//! What the other nodes have taken of this node's clients' publishes.
//!
//! A client's QoS 1/2 publish is acknowledged (PUBACK, PUBREC) only once
//! every node whose link was up when it was forwarded has acknowledged it
//! on that link (the other node has routed it to its subscribers by
//! then): a node that dies right after acknowledging a publish has lost
//! nothing the other nodes' subscribers were to get. A link that goes
//! down is not waited for (what it had not delivered goes again from its
//! session when it is back); a node that stops answering is waited for
//! until its link breaks or it leaves the membership (its lease).
//!
//! Each forwarded QoS 1/2 publish gets a ticket, in order; the connection
//! holds its acknowledgement (and those after it) until [`Confirmations::
//! watch`] reaches the ticket (see `connection/gate.rs`).
//!
//! The link client (rumqttc) does not say which of our publishes an
//! acknowledgement is for; it says which packet id each publish went out
//! with, in the order they were handed to it. So each link keeps the
//! tickets handed to it in order, gives each the packet id it went out
//! with, and a PUBACK (or PUBREC) for that packet id confirms the ticket.
//! A publish sent again after a reconnection goes out with the packet id
//! it had: it is not taken for a new one. When the other node had lost
//! the link's session (restarted), the link client drops what it had not
//! sent, and so do the tickets.
//!
//! Each link also keeps the stamp numbers (see [`super::stamps`]) of the
//! QoS 1/2 publishes handed to it and not acknowledged yet: when it
//! breaks, [`Confirmations::had_up_to`] tells how far the other node had
//! this node's publishes, which a node that takes that node's sessions
//! needs (see [`super::recent`]).
//!
//! Nothing is waited for longer than [`MAX_WAIT`]: a node that stops
//! answering while its link stays up (paused), or a publish the link
//! client lost track of, costs its publishers that long at most (WARN,
//! counted in `statebroker_cluster_unconfirmed_total`).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::watch;

/// How long an acknowledgement waits for the other nodes at most.
pub const MAX_WAIT: Duration = Duration::from_secs(5);

/// See the module's documentation.
pub struct Confirmations {
    state: Mutex<State>,
    /// Every ticket up to this one is confirmed (or not waited for).
    confirmed: watch::Sender<u64>,
}

/// Tickets handed out and what each link owes.
#[derive(Default)]
pub struct State {
    issued: u64,
    /// The stamp number of the publish being handed to the links.
    number: u64,
    links: HashMap<String, Link>,
}

/// One link's publishes, in the order it was handed them.
#[derive(Default)]
struct Link {
    up: bool,
    /// Handed to the link client, not gone out yet: the ticket (0: nobody
    /// waits for it).
    queued: VecDeque<u64>,
    /// Gone out, by packet id: the ticket.
    sent: HashMap<u16, u64>,
    /// Held back by the link client (its packet id still in use).
    held_back: Option<u64>,
    /// How many of `queued` the link client had when the link broke: it
    /// drops them if the other node lost the session.
    unsent_at_break: usize,
    /// The tickets this link has to confirm, and since when.
    owed: BTreeMap<u64, Instant>,
    /// The tickets handed to it and not acknowledged, with their stamp
    /// numbers (not waited for any more or not: it may never have them).
    unacknowledged: Unacknowledged,
}

/// A link's tickets not acknowledged, in the order handed (tickets grow),
/// each with its stamp number; acknowledged ones leave from the front.
#[derive(Default)]
struct Unacknowledged {
    /// Ticket, stamp number, acknowledged.
    entries: VecDeque<(u64, u64, bool)>,
}

impl Unacknowledged {
    fn push(&mut self, ticket: u64, number: u64) {
        self.entries.push_back((ticket, number, false));
    }

    fn remove(&mut self, ticket: u64) {
        if let Ok(at) = self.entries.binary_search_by_key(&ticket, |e| e.0) {
            self.entries[at].2 = true;
        }
        while self.entries.front().is_some_and(|e| e.2) {
            self.entries.pop_front();
        }
    }

    /// The stamp number of the first not acknowledged.
    fn first(&self) -> Option<u64> {
        self.entries.front().map(|e| e.1)
    }
}

impl State {
    /// A ticket for a QoS 1/2 publish about to be forwarded.
    pub fn issue(&mut self) -> u64 {
        self.issued += 1;
        self.issued
    }

    /// The publish about to be handed to the links has stamp `number`.
    pub fn stamped(&mut self, number: u64) {
        self.number = number;
    }

    /// A publish (`ticket`; `None`: nobody waits for it) was handed to the
    /// link to `node`.
    pub fn handed(&mut self, node: &str, ticket: Option<u64>) {
        let link = self.links.entry(node.to_owned()).or_default();
        let ticket = ticket.unwrap_or(0);
        link.queued.push_back(ticket);
        if ticket != 0 {
            link.unacknowledged.push(ticket, self.number);
            if link.up {
                link.owed.insert(ticket, Instant::now());
            }
        }
    }

    /// How far `node` had this node's QoS 1/2 publishes: every one with a
    /// stamp number up to the returned one that was handed to its link, it
    /// acknowledged (`None`: no link to it).
    pub fn had_up_to(&self, node: &str) -> Option<u64> {
        let link = self.links.get(node)?;
        Some(
            link.unacknowledged
                .first()
                .map_or(self.number, |number| number.saturating_sub(1)),
        )
    }

    /// Every ticket up to the returned one is confirmed.
    fn confirmed(&self) -> u64 {
        self.links
            .values()
            .filter_map(|l| l.owed.first_key_value())
            .map(|(&ticket, _)| ticket)
            .min()
            .map_or(self.issued, |first| first - 1)
    }
}

impl Default for Confirmations {
    fn default() -> Self {
        Confirmations {
            state: Mutex::new(State::default()),
            confirmed: watch::Sender::new(0),
        }
    }
}

impl Confirmations {
    /// Every ticket up to the value is confirmed, as it moves.
    pub fn watch(&self) -> watch::Receiver<u64> {
        self.confirmed.subscribe()
    }

    /// Runs `f` with the state locked (tickets issued and publishes handed
    /// to links in one order), then publishes the new watermark.
    pub fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let mut state = self.state.lock();
        let r = f(&mut state);
        let confirmed = state.confirmed();
        drop(state);
        self.confirmed.send_if_modified(|c| {
            let moved = *c != confirmed;
            *c = confirmed;
            moved
        });
        r
    }

    /// The link to `node` connected; `session_present`: the other node
    /// kept its session (what the link had not sent goes now).
    pub fn link_up(&self, node: &str, session_present: bool) {
        self.with(|s| {
            let link = s.links.entry(node.to_owned()).or_default();
            link.up = true;
            if !session_present {
                // The other node lost what it had not acknowledged.
                let dropped = link.unsent_at_break.min(link.queued.len());
                for ticket in link.queued.drain(..dropped) {
                    link.unacknowledged.remove(ticket);
                }
                for (_, ticket) in link.sent.drain() {
                    link.unacknowledged.remove(ticket);
                }
                link.held_back = None;
            }
            link.unsent_at_break = 0;
        });
    }

    /// Whether the link to `node` is connected now.
    pub fn is_up(&self, node: &str) -> bool {
        self.state.lock().links.get(node).is_some_and(|l| l.up)
    }

    /// The link to `node` broke: nothing it owes is waited for any longer.
    pub fn link_down(&self, node: &str) {
        self.with(|s| {
            let link = s.links.entry(node.to_owned()).or_default();
            if link.up {
                link.unsent_at_break = link.queued.len();
            }
            link.up = false;
            link.owed.clear();
        });
    }

    /// Stops waiting for what a node has owed for longer than
    /// [`MAX_WAIT`]: how many, by node.
    pub fn expire(&self) -> Vec<(String, usize)> {
        self.with(|s| {
            let mut expired = Vec::new();
            for (node, link) in &mut s.links {
                let mut count = 0;
                while let Some(entry) = link.owed.first_entry() {
                    if entry.get().elapsed() < MAX_WAIT {
                        break;
                    }
                    entry.remove();
                    count += 1;
                }
                if count > 0 {
                    expired.push((node.clone(), count));
                }
            }
            expired
        })
    }

    /// The link to `node` is gone (its node left).
    pub fn link_closed(&self, node: &str) {
        self.with(|s| s.links.remove(node));
    }

    /// A publish went out on the link to `node` with packet id `pkid` (0:
    /// QoS 0).
    pub fn went_out(&self, node: &str, pkid: u16) {
        self.with(|s| {
            let Some(link) = s.links.get_mut(node) else {
                return;
            };
            if pkid != 0 && link.sent.contains_key(&pkid) {
                // Sent again after a reconnection.
                return;
            }
            let ticket = match link.held_back.take() {
                Some(ticket) if pkid != 0 => ticket,
                held => {
                    link.held_back = held;
                    link.queued.pop_front().unwrap_or(0)
                }
            };
            if pkid != 0 {
                link.sent.insert(pkid, ticket);
            }
        });
    }

    /// The link client held the next publish back (its packet id still in
    /// use): it goes out later.
    pub fn held_back(&self, node: &str) {
        self.with(|s| {
            if let Some(link) = s.links.get_mut(node) {
                link.held_back = link.queued.pop_front();
            }
        });
    }

    /// `node` acknowledged packet id `pkid` (PUBACK, or PUBREC at QoS 2).
    pub fn acknowledged(&self, node: &str, pkid: u16) {
        self.with(|s| {
            if let Some(link) = s.links.get_mut(node)
                && let Some(ticket) = link.sent.remove(&pkid)
            {
                link.owed.remove(&ticket);
                link.unacknowledged.remove(ticket);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn confirmed(c: &Confirmations) -> u64 {
        *c.watch().borrow()
    }

    #[test]
    fn a_ticket_is_confirmed_once_every_link_up_acknowledged_it() {
        let c = Confirmations::default();
        c.link_up("b", true);
        c.link_up("c", true);
        let t1 = c.with(|s| {
            let t = s.issue();
            s.handed("b", Some(t));
            s.handed("c", Some(t));
            t
        });
        let t2 = c.with(|s| {
            let t = s.issue();
            s.handed("b", Some(t));
            s.handed("c", Some(t));
            t
        });
        assert_eq!(confirmed(&c), t1 - 1);
        c.went_out("b", 1);
        c.went_out("b", 2);
        c.went_out("c", 7);
        c.acknowledged("b", 1);
        assert_eq!(confirmed(&c), t1 - 1, "c has not acknowledged t1");
        c.acknowledged("c", 7);
        assert_eq!(confirmed(&c), t1);
        // c breaks: t2 is no longer waited for from it.
        c.link_down("c");
        assert_eq!(confirmed(&c), t1);
        c.acknowledged("b", 2);
        assert_eq!(confirmed(&c), t2);
    }

    #[test]
    fn a_publish_sent_again_keeps_its_ticket() {
        let c = Confirmations::default();
        c.link_up("b", true);
        let t1 = c.with(|s| {
            let t = s.issue();
            s.handed("b", Some(t));
            t
        });
        c.went_out("b", 5);
        // Reconnected: sent again with the same packet id, then a QoS 0
        // publish nobody waits for.
        c.went_out("b", 5);
        c.with(|s| s.handed("b", None));
        c.went_out("b", 0);
        assert_eq!(confirmed(&c), t1 - 1);
        c.acknowledged("b", 5);
        assert_eq!(confirmed(&c), t1);
    }

    #[test]
    fn a_publish_held_back_keeps_its_ticket_until_it_goes() {
        let c = Confirmations::default();
        c.link_up("b", true);
        let (t1, t2) = c.with(|s| {
            let (t1, t2) = (s.issue(), s.issue());
            s.handed("b", Some(t1));
            s.handed("b", Some(t2));
            (t1, t2)
        });
        c.went_out("b", 1);
        c.held_back("b");
        c.acknowledged("b", 1);
        assert_eq!(confirmed(&c), t1);
        c.went_out("b", 1);
        c.acknowledged("b", 1);
        assert_eq!(confirmed(&c), t2);
    }

    #[test]
    fn a_node_that_lost_the_links_session_gets_what_came_after_the_break() {
        let c = Confirmations::default();
        c.link_up("b", true);
        let issue = |c: &Confirmations| {
            c.with(|s| {
                let t = s.issue();
                s.handed("b", Some(t));
                t
            })
        };
        issue(&c);
        c.link_down("b");
        // Dropped by the link client at the reconnection.
        let t2 = issue(&c);
        c.link_up("b", false);
        let t3 = issue(&c);
        assert_eq!(confirmed(&c), t3 - 1);
        // t2 (handed while down) goes out first, then t3.
        c.went_out("b", 1);
        c.went_out("b", 2);
        c.acknowledged("b", 1);
        assert_eq!(confirmed(&c), t3 - 1, "t2 is not t3");
        c.acknowledged("b", 2);
        assert_eq!(confirmed(&c), t3);
        let _ = t2;
    }

    #[test]
    fn a_link_had_every_stamp_number_below_the_first_it_did_not_acknowledge() {
        let c = Confirmations::default();
        c.link_up("b", true);
        let hand = |c: &Confirmations, number: u64, qos0: bool| {
            c.with(|s| {
                s.stamped(number);
                let t = (!qos0).then(|| s.issue());
                s.handed("b", t);
            })
        };
        assert_eq!(c.with(|s| s.had_up_to("b")), Some(0));
        assert_eq!(c.with(|s| s.had_up_to("x")), None, "no link");
        hand(&c, 1, false);
        hand(&c, 2, true);
        hand(&c, 3, false);
        c.went_out("b", 1);
        c.went_out("b", 0);
        c.went_out("b", 2);
        assert_eq!(c.with(|s| s.had_up_to("b")), Some(0));
        c.acknowledged("b", 2);
        assert_eq!(c.with(|s| s.had_up_to("b")), Some(0), "1 still out");
        c.acknowledged("b", 1);
        // Everything it was handed, and the QoS 0 one nobody waits for.
        assert_eq!(c.with(|s| s.had_up_to("b")), Some(3));
        // One not acknowledged when the link breaks stays the limit,
        // waited for or not.
        hand(&c, 4, false);
        c.went_out("b", 3);
        c.link_down("b");
        hand(&c, 5, false);
        assert_eq!(c.with(|s| s.had_up_to("b")), Some(3));
        // The other node lost the link's session: what it lost (4) is not
        // waited for any more; 5, handed after the break, goes now.
        c.link_up("b", false);
        assert_eq!(c.with(|s| s.had_up_to("b")), Some(4));
        c.went_out("b", 1);
        c.acknowledged("b", 1);
        assert_eq!(c.with(|s| s.had_up_to("b")), Some(5));
    }

    #[test]
    fn nothing_is_waited_for_without_a_link_up() {
        let c = Confirmations::default();
        c.link_down("b");
        let t = c.with(|s| {
            let t = s.issue();
            s.handed("b", Some(t));
            t
        });
        assert_eq!(confirmed(&c), t);
        c.link_closed("b");
        assert_eq!(confirmed(&c), t);
    }
}
