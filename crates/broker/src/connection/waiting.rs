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
//! branch won). Nothing is missed: the next poll marks the task waiting
//! before the source looks for what arrived, so a message that comes
//! after that look wakes the task, and one that came before it is found
//! by it (or by the turn's own look). The task's waker is kept from one
//! wait to the next (see `Task`).
//!
//! A source that rarely has anything (the mailbox, the keep-alive timer,
//! the broker's stop) is not even looked at again until it woke:
//! [`WhileWaiting::poll_when_woken`] remembers that its last poll was
//! Pending and that no wake came since, and answers Pending for it (a
//! source that answered Pending wakes the waker of that poll once it has
//! something, and [`WhileWaiting`]'s waker is the same on every poll).
//! Looking at the four of them cost ~1,000 instructions of every turn.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::task::{Context, Poll, RawWakerVTable, Wake, Waker};

use parking_lot::Mutex;

/// See the module's documentation.
pub(crate) struct WhileWaiting {
    /// The waker the source holds: passes wakes on to `task`.
    waker: Waker,
    task: Arc<Task>,
    /// The source's last poll by [`WhileWaiting::poll_when_woken`] was
    /// Pending (it holds `waker`, to wake once it has something).
    parked: AtomicBool,
    /// Which waker `task` holds (its data and vtable, what
    /// [`Waker::will_wake`] compares): set again only when another waker
    /// polls. (Only the polling task reads or writes these.)
    holds_data: AtomicPtr<()>,
    holds_vtable: AtomicPtr<RawWakerVTable>,
}

/// The waiting task's waker, whether the task waits, and whether the
/// source woke since it was last polled.
///
/// The task's waker stays here from one wait to the next (one task polls:
/// it is the same waker every time), and `waiting` says whether a wake is
/// passed on: registering the waker at every wait and taking it out at its
/// end (an `AtomicWaker`, a clone and a drop of the task's waker) cost ~16
/// atomic read-modify-writes a turn, ~135 instructions a request.
#[derive(Default)]
struct Task {
    waker: Mutex<Option<Waker>>,
    waiting: AtomicBool,
    woken: AtomicBool,
}

impl Wake for Task {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // `woken` before `waiting` is looked at, and the task sets
        // `waiting` before it looks at `woken` (both sequentially
        // consistent): either the task sees this wake or this sees the
        // task waiting.
        self.woken.store(true, Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst)
            && let Some(waker) = &*self.waker.lock()
        {
            waker.wake_by_ref();
        }
    }
}

