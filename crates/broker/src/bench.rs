//! For benchmarks and tests only, not a stable API: the data directory
//! written and read as the running broker writes and reads it, without
//! clients (`examples/restart_sessions.rs`, `tests/restart_sessions.rs`).

use std::sync::Arc;

use router::Journal;
pub use router::{SessionRecord, SubOptions};

use crate::config::PersistenceSettings;
use crate::durable::Durable;
use crate::persistence::{Pair, Persistence};

/// Saves `sessions` (client id, record) into the data directory of
/// `settings` through the broker's own journal (the records a persistent
/// session's CONNECT, SUBSCRIBE and end of connection save), then closes
/// it cleanly. Returns how many were saved.
pub fn save_sessions(
    settings: &PersistenceSettings,
    sessions: impl IntoIterator<Item = (String, SessionRecord)>,
) -> Result<usize, String> {
    let (persistence, _loaded) = Persistence::open(settings).map_err(|e| e.to_string())?;
    let persistence = Arc::new(persistence);
    let durable = Durable::new(Arc::clone(&persistence));
    let mut saved = 0;
    for (client, record) in sessions {
        durable.session(&client, Some(&record));
        saved += 1;
    }
    persistence.close();
    Ok(saved)
}

/// The saved persistent sessions of the data directory of `settings`, as
/// stored: (client id, record bytes), by client id.
pub fn saved_sessions(settings: &PersistenceSettings) -> Result<Vec<Pair>, String> {
    let (persistence, loaded) = Persistence::open(settings).map_err(|e| e.to_string())?;
    persistence.close();
    Ok(loaded.sessions)
}

/// The sessions `broker`'s router keeps (`statebroker_kept_sessions`).
pub fn kept_sessions(broker: &crate::RunningBroker) -> usize {
    broker.shared.router.kept_sessions()
}

/// Every client `broker`'s router knows, with its filters (sorted) and
/// whether its session is kept.
pub fn clients(broker: &crate::RunningBroker) -> Vec<(String, Vec<String>, bool)> {
    broker.shared.router.subscriptions().clients()
}
