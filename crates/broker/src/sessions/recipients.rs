//! Direct delivery: a message straight to one client's connection, at what
//! its subscriptions grant (the router's [`router::Subscriptions`] says), and
//! whether a client is a topic's only subscriber.

use super::{Direct, Mailbox, Sessions, ToConnection, Undelivered};

impl Sessions {
    /// Delivers to `client` if it is connected and one of its subscriptions
    /// matches the message's topic, at the smaller of the message's QoS and
    /// the subscription's. Returns `Err` with the message when it could not
    /// be delivered, or that it was dropped because the client's queue is
    /// full.
    pub fn deliver(&self, client: &str, message: Direct) -> Result<(), Undelivered> {
        let grant = router::protocol::mqtt_str(&message.topic)
            .and_then(|topic| self.subscriptions.granted(client, topic));
        self.deliver_granted(client, message, grant)
    }

    /// Delivers `message`, handed over from the node `client`'s session
    /// was on (or read back from etcd for it), to `client` alone: now if
    /// it is connected, otherwise kept for the session's next connection
    /// (see [`Sessions::keep_handed_over`]); dropped, with a WARN, if its
    /// queue is full.
    pub fn deliver_handed_over(&self, client: &str, message: Direct) {
        match self.deliver(client, message) {
            Ok(()) => {}
            // Not connected now: for the session's next connection.
            Err(Undelivered::NoRecipient(message)) => {
                self.keep_handed_over(client, vec![*message]);
            }
            Err(Undelivered::Overflow) => tracing::warn!(
                client_id = client,
                "clustering: a message handed over from the session's previous node is lost: the client's queue is full"
            ),
        }
    }

    /// Delivers to `client` if it is the only subscriber of the message's
    /// topic (and connected, and its queue has room); otherwise gives it
    /// back (see [`Sessions::deliver`]).
    pub fn deliver_to_only_subscriber(
        &self,
        client: &str,
        message: Direct,
    ) -> Result<(), Undelivered> {
        let grant = router::protocol::mqtt_str(&message.topic)
            .and_then(|topic| self.subscriptions.sole_grant(client, topic));
        self.deliver_granted(client, message, grant)
    }

    /// Delivers to `client`'s connection at what its subscriptions
    /// `grant` (none: no recipient).
    fn deliver_granted(
        &self,
        client: &str,
        message: Direct,
        grant: Option<(u8, Vec<usize>)>,
    ) -> Result<(), Undelivered> {
        let no_recipient = |message| Err(Undelivered::NoRecipient(Box::new(message)));
        let Some((granted, ids)) = grant else {
            return no_recipient(message);
        };
        let clients = self.clients.read();
        let Some(live) = clients.get(client).and_then(|c| c.live.as_ref()) else {
            return no_recipient(message);
        };
        send(&live.mailbox, message, granted, ids)
    }
}

/// The QoS a direct delivery at `qos` goes at under a subscription that
/// grants `granted`: the broker's own deliveries go at QoS 1 at most; a
/// QoS 2 message handed over in flight (`kept`: under its kept packet id)
/// keeps QoS 2 while the client's subscriptions still grant it.
pub(super) fn granted_qos(qos: u8, granted: u8, kept: bool) -> u8 {
    qos.min(granted).min(if kept { 2 } else { 1 })
}

/// `message` as a subscription grants it: at QoS `granted` at most, with
/// the subscription identifiers `ids`.
pub(super) fn grant(message: &mut Direct, granted: u8, ids: Vec<usize>) {
    message.qos = granted_qos(message.qos, granted, message.kept_pkid.is_some());
    if message.qos < 2 {
        message.kept_pkid = None;
    }
    message.properties.set_subscription_identifiers(ids);
}