impl WhileWaiting {
    pub fn new() -> WhileWaiting {
        let task = Arc::new(Task::default());
        WhileWaiting {
            waker: Waker::from(Arc::clone(&task)),
            task,
            parked: AtomicBool::new(false),
            holds_data: AtomicPtr::new(std::ptr::null_mut()),
            holds_vtable: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    /// The task waits, woken by `cx`'s waker: kept unless it is another
    /// one; wakes pass on from now until [`WhileWaiting::done`].
    #[inline(always)]
    fn wait(&self, cx: &Context<'_>) {
        let waker = cx.waker();
        if waker.data() != self.holds_data.load(Ordering::Relaxed).cast_const()
            || !std::ptr::eq(waker.vtable(), self.holds_vtable.load(Ordering::Relaxed))
        {
            self.hold(waker);
        }
        // (A source behind `Quiet` waits from its first poll on.)
        if !self.task.waiting.load(Ordering::Relaxed) {
            self.task.waiting.store(true, Ordering::SeqCst);
        }
    }

    /// `waker` in place of the one `task` holds (the first wait, or
    /// another task's).
    #[cold]
    #[inline(never)]
    fn hold(&self, waker: &Waker) {
        *self.task.waker.lock() = Some(waker.clone());
        self.holds_data
            .store(waker.data().cast_mut(), Ordering::Relaxed);
        self.holds_vtable.store(
            std::ptr::from_ref(waker.vtable()).cast_mut(),
            Ordering::Relaxed,
        );
    }

    /// Polls a source with `poll`, given the waker that wakes `cx`'s task
    /// until [`WhileWaiting::done`].
    pub fn poll_with<T>(
        &self,
        cx: &mut Context<'_>,
        poll: impl FnOnce(&mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        // Waiting first: what arrives after the source's look then wakes
        // the task.
        self.wait(cx);
        // A look by this may change what the source holds the waker for:
        // the next `poll_when_woken` looks too.
        self.parked.store(false, Ordering::Relaxed);
        poll(&mut Context::from_waker(&self.waker))
    }

    /// Something other than these polls took from the source (or replaced
    /// it): the next [`WhileWaiting::poll_when_woken`] looks, woken or not.
    pub fn looked_elsewhere(&self) {
        self.parked.store(false, Ordering::Relaxed);
    }

    /// [`WhileWaiting::poll_with`] for a source polled by nothing else (no
    /// other poll replaces the waker it holds): Pending without a look
    /// while its last poll here was Pending and it has not woken since.
    pub fn poll_when_woken<T>(
        &self,
        cx: &mut Context<'_>,
        poll: impl FnOnce(&mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        // Waiting first: a wake after the look below wakes the task, and
        // one before it is seen by it.
        self.wait(cx);
        if self.parked.load(Ordering::Relaxed) {
            if !self.task.woken.load(Ordering::SeqCst) {
                return Poll::Pending;
            }
            self.task.woken.store(false, Ordering::Relaxed);
        }
        let polled = poll(&mut Context::from_waker(&self.waker));
        self.parked.store(polled.is_pending(), Ordering::Relaxed);
        polled
    }

    /// The task no longer waits: what arrives now wakes nobody (the task
    /// looks for it itself).
    pub fn done(&self) {
        self.task.waiting.store(false, Ordering::Relaxed);
    }

    /// Calls [`WhileWaiting::done`] when dropped (with the future that
    /// waits).
    pub fn until_dropped(&self) -> Done<'_> {
        Done(self)
    }
}

impl Drop for WhileWaiting {
    /// The task's waker is not kept past the source's life (the source may
    /// hold this one's waker longer).
    fn drop(&mut self) {
        self.task.waiting.store(false, Ordering::Relaxed);
        self.task.waker.lock().take();
    }
}

/// See [`WhileWaiting::until_dropped`].
pub(crate) struct Done<'a>(&'a WhileWaiting);

impl Drop for Done<'_> {
    fn drop(&mut self) {
        self.0.done();
    }
}

/// A future that lives across the connection's turns (the keep-alive
/// timer, the broker's stop), polled only once it woke (see
/// [`WhileWaiting::poll_when_woken`]). What it wakes for wakes the task
/// while it runs too (these are rare, and end or check the connection).
pub(crate) struct Quiet<F> {
    inner: F,
    wake: WhileWaiting,
}

impl<F: Future + Unpin> Quiet<F> {
    pub fn new(inner: F) -> Quiet<F> {
        Quiet {
            inner,
            wake: WhileWaiting::new(),
        }
    }

