//! Acknowledgements that wait for their requests' outcome (a cluster
//! node's).
//!
//! A cluster node serves a key command through etcd, milliseconds after it
//! read the request. Acknowledged at once (PUBACK, PUBREC), a request whose
//! node died before etcd committed it was lost: the client had its
//! acknowledgement, so it never sent the request again, and it waited for
//! an answer until its own timeout. So on a cluster node each request
//! (QoS 1/2) gets a [`Ticket`] from its connection's [`Tickets`], which
//! travels with the request ([`super::binding::ReplyTo`]) and is dropped
//! once the request's outcome is out: answered (after the answer is
//! published), refused, or given up (etcd could not confirm it). The
//! connection holds the acknowledgement, and every one after it (MQTT 4.6:
//! in order), until then (`connection/gate.rs`), and the acknowledgement
//! and the answer usually leave in one write. A node that dies first
//! leaves the request unacknowledged: its client sends it again once
//! connected to another node, which runs it once (see
//! `cluster::kv`, answers etcd cannot confirm).
//!
//! Tickets are numbered in the order the connection read the requests;
//! requests on different keys end in any order, and the connection waits
//! for the number up to which all have ended ([`Tickets::done`]). What
//! waits is bounded by what the connection's gate may hold.

use std::collections::BTreeSet;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::watch;

/// One connection's tickets.
#[derive(Debug)]
pub struct Tickets {
    state: Mutex<State>,
    /// Every ticket up to this number has ended.
    done: watch::Sender<u64>,
}

#[derive(Debug, Default)]
struct State {
    issued: u64,
    /// Ended, past the first one still out.
    ahead: BTreeSet<u64>,
}

impl Tickets {
    pub fn new() -> Arc<Tickets> {
        Arc::new(Tickets {
            state: Mutex::new(State::default()),
            done: watch::Sender::new(0),
        })
    }

    /// The next request's ticket.
    pub fn issue(self: &Arc<Self>) -> Ticket {
        let number = {
            let mut state = self.state.lock();
            state.issued += 1;
            state.issued
        };
        Ticket(Arc::new(Issued {
            number,
            tickets: Arc::clone(self),
        }))
    }

    /// Whether every ticket up to `number` has ended.
    pub fn is_done(&self, number: u64) -> bool {
        *self.done.borrow() >= number
    }

    /// The number up to which every ticket has ended, to wait on.
    pub fn done(&self) -> watch::Receiver<u64> {
        self.done.subscribe()
    }

    fn end(&self, number: u64) {
        let mut state = self.state.lock();
        let mut done = *self.done.borrow();
        if number != done + 1 {
            state.ahead.insert(number);
            return;
        }
        done = number;
        while state.ahead.remove(&(done + 1)) {
            done += 1;
        }
        self.done.send_replace(done);
    }
}

/// A request's ticket: it ends when the last clone is dropped.
#[derive(Clone)]
pub struct Ticket(Arc<Issued>);

struct Issued {
    number: u64,
    tickets: Arc<Tickets>,
}

impl Drop for Issued {
    fn drop(&mut self) {
        self.tickets.end(self.number);
    }
}

impl Ticket {
    /// Its number, in its connection's order.
    pub fn number(&self) -> u64 {
        self.0.number
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Ticket({})", self.0.number)
    }
}

/// Tickets are equal by number (within one connection).
impl PartialEq for Ticket {
    fn eq(&self, other: &Ticket) -> bool {
        self.0.number == other.0.number
    }
}

impl Eq for Ticket {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn done_moves_over_tickets_ended_in_any_order() {
        let tickets = Tickets::new();
        let [one, two, three, four] = [(); 4].map(|()| tickets.issue());
        assert_eq!(
            [&one, &two, &three, &four].map(Ticket::number),
            [1, 2, 3, 4]
        );
        assert!(tickets.is_done(0));
        drop(three);
        assert!(!tickets.is_done(1), "1 and 2 are out");
        let kept = two.clone();
        drop(two);
        assert!(!tickets.is_done(2), "a clone keeps 2 out");
        drop(one);
        assert!(tickets.is_done(1) && !tickets.is_done(2));
        drop(kept);
        assert!(tickets.is_done(3), "2 ended: 3 had already");
        assert!(!tickets.is_done(4));
        drop(four);
        assert!(tickets.is_done(4));
        assert!(tickets.state.lock().ahead.is_empty());
    }

    #[tokio::test]
    async fn a_waiter_wakes_when_its_ticket_ends() {
        let tickets = Tickets::new();
        let ticket = tickets.issue();
        let mut done = tickets.done();
        let waiting = tokio::spawn(async move {
            let _ = done.wait_for(|&d| d >= 1).await;
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        drop(ticket);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("woken")
            .unwrap();
    }
}
