//! The task that sends a node's etcd requests in batches ([`super::reads`],
//! [`super::writes`]).
//!
//! It takes what waits off its queue into one batch and sends it; what
//! comes meanwhile makes the next batch. One batch is out at a time while
//! etcd answers within [`STUCK_AFTER`]: on a machine that etcd and the
//! nodes share, more requests doing the same work were slower (two, four or
//! eight at a time: 20%, 40%, 45% fewer GETs at 64 connections). A batch
//! out longer than that (an etcd member killed or paused: the request waits
//! for its timeout, 2 s by default) no longer holds the next one back, so a
//! fault stalls requests no longer than it would without batches; at most
//! [`MAX_OUT`] batches are out at once. Such a batch is given up when etcd
//! elects a new leader meanwhile (see [`super::leader`]), or when a batch
//! sent after it has its answer (it is stuck at a member that does not
//! answer, a paused one, while the others do): its requests learn that
//! they got no answer, and try again (a read reads again; a write finds
//! out whether it committed, see [`super::kv`]). The task ends when its
//! queue's sender (the [`Batcher`], the cluster's) is dropped.
//!
//! A request that comes when no batch is out and none waits is sent at
//! once by its own task, without the hop to the batching task and back:
//! it holds the same turn as the task's batches, so still one is out at a
//! time (at one connection, GETs took 1.50 times etcd's own p50 with the
//! hops, see docs/cluster.md).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use etcd_client::KvClient;
use tokio::sync::{Mutex, MutexGuard, OwnedSemaphorePermit, Semaphore, mpsc, watch};

use super::leader::Leader;
use super::route::Route;

/// How long a batch may be out before the next one goes anyway.
pub(super) const STUCK_AFTER: Duration = Duration::from_millis(200);

/// What a request whose batch was given up (or whose node is stopping)
/// learns.
pub(super) const NO_ANSWER: &str = "etcd gave no answer (its leader changed meanwhile, a later request was answered first, or the node is stopping)";

/// Batches out at once, at most.
const MAX_OUT: usize = 16;

/// Requests sent to etcd together.
pub(super) trait Batch: Send + 'static {
    /// One request waiting.
    type Item: Send + 'static;
    /// `read` or `write`: the label of the batches' etcd time in the
    /// metrics.
    const KIND: &'static str;
    /// Whether `item` can join (a batch always takes its first).
    fn fits(&self, item: &Self::Item) -> bool;
    fn add(&mut self, item: Self::Item);
    /// Sends the batch and answers each of its requests (the answers'
    /// terms go to `leader`); `true` if etcd answered. Dropped before it
    /// ends, the batch's requests learn that etcd gave no answer.
    fn send(self, kv: KvClient, leader: Arc<Leader>) -> impl Future<Output = bool> + Send;
}

/// The way to a batching task: requests go through it.
pub(super) struct Batcher<B: Batch> {
    queue: mpsc::UnboundedSender<B::Item>,
    out: Arc<Out>,
    new: Arc<dyn Fn() -> B + Send + Sync>,
}

/// What the task and the requests sent at once share.
struct Out {
    route: Arc<Route>,
    leader: Arc<Leader>,
    /// Held while a batch is out, and not stuck: one at a time.
    turn: Mutex<()>,
    /// Batches out at once, stuck ones included: at most [`MAX_OUT`].
    slots: Arc<Semaphore>,
    /// Requests on the queue, not taken by the task yet.
    waiting: AtomicUsize,
    /// Batches sent, numbered.
    sent: AtomicU64,
    /// The greatest number of a batch etcd answered.
    answered: watch::Sender<u64>,
}

impl<B: Batch> Batcher<B> {
    /// Starts the batching task, sending along `route` batches made by
    /// `new`. Must be called within a tokio runtime.
    pub(super) fn start(
        route: Arc<Route>,
        leader: Arc<Leader>,
        new: impl Fn() -> B + Send + Sync + 'static,
    ) -> Batcher<B> {
        // The queue needs no bound of its own: every request on it belongs
        // to a state store request the service counted against its bound
        // (`MAX_QUEUED`).
        let (queue, taken) = mpsc::unbounded_channel();
        let out = Arc::new(Out {
            route,
            leader,
            turn: Mutex::new(()),
            slots: Arc::new(Semaphore::new(MAX_OUT)),
            waiting: AtomicUsize::new(0),
            sent: AtomicU64::new(0),
            answered: watch::Sender::new(0),
        });
        let new: Arc<dyn Fn() -> B + Send + Sync> = Arc::new(new);
        tokio::spawn(run(Arc::clone(&out), taken, Arc::clone(&new)));
        Batcher { queue, out, new }
    }