    /// The future, to change (a timer's deadline): polled on the next poll,
    /// woken or not.
    pub fn inner_mut(&mut self) -> &mut F {
        self.wake.looked_elsewhere();
        &mut self.inner
    }
}

impl<F: Future + Unpin> Future for Quiet<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let Quiet { inner, wake } = self.get_mut();
        wake.poll_when_woken(cx, |cx| Pin::new(inner).poll(cx))
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Counts the wakes it gets (the inbox's tests use it too).
    #[derive(Default)]
    pub(in crate::connection) struct Count(pub AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A source: Ready once `ready` holds, else Pending with the waker
    /// kept; counts how often it is looked at.
    #[derive(Default)]
    struct Source {
        ready: bool,
        looks: usize,
        waker: Option<Waker>,
    }

    impl Source {
        fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
            self.looks += 1;
            if std::mem::take(&mut self.ready) {
                return Poll::Ready(());
            }
            self.waker = Some(cx.waker().clone());
            Poll::Pending
        }

        fn fill(&mut self) {
            self.ready = true;
            if let Some(waker) = self.waker.take() {
                waker.wake();
            }
        }
    }

    /// A source that was Pending is looked at again only after it woke;
    /// one that was Ready is looked at on the next poll; a wake while the
    /// task runs (after `done`) is remembered, not lost.
    #[test]
    fn a_source_is_looked_at_again_once_it_woke() {
        let wait = WhileWaiting::new();
        let count = Arc::new(Count::default());
        let task = Waker::from(Arc::clone(&count));
        let mut cx = Context::from_waker(&task);
        let mut source = Source::default();

        assert!(
            wait.poll_when_woken(&mut cx, |cx| source.poll(cx))
                .is_pending()
        );
        assert_eq!(source.looks, 1);
        // Nothing came: not looked at.
        for _ in 0..3 {
            assert!(
                wait.poll_when_woken(&mut cx, |cx| source.poll(cx))
                    .is_pending()
            );
        }
        assert_eq!(source.looks, 1);
        // It fills while the task waits: the task is woken, the source
        // looked at.
        source.fill();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert!(
            wait.poll_when_woken(&mut cx, |cx| source.poll(cx))
                .is_ready()
        );
        assert_eq!(source.looks, 2);
        // Ready last time: looked at, whether it woke or not.
        assert!(
            wait.poll_when_woken(&mut cx, |cx| source.poll(cx))
                .is_pending()
        );
        assert_eq!(source.looks, 3);
        // It fills while the task runs: no wake of the task, but the next
        // poll looks.
        wait.done();
        source.fill();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert!(
            wait.poll_when_woken(&mut cx, |cx| source.poll(cx))
                .is_ready()
        );
        assert_eq!(source.looks, 4);
    }

    /// The task's waker is kept from one wait to the next, and replaced
    /// when another waker polls: the wake goes to the waker of the last
    /// wait only, and to none once the source is gone.
    #[test]
    fn the_last_waits_waker_is_woken() {
        let wait = WhileWaiting::new();
        let (first, second) = (Arc::new(Count::default()), Arc::new(Count::default()));
        let (first_waker, second_waker) = (
            Waker::from(Arc::clone(&first)),
            Waker::from(Arc::clone(&second)),
        );
        let mut source = Source::default();

        let mut cx = Context::from_waker(&first_waker);
        assert!(wait.poll_with(&mut cx, |cx| source.poll(cx)).is_pending());
        wait.done();
        // Waits again with the same waker: kept (one reference more than
        // `first` and its waker, held by the wait, not one per wait).
        assert!(wait.poll_with(&mut cx, |cx| source.poll(cx)).is_pending());
        assert_eq!(Arc::strong_count(&first), 3);
        wait.done();
        assert_eq!(Arc::strong_count(&first), 3);
        let mut cx = Context::from_waker(&second_waker);
        assert!(wait.poll_with(&mut cx, |cx| source.poll(cx)).is_pending());
        assert_eq!(Arc::strong_count(&first), 2);
        source.fill();
        assert_eq!(first.0.load(Ordering::SeqCst), 0);
        assert_eq!(second.0.load(Ordering::SeqCst), 1);
        assert_eq!(Arc::strong_count(&second), 3);
        drop(wait);
        assert_eq!(Arc::strong_count(&second), 2);
    }

    async fn poll_once<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
        std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *future).poll(cx))).await
    }

    /// The keep-alive timer behind [`Quiet`]: fires at its deadline, and a
    /// deadline moved through [`Quiet::inner_mut`] holds.
    #[tokio::test(start_paused = true)]
    async fn a_quiet_timer_fires_and_moves() {
        let start = tokio::time::Instant::now();
        let mut timer = Quiet::new(Box::pin(tokio::time::sleep_until(
            start + std::time::Duration::from_secs(10),
        )));
        // Polled while it has not fired (as by other branches' turns).
        for _ in 0..3 {
            assert!(poll_once(&mut timer).await.is_pending());
        }
        (&mut timer).await;
        assert_eq!(start.elapsed(), std::time::Duration::from_secs(10));
        timer
            .inner_mut()
            .as_mut()
            .reset(start + std::time::Duration::from_secs(25));
        assert!(poll_once(&mut timer).await.is_pending());
        (&mut timer).await;
        assert_eq!(start.elapsed(), std::time::Duration::from_secs(25));
    }
}
