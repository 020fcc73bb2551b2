//! The rumqttd router, and how links to it are made.
//!
//! rumqttd's router runs on its own thread and does routing, subscriptions,
//! QoS bookkeeping, sessions, retained messages and shared subscriptions. We
//! talk to it only through `rumqttd::local` links, one per client connection
//! plus one for the state store service. The router's channel type cannot be
//! named outside rumqttd, so the sender lives inside a closure.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use rumqttd::local::{LinkBuilder, LinkRx, LinkTx};
use rumqttd::{Notification, RouterConfig};

/// Client ids with this prefix belong to the broker itself; clients may not use them.
pub const INTERNAL_PREFIX: &str = "statebroker:";

/// Links the broker needs besides client connections: the publisher's.
pub const INTERNAL_LINKS: usize = 1;

/// rumqttd numbers the publishes it sends a client `1..=100` (its private
/// `MAX_INFLIGHT`): the broker's direct deliveries use the ids above. A test
/// below fails if a rumqttd release changes it.
pub const ROUTER_MAX_PKID: u16 = 100;

/// The router did not register a link (it is full, or it refused the client id).
#[derive(Debug, Clone, thiserror::Error)]
#[error("router refused the link: {0}")]
pub struct LinkRefused(String);

/// A registered link: what to send, what to receive, and the router's CONNACK.
pub type Link = (LinkTx, LinkRx, Notification);

type Factory = dyn Fn(&str, bool, u32) -> Result<Link, LinkRefused> + Send + Sync;

/// A handle to a running router.
#[derive(Clone)]
pub struct Router {
    factory: Arc<Factory>,
    /// Retained messages the router holds (rumqttd patch 14).
    retained: Arc<std::sync::atomic::AtomicUsize>,
}

impl Router {
    /// Starts a router on its own thread. `config.max_connections` counts
    /// client connections; room for the broker's own links is added.
    pub fn spawn(id: usize, mut config: RouterConfig) -> Router {
        config.max_connections += INTERNAL_LINKS;
        let router = rumqttd::Router::new(id, config);
        let retained = router.retained_count();
        let router_tx = router.spawn();
        let factory = move |client_id: &str, clean_start: bool, session_expiry: u32| {
            LinkBuilder::new(client_id, router_tx.clone())
                .clean_session(clean_start)
                .session_expiry(session_expiry)
                // A publish to a topic nobody subscribes to is fine (rumqttd
                // would otherwise disconnect the publisher).
                .dynamic_filters(true)
                // No broker-side topic aliases: delivery checks need topics.
                .topic_alias_max(0)
                .build()
                .map_err(|e| LinkRefused(e.to_string()))
        };
        Router {
            factory: Arc::new(factory),
            retained,
        }
    }

    /// How many retained messages the router holds now.
    pub fn retained_messages(&self) -> usize {
        self.retained.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Registers a connection with the router and returns its link and the
    /// router's CONNACK. Blocks until the router answers (it runs on its own
    /// thread), so async callers use [`Router::link_async`].
    /// `clean_start`: discard a session the router keeps for `client_id`;
    /// `session_expiry`: seconds the router keeps this session after the
    /// link ends (0: not at all, `u32::MAX`: for ever).
    pub fn link(
        &self,
        client_id: &str,
        clean_start: bool,
        session_expiry: u32,
    ) -> Result<Link, LinkRefused> {
        (self.factory)(client_id, clean_start, session_expiry)
    }

    /// [`Router::link`] off the async worker threads.
    pub async fn link_async(
        &self,
        client_id: String,
        clean_start: bool,
        session_expiry: u32,
    ) -> Result<Link, LinkRefused> {
        let router = self.clone();
        let link = move || router.link(&client_id, clean_start, session_expiry);
        match tokio::task::spawn_blocking(link).await {
            Ok(result) => result,
            Err(e) => Err(LinkRefused(e.to_string())),
        }
    }
}

/// Polls `future` once. rumqttd's `LinkTx::send` is an `async fn` that never
/// awaits (it completes on its first poll), and `LinkRx::next` is ready at
/// once while its batch lasts: this takes their result without a trip
/// through the scheduler, and `None` where there is none yet. A test below
/// fails if `LinkTx::send` ever returns `Pending`.
pub(crate) fn poll_once<F: Future>(future: F) -> Option<F::Output> {
    let mut future = pin!(future);
    match future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(output) => Some(output),
        Poll::Pending => None,
    }
}

