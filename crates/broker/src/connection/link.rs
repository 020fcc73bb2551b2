//! A connection's link to the router, made on first need.
//!
//! A persistent session links at CONNECT (the router knows whether the
//! session exists); a clean one when it first sends something for the
//! router, so that a connection that only talks to the state store, or
//! idles, costs the router nothing. What one turn of the connection's loop
//! has for the router is handed over in one batch, with one wake-up.
//!
//! On a cluster node a QoS 2 delivery of a persistent session may have to
//! wait before it goes out (see [`super::ask_first`]).

use std::collections::VecDeque;

use router::local::{LinkError, LinkRx, LinkTx};
use router::protocol::{Disconnect, DisconnectProperties, DisconnectReasonCode, Packet};
use router::{LinkRefused, Notification, RouterHandle};

use super::ask_first::AskFirst;
use super::waiting::WhileWaiting;
use crate::sessions::BeforeSending;

/// How long a hold lasts at most, however long the handover's messages
/// keep coming (see [`RouterLink::hold_on`]).
const MAX_HOLD: std::time::Duration = std::time::Duration::from_secs(30);

/// Deliveries a hold keeps at most (see [`RouterLink::hold_until`]).
pub(crate) const MAX_HELD: usize = 4096;

/// Why the router could not be reached.
#[derive(Debug)]
pub(crate) enum LinkFailure {
    /// The router would not register the connection.
    Refused(LinkRefused),
    /// The router dropped the link (a takeover, or it refused a packet).
    Closed,
}

/// The DISCONNECT that ends a connection's part of its session in the
/// router, the session kept `session_expiry` seconds after it (0: it ends).
pub(crate) fn goodbye(session_expiry: u32) -> Packet {
    Packet::Disconnect(
        Disconnect {
            reason_code: DisconnectReasonCode::NormalDisconnection,
        },
        Some(DisconnectProperties {
            session_expiry_interval: Some(session_expiry),
            reason_string: None,
            user_properties: Vec::new(),
            server_reference: None,
        }),
    )
}

/// The link, once made.
pub(crate) struct RouterLink {
    router: RouterHandle,
    client_id: String,
    clean_start: bool,
    session_expiry: u32,
    queue_full: Option<router::QueueFull>,
    link: Option<(LinkTx, LinkRx)>,
    /// The router's trigger wakes the task only while it waits (see
    /// [`super::waiting`]; the wait itself is kept across turns, router
    /// patch 34).
    wake: WhileWaiting,
    /// What the router gives for the session is held until this (see
    /// [`RouterLink::hold_until`]), and never past the second.
    held_until: Option<tokio::time::Instant>,
    hold_ends_by: Option<tokio::time::Instant>,
    /// The deliveries held, in order (given before anything else once the
    /// hold ends).
    held: VecDeque<Notification>,
    /// QoS 2 deliveries that ask before they go (a cluster node's).
    ask_first: Option<AskFirst>,
}

impl RouterLink {
    /// The link of a new connection, and whether the router had a session
    /// for it. A connection that starts clean, keeps nothing after it ends
    /// and has no session to discard (`lazy`) links on first need; others
    /// link now: the router knows whether the session exists, discards it
    /// on a clean start, and keeps the new one for `session_expiry` seconds
    /// with its own `queue_full` (`None`: the broker's).
    pub async fn open(
        router: &RouterHandle,
        client_id: &str,
        clean_start: bool,
        session_expiry: u32,
        queue_full: Option<router::QueueFull>,
        lazy: bool,
    ) -> Result<(RouterLink, bool), LinkRefused> {
        let mut link = RouterLink {
            router: router.clone(),
            client_id: client_id.to_owned(),
            clean_start,
            session_expiry,
            queue_full,
            link: None,
            wake: WhileWaiting::new(),
            held_until: None,
            hold_ends_by: None,
            held: VecDeque::new(),
            ask_first: None,
        };
        if lazy {
            return Ok((link, false));
        }
        let (tx, rx, connack) = router
            .link(client_id, clean_start, session_expiry, queue_full)
            .await?;
        let present = matches!(
            Option::<Packet>::from(connack),
            Some(Packet::ConnAck(ack, _)) if ack.session_present
        );
        link.link = Some((tx, rx));
        Ok((link, present))
    }