    /// Sends `item`: at once, from this task, when no batch is out and
    /// none waits; otherwise with the next batch. Returns once it is sent
    /// (or queued); the item's own channel brings its answer.
    /// `Err`: the node is stopping.
    pub(super) async fn submit(&self, item: B::Item) -> Result<(), ()> {
        if self.out.waiting.load(Ordering::Acquire) == 0
            && let Ok(turn) = self.out.turn.try_lock()
            && let Ok(slot) = Arc::clone(&self.out.slots).try_acquire_owned()
        {
            let mut batch = (self.new)();
            batch.add(item);
            self.out.send(batch, turn, slot).await;
            return Ok(());
        }
        self.out.waiting.fetch_add(1, Ordering::AcqRel);
        self.queue.send(item).map_err(|_| ())
    }
}

impl Out {
    /// Sends `batch`, holding `turn` while it is out, for [`STUCK_AFTER`]
    /// at most: then it goes on in a task of its own, until etcd answers,
    /// has a new leader, or answers a later batch.
    async fn send<B: Batch>(
        self: &Arc<Self>,
        batch: B,
        turn: MutexGuard<'_, ()>,
        slot: OwnedSemaphorePermit,
    ) {
        let number = self.sent.fetch_add(1, Ordering::AcqRel) + 1;
        let term = self.leader.term();
        let sent = Instant::now();
        let way = self.route.way(term);
        let direct = way.direct;
        let mut sending = Box::pin(batch.send(way.kv, Arc::clone(&self.leader)));
        tokio::select! {
            ok = &mut sending => {
                self.ended(B::KIND, ok, direct, number, sent);
                drop(slot);
            }
            () = tokio::time::sleep(STUCK_AFTER) => {
                // The next batch goes now.
                drop(turn);
                let out = Arc::clone(self);
                tokio::spawn(async move {
                    let _probing = out.leader.stuck();
                    let mut later = out.answered.subscribe();
                    tokio::select! {
                        ok = sending => out.ended(B::KIND, ok, direct, number, sent),
                        () = out.leader.newer_than(term) => {
                            tracing::debug!(term, "clustering: etcd requests out since an older leader's term are given up");
                            crate::metrics::cluster_requests_given_up("leader_changed");
                        }
                        _ = later.wait_for(|&n| n > number) => {
                            tracing::debug!("clustering: etcd requests overtaken by later ones are given up");
                            crate::metrics::cluster_requests_given_up("overtaken");
                        }
                    }
                    drop(slot);
                });
            }
        }
    }

    /// Batch `number` (a `kind` one, sent at `sent`, to the leader if
    /// `direct`) ended: answered (`ok`), or not, which leaves the route to
    /// the leader.
    fn ended(&self, kind: &'static str, ok: bool, direct: bool, number: u64, sent: Instant) {
        if ok {
            crate::metrics::cluster_etcd_answered(kind, sent.elapsed());
            self.note_answered(number);
        } else if direct {
            self.route.leave();
        }
    }

    fn note_answered(&self, number: u64) {
        self.answered.send_if_modified(|n| {
            let later = *n < number;
            if later {
                *n = number;
            }
            later
        });
    }
}

/// Sends what comes on `queue` in batches made by `new`, until the queue's
/// sender is dropped.
async fn run<B: Batch>(
    out: Arc<Out>,
    mut queue: mpsc::UnboundedReceiver<B::Item>,
    new: Arc<dyn Fn() -> B + Send + Sync>,
) {
    let mut next: Option<B::Item> = None;
    loop {
        let first = match next.take() {
            Some(item) => item,
            None => match queue.recv().await {
                Some(item) => item,
                None => return,
            },
        };
        let Ok(slot) = Arc::clone(&out.slots).acquire_owned().await else {
            return;
        };
        let turn = out.turn.lock().await;
        let mut batch = new();
        batch.add(first);
        let mut taken = 1;
        while let Ok(item) = queue.try_recv() {
            taken += 1;
            if !batch.fits(&item) {
                next = Some(item);
                break;
            }
            batch.add(item);
        }
        // (The one held over for the next batch still counts as waiting:
        // nothing is sent at once past it.)
        out.waiting
            .fetch_sub(taken - usize::from(next.is_some()), Ordering::AcqRel);
        out.send(batch, turn, slot).await;
    }
}
