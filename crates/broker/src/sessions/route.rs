//! Answer routes: the way a state store answer on one Response Topic
//! reaches its requester, kept by the requesting connection from one
//! request to the next.
//!
//! Every answer asks who gets it: whether the requester is the only
//! subscriber of its Response Topic, at what QoS (the router's index: two
//! SipHash look-ups of the topic and the client id, and the wildcard
//! filters' candidates), and which connection is the client's live one
//! (one more look-up). The answer is the same as the last one on that
//! topic until someone subscribes or unsubscribes, or a connection of
//! the client comes or goes: a [`Route`] keeps it with the two counts of
//! those changes ([`router::Subscriptions::changes`] and the sessions'
//! own), read before it was made, and holds while they stay the same.
//! A route that no longer holds is not used: the answer goes the way it
//! always did ([`Sessions::deliver_to_only_subscriber`]).

use std::sync::atomic::Ordering;

use bytes::Bytes;

use super::recipients::{granted_qos, send};
use super::{Answer, Direct, Mailbox, Sessions, Undelivered};

/// The way to one client's live connection for answers on one topic of
/// which it is the only subscriber, as it was at the changes `seen`.
#[derive(Debug)]
pub struct Route {
    topic: Bytes,
    seen: (u64, u64),
    granted: u8,
    ids: Vec<usize>,
    mailbox: Mailbox,
}

impl Route {
    /// The topic its answers go on (a request's Response Topic shares it,
    /// see [`crate::store::binding::admit`]).
    pub fn topic(&self) -> &Bytes {
        &self.topic
    }
}

/// Routes are told apart by identity (a [`crate::store::binding::ReplyTo`]
/// carries one).
impl PartialEq for Route {
    fn eq(&self, other: &Route) -> bool {
        std::ptr::eq(self, other)
    }
}

impl Eq for Route {}

impl Sessions {
    /// The way answers on `topic` reach `client`'s connection
    /// `connection`: `None` unless `client` is the topic's only subscriber
    /// and that connection is its live one.
    pub fn route(&self, client: &str, connection: u64, topic: &[u8]) -> Option<Route> {
        // Read before looking: a change made meanwhile counts after it.
        let seen = self.changes();
        let (granted, ids) = router::protocol::mqtt_str(topic)
            .and_then(|text| self.subscriptions.sole_grant(client, text))?;
        let clients = self.clients.read();
        let live = clients.get(client)?.live.as_ref()?;
        (live.connection == connection).then(|| Route {
            topic: Bytes::copy_from_slice(topic),
            seen,
            granted,
            ids,
            mailbox: live.mailbox.clone(),
        })
    }

    /// Whether `route` still holds: nobody subscribed or unsubscribed, and
    /// no connection came or went, since it was made.
    pub fn holds(&self, route: &Route) -> bool {
        route.seen == self.changes()
    }

    /// Delivers `message` (an answer to `client`) on `route` if it still
    /// holds and is for the message's topic; otherwise as
    /// [`Sessions::deliver_to_only_subscriber`].
    pub fn deliver_on(
        &self,
        client: &str,
        route: &Route,
        message: Direct,
    ) -> Result<(), Undelivered> {
        if self.holds(route) && message.topic == route.topic {
            send(&route.mailbox, message, route.granted, route.ids.clone())
        } else {
            self.deliver_to_only_subscriber(client, message)
        }
    }

    /// `answer` ready for the connection `route` leads to, to be encoded
    /// by its caller rather than sent through its mailbox: for the
    /// connection's own task, which ran the request (see
    /// `StateStoreService::serve_here`). At the QoS and with the
    /// Subscription Identifiers the route grants, within the connection's
    /// bound, as [`send`]. `false`: the route no longer holds, or is for
    /// another topic, or the bound is reached: deliver it as always.
    // In place: an answer is ~200 bytes, and taken and handed back by
    // value it was copied twice more a request.
    pub fn take_on(&self, route: &Route, answer: &mut Answer) -> bool {
        if !self.holds(route) || answer.topic != route.topic {
            return false;
        }
        answer.qos = granted_qos(answer.qos, route.granted, false);
        answer.subscription_identifiers = route.ids.clone();
        route.mailbox.bound.reserve(answer.size())
    }

