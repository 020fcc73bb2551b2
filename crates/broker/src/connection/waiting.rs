//! A waker that wakes the connection's task only while the task waits.
//!
//! A channel keeps the waker of its receiver's last poll until the next
//! poll replaces it. The connection's loop polls its sources in one
//! `select!` and then runs a turn, during which the same sources fill
//! again (its own state store answers arrive on its mailbox in the turn
//! that read the request), so each such message woke the running task: one
//! more, empty, turn (every branch of the `select!` polled again, all
//! Pending), about 1,000 instructions of a request's 18,500.
//!
//! A source is polled with a [`WhileWaiting`]'s waker instead of the
//! task's: it passes a wake on only between [`WhileWaiting::poll_with`]
//! and [`WhileWaiting::done`] (called when the `select!` ends, whichever
//! branch won). Nothing is missed: the next poll registers the task's
//! waker before the source looks for what arrived, so a message that
//! comes after that look wakes the task, and one that came before it is
//! found by it (or by the turn's own look).

use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// See the module's documentation.
pub(crate) struct WhileWaiting {
    /// The waker the source holds: passes wakes on to `task`.
    waker: Waker,
    task: Arc<Task>,
}

/// The waiting task's waker, while it waits.
#[derive(Default)]
struct Task(AtomicWaker);

impl Wake for Task {
    fn wake(self: Arc<Self>) {
        self.0.wake();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.wake();
    }
}

impl WhileWaiting {
    pub fn new() -> WhileWaiting {
        let task = Arc::new(Task::default());
        WhileWaiting {
            waker: Waker::from(Arc::clone(&task)),
            task,
        }
    }

    /// Polls a source with `poll`, given the waker that wakes `cx`'s task
    /// until [`WhileWaiting::done`].
    pub fn poll_with<T>(
        &self,
        cx: &mut Context<'_>,
        poll: impl FnOnce(&mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        // The task's waker first: what arrives after the source's look
        // then wakes the task.
        self.task.0.register(cx.waker());
        poll(&mut Context::from_waker(&self.waker))
    }

    /// The task no longer waits: what arrives now wakes nobody (the task
    /// looks for it itself).
    pub fn done(&self) {
        drop(self.task.0.take());
    }

    /// Calls [`WhileWaiting::done`] when dropped (with the future that
    /// waits).
    pub fn until_dropped(&self) -> Done<'_> {
        Done(self)
    }
}

/// See [`WhileWaiting::until_dropped`].
pub(crate) struct Done<'a>(&'a WhileWaiting);

impl Drop for Done<'_> {
    fn drop(&mut self) {
        self.0.done();
    }
}
