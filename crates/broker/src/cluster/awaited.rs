//! Handovers this node waits for, from nodes that may be dead.
//!
//! A session resumed here from a node whose link to this one was up is
//! to get its queued messages from that node (see [`super::handover`]).
//! A node that has just died can look alive for a while: killed with its
//! machine, its links stay up until their keep-alive runs out. So the
//! node waits: if the other node leaves the cluster (its lease ended) and
//! no handover for the client came from it, the messages it kept in
//! etcd for the session (see [`super::queue`]) are delivered from there,
//! to that client alone, each QoS 1 one removed from etcd once the client
//! has acknowledged it (one its connection ends without acknowledging is
//! kept for the session's next connection, and its copy stays in etcd
//! until then), each QoS 2 one once etcd has its removal, before it goes
//! to the client. A handover from that node for that
//! client that comes later (it was paused or cut off, and came back) is
//! then dropped: its messages are the ones etcd gave. The wait ends after
//! twice the lease's TTL and one etcd request: a node still a member then
//! is alive, and hands over (or has).
//!
//! Bounds: at most [`MAX_CLIENTS`] clients waited for, and as many whose
//! handovers are dropped (past either, the oldest entries are forgotten:
//! a late handover is then delivered, as before).

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::watch;

use super::Queue;
use super::membership::Member;
use crate::sessions::{OnDone, Sessions};

/// Clients waited for (and clients whose late handover is dropped), at most.
pub const MAX_CLIENTS: usize = 10_000;

/// See the module's documentation.
pub struct Awaited {
    queue: Arc<Queue>,
    sessions: Arc<Sessions>,
    members: watch::Receiver<Vec<Member>>,
    /// How long a wait lasts.
    patience: Duration,
    state: Mutex<State>,
    stop: watch::Receiver<()>,
}

#[derive(Default)]
struct State {
    /// Client id -> the node whose handover is awaited, and the wait's
    /// number (a newer wait for the client replaces it).
    waiting: HashMap<String, (String, u64)>,
    /// Client id -> the node whose handover for it is dropped.
    superseded: HashMap<String, String>,
    numbers: u64,
}

impl Awaited {
    /// Waits end when `stop` changes (the cluster is dropped).
    pub fn new(
        queue: Arc<Queue>,
        sessions: Arc<Sessions>,
        members: watch::Receiver<Vec<Member>>,
        patience: Duration,
        stop: watch::Receiver<()>,
    ) -> Arc<Awaited> {
        Arc::new(Awaited {
            queue,
            sessions,
            members,
            patience,
            state: Mutex::new(State::default()),
            stop,
        })
    }

    /// `client_id`'s session was resumed here from `from`, whose handover
    /// is awaited (see the module's documentation).
    pub fn wait(self: &Arc<Self>, client_id: &str, from: &str) {
        let number = {
            let mut state = self.state.lock();
            if state.waiting.len() >= MAX_CLIENTS {
                state.waiting.clear();
            }
            state.numbers += 1;
            let number = state.numbers;
            state
                .waiting
                .insert(client_id.to_owned(), (from.to_owned(), number));
            state.superseded.remove(client_id);
            number
        };
        tokio::spawn(watch_for(
            Arc::downgrade(self),
            client_id.to_owned(),
            from.to_owned(),
            number,
        ));
    }

    /// A handover for `client_id` came from `from`: whether to deliver it
    /// (not when etcd gave its messages already).
    pub fn came(&self, client_id: &str, from: &str) -> bool {
        let mut state = self.state.lock();
        if state.superseded.get(client_id).is_some_and(|n| n == from) {
            return false;
        }
        if state.waiting.get(client_id).is_some_and(|(n, _)| n == from) {
            state.waiting.remove(client_id);
        }
        true
    }

    /// Whether wait `number` for `client_id` is still on; ends it, and
    /// (`supersede`) drops `from`'s later handovers for the client.
    fn end(&self, client_id: &str, number: u64, from: &str, supersede: bool) -> bool {
        let mut state = self.state.lock();
        if state
            .waiting
            .get(client_id)
            .is_none_or(|(_, n)| *n != number)
        {
            return false;
        }
        state.waiting.remove(client_id);
        if supersede {
            if state.superseded.len() >= MAX_CLIENTS {
                state.superseded.clear();
            }
            state
                .superseded
                .insert(client_id.to_owned(), from.to_owned());
        }
        true
    }

    /// Delivers what `from` kept in etcd for `client_id`; each copy leaves
    /// etcd once the client acknowledged it.
    async fn take_from_etcd(&self, client_id: &str, from: &str) {
        let messages = match self.queue.read_from(client_id, from).await {
            Ok(messages) => messages,
            Err(e) => {
                tracing::warn!(
                    client_id,
                    node = from,
                    error = e,
                    "clustering: the session's messages its dead node kept in etcd cannot be read: they stay there until the session ends"
                );
                return;
            }
        };
        let count = messages.len();
        // A QoS 2 message leaves etcd before the client may have it here
        // (handed over, see `Direct::handed_over`: at QoS 1, or under the
        // id it was in flight under): the removals go at once, in as few
        // requests as they take, and each delivery waits for its own.
        let removals: Vec<_> = messages
            .iter()
            .map(|queued| {
                (queued.message.publish.qos == router::protocol::QoS::ExactlyOnce)
                    .then(|| self.queue.remove_waited(queued.key.clone()))
            })
            .collect();
        for (queued, removal) in messages.into_iter().zip(removals) {
            let (key, mut direct) = queued.handed_over();
            if let Some(removal) = removal {
                if removal.await.is_err() {
                    // The node stops: the rest stays in etcd.
                    return;
                }
            } else {
                let queue = Arc::clone(&self.queue);
                direct.on_done = Some(OnDone::new(move || queue.remove(vec![key.clone()])));
            }
            self.sessions.deliver_handed_over(client_id, direct);
        }
        tracing::info!(
            client_id,
            node = from,
            queued = count,
            "clustering: the node the session was on left the cluster without handing it over: its queued messages came from etcd"
        );
    }
}

/// Waits until `from` leaves the cluster or the wait's time is up (see
/// the module's documentation).
async fn watch_for(awaited: Weak<Awaited>, client_id: String, from: String, number: u64) {
    let Some((mut members, mut stop, patience)) = awaited
        .upgrade()
        .map(|a| (a.members.clone(), a.stop.clone(), a.patience))
    else {
        return;
    };
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        if !members
            .borrow_and_update()
            .iter()
            .any(|m| m.node_id == from)
        {
            break;
        }
        tokio::select! {
            changed = members.changed() => if changed.is_err() { return },
            () = tokio::time::sleep_until(deadline) => {
                if let Some(a) = awaited.upgrade() {
                    a.end(&client_id, number, &from, false);
                }
                return;
            }
            _ = stop.changed() => return,
        }
    }
    let Some(a) = awaited.upgrade() else { return };
    if a.end(&client_id, number, &from, true) {
        a.take_from_etcd(&client_id, &from).await;
    }
}
