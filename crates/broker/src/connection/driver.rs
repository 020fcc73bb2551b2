//! The connection's loop: the I/O around the [`Machine`].
//!
//! It waits for whichever comes first (bytes from the client, a
//! notification from the router, a delivery from the broker, the disk
//! moving on, the keep-alive timer, the broker stopping), hands it to the
//! machine, then hands what the machine produced to the router (joining it
//! on first need), starts the requests a fault delays, and writes to the
//! client in one write per turn. It stops reading while the machine says
//! too much waits for the disk, and gives up on a client that stops
//! reading (a write stalled as long as the client may stay silent).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::{Instant, Sleep};

use super::end::End;
use super::gate::Waits;
use super::inbox::Inbox;
use super::link::RouterLink;
use super::machine::Machine;
use super::socket::{Socket, Stream};
use super::waiting::Quiet;
use crate::clock::Ticks;
use crate::codec::Incoming;
use crate::persistence::Position;
use crate::sessions::{Peer, ToConnection};
use crate::shared::Shared;

/// How long a closing connection waits for the router to end its session
/// before it closes the socket anyway.
pub(super) const ROUTER_GOODBYE: Duration = Duration::from_secs(2);

/// How long what the router gives a session that moved here waits for
/// its previous node's handover at most (see
/// [`RouterLink::hold_until`]): that node sees the move through
/// etcd's watch and drains its router (2 s at most before it takes it
/// for stalled, see `cluster::handover`); one that died with its link up
/// never says.
pub(super) const HANDOVER_WAIT: Duration = Duration::from_secs(3);

/// How long a write to a client without keep-alive may stall before the
/// client is disconnected.
const WRITE_STALL: Duration = Duration::from_secs(60);

/// The router's deliveries encoded for one write, at most (plus the last
/// one): the rest waits for the next turn, so that a client whose
/// subscriptions have many large messages ready does not grow its write
/// buffer to all of them at once.
const WRITE_BATCH: usize = 256 * 1024;

/// A write buffer that grew beyond this for a large write is let go once
/// written, rather than kept, empty, for the life of the connection.
const KEEP_WRITE_ROOM: usize = 1024 * 1024;

/// The connection's I/O.
pub(crate) struct Driver<S> {
    pub socket: Socket<S>,
    pub link: RouterLink,
    /// Direct deliveries and takeover notices (see [`crate::sessions`]).
    pub inbox: Inbox,
    /// How long the client may stay silent (1.5 times its keep-alive).
    pub idle_limit: Option<Duration>,
    /// The largest packet the listener accepts.
    pub max_packet_size: usize,
    /// What the web view shows of this connection.
    pub peer: Arc<Peer>,
    /// Becomes `true` when the connection is to end because the broker
    /// stops (a link from another cluster node hears it after the clients:
    /// see `Broker::shutdown`).
    pub stop: watch::Receiver<bool>,
    pub shared: Arc<Shared>,
    /// Which of the client, the router and the broker [`Driver::turn`]
    /// looks at first (0, 1, 2).
    pub first_source: u8,
}

impl<S: Stream> Driver<S> {
    /// Runs `machine` until the connection ends; returns how.
    ///
    /// (Not an `async fn` around `serve`: that would be one more future
    /// polled, with its state on a line of its own, at every turn.)
    pub fn run<'a>(&'a mut self, machine: &'a mut Machine) -> impl Future<Output = End> + 'a {
        futures_util::FutureExt::map(self.serve(machine), |served| match served {
            Err(end) => end,
            Ok(never) => match never {},
        })
    }