/// Sends `message` on `mailbox` at what a subscription grants (`granted`,
/// with its subscription identifiers `ids`), within the mailbox's bound.
pub(super) fn send(
    mailbox: &Mailbox,
    mut message: Direct,
    granted: u8,
    ids: Vec<usize>,
) -> Result<(), Undelivered> {
    grant(&mut message, granted, ids);
    let Mailbox { tx, bound } = mailbox;
    let size = message.size();
    if !bound.reserve(size) {
        crate::metrics::dropped(crate::metrics::DropReason::QueueFull, 1);
        if bound.overflow_once() {
            let _ = tx.send(ToConnection::Overflow);
        }
        return Err(Undelivered::Overflow);
    }
    match tx.send(ToConnection::Deliver(Box::new(message))) {
        Err(tokio::sync::mpsc::error::SendError(ToConnection::Deliver(message))) => {
            bound.release(size);
            Err(Undelivered::NoRecipient(message))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::sync::Arc;

    use bytes::Bytes;
    use tokio::sync::mpsc;

    use super::*;
    use crate::sessions::QueueBound;
    use crate::sessions::tests::{mailbox, peer};

    /// A message on `resp/a`.
    pub(in crate::sessions) fn msg() -> Direct {
        Direct::qos1(b"resp/a", Bytes::new())
    }

    /// A router whose subscriptions the tests set up through real links.
    pub(in crate::sessions) fn router() -> router::RouterHandle {
        let config = router::RouterConfig {
            max_connections: 10,
            max_segment_size: 1 << 20,
            max_segment_count: 2,
            max_outgoing_packet_count: 10,
            ..router::RouterConfig::default()
        };
        router::RouterHandle::spawn(0, config, 0, None)
    }

    /// `client` subscribes to `filter` at `qos` with identifier `id`, on a
    /// link of its own (kept open: the subscription lives with it).
    pub(in crate::sessions) async fn subscribe(
        router: &router::RouterHandle,
        client: &str,
        filter: &str,
        qos: u8,
        id: Option<usize>,
    ) -> router::Link {
        use router::protocol::{Filter, Packet, RetainForwardRule, Subscribe, SubscribeProperties};
        let (mut tx, mut rx, connack) = router.link(client, true, 0, None).await.unwrap();
        let subscribe = Subscribe {
            pkid: 1,
            filters: vec![Filter {
                path: filter.into(),
                qos: router::protocol::qos(qos).unwrap(),
                nolocal: false,
                preserve_retain: false,
                retain_forward_rule: RetainForwardRule::OnEverySubscribe,
            }],
        };
        let properties = id.map(|id| SubscribeProperties {
            id: Some(id),
            user_properties: Vec::new(),
        });
        tx.send_all([Packet::Subscribe(subscribe, properties)])
            .unwrap();
        // The SUBACK: the router has applied it.
        loop {
            if let Ok(Some(router::Notification::DeviceAck(_))) = rx.next().await {
                break;
            }
        }
        (tx, rx, connack)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn delivers_only_to_live_matching_subscribers() {
        let router = router();
        let s = Sessions::new(Arc::clone(router.subscriptions()));
        let (tx, mut rx) = mpsc::unbounded_channel();
        assert!(s.deliver("a", msg()).is_err(), "unknown client");
        s.connected("a", 1, false, mailbox(tx), peer());
        assert!(s.deliver("a", msg()).is_err(), "no subscription");
        let _link = subscribe(&router, "a", "resp/+", 0, Some(7)).await;
        s.deliver("a", msg()).unwrap();
        let Ok(ToConnection::Deliver(got)) = rx.try_recv() else {
            panic!("not delivered")
        };
        assert_eq!(
            (got.qos, got.properties.subscription_identifiers().to_vec()),
            (0, vec![7]),
            "QoS capped by the subscription, with its identifier"
        );
        assert!(s.deliver_to_only_subscriber("a", msg()).is_ok());
        let _spy = subscribe(&router, "spy", "#", 0, None).await;
        assert!(
            s.deliver_to_only_subscriber("a", msg()).is_err(),
            "the router knows the spy"
        );
        assert!(
            s.deliver("a", msg()).is_ok(),
            "delivered to it all the same"
        );
        s.disconnected("a", 1, 0);
        assert!(s.deliver("a", msg()).is_err(), "not connected");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_queue_drops_and_tells_the_connection_once() {
        let router = router();
        let s = Sessions::new(Arc::clone(router.subscriptions()));
        let (tx, mut rx) = mpsc::unbounded_channel();
        let bound = QueueBound::new(2, 1000);
        s.connected("q", 1, false, Mailbox::new(tx, Arc::clone(&bound)), peer());
        let _link = subscribe(&router, "q", "resp/+", 1, None).await;
        s.deliver("q", msg()).unwrap();
        s.deliver("q", msg()).unwrap();
        assert!(matches!(s.deliver("q", msg()), Err(Undelivered::Overflow)));
        assert!(matches!(s.deliver("q", msg()), Err(Undelivered::Overflow)));
        let received: Vec<_> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
        assert_eq!(received.len(), 3, "two deliveries and one overflow notice");
        assert!(matches!(received[2], ToConnection::Overflow));
        assert_eq!(bound.held(), (2, 2 * msg().size()));
        bound.release(msg().size());
        assert_eq!(bound.held(), (1, msg().size()));
        // Bytes count too.
        let big = QueueBound::new(100, 10);
        assert!(big.reserve(10));
        assert!(!big.reserve(1));
    }
}