    /// The counts of changes a route depends on: the subscriptions', and
    /// the live connections'.
    fn changes(&self) -> (u64, u64) {
        (
            self.subscriptions.changes(),
            self.live_changes.load(Ordering::Acquire),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::sync::mpsc;

    use super::*;
    use crate::sessions::ToConnection;
    use crate::sessions::recipients::tests::{msg, router, subscribe};
    use crate::sessions::tests::{mailbox, peer};

    static FIXED: crate::sessions::FixedProperties =
        crate::sessions::FixedProperties::new("text/plain", &[]);

    /// An answer on `resp/a`.
    fn answer() -> Answer {
        Answer {
            topic: bytes::Bytes::from_static(b"resp/a"),
            payload: Vec::new(),
            fixed: &FIXED,
            correlation_data: None,
            varying: ("__ts", Default::default()),
            qos: 1,
            subscription_identifiers: Vec::new(),
        }
    }

    /// What `rx` has now: the QoS of each delivery.
    fn delivered(rx: &mut mpsc::UnboundedReceiver<ToConnection>) -> Vec<u8> {
        let mut got = Vec::new();
        while let Ok(item) = rx.try_recv() {
            if let ToConnection::Deliver(m) = item {
                got.push(m.qos);
            }
        }
        got
    }

    /// A route is made for the live connection of a topic's only
    /// subscriber and holds until who subscribes, or which connection is
    /// live, changes; one that no longer holds is not used.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_route_holds_until_subscriptions_or_connections_change() {
        let router = router();
        let s = Sessions::new(Arc::clone(router.subscriptions()));
        let (tx, mut rx) = mpsc::unbounded_channel();
        s.connected("a", 1, false, mailbox(tx), peer());
        assert!(s.route("a", 1, b"resp/a").is_none(), "no subscription");
        let _a = subscribe(&router, "a", "resp/a", 1, None).await;
        assert!(
            s.route("a", 2, b"resp/a").is_none(),
            "not its live connection"
        );
        let route = s.route("a", 1, b"resp/a").expect("the only subscriber");
        assert!(s.holds(&route));
        s.deliver_on("a", &route, msg()).unwrap();
        assert_eq!(delivered(&mut rx), [1]);
        // Another message's topic: not on this route (delivered as ever:
        // nobody subscribes to it).
        let mut other = msg();
        other.topic = Bytes::from_static(b"resp/other");
        assert!(s.deliver_on("a", &route, other).is_err());

        // Someone else subscribes: the route no longer holds, and the
        // answer goes through the router (a is not the only subscriber).
        let _b = subscribe(&router, "b", "resp/#", 1, None).await;
        assert!(!s.holds(&route));
        assert!(matches!(
            s.deliver_on("a", &route, msg()),
            Err(Undelivered::NoRecipient(_))
        ));
        assert_eq!(delivered(&mut rx), [] as [u8; 0]);

        // A new route after the change; a new connection of the client
        // (a takeover) ends it, and the answer goes to the new one.
        let (mut b_tx, _, _) = _b;
        let goodbye = router::protocol::Disconnect {
            reason_code: router::protocol::DisconnectReasonCode::NormalDisconnection,
        };
        b_tx.send_all([router::protocol::Packet::Disconnect(goodbye, None)])
            .unwrap();
        let started = std::time::Instant::now();
        let route = loop {
            // b gone: the router ends its session in its own time.
            if let Some(route) = s.route("a", 1, b"resp/a") {
                break route;
            }
            assert!(
                started.elapsed() < std::time::Duration::from_secs(10),
                "b's subscription never went"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        };
        let (tx2, mut rx2) = mpsc::unbounded_channel();
        s.connected("a", 2, true, mailbox(tx2), peer());
        assert!(!s.holds(&route));
        s.deliver_on("a", &route, msg()).unwrap();
        assert!(delivered(&mut rx).is_empty(), "not to the old connection");
        assert_eq!(delivered(&mut rx2), [1]);
    }

    /// An answer taken for the route's connection itself (its own task
    /// ran the request): granted as the route says, counted in the
    /// connection's bound, nothing in its mailbox; refused when the route
    /// no longer holds, or the bound is full.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_answer_taken_on_a_route_counts_in_its_connections_bound() {
        let router = router();
        let s = Sessions::new(Arc::clone(router.subscriptions()));
        let (tx, mut rx) = mpsc::unbounded_channel();
        let bound = crate::sessions::QueueBound::new(1, usize::MAX);
        s.connected("a", 1, false, Mailbox::new(tx, Arc::clone(&bound)), peer());
        let _a = subscribe(&router, "a", "resp/a", 0, None).await;
        let route = s.route("a", 1, b"resp/a").expect("the only subscriber");

        let mut taken = answer();
        assert!(s.take_on(&route, &mut taken), "not taken");
        assert_eq!(taken.qos, 0, "at the subscription's QoS");
        assert!(delivered(&mut rx).is_empty(), "not through the mailbox");
        assert!(!s.take_on(&route, &mut answer()), "the bound is full");
        bound.release(taken.size());
        assert!(s.take_on(&route, &mut answer()));

        let _b = subscribe(&router, "b", "resp/#", 1, None).await;
        assert!(
            !s.take_on(&route, &mut answer()),
            "the route no longer holds"
        );
    }
}