    async fn serve(&mut self, machine: &mut Machine) -> Result<std::convert::Infallible, End> {
        let mut last_heard = Ticks::now();
        // The keep-alive timer is set once and moved on only when it fires
        // (to the last time the client was heard, plus the limit), and the
        // shutdown signal is awaited by one future: making both anew on
        // every turn registered and removed a timer and a waiter per
        // request (1,400 instructions, 6% of a request).
        // Both are looked at only once they woke (see `waiting::Quiet`).
        let mut keep_alive = Quiet::new(Box::pin(tokio::time::sleep_until(
            Instant::now() + self.idle_limit.unwrap_or(Duration::from_secs(86_400)),
        )));
        let mut shutdown = self.stop.clone();
        let mut shutdown = Quiet::new(Box::pin(shutdown.changed()));
        // One subscription to the disk's position for the connection's life.
        let mut disk: watch::Receiver<Position> = self.shared.store.answered();
        // A cluster node's: how far the other nodes confirmed its forwarded
        // publishes (a receiver that never moves otherwise).
        let mut forwarded = self
            .shared
            .forwarding_confirmed()
            .unwrap_or_else(|| watch::Sender::new(0).subscribe());
        // A cluster node's: how far its state store requests have their
        // outcome out (see `store::tickets`).
        let mut outcomes = machine
            .outcomes_done()
            .unwrap_or_else(|| watch::Sender::new(0).subscribe());
        // What the client sent right after its CONNECT and came in the same
        // read (a client need not wait for the CONNACK: MQTT 5 and 3.1.1,
        // 3.1.4) is taken in before the first wait: no read may follow it.
        let mut read = self.socket.has_buffered();
        // What the web view was last told is in flight to the client.
        let mut shown_in_flight = self
            .peer
            .in_flight
            .load(std::sync::atomic::Ordering::Relaxed);
        loop {
            let waits = machine.waits();
            if !read {
                // Only while something waits for the disk, the other nodes
                // or requests' outcomes is that waited for too: each of
                // those waits made (and dropped unpolled) at every turn
                // cost ~150 instructions and four cold cache lines a
                // request.
                if !waits.any() {
                    read = self
                        .turn(machine, &mut last_heard, &mut keep_alive, &mut shutdown)
                        .await?;
                } else {
                    tokio::select! {
                        turned = self.turn(machine, &mut last_heard, &mut keep_alive, &mut shutdown) => {
                            read = turned?;
                        }
                        // The disk, the other nodes or the outcomes moved
                        // past what something here waits for: held
                        // acknowledgements go, reading stopped at a bound
                        // goes on.
                        () = moved_on(waits, &mut disk, &mut forwarded, &mut outcomes) => {
                            machine.on_disk()?;
                            self.read_packets(machine)?;
                        }
                    }
                }
            }
            // (Outside the select: its outcome may hold a watch's guard.)
            if std::mem::take(&mut read) {
                if !self.shared.standing.serving() {
                    self.suspended().await?;
                }
                self.read_packets(machine)?;
            }
            // (Most turns have nothing for the router: its hand-over is
            // not even started.)
            if !machine.to_router.is_empty() || !machine.released_stamps.is_empty() {
                let sent = self.link.send(&mut machine.to_router).await;
                self.shared.qos2_sent(&mut machine.released_stamps);
                sent?;
            }
            // The router answered the (UN)SUBSCRIBEs reading waited for:
            // what was read after them is served now (see
            // `Machine::awaiting_router`).
            if std::mem::take(&mut machine.resume_reading) && self.socket.has_buffered() {
                read = true;
            }
            // Direct deliveries that are ready (the answers to what was just
            // read among them) go out with the same write.
            while let Some(message) = self.inbox.try_recv() {
                self.on_broker(machine, message)?;
            }
            if !machine.later.is_empty() {
                for delayed in machine.later.drain(..) {
                    tokio::spawn(delayed.run(Arc::clone(&self.shared)));
                }
            }
            // Counted before the write: a client that has read a delivery
            // sees it counted (the web view's list). Stored only when it
            // changed: the count sits on a line of its own, cold at every
            // turn under load.
            let in_flight = machine.out.in_flight();
            if in_flight != shown_in_flight {
                self.peer
                    .in_flight
                    .store(in_flight, std::sync::atomic::Ordering::Relaxed);
                shown_in_flight = in_flight;
            }
            if !machine.may_hold_output() {
                if !self.shared.standing.serving() {
                    self.suspended().await?;
                }
                self.write(machine).await?;
            }
            if std::mem::take(&mut machine.unscheduled) {
                self.link.wake().await?;
            }
        }
    }

