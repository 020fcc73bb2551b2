//! QoS 2 deliveries that ask before they go out (a cluster node's).
//!
//! A QoS 2 message queued for a persistent session may have a copy in
//! etcd (see `cluster::queue`), which must say, before the client may
//! have the message, that it is in flight under its packet id: the next
//! node, if this one dies, sends it again under that id with DUP, which a
//! client that had it takes for the same message (MQTT 5 4.3.3), and one
//! that had not gets. The copy must be gone before the PUBREL: the client
//! forgets the id then, and a copy sent again would be a new message. So
//! before the connection reads such a delivery, or the PUBREL of one,
//! from its router link, it asks ([`BeforeSending`]); one that must wait
//! is kept, with everything the router gives after it (the client sees
//! them in order), until etcd has the write. What the router gives
//! meanwhile is asked about at once (its write goes with the first's), up
//! to [`MAX_WAITING`] notifications.
//!
//! A single node has no such link state: the router link reads as if this
//! were not there (measured: the moves of a notification through a check
//! like this cost a single node's QoS 2 deliveries 5% of their
//! instructions).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use router::local::{LinkError, LinkRx};
use router::protocol::QoS;
use router::{Ack, Notification};
use tokio::sync::oneshot;

use crate::sessions::{BeforeSending, Sending};

/// Notifications kept behind a delivery that waits, at most: past them
/// the router is not read until that delivery goes.
pub(super) const MAX_WAITING: usize = 1024;

/// What the router link reads from the router: the next notification,
/// `Ok(None)` for a wake-up that found nothing.
pub(super) type Read = Poll<Result<Option<Notification>, LinkError>>;

/// See the module's documentation.
pub(super) struct AskFirst {
    ask: BeforeSending,
    /// What the router gave behind a delivery that waits, in order, each
    /// with the write to etcd it waits for.
    waiting: VecDeque<(Notification, Option<oneshot::Receiver<()>>)>,
    /// A write waited for will not come (the node stops): what waits is
    /// never given.
    stopped: bool,
}

impl AskFirst {
    pub fn new(ask: BeforeSending) -> AskFirst {
        AskFirst {
            ask,
            waiting: VecDeque::new(),
            stopped: false,
        }
    }

    /// The next notification for `client`'s connection, reading the
    /// router with `read` (see [`Read`]).
    #[inline(never)]
    pub fn poll_next(
        &mut self,
        client: &str,
        cx: &mut Context<'_>,
        mut read: impl FnMut(&mut Context<'_>) -> Read,
    ) -> Read {
        loop {
            if let Some(notification) = self.ready() {
                return Poll::Ready(Ok(Some(notification)));
            }
            if self.stopped {
                return Poll::Pending;
            }
            if let Some((_, removal)) = self.waiting.front_mut()
                && let Some(heard) = removal
                && let Poll::Ready(heard) = Pin::new(heard).poll(cx)
            {
                *removal = None;
                self.stopped = heard.is_err();
                continue;
            }
            if self.waiting.len() >= MAX_WAITING {
                return Poll::Pending;
            }
            match read(cx) {
                Poll::Ready(Ok(Some(notification))) => {
                    if let Some(notification) = self.admit(client, notification) {
                        return Poll::Ready(Ok(Some(notification)));
                    }
                }
                Poll::Ready(Ok(None)) if !self.waiting.is_empty() => {}
                other => return other,
            }
        }
    }

    /// The next notification if one may go now, reading the router from
    /// `rx` (`None`: nothing ready).
    // Out of line: the router link's own path stays as small as a
    // single node's without this.
    #[inline(never)]
    pub fn next_ready(&mut self, client: &str, rx: &mut LinkRx) -> Option<Notification> {
        if !self.waiting.is_empty() {
            return self.ready();
        }
        let notification = rx.try_next().ok().flatten()?;
        self.admit(client, notification)
    }

    /// Forgets what waits (the connection closes: the router takes it as
    /// sent, and gives it again to the session's next connection).
    pub fn clear(&mut self) {
        self.waiting.clear();
        self.stopped = false;
    }

    /// `notification` if it may go now; otherwise it waits.
    fn admit(&mut self, client: &str, notification: Notification) -> Option<Notification> {
        let removal = match &notification {
            Notification::Forward(forward) if forward.publish.qos == QoS::ExactlyOnce => {
                forward.queued.and_then(|number| {
                    let sending = Sending::Publish {
                        number,
                        publish: &forward.publish,
                        properties: forward.properties.as_ref(),
                    };
                    (self.ask)(client, sending)
                })
            }
            Notification::DeviceAck(Ack::PubRel(rel) | Ack::PubRelWithProperties(rel, _)) => {
                (self.ask)(client, Sending::PubRel(rel.pkid))
            }
            _ => None,
        };
        if removal.is_none() && self.waiting.is_empty() {
            return Some(notification);
        }
        self.waiting.push_back((notification, removal));
        None
    }

    /// The first of those waiting, if it may go now.
    fn ready(&mut self) -> Option<Notification> {
        let (_, removal) = self.waiting.front_mut()?;
        if let Some(heard) = removal {
            match heard.try_recv() {
                Ok(()) => {}
                Err(oneshot::error::TryRecvError::Empty) => return None,
                Err(oneshot::error::TryRecvError::Closed) => {
                    self.stopped = true;
                    return None;
                }
            }
        }
        self.waiting
            .pop_front()
            .map(|(notification, _)| notification)
    }
}
