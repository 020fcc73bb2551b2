//! The broker's wall clock.
//!
//! One function, so that the store service, persistence and anything else
//! that stamps time read the same clock (and nothing imports the service
//! just to know the time).

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch (0 if the system clock is before it).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Nanoseconds since the Unix epoch: a number that differs between two runs
/// of the broker (assigned client ids carry it).
pub fn now_nanos() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}
