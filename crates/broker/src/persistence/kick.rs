//! When the writer wakes: once per round of the runtime, not once per write.
//!
//! A blocked channel receiver is woken by every send, so each submitted
//! write used to wake the writer thread at once. On one core that wake-up
//! preempts the connection task that submitted it: the writer commits the
//! one or two writes queued so far, the connections run again, submit, wake
//! it again. In `interval` mode that was 2.5 writes per commit and a
//! context switch per request; in `fsync` mode the fsync's wait let 18
//! gather.
//!
//! Instead, the first write of a round schedules one small task. The
//! runtime queues it behind the connection tasks that the same readiness
//! woke, so it runs once they have all handed in their writes, and wakes
//! the writer once: the group commit takes them all. (Redis writes its
//! journal the same way, once per event-loop round, "before sleep"; here
//! the event loop does not wait for the disk.)

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::Thread;
use std::time::Duration;

/// The writer's wake-up call.
pub(super) struct Kick {
    /// A wake-up is on its way (a task will deliver it).
    scheduled: AtomicBool,
    /// The writer was woken and has not looked yet.
    woken: AtomicBool,
    writer: OnceLock<Thread>,
}

/// Wakes the writer when dropped: when the scheduled task runs, and also
/// if the runtime drops the task without running it (at shutdown), so that
/// no write waits for a wake-up that never comes.
struct WakeOnDrop(Arc<Kick>);

impl Drop for WakeOnDrop {
    fn drop(&mut self) {
        self.0.now();
    }
}

impl Kick {
    pub fn new() -> Arc<Kick> {
        Arc::new(Kick {
            scheduled: AtomicBool::new(false),
            woken: AtomicBool::new(false),
            writer: OnceLock::new(),
        })
    }

    /// The thread [`Kick::now`] wakes.
    pub fn set_writer(&self, writer: Thread) {
        let _ = self.writer.set(writer);
    }

    /// After queueing a job: the writer wakes at the end of this round of
    /// the runtime (at once outside a runtime).
    pub fn request(self: &Arc<Self>) {
        if self.scheduled.swap(true, Ordering::AcqRel) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let wake = WakeOnDrop(Arc::clone(self));
                drop(runtime.spawn(async move { drop(wake) }));
            }
            Err(_) => self.now(),
        }
    }

    /// Wakes the writer now.
    pub fn now(&self) {
        self.scheduled.store(false, Ordering::Release);
        self.woken.store(true, Ordering::Release);
        if let Some(writer) = self.writer.get() {
            writer.unpark();
        }
    }

    /// On the writer's thread: waits until woken, or for `timeout`.
    pub fn wait(&self, timeout: Duration) {
        if !self.woken.swap(false, Ordering::AcqRel) {
            std::thread::park_timeout(timeout);
            self.woken.store(false, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// Requests made in one round of a current-thread runtime wake the
    /// writer once, after the round; outside a runtime, at once.
    #[test]
    fn one_wake_up_per_round() {
        let kick = Kick::new();
        kick.set_writer(std::thread::current());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(async {
            for _ in 0..10 {
                kick.request();
                assert!(
                    !kick.woken.load(Ordering::Acquire),
                    "not before the round ends"
                );
            }
            // The scheduled task runs once this round's tasks have run.
            for _ in 0..10 {
                if kick.woken.load(Ordering::Acquire) {
                    break;
                }
                tokio::task::yield_now().await;
            }
            assert!(kick.woken.load(Ordering::Acquire));
            assert!(!kick.scheduled.load(Ordering::Acquire));
        });
        let started = Instant::now();
        kick.wait(Duration::from_secs(5));
        assert!(started.elapsed() < Duration::from_secs(1));
        kick.request();
        assert!(
            kick.woken.load(Ordering::Acquire),
            "outside a runtime: at once"
        );
    }

    /// A wake-up whose task is dropped unrun (the runtime shut down) is
    /// delivered anyway.
    #[test]
    fn a_dropped_task_still_wakes() {
        let kick = Kick::new();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(async { kick.request() });
        drop(runtime);
        assert!(kick.woken.load(Ordering::Acquire));
        assert!(!kick.scheduled.load(Ordering::Acquire));
    }
}