    /// Waits for the client, the router, the broker, the keep-alive timer
    /// or the broker's stop, and hands the machine what came; `Ok(true)`:
    /// bytes were read, for the caller to take in.
    ///
    /// Polled by hand rather than by `tokio::select!` (its random start,
    /// branch mask and futures moved into a tuple cost ~110 instructions a
    /// turn): the stop and the keep-alive timer first (each a flag until it
    /// fires, see `waiting::Quiet`), then the client, the router and the
    /// broker from a start that moves on every turn, so that none of them,
    /// always ready, keeps the others waiting (what select!'s random
    /// start is for).
    async fn turn(
        &mut self,
        machine: &mut Machine,
        last_heard: &mut Ticks,
        keep_alive: &mut Quiet<Pin<Box<Sleep>>>,
        shutdown: &mut Quiet<Pin<Box<impl Future<Output = Result<(), watch::error::RecvError>>>>>,
    ) -> Result<bool, End> {
        let reading = !machine.reading_paused();
        // (Without a link nothing comes: not looked at.)
        let notifying = self.link.may_notify();
        let keeping = self.idle_limit.is_some();
        self.first_source = (self.first_source + 1) % 3;
        let first = self.first_source;
        // What the router or the broker handed over, kept here rather than
        // carried in `Woke`: a `Woke` that large was copied out of the
        // wait, ~30 instructions a turn, the client's turns too.
        let mut from_router = None;
        let mut from_broker = None;
        let woke = {
            let mut fill = std::pin::pin!(self.socket.fill());
            let mut next = std::pin::pin!(self.link.next());
            let mut recv = self.inbox.recv();
            // Every sender gone: not looked at again this turn.
            let mut inbox_open = true;
            std::future::poll_fn(|cx| {
                if Pin::new(&mut *shutdown).poll(cx).is_ready() {
                    return Poll::Ready(Woke::Stop);
                }
                if keeping && Pin::new(&mut *keep_alive).poll(cx).is_ready() {
                    return Poll::Ready(Woke::KeepAlive);
                }
                for source in [first, (first + 1) % 3, (first + 2) % 3] {
                    match source {
                        0 if reading => {
                            if let Poll::Ready(filled) = fill.as_mut().poll(cx) {
                                return Poll::Ready(Woke::Client(filled));
                            }
                        }
                        1 if notifying => {
                            if let Poll::Ready(notification) = next.as_mut().poll(cx) {
                                from_router = Some(notification);
                                return Poll::Ready(Woke::Router);
                            }
                        }
                        2 if inbox_open => match Pin::new(&mut recv).poll(cx) {
                            Poll::Ready(Some(message)) => {
                                from_broker = Some(message);
                                return Poll::Ready(Woke::Broker);
                            }
                            Poll::Ready(None) => inbox_open = false,
                            Poll::Pending => {}
                        },
                        _ => {}
                    }
                }
                Poll::Pending
            })
            .await
        };
        match woke {
            Woke::Client(Ok(0)) => Err(End::Closed),
            Woke::Client(Err(e)) => Err(End::read_failed(e)),
            Woke::Client(Ok(_)) => {
                *last_heard = Ticks::now();
                Ok(true)
            }
            Woke::Router => match from_router {
                Some(Ok(Some(n))) => {
                    machine.on_router(n)?;
                    // What else the router has ready, before writing (up to
                    // a batch: the rest comes next turn).
                    while machine.wbuf.len() < WRITE_BATCH
                        && let Some(n) = self.link.next_ready()
                    {
                        machine.on_router(n)?;
                    }
                    Ok(false)
                }
                Some(Ok(None)) | None => Ok(false),
                Some(Err(_)) => Err(End::RouterClosed),
            },
            Woke::Broker => {
                if let Some(message) = from_broker {
                    self.on_broker(machine, message)?;
                }
                Ok(false)
            }
            Woke::KeepAlive => {
                let limit = self.idle_limit.unwrap_or_default();
                let silent = last_heard.elapsed();
                if silent >= limit {
                    return Err(End::KeepAlive);
                }
                keep_alive
                    .inner_mut()
                    .as_mut()
                    .reset(Instant::now() + (limit - silent));
                Ok(false)
            }
            Woke::Stop => Err(End::Shutdown),
        }
    }

