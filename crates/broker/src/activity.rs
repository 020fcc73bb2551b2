//! What the state store is doing, as it happens, for the web view's live
//! list: each request (caller, command, key, outcome, latency) and each
//! notification sent.
//!
//! A `tokio::sync::broadcast` channel: nothing is built or sent while no
//! one watches (one atomic load per request); a viewer that falls behind
//! loses the oldest events, never slows the store.

use serde::Serialize;
use tokio::sync::broadcast;

/// Events a slow viewer may fall behind by before losing the oldest.
const BACKLOG: usize = 1024;

/// One thing the store did.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Event {
    /// A request was answered.
    Request {
        /// Milliseconds since the Unix epoch.
        at_ms: u64,
        /// The caller's client id.
        client: String,
        /// The verb (`unknown` if it could not be read).
        command: &'static str,
        /// The key, as text (lossy) when there is one.
        key: Option<String>,
        /// `ok`, or the error answered.
        outcome: String,
        /// Arrival to answer, microseconds.
        latency_us: u64,
    },
    /// A KEYNOTIFY notification was sent.
    Notification {
        /// Milliseconds since the Unix epoch.
        at_ms: u64,
        /// Its recipient.
        watcher: String,
        /// The key, as text (lossy).
        key: String,
        /// `SET` or `DELETE`.
        operation: &'static str,
    },
}

/// The channel of [`Event`]s.
#[derive(Debug)]
pub struct Activity {
    tx: broadcast::Sender<Event>,
}

impl Default for Activity {
    fn default() -> Activity {
        Activity {
            tx: broadcast::channel(BACKLOG).0,
        }
    }
}

impl Activity {
    /// Whether anyone watches (build events only then).
    pub fn watched(&self) -> bool {
        self.tx.receiver_count() > 0
    }

    /// Hands `event` to the viewers.
    pub fn record(&self, event: Event) {
        let _ = self.tx.send(event);
    }

    /// A new viewer.
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.tx.subscribe()
    }
}
