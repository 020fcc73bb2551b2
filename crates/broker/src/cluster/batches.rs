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
//! queue's sender (the cluster) is dropped.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::KvClient;
use tokio::sync::{Semaphore, mpsc, watch};

use super::leader::Leader;

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
    /// Whether `item` can join (a batch always takes its first).
    fn fits(&self, item: &Self::Item) -> bool;
    fn add(&mut self, item: Self::Item);
    /// Sends the batch and answers each of its requests (the answers'
    /// terms go to `leader`); `true` if etcd answered. Dropped before it
    /// ends, the batch's requests learn that etcd gave no answer.
    fn send(self, kv: KvClient, leader: Arc<Leader>) -> impl Future<Output = bool> + Send;
}

/// Sends what comes on `queue` in batches made by `new`, until the queue's
/// sender is dropped.
pub(super) async fn run<B: Batch>(
    kv: KvClient,
    leader: Arc<Leader>,
    mut queue: mpsc::UnboundedReceiver<B::Item>,
    new: impl Fn() -> B,
) {
    let out = Arc::new(Semaphore::new(MAX_OUT));
    // The greatest number of a batch etcd answered.
    let answered = Arc::new(watch::Sender::new(0u64));
    let mut sent = 0u64;
    let mut next: Option<B::Item> = None;
    loop {
        let first = match next.take() {
            Some(item) => item,
            None => match queue.recv().await {
                Some(item) => item,
                None => return,
            },
        };
        let Ok(slot) = Arc::clone(&out).acquire_owned().await else {
            return;
        };
        let mut batch = new();
        batch.add(first);
        while let Ok(item) = queue.try_recv() {
            if !batch.fits(&item) {
                next = Some(item);
                break;
            }
            batch.add(item);
        }
        sent += 1;
        let number = sent;
        let term = leader.term();
        let note = move |answered: &watch::Sender<u64>| {
            answered.send_if_modified(|n| {
                let later = *n < number;
                if later {
                    *n = number;
                }
                later
            });
        };
        let mut sending = Box::pin(batch.send(kv.clone(), Arc::clone(&leader)));
        tokio::select! {
            ok = &mut sending => {
                if ok {
                    note(&answered);
                }
                drop(slot);
            }
            () = tokio::time::sleep(STUCK_AFTER) => {
                // It goes on by itself, until etcd answers, has a new
                // leader, or answers a later batch; the next batch goes now.
                let leader = Arc::clone(&leader);
                let answered = Arc::clone(&answered);
                tokio::spawn(async move {
                    let _probing = leader.stuck();
                    let mut later = answered.subscribe();
                    tokio::select! {
                        ok = sending => {
                            if ok {
                                note(&answered);
                            }
                        }
                        () = leader.newer_than(term) => {
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
}
