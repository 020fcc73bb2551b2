//! The state store service: the store inside the broker.
//!
//! Connection tasks hand it requests directly (no network hop, and no trip
//! through the router, so a request can never be lost between router and
//! store). It runs them against the [`statestore::Store`] and delivers the
//! response to the caller's Response Topic and notifications to watchers, at
//! QoS 1: straight to the connection that is their only recipient (see
//! [`crate::sessions`]), and otherwise into the router through the service's
//! own in-process link, to travel like any other message: to whoever
//! subscribes, at the subscriber's QoS, kept for persistent sessions.
//!
//! It also owns the expiry timer: a task that sleeps until the store's next
//! expiry and publishes the DELETE notifications of what expired.
//!
//! With persistence, the durable changes of a request are queued to the
//! [`Persistence`] writer while the store is still locked (so they reach the
//! disk in the order they happened), and the answer waits until everything
//! queued before it is durable (see [`crate::persistence`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use parking_lot::Mutex;
use rumqttd::Notification;
use rumqttd::local::{LinkRx, LinkTx};
use rumqttd::protocol::{LastWill, LastWillProperties, Packet, Publish, PublishProperties, QoS};
use statestore::persist::Write;
use statestore::{Caller, Outcome, Request, Store};
use tokio::sync::Notify;

use crate::codec;
use crate::persistence::{Loaded, Persistence};
use crate::router::{INTERNAL_PREFIX, Router, poll_once};
use crate::sessions::{Direct, Sessions};
use crate::topics;

/// Content type of every state store payload.
pub const CONTENT_TYPE: &str = "application/octet-stream";

/// The broker's wall clock, milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Where a response goes.
#[derive(Debug, Clone)]
pub struct ReplyTo {
    /// The request's Response Topic.
    pub topic: String,
    /// The request's Correlation Data.
    pub correlation: Option<Bytes>,
}

/// Publishes into the router as the broker itself.
struct Publisher {
    tx: LinkTx,
    next_pkid: u16,
}

impl Publisher {
    fn next_pkid(&mut self) -> u16 {
        self.next_pkid = self.next_pkid.checked_add(1).unwrap_or(1);
        self.next_pkid
    }

    /// Hands `packets` to the router with one wake-up.
    fn send(&mut self, mut packets: Vec<Packet>) {
        let Some(last) = packets.pop() else { return };
        self.tx.buffer().extend(packets);
        // `LinkTx::send` is an async fn that never awaits: it completes on its first poll.
        match poll_once(self.tx.send(last)) {
            Some(Ok(_)) => {}
            Some(Err(e)) => tracing::error!(error = %e, "router link failed: cannot publish"),
            None => tracing::error!("router link did not accept a publish"),
        }
    }
}

/// The state store, served in process.
pub struct StateStoreService {
    store: Mutex<Store>,
    publisher: Mutex<Publisher>,
    node_id: String,
    /// Wakes the expiry task when an earlier expiry appears.
    expiry_changed: Notify,
    /// The expiry time the expiry task sleeps until (u64::MAX: none).
    expiry_armed: AtomicU64,
    persistence: Option<Persistence>,
    sessions: Arc<Sessions>,
}

/// Where a response goes, and who asked.
#[derive(Debug, Clone)]
struct Reply {
    to: ReplyTo,
    requester: String,
}

impl StateStoreService {
    /// Starts the service on `router`; with `persistence`, the store starts
    /// from what was on disk.
    pub async fn start(
        router: &Router,
        config: statestore::Config,
        persistence: Option<(Persistence, Loaded)>,
        sessions: Arc<Sessions>,
    ) -> std::io::Result<Arc<StateStoreService>> {
        let (tx, rx, _connack) = router
            .link_async(format!("{INTERNAL_PREFIX}store"), true)
            .await
            .map_err(|e| {
                std::io::Error::other(format!("cannot link the state store to the router: {e}"))
            })?;
        let node_id = config.node_id.clone();
        let (store, persistence) = match persistence {
            None => (Store::new(config), None),
            Some((persistence, loaded)) => {
                let started = std::time::Instant::now();
                let (store, restored) =
                    Store::restore(config, loaded.records, loaded.clock_mark, now_ms());
                tracing::info!(
                    keys = restored.keys,
                    expired_while_down = restored.expired.len(),
                    unreadable = loaded.corrupt,
                    read_ms = loaded.elapsed.as_millis() as u64,
                    restore_ms = started.elapsed().as_millis() as u64,
                    "restored persisted keys"
                );
                if !restored.expired.is_empty() {
                    persistence.submit(restored.expired.into_iter().map(Write::Delete).collect());
                }
                (store, Some(persistence))
            }
        };
        let service = Arc::new(StateStoreService {
            node_id,
            store: Mutex::new(store),
            publisher: Mutex::new(Publisher { tx, next_pkid: 0 }),
            expiry_changed: Notify::new(),
            expiry_armed: AtomicU64::new(u64::MAX),
            persistence,
            sessions,
        });
        tokio::spawn(drain_acks(rx));
        tokio::spawn(expiry_task(Arc::downgrade(&service)));
        Ok(service)
    }