    /// Waits while the node does not serve (a cluster node: while it holds
    /// its membership lease, read from the clock, checked before the
    /// connection takes in what it read and before each write): a node
    /// that wakes from a pause, or cannot confirm its lease in time,
    /// neither takes a request nor writes a delivery until etcd confirms
    /// the lease again; once the node lost it, the connection ends (see
    /// `standing.rs`).
    async fn suspended(&self) -> Result<(), End> {
        let mut shutdown = self.stop.clone();
        tokio::select! {
            resumed = self.shared.standing.resumed(self.peer.epoch) => {
                resumed.map_err(|()| End::NotServing)
            }
            _ = shutdown.changed() => Err(End::Shutdown),
        }
    }

    /// What the broker tells the connection: to the machine, but the end of
    /// a handover, which ends the link's hold (see
    /// [`RouterLink::hold_until`]).
    fn on_broker(&mut self, machine: &mut Machine, message: ToConnection) -> Result<(), End> {
        match &message {
            ToConnection::HandoverDone => {
                self.link
                    .release("the session's previous node handed over what it had");
                return Ok(());
            }
            // The handover goes on: the hold lasts (see
            // [`RouterLink::hold_on`]).
            ToConnection::Deliver(direct) if direct.handed_over => {
                self.link
                    .hold_on(tokio::time::Instant::now(), HANDOVER_WAIT);
            }
            _ => {}
        }
        machine.on_broker(message)
    }

