use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::time::Instant;

use super::logs::Held;
use super::{
    iobufs::Replay,
    scheduler::{PauseReason, Tracker},
    ConnectionEvents,
};
use crate::QueueFull;

pub struct Graveyard {
    connections: HashMap<String, SavedState>,
    /// When kept sessions expire (statebroker patch 9).
    deadlines: BTreeSet<(Instant, String)>,
}

impl Graveyard {
    pub fn new() -> Graveyard {
        Graveyard {
            connections: HashMap::new(),
            deadlines: BTreeSet::new(),
        }
    }

    /// Add a new connection.
    /// Return tracker of previous connection if connection id already exists
    pub fn retrieve(&mut self, id: &str) -> Option<SavedState> {
        let saved = self.connections.remove(id)?;
        if let Some(at) = saved.expires_at {
            self.deadlines.remove(&(at, id.to_owned()));
        }
        Some(saved)
    }

    /// A kept session without a connection that refuses new messages when
    /// its own would be pushed out (`default` for a session that chose
    /// nothing; statebroker patch 25) and reads the log at `filter_idx` at
    /// QoS 1 or 2 from before absolute offset `below` (statebroker patch 23).
    pub fn reads_before(&self, filter_idx: usize, below: u64, default: QueueFull) -> Option<&str> {
        self.connections.iter().find_map(|(client, saved)| {
            let state = saved.session_state.as_ref()?;
            if state.queue_full.unwrap_or(default) != QueueFull::Refuse {
                return None;
            }
            state
                .tracker
                .data_requests
                .iter()
                .any(|r| {
                    r.filter_idx == filter_idx
                        && r.qos > 0
                        && r.group.is_none()
                        && r.cursor.1 < below
                })
                .then_some(client.as_str())
        })
    }

    /// Whether any kept session has an expiry.
    pub fn has_deadlines(&self) -> bool {
        !self.deadlines.is_empty()
    }

    /// Takes out the sessions whose expiry passed by `now`.
    pub fn expired(&mut self, now: Instant) -> Vec<SessionState> {
        let mut gone = Vec::new();
        while let Some((at, _)) = self.deadlines.first() {
            if *at > now {
                break;
            }
            let (_, id) = self.deadlines.pop_first().expect("not empty");
            if let Some(state) = self.connections.remove(&id).and_then(|s| s.session_state) {
                gone.push(state);
            }
        }
        gone
    }

    /// Save connection tracker
    #[allow(clippy::too_many_arguments)] // rumqttd's, with patches 6, 9, 11 and 25's
    pub fn save_state(
        &mut self,
        mut tracker: Tracker,
        queue_full: Option<QueueFull>,
        subscriptions: HashSet<String>,
        subscription_ids: HashMap<String, usize>,
        metrics: ConnectionEvents,
        unacked_pubrels: VecDeque<u16>,
        incoming_qos2: Held,
        replay: Replay,
        expires_at: Option<Instant>,
    ) {
        tracker.pause(PauseReason::Busy);
        let id = tracker.id.clone();

        let session_state = SessionState {
            tracker,
            queue_full,
            subscriptions,
            subscription_ids,
            unacked_pubrels,
            incoming_qos2,
            replay,
        };

        if let Some(at) = expires_at {
            self.deadlines.insert((at, id.clone()));
        }
        self.connections.insert(
            id,
            SavedState {
                session_state: Some(session_state),
                metrics,
                expires_at,
            },
        );
    }

    /// Save only metrics for connection
    pub fn save_metrics(&mut self, id: String, metrics: ConnectionEvents) {
        self.connections.insert(
            id,
            SavedState {
                session_state: None,
                metrics,
                expires_at: None,
            },
        );
    }
}

#[derive(Debug)]
pub struct SavedState {
    pub session_state: Option<SessionState>,
    pub metrics: ConnectionEvents,
    /// When the kept session expires (`None`: never).
    pub expires_at: Option<Instant>,
}

#[derive(Debug)]
pub struct SessionState {
    pub tracker: Tracker,
    /// The session's own choice of what a publish does when it would push
    /// out of a log what the session has not had (statebroker patch 25).
    pub queue_full: Option<QueueFull>,
    pub subscriptions: HashSet<String>,
    /// MQTT 5 subscription identifiers by filter (statebroker patch 10).
    pub subscription_ids: HashMap<String, usize>,
    // used for pubrel in qos2
    pub unacked_pubrels: VecDeque<u16>,
    /// QoS 2 publishes from the client waiting for its PUBREL (statebroker
    /// patch 6).
    pub incoming_qos2: Held,
    /// Deliveries to send again as they were (statebroker patch 11).
    pub replay: Replay,
}