/// Assumptions about rumqttd's private behaviour that the broker relies on;
/// each fails loudly if a rumqttd release changes it.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec;
    use rumqttd::protocol::{
        Filter, Packet, PubAck, PubAckReason, QoS, RetainForwardRule, Subscribe,
    };

    fn router() -> Router {
        let config = RouterConfig {
            max_connections: 10,
            max_outgoing_packet_count: 200,
            max_segment_size: 1 << 20,
            max_segment_count: 4,
            ..RouterConfig::default()
        };
        Router::spawn(0, config)
    }

    /// Collects forwarded publishes' packet ids until `count` arrived or
    /// nothing more comes for a while.
    async fn forwarded(rx: &mut LinkRx, count: usize) -> Vec<u16> {
        let mut pkids = Vec::new();
        while pkids.len() < count {
            let next = tokio::time::timeout(std::time::Duration::from_millis(300), rx.next());
            match next.await {
                Ok(Ok(Some(Notification::Forward(f)))) => {
                    let mut buf = bytes::BytesMut::new();
                    codec::Protocol::V5
                        .write(Packet::Publish(f.publish, None), &mut buf)
                        .unwrap();
                    pkids.push(codec::encoded_publish_id(&buf).unwrap().1);
                }
                Ok(Ok(Some(Notification::Unschedule))) => rx.wake().await.unwrap(),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => panic!("{e}"),
                Err(_) => break,
            }
        }
        pkids
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_router_numbers_deliveries_within_its_range_and_send_never_waits() {
        let router = router();
        let (mut sub_tx, mut sub_rx, _) = router.link_async("sub".into(), true, 0).await.unwrap();
        let subscribe = Subscribe {
            pkid: 1,
            filters: vec![Filter {
                path: "t".into(),
                qos: QoS::AtLeastOnce,
                nolocal: false,
                preserve_retain: false,
                retain_forward_rule: RetainForwardRule::OnEverySubscribe,
            }],
        };
        assert!(poll_once(sub_tx.send(Packet::Subscribe(subscribe, None))).is_some());
        // The SUBACK.
        loop {
            if let Ok(Some(Notification::DeviceAck(_))) = sub_rx.next().await {
                break;
            }
        }
        let (mut pub_tx, _pub_rx, _) = router.link_async("pub".into(), true, 0).await.unwrap();
        let total = usize::from(ROUTER_MAX_PKID) + 50;
        for n in 0..total {
            let publish = codec::publish(b"t", b"x", 1, (n % 60000 + 1) as u16, false);
            let sent = poll_once(pub_tx.send(Packet::Publish(publish, None)));
            assert!(
                matches!(sent, Some(Ok(_))),
                "LinkTx::send did not complete on its first poll"
            );
        }
        let first = forwarded(&mut sub_rx, total).await;
        assert_eq!(
            first,
            (1..=ROUTER_MAX_PKID).collect::<Vec<_>>(),
            "rumqttd sends 1..=ROUTER_MAX_PKID before it waits for acknowledgements"
        );
        // Acknowledge them all: the rest come, numbered from 1 again.
        for pkid in first {
            let ack = PubAck {
                pkid,
                reason: PubAckReason::Success,
            };
            assert!(poll_once(sub_tx.send(Packet::PubAck(ack, None))).is_some());
        }
        let rest = forwarded(&mut sub_rx, 50).await;
        assert_eq!(rest.len(), 50);
        assert!(
            rest.iter().all(|&p| (1..=ROUTER_MAX_PKID).contains(&p)),
            "{rest:?}"
        );
    }
}
