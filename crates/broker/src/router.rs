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

/// Links the broker needs besides client connections.
pub const INTERNAL_LINKS: usize = 4;

/// The router did not register a link (it is full, or it refused the client id).
#[derive(Debug, Clone, thiserror::Error)]
#[error("router refused the link: {0}")]
pub struct LinkRefused(String);

/// A registered link: what to send, what to receive, and the router's CONNACK.
pub type Link = (LinkTx, LinkRx, Notification);

type Factory = dyn Fn(&str, bool) -> Result<Link, LinkRefused> + Send + Sync;

/// A handle to a running router.
#[derive(Clone)]
pub struct Router {
    factory: Arc<Factory>,
}

impl Router {
    /// Starts a router on its own thread. `config.max_connections` counts
    /// client connections; room for the broker's own links is added.
    pub fn spawn(id: usize, mut config: RouterConfig) -> Router {
        config.max_connections += INTERNAL_LINKS;
        let router_tx = rumqttd::Router::new(id, config).spawn();
        let factory = move |client_id: &str, clean_session: bool| {
            LinkBuilder::new(client_id, router_tx.clone())
                .clean_session(clean_session)
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
        }
    }

    /// Registers a connection with the router and returns its link and the
    /// router's CONNACK. Blocks until the router answers (it runs on its own
    /// thread), so async callers use [`Router::link_async`].
    pub fn link(&self, client_id: &str, clean_session: bool) -> Result<Link, LinkRefused> {
        (self.factory)(client_id, clean_session)
    }

    /// [`Router::link`] off the async worker threads.
    pub async fn link_async(
        &self,
        client_id: String,
        clean_session: bool,
    ) -> Result<Link, LinkRefused> {
        let router = self.clone();
        match tokio::task::spawn_blocking(move || router.link(&client_id, clean_session)).await {
            Ok(result) => result,
            Err(e) => Err(LinkRefused(e.to_string())),
        }
    }
}

/// Polls `future` once. rumqttd's `LinkTx::send` is an `async fn` that never
/// awaits (it completes on its first poll), and `LinkRx::next` is ready at
/// once while its batch lasts: this takes their result without a trip
/// through the scheduler, and `None` where there is none yet.
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