    /// Whether the connection has joined the router.
    pub fn is_linked(&self) -> bool {
        self.link.is_some()
    }

    /// Hands `packets` to the router with one wake-up (emptying it); joins
    /// the router first if the connection has not yet.
    pub async fn send(&mut self, packets: &mut Vec<Packet>) -> Result<(), LinkFailure> {
        if packets.is_empty() {
            return Ok(());
        }
        if self.link.is_none() {
            let (tx, rx, _connack) = self
                .router
                .link(
                    &self.client_id,
                    self.clean_start,
                    self.session_expiry,
                    self.queue_full,
                )
                .await
                .map_err(|e| {
                    tracing::error!(client_id = self.client_id, error = %e, "cannot join the router");
                    LinkFailure::Refused(e)
                })?;
            self.link = Some((tx, rx));
        }
        let Some((tx, _)) = &mut self.link else {
            return Err(LinkFailure::Closed);
        };
        tx.send_all(packets.drain(..))
            .map_err(|_| LinkFailure::Closed)
    }

    /// Ends the connection's part of its session in the router, as a
    /// client's DISCONNECT with `session_expiry` would (0: the session
    /// ends), and waits up to `within` for the router to close the link.
    /// For a connection that ends before its machine runs; a link merely
    /// dropped would stay connected in the router.
    pub async fn leave(&mut self, session_expiry: u32, within: std::time::Duration) {
        if self.link.is_some() {
            self.close_with(&mut vec![goodbye(session_expiry)], within)
                .await;
        }
    }

    /// Hands the router the connection's last `packets` (they end with a
    /// [`goodbye`]) and waits up to `within` for it to close the link: it
    /// does once the session is as the goodbye says (and, with a data
    /// directory, its journal has it).
    pub async fn close_with(&mut self, packets: &mut Vec<Packet>, within: std::time::Duration) {
        // Deliveries that wait for etcd do not go now.
        if let Some(ask_first) = &mut self.ask_first {
            ask_first.clear();
        }
        if self.send(packets).await.is_ok() {
            // Until the link closes (`Err`): a wake-up that finds nothing
            // (`Ok(None)`: the router wakes the link once per push, and one
            // read may take several) is not the close; before, it ended
            // the wait early.
            let _ =
                tokio::time::timeout(within, async { while self.next().await.is_ok() {} }).await;
        }
    }

    /// The router's deliveries to the session are held until `until`, or
    /// [`RouterLink::release`]; its other notifications (acknowledgements
    /// of what the client sends meanwhile: a SUBACK, a PUBACK) are not. A
    /// session that moved here from a live cluster node waits for that
    /// node's handover (see `cluster::handover`), so that the older
    /// messages come first. (Before 2026-11-30 the hold held everything
    /// and ended at the client's first SUBSCRIBE or PUBLISH, which needed
    /// the router's answer.) At most [`MAX_HELD`] deliveries are held: past
    /// them the hold ends.
    pub fn hold_until(&mut self, until: tokio::time::Instant) {
        self.held_until = Some(until);
        self.hold_ends_by = Some(tokio::time::Instant::now() + MAX_HOLD);
    }

    /// The previous node's handed-over messages are still coming: a hold
    /// that is on lasts `wait` from `now` (never past [`MAX_HOLD`] after
    /// it began). A handover that takes longer than the first wait (a
    /// large backlog over a busy link) keeps its messages before the
    /// router's; before 2026-11-30 the hold ended 3 s after the CONNECT
    /// whatever came.
    pub fn hold_on(&mut self, now: tokio::time::Instant, wait: std::time::Duration) {
        if let (Some(until), Some(by)) = (&mut self.held_until, self.hold_ends_by) {
            *until = (*until).max(now + wait).min(by);
        }
    }

    /// Ends the hold (see [`RouterLink::hold_until`]): the deliveries held
    /// come first.
    pub fn release(&mut self, why: &'static str) {
        if self.held_until.take().is_some() {
            tracing::debug!(
                client_id = self.client_id,
                why,
                held = self.held.len(),
                "clustering: the router's deliveries go out"
            );
        }
    }

