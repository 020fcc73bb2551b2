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
//! [`MAX_OUT`] batches are out at once. The task ends when its queue's
//! sender (the cluster) is dropped.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::KvClient;
use tokio::sync::{Semaphore, mpsc};

/// How long a batch may be out before the next one goes anyway.
pub(super) const STUCK_AFTER: Duration = Duration::from_millis(200);

/// Batches out at once, at most.
const MAX_OUT: usize = 16;

/// Requests sent to etcd together.
pub(super) trait Batch: Send + 'static {
    /// One request waiting.
    type Item: Send + 'static;
    /// Whether `item` can join (a batch always takes its first).
    fn fits(&self, item: &Self::Item) -> bool;
    fn add(&mut self, item: Self::Item);
    /// Sends the batch and answers each of its requests.
    fn send(self, kv: KvClient) -> impl Future<Output = ()> + Send;
}

/// Sends what comes on `queue` in batches made by `new`, until the queue's
/// sender is dropped.
pub(super) async fn run<B: Batch>(
    kv: KvClient,
    mut queue: mpsc::UnboundedReceiver<B::Item>,
    new: impl Fn() -> B,
) {
    let out = Arc::new(Semaphore::new(MAX_OUT));
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
        let mut sending = Box::pin(batch.send(kv.clone()));
        tokio::select! {
            () = &mut sending => drop(slot),
            () = tokio::time::sleep(STUCK_AFTER) => {
                // It goes on by itself; the next batch goes now.
                tokio::spawn(async move {
                    sending.await;
                    drop(slot);
                });
            }
        }
    }
}
