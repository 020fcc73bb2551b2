//! What the state store is doing, as it happens, for the web view: each
//! request (caller, command, key, outcome, latency) and each notification
//! sent, the last of them kept for a page that opens later, and requests
//! and messages per second over the last minute.
//!
//! Viewers get events through a `tokio::sync::broadcast` channel; one that
//! falls behind loses the oldest events, never slows the store. While no
//! one watches, events are built for the backlog at most
//! [`UNWATCHED_PER_SECOND`] times a second (one clock read and one atomic
//! per request otherwise), so a page opened after a test run shows the
//! requests of that run, and a busy broker pays almost nothing for it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::broadcast;

/// Events a slow viewer may fall behind by before losing the oldest.
const CHANNEL: usize = 1024;
/// Events kept for a viewer that comes later.
pub const BACKLOG: usize = 100;
/// Events built per second for the backlog while no one watches.
pub const UNWATCHED_PER_SECOND: u64 = 20;
/// Seconds of [`Rate`]s kept.
pub const RATES: usize = 60;

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

/// An [`Event`] with its number (in the order recorded, from 1).
pub type Numbered = (u64, Event);

/// One second of traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Rate {
    /// The second's end, milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// State store requests answered.
    pub requests: u64,
    /// MQTT PUBLISH packets received (state store requests included).
    pub messages: u64,
}

/// The events, the backlog and the rates.
#[derive(Debug)]
pub struct Activity {
    tx: broadcast::Sender<Numbered>,
    /// The last [`BACKLOG`] events; its lock also orders numbering and
    /// sending, so a viewer sees each event once, in order.
    backlog: Mutex<(u64, VecDeque<Numbered>)>,
    /// While unwatched: the current second (high bits) and the events built
    /// in it (low 20 bits).
    unwatched: AtomicU64,
    /// Requests answered since the start.
    requests: AtomicU64,
    rates: Mutex<VecDeque<Rate>>,
}

impl Default for Activity {
    fn default() -> Activity {
        Activity {
            tx: broadcast::channel(CHANNEL).0,
            backlog: Mutex::new((0, VecDeque::with_capacity(BACKLOG))),
            unwatched: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            rates: Mutex::new(VecDeque::with_capacity(RATES)),
        }
    }
}

impl Activity {
    /// Whether to build the next event: always while someone watches, else
    /// at most [`UNWATCHED_PER_SECOND`] a second (for the backlog).
    pub fn wanted(&self) -> bool {
        self.wanted_at(crate::clock::now_ms())
    }

    /// [`Activity::wanted`] at `now_ms` (the caller's reading of
    /// [`crate::clock::now_ms`]: a request reads the clock once).
    pub fn wanted_at(&self, now_ms: u64) -> bool {
        if self.tx.receiver_count() > 0 {
            return true;
        }
        let second = now_ms / 1000;
        let window = self.unwatched.load(Relaxed);
        let next = if window >> 20 == second {
            if window & 0xF_FFFF >= UNWATCHED_PER_SECOND {
                return false;
            }
            window + 1
        } else {
            second << 20 | 1
        };
        // Two callers at once: one of them goes without; no matter.
        self.unwatched
            .compare_exchange(window, next, Relaxed, Relaxed)
            .is_ok()
    }

    /// Keeps `event` in the backlog and hands it to the viewers.
    pub fn record(&self, event: Event) {
        let mut backlog = self.backlog.lock();
        backlog.0 += 1;
        let numbered = (backlog.0, event);
        if self.tx.receiver_count() > 0 {
            let _ = self.tx.send(numbered.clone());
        }
        if backlog.1.len() == BACKLOG {
            backlog.1.pop_front();
        }
        backlog.1.push_back(numbered);
    }

    /// A new viewer: the backlog, and the events after it.
    pub fn subscribe(&self) -> (Vec<Numbered>, broadcast::Receiver<Numbered>) {
        let backlog = self.backlog.lock();
        (backlog.1.iter().cloned().collect(), self.tx.subscribe())
    }

    /// A request was answered.
    pub fn answered(&self) {
        self.requests.fetch_add(1, Relaxed);
    }

    /// Requests answered since the start.
    pub fn requests(&self) -> u64 {
        self.requests.load(Relaxed)
    }

    /// The last [`RATES`] seconds, oldest first.
    pub fn rates(&self) -> Vec<Rate> {
        self.rates.lock().iter().copied().collect()
    }

    /// Adds a second of traffic.
    pub fn push_rate(&self, rate: Rate) {
        let mut rates = self.rates.lock();
        if rates.len() == RATES {
            rates.pop_front();
        }
        rates.push_back(rate);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(n: u64) -> Event {
        Event::Request {
            at_ms: n,
            client: "c".into(),
            command: "GET",
            key: None,
            outcome: "ok".into(),
            latency_us: 1,
        }
    }

    #[test]
    fn unwatched_events_are_sampled_and_the_last_kept() {
        let activity = Activity::default();
        let built = (0..1000).filter(|_| activity.wanted()).count() as u64;
        // Within one second, or across the turn of one.
        assert!(
            (UNWATCHED_PER_SECOND..=2 * UNWATCHED_PER_SECOND).contains(&built),
            "{built}"
        );
        for n in 0..BACKLOG as u64 + 5 {
            activity.record(request(n));
        }
        let (backlog, _rx) = activity.subscribe();
        let numbers: Vec<u64> = backlog.iter().map(|(n, _)| *n).collect();
        assert_eq!(numbers, (6..=BACKLOG as u64 + 5).collect::<Vec<_>>());
        // Watched: every event is wanted and sent, numbered on.
        assert!((0..1000).all(|_| activity.wanted()));
        let (_, mut rx) = activity.subscribe();
        activity.record(request(7));
        assert_eq!(rx.try_recv().unwrap().0, BACKLOG as u64 + 6);
    }

    #[test]
    fn rates_keep_the_last_minute() {
        let activity = Activity::default();
        for n in 0..RATES as u64 + 3 {
            activity.push_rate(Rate {
                at_ms: n,
                requests: n,
                messages: 2 * n,
            });
        }
        let rates = activity.rates();
        assert_eq!(rates.len(), RATES);
        assert_eq!(rates[0].at_ms, 3);
        assert_eq!(rates[RATES - 1].messages, 2 * (RATES as u64 + 2));
    }
}