    /// Serves one request from `caller` and publishes the answer to
    /// `reply_to`, once what it could have observed is durable.
    pub fn serve(self: &Arc<Self>, request: &Request<'_>, caller: Caller<'_>, reply_to: ReplyTo) {
        let (outcome, wait) = {
            let mut store = self.store.lock();
            let mut outcome = store.execute(request, caller, now_ms());
            self.rearm_expiry(store.next_expiry());
            let wait = self.persist(std::mem::take(&mut outcome.writes));
            (outcome, wait)
        };
        if let Some(error) = outcome.error {
            tracing::debug!(client_id = caller.client_id, command = outcome.command, %error, "request refused");
        }
        let reply = Reply {
            to: reply_to,
            requester: caller.client_id.to_owned(),
        };
        self.publish_when_durable(Some(reply), outcome, wait);
    }

    /// Queues durable writes (call with the store locked); returns the batch
    /// an answer given now must wait for.
    fn persist(&self, writes: Vec<Write>) -> u64 {
        let Some(persistence) = &self.persistence else {
            return 0;
        };
        if !writes.is_empty() {
            persistence.submit(writes);
        }
        persistence.submitted()
    }

    fn publish_when_durable(self: &Arc<Self>, reply: Option<Reply>, outcome: Outcome, wait: u64) {
        match &self.persistence {
            Some(persistence) if !persistence.is_durable(wait) => {
                let service = Arc::clone(self);
                tokio::spawn(async move {
                    if let Some(persistence) = &service.persistence {
                        persistence.wait_durable(wait).await;
                    }
                    service.publish_outcome(reply, outcome);
                });
            }
            _ => self.publish_outcome(reply, outcome),
        }
    }

    /// Writes and syncs what is queued and closes the storage engine.
    pub fn close(&self) {
        if let Some(persistence) = &self.persistence {
            persistence.close();
        }
    }

    /// Answers a request the broker refused before it reached the store.
    pub fn refuse(&self, reply_to: ReplyTo, requester: &str, text: &str) {
        let timestamp = statestore::hlc::Version {
            wall_ms: now_ms(),
            counter: 0,
        }
        .format(&self.node_id);
        let reply = Reply {
            to: reply_to,
            requester: requester.to_owned(),
        };
        self.deliver_response(reply, format!("-ERR {text}\r\n").into_bytes(), timestamp);
    }

    /// Delivers the response and the notifications of an outcome.
    fn publish_outcome(&self, reply: Option<Reply>, outcome: Outcome) {
        if let Some(reply) = reply {
            self.deliver_response(reply, outcome.payload, outcome.timestamp);
        }
        for notice in &outcome.notices {
            let payload = Bytes::from(notice.payload());
            for watcher in &notice.watchers {
                let message = Direct {
                    topic: Bytes::from(topics::notification_topic(watcher, &notice.key)),
                    payload: payload.clone(),
                    properties: PublishProperties {
                        content_type: Some(CONTENT_TYPE.to_owned()),
                        user_properties: vec![
                            ("__ts".to_owned(), notice.version.clone()),
                            ("__protVer".to_owned(), "1.0".to_owned()),
                        ],
                        ..PublishProperties::default()
                    },
                    qos: 1,
                };
                // A notification is private to its watcher: if the watcher's
                // connection cannot take it, nobody gets it.
                if let Err(message) = self.sessions.deliver(watcher, message) {
                    tracing::debug!(
                        client_id = %watcher,
                        topic = %String::from_utf8_lossy(&message.topic),
                        "notification dropped: watcher not connected or not subscribed"
                    );
                }
            }
        }
    }

    /// Delivers a response straight to the requester when it is the only
    /// subscriber of the Response Topic, through the router otherwise.
    fn deliver_response(&self, reply: Reply, payload: Vec<u8>, timestamp: String) {
        let direct = self
            .sessions
            .only_subscriber(&reply.requester, &reply.to.topic);
        let message = Direct {
            topic: Bytes::from(reply.to.topic),
            payload: Bytes::from(payload),
            properties: PublishProperties {
                correlation_data: reply.to.correlation,
                content_type: Some(CONTENT_TYPE.to_owned()),
                user_properties: vec![
                    ("__stat".to_owned(), "200".to_owned()),
                    ("__ts".to_owned(), timestamp),
                    ("__protVer".to_owned(), "1.0".to_owned()),
                ],
                ..PublishProperties::default()
            },
            qos: 1,
        };
        let message = if direct {
            match self.sessions.deliver(&reply.requester, message) {
                Ok(()) => return,
                Err(message) => *message,
            }
        } else {
            message
        };
        self.route(vec![message]);
    }

