//! Answers that wait for the disk: a request's changes are queued to the
//! [`Persistence`] writer while the store is still locked (so they reach
//! the disk in the order they happened), and its answer waits until what
//! it could show is durable (its own changes and everything queued before
//! them, or the pending changes of the key it reads: see `pending.rs`).
//! One task publishes what waited each time the durable position moves,
//! and then tells each requester whose answer went elsewhere (another
//! client's Response Topic, the router, nowhere) that it is out: its
//! connection holds the acknowledgement for the answer (see
//! `connection/hold.rs`) and is woken by the answer, or by that.

use std::sync::Arc;

use statestore::Outcome;
use statestore::Store;
use statestore::persist::{Observed, Write};

use super::{Reply, StateStoreService};
use crate::persistence::{Batch, Position};
use crate::sessions::Answer;

/// How many released answers the durable task keeps room for between
/// group commits (64 connections' worth, four times over).
const KEEP_READY: usize = 256;

/// What waits for the disk.
#[derive(Default)]
pub(super) struct Waiters {
    list: Vec<Waiting>,
    /// The durable position up to which the durable task has taken what
    /// waited: an answer waiting for no more than this goes out at once,
    /// anything else after what waits (so that, for one key, answers and
    /// notifications go out in the order they were made).
    released: Position,
}

/// An answer (or notifications only) waiting for its batch to be durable.
struct Waiting {
    batch: Batch,
    reply: Option<Reply<'static>>,
    outcome: Outcome,
}

impl StateStoreService {
    /// Answers (and notifications) waiting for the disk now.
    pub fn answers_waiting(&self) -> usize {
        self.waiting.lock().list.len()
    }

    /// Whether `batch` (and all before it) is durable and the answers that
    /// waited for it are published.
    pub fn is_answered(&self, batch: Batch) -> bool {
        self.published.borrow().covers(batch)
    }

    /// The position up to which the disk has everything and the answers
    /// that waited for it are published, to wait on (`wait_for(|p|
    /// p.covers(batch))`): a connection keeps one, rather than subscribing
    /// anew each time it waits. It covers every batch, the MQTT side's
    /// (the router's journal) included.
    pub fn answered(&self) -> tokio::sync::watch::Receiver<Position> {
        self.published.subscribe()
    }

    /// Queues durable writes (call with the store locked); returns the batch
    /// an answer given now must wait for: the writes' own, or, with none,
    /// that of the changes not on disk yet that it could show (`observed`,
    /// in the request's `payload`; see `pending.rs`).
    pub(super) fn persist(
        &self,
        store: &Store,
        writes: Vec<Write>,
        observed: &Observed,
        payload: &[u8],
    ) -> Option<Batch> {
        let Some(persistence) = self.persistence.as_ref() else {
            super::drop_vec(writes);
            return None;
        };
        let mut pending = self.pending.lock();
        // Forget only what was published: a later answer about a key must
        // not overtake an earlier one still in the waiting list.
        pending.forget(*self.published.borrow());
        if writes.is_empty() {
            let last_ms = store.last_version().wall_ms;
            pending.wait_for(observed, payload, persistence.submitted(), last_ms)
        } else {
            Some(persistence.submit(writes, |batch, writes| pending.wrote(batch, writes)))
        }
    }

    /// Publishes now if batch `wait` is durable, or leaves it to the
    /// durable task. One task for all that waits, rather than one spawned
    /// per answer: a group commit releases dozens of answers at once.
    /// Returns the batch waited for, if the answer was not published now.
    /// `here`: see [`Self::serve_here`].
    pub(super) fn publish_when_durable(
        self: &Arc<Self>,
        reply: Option<&mut Reply<'_>>,
        outcome: &mut Outcome,
        wait: Option<Batch>,
        here: Option<&mut Option<Answer>>,
    ) -> Option<Batch> {
        if let Some(batch) = wait {
            // Checked under the lock the durable task drains under: either
            // the task sees this entry, or it has taken all this waits for.
            let mut waiting = self.waiting.lock();
            if !waiting.released.covers(batch) {
                waiting.list.push(Waiting {
                    batch,
                    reply: reply.map(Reply::take_detached),
                    outcome: super::take_outcome(outcome),
                });
                return Some(batch);
            }
        }
        self.publish_outcome(reply, outcome, here);
        None
    }

    /// Publishes, in batch order, what waited for batches up to the durable
    /// position, read under the waiting lock (see `publish_when_durable`);
    /// then moves the answered position on, and only then tells the
    /// requesters whose answers did not go straight to their connection
    /// (a connection told looks at that position). `ready`, `elsewhere`:
    /// the durable task's own vectors, empty, kept between calls for their
    /// room (a group commit releases dozens of answers: collected into a
    /// new vector each time, it grew by reallocating and copying them,
    /// ~400 instructions a persisted write).
    fn publish_durable(
        &self,
        durable: &mut tokio::sync::watch::Receiver<Position>,
        ready: &mut Vec<Waiting>,
        elsewhere: &mut Vec<String>,
    ) {
        let durable = {
            let mut waiting = self.waiting.lock();
            let durable = *durable.borrow_and_update();
            // Only the ready entries move; the rest stay where they are.
            ready.extend(waiting.list.extract_if(.., |w| durable.covers(w.batch)));
            waiting.released = durable;
            durable
        };
        // Nearly always in order already (the sort would still take room
        // for half of them: a stable sort, so that answers for one batch
        // keep the order they were made in).
        if !ready.is_sorted_by_key(|w| w.batch) {
            ready.sort_by_key(|w| w.batch);
        }
        for mut w in ready.drain(..) {
            let straight = self.publish_outcome(w.reply.as_mut(), &mut w.outcome, None);
            if !straight && let Some(reply) = w.reply {
                elsewhere.push(reply.requester.into_owned());
            }
        }
        // Room for a burst (what a stalled disk released at once) is let go.
        if ready.capacity() > KEEP_READY {
            *ready = Vec::new();
        }
        self.published.send_replace(durable);
        // Once each (a client with many answers elsewhere in one commit).
        elsewhere.sort_unstable();
        elsewhere.dedup();
        for requester in elsewhere.drain(..) {
            self.publisher.answers_out(&requester);
        }
        if elsewhere.capacity() > KEEP_READY {
            *elsewhere = Vec::new();
        }
    }
}

/// Publishes the answers and notifications that waited for the disk, each
/// time the durable position moves; ends with the persistence writer.
pub(super) async fn durable_task(
    service: std::sync::Weak<StateStoreService>,
    mut durable: tokio::sync::watch::Receiver<Position>,
) {
    let (mut ready, mut elsewhere) = (Vec::new(), Vec::new());
    while durable.changed().await.is_ok() {
        let Some(service) = service.upgrade() else {
            return;
        };
        service.publish_durable(&mut durable, &mut ready, &mut elsewhere);
    }
}