    /// Holds `forward` (see [`RouterLink::hold_until`]).
    fn hold(&mut self, forward: Notification) {
        self.held.push_back(forward);
        if self.held.len() >= MAX_HELD {
            self.release("too many deliveries held");
        }
    }

    /// QoS 2 deliveries ask `before_sending` before they go (see
    /// [`super::ask_first`]).
    pub fn ask_before_sending(&mut self, before_sending: Option<BeforeSending>) {
        self.ask_first = before_sending.map(AskFirst::new);
    }

    /// The next notification from the router; never, without a link (nor
    /// a delivery while held, see [`RouterLink::hold_until`]). `Ok(None)`:
    /// nothing yet (a wake-up that found nothing to give).
    pub async fn next(&mut self) -> Result<Option<Notification>, LinkError> {
        loop {
            let Some(until) = self.held_until else {
                if let Some(held) = self.held.pop_front() {
                    return Ok(Some(held));
                }
                return self.read().await;
            };
            let read = tokio::select! {
                read = self.read() => read,
                () = tokio::time::sleep_until(until) => {
                    self.release("the session's previous node did not hand over in time");
                    continue;
                }
            };
            match read {
                Ok(Some(forward @ Notification::Forward(_))) => self.hold(forward),
                other => return other,
            }
        }
    }

    /// Whether [`RouterLink::next`] may ever give anything: not before the
    /// connection joins the router, unless a hold is on or holds something.
    pub fn may_notify(&self) -> bool {
        self.link.is_some() || self.held_until.is_some() || !self.held.is_empty()
    }

    /// The next notification from the router (see [`RouterLink::next`]),
    /// hold or not.
    async fn read(&mut self) -> Result<Option<Notification>, LinkError> {
        let Some((_, rx)) = &mut self.link else {
            return std::future::pending().await;
        };
        let _done = self.wake.until_dropped();
        let wake = &self.wake;
        match &mut self.ask_first {
            // Only this and `read_ready` (which resets it) take from `rx`:
            // it is looked at again once it woke. (What `ask_first` waits
            // for wakes the task itself, so it is looked at every time.)
            None => {
                std::future::poll_fn(|cx| wake.poll_when_woken(cx, |cx| rx.poll_next(cx))).await
            }
            Some(ask_first) => {
                let client = &self.client_id;
                std::future::poll_fn(|cx| {
                    ask_first.poll_next(client, cx, |cx| wake.poll_with(cx, |cx| rx.poll_next(cx)))
                })
                .await
            }
        }
    }

    /// The next notification if the router has one ready now (nor a
    /// delivery while held, see [`RouterLink::hold_until`]).
    pub fn next_ready(&mut self) -> Option<Notification> {
        if self.held_until.is_some() || !self.held.is_empty() {
            return self.next_ready_held();
        }
        self.read_ready()
    }

    /// [`RouterLink::next_ready`] while the hold lasts or what it held
    /// goes.
    #[inline(never)]
    fn next_ready_held(&mut self) -> Option<Notification> {
        loop {
            if self.held_until.is_none() {
                return self.held.pop_front().or_else(|| self.read_ready());
            }
            match self.read_ready()? {
                forward @ Notification::Forward(_) => self.hold(forward),
                other => return Some(other),
            }
        }
    }

    /// The next notification if the router has one ready now, hold or not.
    fn read_ready(&mut self) -> Option<Notification> {
        let (_, rx) = self.link.as_mut()?;
        // A trigger it takes woke the link's waker when it came, so the
        // next look would happen anyway; it is not left to that.
        self.wake.looked_elsewhere();
        if let Some(ask_first) = &mut self.ask_first {
            return ask_first.next_ready(&self.client_id, rx);
        }
        rx.try_next().ok().flatten()
    }

    /// Tells the router this connection wants to be scheduled again (after
    /// it said `Unschedule`).
    pub async fn wake(&self) -> Result<(), LinkFailure> {
        match &self.link {
            Some((_, rx)) => rx.wake().await.map_err(|_| LinkFailure::Closed),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests;
