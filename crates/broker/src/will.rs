//! Last Will messages.
//!
//! The broker keeps wills itself instead of handing them to the router,
//! because only the connection task knows how a connection ended, and
//! rumqttd's own will trigger is not reachable from outside the crate.
//!
//! A will is published when a connection ends without a normal DISCONNECT
//! (or with MQTT 5's "disconnect with will message"), after the Will Delay
//! Interval (bounded by the Session Expiry Interval). A new connection with
//! the same client id before then cancels it; if that new connection starts
//! a clean session, the old session has ended and the will goes out at once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use router::protocol::{LastWill, LastWillProperties};

use crate::publisher::Publisher;

/// How long a will waits after its connection ended: min(Will Delay
/// Interval, Session Expiry Interval).
pub fn delay(properties: Option<&LastWillProperties>, session_expiry: u32) -> Duration {
    let delay = properties.and_then(|p| p.delay_interval).unwrap_or(0);
    Duration::from_secs(u64::from(delay.min(session_expiry)))
}

/// A will waiting to be published.
#[derive(Debug, Clone)]
pub struct Will {
    /// The message.
    pub will: LastWill,
    /// Its MQTT 5 properties.
    pub properties: Option<LastWillProperties>,
    /// min(Will Delay Interval, Session Expiry Interval).
    pub delay: Duration,
}

#[derive(Default)]
struct ClientWills {
    /// The newest connection of this client id, and whether it started clean.
    latest: Option<(u64, bool)>,
    /// A will waiting for its delay: (connection it belongs to, the will).
    pending: Option<(u64, Will)>,
    /// Connections taken over that have not ended yet, each with whether
    /// the connection that took it over started clean. A taken-over
    /// connection may end after its successor did (it lets its client read
    /// the DISCONNECT first): it is still judged as taken over.
    superseded: Vec<(u64, bool)>,
}

impl ClientWills {
    fn is_empty(&self) -> bool {
        self.latest.is_none() && self.pending.is_none() && self.superseded.is_empty()
    }
}

/// Wills of all clients.
pub struct WillRegistry {
    clients: Mutex<HashMap<String, ClientWills>>,
    publisher: Arc<Publisher>,
}

impl WillRegistry {
    /// A registry that publishes through `publisher` (the router saves a
    /// retained will as it saves any retained message).
    pub fn new(publisher: Arc<Publisher>) -> Arc<WillRegistry> {
        Arc::new(WillRegistry {
            clients: Mutex::new(HashMap::new()),
            publisher,
        })
    }

    fn publish(&self, will: Will) {
        self.publisher.publish_will(will.will, will.properties);
    }

    /// A connection of `client_id` was accepted.
    pub fn connected(&self, client_id: &str, connection: u64, clean_start: bool) {
        let pending = {
            let mut clients = self.clients.lock();
            let state = clients.entry(client_id.to_owned()).or_default();
            if let Some((previous, _)) = state.latest
                && previous != connection
            {
                state.superseded.push((previous, clean_start));
            }
            state.latest = Some((connection, clean_start));
            state.pending.take()
        };
        if let Some((_, will)) = pending
            && clean_start
        {
            tracing::debug!(
                client_id,
                "session ended by a clean start: publishing the pending will"
            );
            self.publish(will);
        }
    }

    /// Another cluster node accepted a connection of `client_id` (its
    /// claim took the client id from this node), one that started `clean`
    /// or not: the connection here, if it still runs, is judged as taken
    /// over when it ends, and a will waiting here for its delay goes out
    /// at once if the new connection ended the session, never if it
    /// continues it ([MQTT-3.1.3-9]), as when the new connection is here.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub fn taken_elsewhere(&self, client_id: &str, clean: bool) {
        let pending = {
            let mut clients = self.clients.lock();
            let Some(state) = clients.get_mut(client_id) else {
                return;
            };
            if let Some((previous, _)) = state.latest.take() {
                state.superseded.push((previous, clean));
            }
            let pending = state.pending.take();
            if state.is_empty() {
                clients.remove(client_id);
            }
            pending
        };
        match pending {
            Some((_, will)) if clean => {
                tracing::debug!(
                    client_id,
                    "session ended by a clean start on another node: publishing the pending will"
                );
                self.publish(will);
            }
            Some(_) => tracing::debug!(
                client_id,
                "the client connected to another node within the will delay, session continued: will discarded"
            ),
            None => {}
        }
    }

    /// A connection of `client_id` ended; `will` is its will if it is to be
    /// published (the connection did not end with a normal DISCONNECT).
    pub fn disconnected(self: &Arc<Self>, client_id: &str, connection: u64, will: Option<Will>) {
        let mut clients = self.clients.lock();
        let Some(state) = clients.get_mut(client_id) else {
            drop(clients);
            if let Some(will) = will {
                self.publish(will);
            }
            return;
        };
        let superseded = match state.superseded.iter().position(|&(c, _)| c == connection) {
            Some(at) => Some(state.superseded.swap_remove(at).1),
            None => {
                if state.latest.is_some_and(|(c, _)| c == connection) {
                    state.latest = None;
                }
                None
            }
        };
        let Some(will) = will else {
            if state.is_empty() {
                clients.remove(client_id);
            }
            return;
        };
        let publish_now = match superseded {
            // Taken over (MQTT 5 3.1.4): published as 3.1.2.5 says, so at
            // once without a Will Delay Interval or when the takeover
            // ended the session (Clean Start 1); with a delay, the new
            // connection came before it passed: never ([MQTT-3.1.3-9]).
            Some(new_clean) => {
                if !(new_clean || will.delay.is_zero()) {
                    if state.is_empty() {
                        clients.remove(client_id);
                    }
                    tracing::debug!(
                        client_id,
                        "taken over within the will delay, session continued: will discarded"
                    );
                    return;
                }
                true
            }
            None => will.delay.is_zero(),
        };
        if publish_now {
            if state.is_empty() {
                clients.remove(client_id);
            }
            drop(clients);
            self.publish(will);
            return;
        }
        let delay = will.delay;
        state.pending = Some((connection, will));
        drop(clients);
        let registry = Arc::clone(self);
        let client_id = client_id.to_owned();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let due = {
                let mut clients = registry.clients.lock();
                match clients.get_mut(&client_id) {
                    Some(state)
                        if state
                            .pending
                            .as_ref()
                            .is_some_and(|(c, _)| *c == connection) =>
                    {
                        let will = state.pending.take().map(|(_, w)| w);
                        if state.is_empty() {
                            clients.remove(&client_id);
                        }
                        will
                    }
                    _ => None,
                }
            };
            if let Some(will) = due {
                tracing::debug!(client_id, "will delay passed: publishing the will");
                registry.publish(will);
            }
        });
    }
}
