//! The connection's end of its mailbox (see [`crate::sessions::Mailbox`]):
//! direct deliveries and notices, woken for only while the connection
//! waits for them.
//!
//! tokio's channel keeps the last waker its receiver registered until the
//! next one replaces it. A connection's own answers are sent on its
//! mailbox while the connection runs (the store answers in the request's
//! turn), so each woke the running task: one more, empty, turn per request
//! (the whole `select!` polled again, every branch Pending), about 1,000
//! instructions of 18,500. Here the channel holds a waker of the inbox's
//! own that passes a wake on only while a [`Inbox::recv`] future exists;
//! dropping the future (the `select!` ending, whichever branch won) lets
//! go of the task's waker. Nothing is missed: the next `recv` registers
//! the task's waker before the channel looks at its queue, so a message
//! sent in between is either found by that look or wakes the task.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;
use tokio::sync::mpsc;

use crate::sessions::ToConnection;

/// The receiving end of a connection's mailbox.
pub(crate) struct Inbox {
    rx: mpsc::UnboundedReceiver<ToConnection>,
    /// The waker the channel holds: passes wakes on to `waiting.task`.
    waker: Waker,
    waiting: Arc<Waiting>,
}

/// The task waiting on the inbox, while a [`Recv`] exists.
#[derive(Default)]
struct Waiting {
    task: AtomicWaker,
}

impl Wake for Waiting {
    fn wake(self: Arc<Self>) {
        self.task.wake();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.task.wake();
    }
}

impl Inbox {
    pub fn new(rx: mpsc::UnboundedReceiver<ToConnection>) -> Inbox {
        let waiting = Arc::new(Waiting::default());
        Inbox {
            rx,
            waker: Waker::from(Arc::clone(&waiting)),
            waiting,
        }
    }

    /// The next message; `None` once every sender is gone. The task is
    /// woken for a message only while the future exists.
    pub fn recv(&mut self) -> Recv<'_> {
        Recv { inbox: self }
    }

    /// A message that is ready, if any.
    pub fn try_recv(&mut self) -> Option<ToConnection> {
        self.rx.try_recv().ok()
    }
}

/// [`Inbox::recv`]'s future.
pub(crate) struct Recv<'a> {
    inbox: &'a mut Inbox,
}

impl Future for Recv<'_> {
    type Output = Option<ToConnection>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inbox = &mut self.get_mut().inbox;
        // The task's waker first: a message sent after the channel's look
        // at its queue below then wakes the task.
        inbox.waiting.task.register(cx.waker());
        inbox.rx.poll_recv(&mut Context::from_waker(&inbox.waker))
    }
}

impl Drop for Recv<'_> {
    fn drop(&mut self) {
        // No longer waiting: what is sent now is taken by the connection's
        // own look (`try_recv` after its turn, or the next `recv`).
        drop(self.inbox.waiting.task.take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts the wakes it gets.
    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn poll_once(inbox: &mut Inbox, waker: &Waker) -> Poll<Option<ToConnection>> {
        let mut recv = inbox.recv();
        Pin::new(&mut recv).poll(&mut Context::from_waker(waker))
    }

    /// A message sent while the task waits wakes it; one sent while it
    /// runs (no `recv` future) does not, and is there for the next look.
    #[test]
    fn wakes_only_while_waiting() {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut inbox = Inbox::new(rx);
        let count = Arc::new(Count::default());
        let task = Waker::from(Arc::clone(&count));

        // Waiting: a send wakes the task.
        let mut recv = inbox.recv();
        assert!(
            Pin::new(&mut recv)
                .poll(&mut Context::from_waker(&task))
                .is_pending()
        );
        tx.send(ToConnection::TakenOver).unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert!(matches!(
            Pin::new(&mut recv).poll(&mut Context::from_waker(&task)),
            Poll::Ready(Some(ToConnection::TakenOver))
        ));
        drop(recv);

        // Waiting, then another branch of the `select!` won (the future
        // dropped): the connection runs, and a send now wakes nobody...
        assert!(poll_once(&mut inbox, &task).is_pending());
        tx.send(ToConnection::Overflow).unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        // ...and is found by the connection's own look.
        assert!(matches!(inbox.try_recv(), Some(ToConnection::Overflow)));
        assert!(inbox.try_recv().is_none());

        // Sent while running, found by the next wait without a wake.
        tx.send(ToConnection::SendAway).unwrap();
        assert!(matches!(
            poll_once(&mut inbox, &task),
            Poll::Ready(Some(ToConnection::SendAway))
        ));
        assert_eq!(count.0.load(Ordering::SeqCst), 1);

        // Waiting again after a turn: woken again.
        let mut recv = inbox.recv();
        assert!(
            Pin::new(&mut recv)
                .poll(&mut Context::from_waker(&task))
                .is_pending()
        );
        tx.send(ToConnection::TakenOver).unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 2);
        drop(recv);

        // Every sender gone: the end.
        assert!(matches!(inbox.try_recv(), Some(ToConnection::TakenOver)));
        drop(tx);
        assert!(matches!(poll_once(&mut inbox, &task), Poll::Ready(None)));
    }

    /// The task is woken from another thread while it waits (the mailbox's
    /// senders are other connections' tasks).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_message_from_another_task_arrives() {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut inbox = Inbox::new(rx);
        for _ in 0..100 {
            let tx = tx.clone();
            let sender = tokio::spawn(async move { tx.send(ToConnection::TakenOver).unwrap() });
            assert!(matches!(inbox.recv().await, Some(ToConnection::TakenOver)));
            sender.await.unwrap();
        }
    }
}
