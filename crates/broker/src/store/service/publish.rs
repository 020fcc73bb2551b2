//! Delivering what the store decided: a request's answer to its Response
//! Topic (straight to the connection that asked when it is the only
//! recipient, see [`crate::publisher`]), its notifications to their
//! watchers, and the answers to requests refused before the store.

use statestore::Outcome;
use statestore::persist::Observed;

use super::reply::{Reply, settle};
use super::{StateStoreService, notices_only};
use crate::activity::Event;
use crate::clock::now_ms;
use crate::sessions::{Answer, Undelivered};
use crate::store::binding::{self, ReplyTo};

impl StateStoreService {
    /// Publishes an answer decided elsewhere (a cluster node's etcd).
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(in crate::store) fn answer(
        &self,
        mut reply: Reply<'_>,
        frame: statestore::resp3::Frame,
        version: statestore::hlc::Stamp,
        error: Option<statestore::Error>,
    ) {
        settle(&mut reply, error);
        let mut payload = Vec::new();
        frame.encode(&mut payload);
        let version = if version.is_empty() {
            let store = self.store.lock();
            store.clock_now(self.now()).format(&store.config().node_id)
        } else {
            version
        };
        let mut outcome = Outcome {
            payload,
            timestamp: version,
            notices: Vec::new(),
            writes: Vec::new(),
            observed: Observed::Nothing,
            command: Some(reply.command),
            error,
        };
        self.publish_outcome(Some(&mut reply), &mut outcome, None);
    }

    /// Publishes an answer served at once.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(in crate::store) fn publish_answer(&self, mut reply: Reply<'_>, mut outcome: Outcome) {
        self.publish_outcome(Some(&mut reply), &mut outcome, None);
    }

    /// Publishes notifications without an answer.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(in crate::store) fn publish_notices(&self, notices: Vec<statestore::Notice>) {
        self.publish_outcome(None, &mut notices_only(notices), None);
    }

    /// Answers a request the broker refused before it reached the store:
    /// `-ERR <text>`, stamped by the store's clock.
    pub fn refuse(&self, mut reply_to: ReplyTo, requester: &str, text: &str) {
        let outcome = self.store.lock().refuse(text, self.now());
        let ticket = reply_to.ticket.take();
        let route = reply_to.route.take();
        let response = binding::response(reply_to, outcome.payload, outcome.timestamp);
        self.publisher
            .publish_for(requester, route.as_deref(), response);
        drop(ticket);
    }

    /// Delivers the response and the notifications of an outcome (its
    /// answer and the reply's destination taken out of them).
    /// `here`: see [`Self::serve_here`]. `true`: the answer went straight
    /// to its requester's connection (its mailbox, or `here`), which its
    /// acknowledgement may be held for (see `durable.rs`).
    pub(super) fn publish_outcome(
        &self,
        reply: Option<&mut Reply<'_>>,
        outcome: &mut Outcome,
        here: Option<&mut Option<Answer>>,
    ) -> bool {
        let payload = std::mem::take(&mut outcome.payload);
        let timestamp = std::mem::take(&mut outcome.timestamp);
        let mut straight = false;
        if let Some(reply) = reply {
            let took = reply.started.elapsed();
            crate::metrics::store_request(reply.command, reply.ok, took);
            self.activity.answered();
            if let Some((key, outcome)) = reply.shown.take() {
                self.activity.record(Event::Request {
                    at_ms: now_ms(),
                    client: reply.requester.to_string(),
                    command: reply.command,
                    key,
                    outcome,
                    latency_us: u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
                });
            }
            if let Some(mut to) = reply.to.take() {
                // The acknowledgement goes once the answer is on its way.
                let ticket = to.ticket.take();
                let route = to.route.take();
                match (here, route.as_deref()) {
                    (Some(here), Some(route)) => {
                        // Made where the connection finds it (not moved there).
                        *here = Some(binding::answer(to, payload, timestamp));
                        straight = self
                            .publisher
                            .take_or_publish(&reply.requester, route, here);
                    }
                    (_, route) => {
                        let answer = binding::answer(to, payload, timestamp);
                        straight = self.publisher.publish_for(
                            &reply.requester,
                            route,
                            answer.into_direct(),
                        );
                    }
                }
                drop(ticket);
            }
        }
        for notice in &outcome.notices {
            if self.activity.wanted() {
                for watcher in &notice.watchers {
                    self.activity.record(Event::Notification {
                        at_ms: now_ms(),
                        watcher: watcher.to_string(),
                        key: String::from_utf8_lossy(&notice.key).into_owned(),
                        operation: match notice.event {
                            statestore::Event::Set(_) => "SET",
                            statestore::Event::Delete => "DELETE",
                        },
                    });
                }
            }
            for (watcher, message) in binding::notifications(notice) {
                // A notification is private to its watcher: if the watcher's
                // connection cannot take it, nobody gets it.
                match self.publisher.deliver_to(watcher, message) {
                    Ok(()) => {}
                    Err(Undelivered::NoRecipient(message)) => {
                        crate::metrics::dropped(crate::metrics::DropReason::NoWatcher, 1);
                        tracing::debug!(
                            client_id = %watcher,
                            topic = %String::from_utf8_lossy(&message.topic),
                            "notification dropped: watcher not connected or not subscribed"
                        );
                    }
                    Err(Undelivered::Overflow) => tracing::debug!(
                        client_id = %watcher,
                        "notification dropped: the watcher's queue is full"
                    ),
                }
            }
        }
        straight
    }
}
