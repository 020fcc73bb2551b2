//! What waits to be written to etcd in the background (the retained
//! messages of `retained.rs`, the queued messages of `queue/`), and the
//! writer that takes it there batch by batch, until the backlog's owner is
//! dropped or the node stops.
//!
//! The writer holds no strong reference to its owner while it waits, so
//! dropping the owner ends it. It waits for the owner's wake-up (registered
//! before its last look at the backlog: something kept after that look
//! wakes it) or for the time the next batch is due. A batch etcd does not
//! take within the request timeout goes back to the backlog, and the
//! writer tries again a moment later.
//!
//! Not `super::batches`: that batches requests whose callers wait for the
//! answers (`super::writes`, the keys' records); nobody waits for these.

use std::future::Future;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::Cluster;

/// How long the writer waits after a batch etcd did not take.
const RETRY: Duration = Duration::from_millis(250);

/// What a background writer writes from.
pub(super) trait Backlog: Send + Sync + 'static {
    /// A batch taken out of the backlog.
    type Batch: Send + 'static;
    /// What the writer's log line calls what it writes.
    const WHAT: &'static str;

    fn cluster(&self) -> &Arc<Cluster>;
    /// What wakes the writer once something is kept (kept apart from the
    /// owner, which the writer does not hold while it waits).
    fn wake(&self) -> &Arc<Notify>;
    /// The next batch, if one is due now.
    fn take(&self) -> Option<Self::Batch>;
    /// When the next batch is due (at once if that is past), if anything
    /// waits.
    fn next_due(&self) -> Option<Instant>;
    /// Writes `batch` to etcd (it may take what the write needs out of it:
    /// a batch that fails goes back whole only in what `put_back` keeps).
    fn commit(
        &self,
        client: &mut etcd_client::Client,
        batch: &mut Self::Batch,
    ) -> impl Future<Output = Result<(), etcd_client::Error>> + Send;
    /// A batch etcd did not take, back into the backlog.
    fn put_back(&self, batch: Self::Batch);
}

/// Starts `owner`'s writer.
pub(super) fn start<B: Backlog>(owner: &Arc<B>) {
    tokio::spawn(run(Arc::downgrade(owner), owner.cluster().stop.subscribe()));
}

async fn run<B: Backlog>(owner: Weak<B>, mut stop: tokio::sync::watch::Receiver<()>) {
    loop {
        let Some(backlog) = owner.upgrade() else {
            return;
        };
        let Some(mut batch) = backlog.take() else {
            let wake = Arc::clone(backlog.wake());
            let woken = wake.notified();
            tokio::pin!(woken);
            // Registered before the last look: something kept after it
            // wakes the writer.
            woken.as_mut().enable();
            let due = backlog.next_due();
            drop(backlog);
            let until = due.map_or_else(far_future, tokio::time::Instant::from_std);
            tokio::select! {
                () = woken => {}
                () = tokio::time::sleep_until(until) => {}
                _ = stop.changed() => return,
            }
            continue;
        };
        let mut client = backlog.cluster().client.clone();
        let timeout = backlog.cluster().settings.request_timeout;
        let written = tokio::time::timeout(timeout, backlog.commit(&mut client, &mut batch)).await;
        if !matches!(written, Ok(Ok(()))) {
            tracing::debug!(
                "clustering: {} not written to etcd yet: trying again",
                B::WHAT
            );
            backlog.put_back(batch);
            drop(backlog);
            tokio::select! {
                () = tokio::time::sleep(RETRY) => {}
                _ = stop.changed() => return,
            }
        }
    }
}

/// An instant nothing waits for (a day from now).
fn far_future() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(86_400)
}
