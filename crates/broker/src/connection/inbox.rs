//! The connection's end of its mailbox (see [`crate::sessions::Mailbox`]):
//! direct deliveries and notices, woken for only while the connection
//! waits for them (see [`super::waiting`]: its own state store answers
//! arrive here while it runs).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::mpsc;

use super::waiting::WhileWaiting;
use crate::sessions::ToConnection;

/// The receiving end of a connection's mailbox.
pub(crate) struct Inbox {
    rx: mpsc::UnboundedReceiver<ToConnection>,
    wake: WhileWaiting,
}

impl Inbox {
    pub fn new(rx: mpsc::UnboundedReceiver<ToConnection>) -> Inbox {
        Inbox {
            rx,
            wake: WhileWaiting::new(),
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
        let Inbox { rx, wake } = &mut *self.get_mut().inbox;
        // Only this polls `rx` (`try_recv` leaves its waker as it is).
        wake.poll_when_woken(cx, |cx| rx.poll_recv(cx))
    }
}

impl Drop for Recv<'_> {
    fn drop(&mut self) {
        self.inbox.wake.done();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connection::waiting::tests::Count;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::task::Waker;

    fn poll(recv: &mut Recv<'_>, waker: &Waker) -> Poll<Option<ToConnection>> {
        Pin::new(recv).poll(&mut Context::from_waker(waker))
    }

    fn poll_once(inbox: &mut Inbox, waker: &Waker) -> Poll<Option<ToConnection>> {
        poll(&mut inbox.recv(), waker)
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
        assert!(poll(&mut recv, &task).is_pending());
        tx.send(ToConnection::TakenOver).unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert!(matches!(
            poll(&mut recv, &task),
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
        assert!(poll(&mut recv, &task).is_pending());
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
