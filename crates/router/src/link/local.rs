use crate::protocol::{
    ConnectReturnCode, Filter, LastWill, LastWillProperties, Packet, Publish, QoS,
    RetainForwardRule, Subscribe, Unsubscribe,
};
use crate::router::Ack;
use crate::router::{
    iobufs::{Incoming, Outgoing},
    Connection, Event, Notification, ShadowRequest,
};
use crate::ConnectionId;
use bytes::Bytes;
use flume::{Receiver, RecvError, RecvTimeoutError, SendError, Sender, TrySendError};
use parking_lot::lock_api::MutexGuard;
use parking_lot::{Mutex, RawMutex};

use std::collections::VecDeque;
use std::mem;
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("Unexpected router message")]
    NotConnectionAck,
    #[error("ConnAck error {0}")]
    ConnectionAck(String),
    /// The router refused the connection with this CONNACK code
    /// (statebroker patch 22: `QuotaExceeded` when it keeps
    /// `max_kept_sessions` sessions already).
    #[error("the router refused the connection: {0:?}")]
    Refused(ConnectReturnCode),
    /// The router's channel is full (what could not be sent is dropped:
    /// the error stays small, statebroker).
    #[error("Channel try send error")]
    TrySend,
    /// The router is gone.
    #[error("Channel send error")]
    Send,
    #[error("Channel recv error")]
    Recv(#[from] RecvError),
    #[error("Channel timeout recv error")]
    RecvTimeout(#[from] RecvTimeoutError),
    #[error("Timeout = {0}")]
    Elapsed(#[from] tokio::time::error::Elapsed),
}

impl From<TrySendError<(ConnectionId, Event)>> for LinkError {
    fn from(_: TrySendError<(ConnectionId, Event)>) -> Self {
        LinkError::TrySend
    }
}

impl From<SendError<(ConnectionId, Event)>> for LinkError {
    fn from(_: SendError<(ConnectionId, Event)>) -> Self {
        LinkError::Send
    }
}

// used to build LinkTx and LinkRx
pub struct LinkBuilder<'a> {
    tenant_id: Option<String>,
    client_id: &'a str,
    router_tx: Sender<(ConnectionId, Event)>,
    // true by default
    clean_session: bool,
    last_will: Option<LastWill>,
    last_will_properties: Option<LastWillProperties>,
    // false by default
    dynamic_filters: bool,
    // default to 0, indicating to not use topic alias
    topic_alias_max: u16,
    // MQTT 5 Session Expiry Interval in seconds (u32::MAX: never); by
    // default 0 for a clean session and never otherwise, as in 3.1.1
    // (statebroker patch 9)
    session_expiry: Option<u32>,
    // This session's choice when a publish would push out of a log what it
    // has not had (`None`: the router's) (statebroker patch 25)
    queue_full: Option<crate::QueueFull>,
    // Told once the router has given everything the session had waiting
    // (statebroker patch 48)
    tell_caught_up: bool,
}

impl<'a> LinkBuilder<'a> {
    pub fn new(client_id: &'a str, router_tx: Sender<(ConnectionId, Event)>) -> Self {
        LinkBuilder {
            client_id,
            router_tx,
            tenant_id: None,
            clean_session: true,
            last_will: None,
            last_will_properties: None,
            dynamic_filters: false,
            topic_alias_max: 0,
            session_expiry: None,
            queue_full: None,
            tell_caught_up: false,
        }
    }

    /// The link gets `Notification::CaughtUp` once, the first time the
    /// router has given it everything: the session's restored messages
    /// and what its subscriptions' logs held for it (statebroker patch
    /// 48).
    pub fn tell_caught_up(mut self, tell: bool) -> Self {
        self.tell_caught_up = tell;
        self
    }

    /// MQTT 5: how long (seconds, `u32::MAX` for ever) the router keeps the
    /// session after the connection ends, separately from whether the
    /// connection starts clean (`clean_session`) (statebroker patch 9).
    pub fn session_expiry(mut self, seconds: u32) -> Self {
        self.session_expiry = Some(seconds);
        self
    }

    /// What a publish does when it would push out of a log a message this
    /// session has not had; `None`: the router's `queue_full`
    /// (statebroker patch 25).
    pub fn queue_full(mut self, queue_full: Option<crate::QueueFull>) -> Self {
        self.queue_full = queue_full;
        self
    }

    pub fn tenant_id(mut self, tenant_id: Option<String>) -> Self {
        self.tenant_id = tenant_id;
        self
    }

    pub fn last_will(mut self, last_will: Option<LastWill>) -> Self {
        self.last_will = last_will;
        self
    }

    pub fn last_will_properties(
        mut self,
        last_will_properties: Option<LastWillProperties>,
    ) -> Self {
        self.last_will_properties = last_will_properties;
        self
    }

    pub fn topic_alias_max(mut self, max: u16) -> Self {
        self.topic_alias_max = max;
        self
    }

    pub fn clean_session(mut self, clean: bool) -> Self {
        self.clean_session = clean;
        self
    }

    pub fn dynamic_filters(mut self, dynamic_filters: bool) -> Self {
        self.dynamic_filters = dynamic_filters;
        self
    }

    pub fn build(self) -> Result<(LinkTx, LinkRx, Notification), LinkError> {
        let (event, pending) = self.connect();
        pending.router_tx.send((0, event))?;
        pending.link_rx.recv()?;
        pending.finish()
    }

    /// [`LinkBuilder::build`] without blocking the thread while the router
    /// registers the link (statebroker).
    pub async fn build_async(self) -> Result<(LinkTx, LinkRx, Notification), LinkError> {
        let (event, pending) = self.connect();
        pending.router_tx.send_async((0, event)).await?;
        pending.link_rx.recv_async().await?;
        pending.finish()
    }

    /// The connection event for the router, and the link's ends.
    fn connect(self) -> (Event, PendingLink) {
        // Local connections to the router shall have access to all subscriptions
        let mut connection = Connection::new(
            self.tenant_id,
            self.client_id.to_owned(),
            self.clean_session,
            self.dynamic_filters,
        );
        connection.session_expiry =
            self.session_expiry
                .unwrap_or(if self.clean_session { 0 } else { u32::MAX });
        connection.queue_full = self.queue_full;
        connection.tell_caught_up = self.tell_caught_up;

        connection
            .last_will(self.last_will, self.last_will_properties)
            .topic_alias_max(self.topic_alias_max);
        let incoming = Incoming::new(connection.client_id.to_owned());
        let (outgoing, link_rx) = Outgoing::new(connection.client_id.to_owned());
        let outgoing_data_buffer = outgoing.buffer();
        let incoming_data_buffer = incoming.buffer();
        let event = Event::Connect {
            connection,
            incoming,
            outgoing,
        };
        let pending = PendingLink {
            router_tx: self.router_tx,
            link_rx,
            outgoing_data_buffer,
            incoming_data_buffer,
        };
        (event, pending)
    }
}

/// A link the router is registering.
struct PendingLink {
    router_tx: Sender<(ConnectionId, Event)>,
    link_rx: Receiver<()>,
    outgoing_data_buffer: Arc<Mutex<VecDeque<Notification>>>,
    incoming_data_buffer: Arc<Mutex<VecDeque<Packet>>>,
}

impl PendingLink {
    /// Once the router answered: the link, with the connection id the
    /// router assigned, and the router's CONNACK.
    fn finish(self) -> Result<(LinkTx, LinkRx, Notification), LinkError> {
        let notification = self
            .outgoing_data_buffer
            .lock()
            .pop_front()
            .ok_or(LinkError::NotConnectionAck)?;
        // Right now link identifies failure with dropped rx in router,
        // which is probably ok. We need this here to get id assigned by router
        let id = match notification {
            Notification::DeviceAck(Ack::ConnAck(_, ack, _))
                if ack.code != ConnectReturnCode::Success =>
            {
                return Err(LinkError::Refused(ack.code))
            }
            Notification::DeviceAck(Ack::ConnAck(id, ..)) => id,
            _message => return Err(LinkError::NotConnectionAck),
        };
        let tx = LinkTx::new(id, self.router_tx.clone(), self.incoming_data_buffer);
        let mut rx = LinkRx::new(id, self.router_tx, self.link_rx, self.outgoing_data_buffer);
        // What came with the CONNACK, under the same wake-up (a resumed
        // session's PUBRELs), is read next rather than with the next
        // wake-up (statebroker patch 21).
        rx.cache.extend(rx.send_buffer.lock().drain(..));
        Ok((tx, rx, notification))
    }
}

pub struct LinkTx {
    pub(crate) connection_id: ConnectionId,
    router_tx: Sender<(ConnectionId, Event)>,
    recv_buffer: Arc<Mutex<VecDeque<Packet>>>,
}

impl LinkTx {
    pub fn new(
        connection_id: ConnectionId,
        router_tx: Sender<(ConnectionId, Event)>,
        recv_buffer: Arc<Mutex<VecDeque<Packet>>>,
    ) -> LinkTx {
        LinkTx {
            connection_id,
            router_tx,
            recv_buffer,
        }
    }

    pub fn buffer(&self) -> MutexGuard<RawMutex, VecDeque<Packet>> {
        self.recv_buffer.lock()
    }

    /// Send raw device data
    fn push(&mut self, data: Packet) -> Result<usize, LinkError> {
        let len = {
            let mut buffer = self.recv_buffer.lock();
            buffer.push_back(data);
            buffer.len()
        };

        self.router_tx
            .send((self.connection_id, Event::DeviceData))?;

        Ok(len)
    }

    /// Send raw device data
    pub async fn send(&mut self, data: Packet) -> Result<usize, LinkError> {
        let len = {
            let mut buffer = self.recv_buffer.lock();
            buffer.push_back(data);
            buffer.len()
        };

        self.router_tx
            .send((self.connection_id, Event::DeviceData))?;

        Ok(len)
    }

    /// Hands `packets` to the router with one wake-up, without waiting
    /// (statebroker). Nothing to send is not an error.
    pub fn send_all(&mut self, packets: impl IntoIterator<Item = Packet>) -> Result<(), LinkError> {
        let len = {
            let mut buffer = self.recv_buffer.lock();
            let before = buffer.len();
            buffer.extend(packets);
            buffer.len() - before
        };
        if len > 0 {
            self.router_tx
                .send((self.connection_id, Event::DeviceData))?;
        }
        Ok(())
    }

    fn try_push(&mut self, data: Packet) -> Result<usize, LinkError> {
        let len = {
            let mut buffer = self.recv_buffer.lock();
            buffer.push_back(data);
            buffer.len()
        };

        self.router_tx
            .try_send((self.connection_id, Event::DeviceData))?;
        Ok(len)
    }

    pub(crate) async fn notify(&mut self) -> Result<(), LinkError> {
        self.router_tx
            .send_async((self.connection_id, Event::DeviceData))
            .await?;

        Ok(())
    }

    /// Sends a MQTT Publish to the router
    pub fn publish<S, V>(&mut self, topic: S, payload: V) -> Result<usize, LinkError>
    where
        S: Into<Bytes>,
        V: Into<Bytes>,
    {
        let publish = Publish {
            dup: false,
            qos: QoS::AtMostOnce,
            retain: false,
            topic: topic.into(),
            pkid: 0,
            payload: payload.into(),
        };

        let len = self.push(Packet::Publish(publish, None))?;
        Ok(len)
    }

    /// Sends a MQTT Publish to the router
    pub fn try_publish<S, V>(&mut self, topic: S, payload: V) -> Result<usize, LinkError>
    where
        S: Into<Bytes>,
        V: Into<Bytes>,
    {
        let publish = Publish {
            dup: false,
            qos: QoS::AtMostOnce,
            retain: false,
            topic: topic.into(),
            pkid: 0,
            payload: payload.into(),
        };

        let len = self.try_push(Packet::Publish(publish, None))?;
        // TODO: Remote item in buffer after failure and write unittest
        Ok(len)
    }

    /// Sends a MQTT Subscribe to the eventloop
    pub fn subscribe<S: Into<String>>(&mut self, filter: S) -> Result<usize, LinkError> {
        let filters = vec![Filter {
            path: filter.into(),
            qos: QoS::AtMostOnce,
            nolocal: false,
            preserve_retain: false,
            retain_forward_rule: RetainForwardRule::Never,
        }];

        let subscribe = Subscribe { pkid: 0, filters };

        let len = self.push(Packet::Subscribe(subscribe, None))?;
        Ok(len)
    }

    /// Sends a MQTT Subscribe to the eventloop
    pub fn try_subscribe<S: Into<String>>(&mut self, filter: S) -> Result<usize, LinkError> {
        let filters = vec![Filter {
            path: filter.into(),
            qos: QoS::AtMostOnce,
            nolocal: false,
            preserve_retain: false,
            retain_forward_rule: RetainForwardRule::Never,
        }];

        let subscribe = Subscribe { pkid: 0, filters };

        let len = self.try_push(Packet::Subscribe(subscribe, None))?;
        Ok(len)
    }

    /// Sends a MQTT Unsubscribe to the eventloop
    pub fn unsubscribe<S: Into<String>>(&mut self, filter: S) -> Result<usize, LinkError> {
        let unsubscribe = Unsubscribe {
            pkid: 0,
            filters: vec![filter.into()],
        };

        let len = self.push(Packet::Unsubscribe(unsubscribe, None))?;
        Ok(len)
    }

    /// Sends a MQTT Unsubscribe to the eventloop
    pub fn try_unsubscribe<S: Into<String>>(&mut self, filter: S) -> Result<usize, LinkError> {
        let unsubscribe = Unsubscribe {
            pkid: 0,
            filters: vec![filter.into()],
        };

        let len = self.try_push(Packet::Unsubscribe(unsubscribe, None))?;
        Ok(len)
    }

    /// Request to get device shadow
    pub fn shadow<S: Into<String>>(&mut self, filter: S) -> Result<(), LinkError> {
        let message = Event::Shadow(ShadowRequest {
            filter: filter.into(),
        });

        self.router_tx.try_send((self.connection_id, message))?;
        Ok(())
    }
}

#[derive(Debug)]
pub struct LinkRx {
    connection_id: ConnectionId,
    router_tx: Sender<(ConnectionId, Event)>,
    router_rx: Receiver<()>,
    send_buffer: Arc<Mutex<VecDeque<Notification>>>,
    cache: VecDeque<Notification>,
    /// statebroker patch 34: the wait for the router's trigger, kept from
    /// one [`LinkRx::poll_next`] to the next while no trigger comes (see
    /// there).
    trigger: Option<flume::r#async::RecvFut<'static, ()>>,
}

impl LinkRx {
    pub fn new(
        connection_id: ConnectionId,
        router_tx: Sender<(ConnectionId, Event)>,
        router_rx: Receiver<()>,
        outgoing_data_buffer: Arc<Mutex<VecDeque<Notification>>>,
    ) -> LinkRx {
        LinkRx {
            connection_id,
            router_tx,
            router_rx,
            send_buffer: outgoing_data_buffer,
            cache: VecDeque::with_capacity(100),
            trigger: None,
        }
    }

    pub fn id(&self) -> ConnectionId {
        self.connection_id
    }

    pub fn recv(&mut self) -> Result<Option<Notification>, LinkError> {
        // Read from cache first
        // One router_rx trigger signifies a bunch of notifications. So we
        // should always check cache first
        match self.cache.pop_front() {
            Some(v) => Ok(Some(v)),
            None => {
                // If cache is empty, check for router trigger and get fresh notifications
                self.router_rx.recv()?;
                // A kept wait may have fired for this trigger (patch 34).
                self.trigger = None;
                // Collect 'all' the data in the buffer after a notification.
                // Notification means fresh data which isn't previously collected
                mem::swap(&mut *self.send_buffer.lock(), &mut self.cache);
                Ok(self.cache.pop_front())
            }
        }
    }

    pub fn recv_deadline(&mut self, deadline: Instant) -> Result<Option<Notification>, LinkError> {
        // Read from cache first
        // One router_rx trigger signifies a bunch of notifications. So we
        // should always check cache first
        match self.cache.pop_front() {
            Some(v) => Ok(Some(v)),
            None => {
                // If cache is empty, check for router trigger and get fresh notifications
                self.router_rx.recv_deadline(deadline)?;
                // A kept wait may have fired for this trigger (patch 34).
                self.trigger = None;
                mem::swap(&mut *self.send_buffer.lock(), &mut self.cache);
                Ok(self.cache.pop_front())
            }
        }
    }

    pub async fn next(&mut self) -> Result<Option<Notification>, LinkError> {
        std::future::poll_fn(|cx| self.poll_next(cx)).await
    }

    /// statebroker patch 34: [`LinkRx::next`] as a poll. A connection polls
    /// it once per turn while it waits for other things too (its socket),
    /// and `recv_async`'s future, made and dropped on each turn, registered
    /// a new waiter with the channel each time (an allocation and two locks
    /// of the channel, 600 instructions per state store request). The wait
    /// is kept here from one poll to the next instead, registered once,
    /// until a trigger is taken (here, or by [`LinkRx::try_next`] or
    /// [`LinkRx::recv`]: then it is dropped, so that a waiter that fired
    /// is not kept; flume puts a fired waiter back on every poll that
    /// finds nothing). Between polls the waiter stays with the channel:
    /// the router's trigger wakes the waker of the last poll.
    pub fn poll_next(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<Option<Notification>, LinkError>> {
        use std::future::Future;
        if let Some(v) = self.cache.pop_front() {
            return std::task::Poll::Ready(Ok(Some(v)));
        }
        let router_rx = &self.router_rx;
        let trigger = self
            .trigger
            .get_or_insert_with(|| router_rx.clone().into_recv_async());
        let triggered = std::task::ready!(std::pin::Pin::new(trigger).poll(cx));
        self.trigger = None;
        triggered?;
        // Collect 'all' the data in the buffer after a notification.
        mem::swap(&mut *self.send_buffer.lock(), &mut self.cache);
        std::task::Poll::Ready(Ok(self.cache.pop_front()))
    }

    /// The next notification if the router has one ready now, without
    /// waiting (statebroker).
    pub fn try_next(&mut self) -> Result<Option<Notification>, LinkError> {
        if let Some(v) = self.cache.pop_front() {
            return Ok(Some(v));
        }
        match self.router_rx.try_recv() {
            Ok(()) => {
                // A kept wait may have fired for this trigger (patch 34).
                self.trigger = None;
                mem::swap(&mut *self.send_buffer.lock(), &mut self.cache);
                Ok(self.cache.pop_front())
            }
            Err(flume::TryRecvError::Empty) => Ok(None),
            Err(flume::TryRecvError::Disconnected) => Err(LinkError::Recv(RecvError::Disconnected)),
        }
    }

    pub(crate) async fn exchange(
        &mut self,
        notifications: &mut VecDeque<Notification>,
    ) -> Result<(), LinkError> {
        self.trigger = None;
        self.router_rx.recv_async().await?;
        mem::swap(&mut *self.send_buffer.lock(), notifications);
        Ok(())
    }

    pub fn ready(&self) -> Result<(), LinkError> {
        self.router_tx.send((self.connection_id, Event::Ready))?;
        Ok(())
    }

    pub async fn wake(&self) -> Result<(), LinkError> {
        self.router_tx
            .send_async((self.connection_id, Event::Ready))
            .await?;

        Ok(())
    }
}

#[cfg(test)]
mod test {
    use super::LinkTx;
    use flume::bounded;
    use parking_lot::Mutex;
    use std::{collections::VecDeque, sync::Arc, thread};

    #[test]
    fn push_sends_all_data_and_notifications_to_router() {
        let (router_tx, router_rx) = bounded(10);
        let mut buffers = Vec::new();
        const CONNECTIONS: usize = 1000;
        const MESSAGES_PER_CONNECTION: usize = 100;

        for i in 0..CONNECTIONS {
            let buffer = Arc::new(Mutex::new(VecDeque::new()));
            let mut link_tx = LinkTx::new(i, router_tx.clone(), buffer.clone());
            buffers.push(buffer);
            thread::spawn(move || {
                for _ in 0..MESSAGES_PER_CONNECTION {
                    link_tx.publish("hello/world", vec![1, 2, 3]).unwrap();
                }
            });
        }

        // Router should receive notifications from all the connections
        for _ in 0..CONNECTIONS * MESSAGES_PER_CONNECTION {
            let _v = router_rx.recv().unwrap();
        }

        // Every connection has expected number of messages
        for item in buffers.iter().take(CONNECTIONS) {
            assert_eq!(item.lock().len(), MESSAGES_PER_CONNECTION);
        }

        // TODO: Write a similar test to benchmark buffer vs channels
    }

    /// statebroker patch 34: the wait for the router's trigger, kept across
    /// polls, wakes the last poll's waker when the router triggers; a
    /// trigger taken by `try_next` leaves no fired wait behind.
    #[test]
    fn a_kept_wait_is_woken_by_the_router() {
        use super::LinkRx;
        use crate::router::Notification;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::task::{Context, Poll, Wake, Waker};

        #[derive(Default)]
        struct Count(AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let count = Arc::new(Count::default());
        let waker = Waker::from(Arc::clone(&count));
        let mut cx = Context::from_waker(&waker);
        let woken = || count.0.load(Ordering::SeqCst);

        let (router_tx, _router_rx) = bounded(10);
        let (trigger, triggers) = bounded(10);
        let buffer = Arc::new(Mutex::new(VecDeque::new()));
        let mut rx = LinkRx::new(1, router_tx, triggers, Arc::clone(&buffer));
        let notify = |n| {
            buffer.lock().push_back(n);
            trigger.send(()).unwrap();
        };

        // Waiting across several polls: one trigger wakes it once.
        for _ in 0..3 {
            assert!(rx.poll_next(&mut cx).is_pending());
        }
        notify(Notification::Unschedule);
        assert_eq!(woken(), 1);
        assert!(matches!(
            rx.poll_next(&mut cx),
            Poll::Ready(Ok(Some(Notification::Unschedule)))
        ));

        // A trigger the connection takes itself (its turn's own look)...
        assert!(rx.poll_next(&mut cx).is_pending());
        notify(Notification::Unschedule);
        assert_eq!(woken(), 2);
        assert!(matches!(rx.try_next(), Ok(Some(Notification::Unschedule))));
        assert!(matches!(rx.try_next(), Ok(None)));
        // ...leaves nothing that looks triggered: the next polls wait, and
        // the next trigger wakes them.
        for _ in 0..3 {
            assert!(rx.poll_next(&mut cx).is_pending());
        }
        assert_eq!(woken(), 2);
        notify(Notification::Unschedule);
        assert_eq!(woken(), 3);
        assert!(matches!(
            rx.poll_next(&mut cx),
            Poll::Ready(Ok(Some(Notification::Unschedule)))
        ));

        // The router gone: the link says so.
        drop(trigger);
        assert!(matches!(rx.poll_next(&mut cx), Poll::Ready(Err(_))));
    }
}