    /// Hands the machine every complete packet read, until too much waits
    /// for the disk.
    fn read_packets(&mut self, machine: &mut Machine) -> Result<(), End> {
        while !machine.reading_paused() {
            // A state store request is read in place (see
            // `request_publish`); any other packet is decoded.
            if let Some((request, len)) = self.socket.next_request(self.max_packet_size) {
                let served = machine.on_request_read(request);
                self.socket.consume(len);
                served?;
                continue;
            }
            // The answers' acknowledgements, made where the machine takes
            // them (decoded, each was copied out of the decoder's result).
            if let Some(pkid) = self.socket.next_puback(self.max_packet_size) {
                machine.on_packet(Incoming::puback(pkid))?;
                continue;
            }
            // Matched whole, not through `?`: that moved the whole result
            // (the size of the largest packet) twice a request, to find
            // nothing more to read.
            match self.socket.next_packet(self.max_packet_size) {
                Ok(Some(incoming)) => machine.on_packet(incoming)?,
                Ok(None) => break,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Writes what the machine encoded for the client. A client that stops
    /// reading cannot hold its connection: the write may stall for as long
    /// as the client may stay silent.
    async fn write(&mut self, machine: &mut Machine) -> Result<(), End> {
        // Nearly every write completes at once: only one that waits for
        // the client sets a timer (its deadline, read from the clock, and
        // the timer's set-up and removal cost ~150 instructions a request).
        let written = {
            let mut write = std::pin::pin!(self.socket.write_all(&mut machine.wbuf));
            match std::future::poll_fn(|cx| Poll::Ready(write.as_mut().poll(cx))).await {
                Poll::Ready(written) => Ok(written),
                Poll::Pending => {
                    let stall = self.idle_limit.unwrap_or(WRITE_STALL);
                    tokio::time::timeout(stall, write).await
                }
            }
        };
        match written {
            Ok(Ok(())) => {
                if machine.wbuf.capacity() > KEEP_WRITE_ROOM {
                    machine.wbuf = bytes::BytesMut::new();
                }
                Ok(())
            }
            Ok(Err(e)) => Err(End::Io(e)),
            Err(_) => Err(End::WriteStalled),
        }
    }

    /// After the connection ended with `end`: tells the client why (MQTT 5),
    /// closes the socket (letting the client read why first), and tells the
    /// router the connection's part of the session is over.
    pub async fn finish(&mut self, machine: &mut Machine, end: &End) {
        if matches!(end, End::NotServing) {
            // What was encoded for the client stays unsent.
            machine.wbuf.clear();
        }
        machine.end(end);
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            self.socket.write_all(&mut machine.wbuf),
        )
        .await;
        // What the connection read before it ended goes to the router too,
        // joining it if the connection has not yet: a PUBLISH and the
        // DISCONNECT after it, read at once (`mosquitto_pub -q 0`), ended
        // the connection before the PUBLISH went anywhere.
        let for_router = self.link.is_linked() || !machine.to_router.is_empty();
        if for_router {
            // The router ends the session as the DISCONNECT says (kept with
            // its expiry, or discarded) and closes the link once its journal
            // has the change. Only then is the socket closed: a client that
            // reconnects after seeing it close finds the session as this
            // connection left it, also across a restart (MQTT 5 3.1.2.11.2:
            // a Session Expiry Interval of 0 ends the session with the
            // connection). Bounded, for a router that is stopping.
            self.link
                .close_with(&mut machine.to_router, ROUTER_GOODBYE)
                .await;
        }
        self.shared.qos2_sent(&mut machine.released_stamps);
        self.socket.shutdown().await;
        if end.reason().0.is_some() {
            // The broker ended it: let the client read why before closing.
            self.socket.linger(Duration::from_millis(500)).await;
        }
    }
}

/// Until the disk, the other nodes' confirmations or the requests'
/// outcomes moved past what `waits` waits for (not called with nothing to
/// wait for).
async fn moved_on(
    waits: Waits,
    disk: &mut watch::Receiver<Position>,
    forwarded: &mut watch::Receiver<u64>,
    outcomes: &mut watch::Receiver<u64>,
) {
    let Waits {
        batch,
        links,
        outcome,
    } = waits;
    tokio::select! {
        () = until(disk, |p| p.covers_all(batch)), if batch.is_some() => {}
        () = until(forwarded, |c| Some(*c) >= links), if links.is_some() => {}
        () = until(outcomes, |d| Some(*d) >= outcome), if outcome.is_some() => {}
        else => std::future::pending().await,
    }
}

/// Waits until `ready` holds for `watch`'s value (or its sender is gone),
/// and holds no read guard once it returns. What a select arm does next
/// reads the state store's watches and moves others (a forwarded publish
/// moves `forwarded`): a read guard still held then, as `wait_for`'s is to
/// the end of an arm whose pattern is `_`, deadlocks against a writer
/// waiting for the same watch, since a waiting writer makes new readers
/// wait. Two clients publishing retained QoS 1 messages stopped the whole
/// broker within a minute that way (the disk arm).
async fn until<T>(watch: &mut watch::Receiver<T>, ready: impl FnMut(&T) -> bool) {
    let _ = watch.wait_for(ready).await;
}

/// What ended a [`Driver::turn`]'s wait: the client's read, or which
/// source has something (what the router or the broker handed over waits
/// in the turn's own slots: large, it made every `Woke` large).
enum Woke {
    Client(std::io::Result<usize>),
    Router,
    Broker,
    KeepAlive,
    Stop,
}