    /// Publishes through the router, as the broker, at QoS 1 (QoS 0 stays 0).
    fn route(&self, messages: Vec<Direct>) {
        if messages.is_empty() {
            return;
        }
        let mut publisher = self.publisher.lock();
        let packets = messages
            .into_iter()
            .map(|m| {
                let pkid = if m.qos == 0 { 0 } else { publisher.next_pkid() };
                let publish = codec::publish(&m.topic, &m.payload, m.qos.min(1), pkid, false);
                Packet::Publish(publish, Some(m.properties))
            })
            .collect();
        publisher.send(packets);
    }

    /// Hands messages that a connection delivered directly, but that were
    /// not acknowledged when it ended, to the router, which keeps them for
    /// the client's persistent session.
    pub fn redeliver_later(&self, mut messages: Vec<Direct>) {
        for m in &mut messages {
            m.properties.subscription_identifiers.clear();
            m.qos = 1;
        }
        self.route(messages);
    }

    /// Drops the KEYNOTIFY registrations of a connection that ended.
    pub fn connection_closed(&self, client_id: &str, connection: u64) {
        let dropped = self.store.lock().connection_closed(client_id, connection);
        if dropped > 0 {
            tracing::debug!(
                client_id,
                connection,
                dropped,
                "KEYNOTIFY registrations removed"
            );
        }
    }

    /// Publishes a client's Last Will. QoS 2 wills are delivered at QoS 1
    /// at most.
    pub fn publish_will(&self, will: LastWill, properties: Option<LastWillProperties>) {
        let mut publisher = self.publisher.lock();
        let publish = match will.qos {
            QoS::AtMostOnce => Publish::new(will.topic.clone(), will.message.clone(), will.retain),
            _ => codec::publish(
                &will.topic,
                &will.message,
                1,
                publisher.next_pkid(),
                will.retain,
            ),
        };
        let properties = properties.map(|p| PublishProperties {
            payload_format_indicator: p.payload_format_indicator,
            message_expiry_interval: p.message_expiry_interval,
            content_type: p.content_type,
            response_topic: p.response_topic,
            correlation_data: p.correlation_data,
            user_properties: p.user_properties,
            ..PublishProperties::default()
        });
        publisher.send(vec![Packet::Publish(publish, properties)]);
    }

    /// Runs `f` on the store (for tests and tools).
    pub fn with_store<R>(&self, f: impl FnOnce(&mut Store) -> R) -> R {
        f(&mut self.store.lock())
    }

    fn rearm_expiry(&self, next: Option<u64>) {
        let next = next.unwrap_or(u64::MAX);
        if next < self.expiry_armed.load(Ordering::Relaxed) {
            self.expiry_changed.notify_one();
        }
    }

    /// Expires what is due and publishes the notifications; returns the next expiry.
    fn expire_now(self: &Arc<Self>) -> Option<u64> {
        let (fx, next, wait) = {
            let mut store = self.store.lock();
            let mut fx = store.expire(now_ms());
            let wait = self.persist(std::mem::take(&mut fx.writes));
            (fx, store.next_expiry(), wait)
        };
        if !fx.notices.is_empty() {
            let outcome = Outcome {
                payload: Vec::new(),
                timestamp: String::new(),
                notices: fx.notices,
                writes: Vec::new(),
                command: None,
                error: None,
            };
            self.publish_when_durable(None, outcome, wait);
        }
        next
    }
}

/// The router acknowledges the service's QoS 1 publishes; nothing to do with them.
async fn drain_acks(mut rx: LinkRx) {
    loop {
        match rx.next().await {
            Ok(Some(Notification::Unschedule)) => {
                if rx.wake().await.is_err() {
                    break;
                }
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    tracing::debug!("state store link closed");
}

/// Sleeps until the next expiry, expires, repeats; woken early by
/// [`StateStoreService::rearm_expiry`].
async fn expiry_task(service: std::sync::Weak<StateStoreService>) {
    let mut next = None;
    loop {
        let Some(svc) = service.upgrade() else { return };
        svc.expiry_armed
            .store(next.unwrap_or(u64::MAX), Ordering::Relaxed);
        // Sleep at most a second at a time, so a stopped broker's service is
        // dropped promptly.
        let wait = next.map_or(Duration::from_secs(1), |at: u64| {
            Duration::from_millis(at.saturating_sub(now_ms())).min(Duration::from_secs(1))
        });
        tokio::select! {
            () = svc.expiry_changed.notified() => {}
            () = tokio::time::sleep(wait) => {}
        }
        next = svc.expire_now();
    }
}
