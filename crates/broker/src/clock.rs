//! The broker's wall clock.
//!
//! One function, so that the store service, persistence and anything else
//! that stamps time read the same clock (and nothing imports the service
//! just to know the time).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// `clock`'s reading as seconds and nanoseconds (0, 0 if it fails, which
/// for these two clocks it does not).
fn read(clock: libc::clockid_t) -> (u64, u64) {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec for the call.
    let failed = unsafe { libc::clock_gettime(clock, &mut now) } != 0;
    match (u64::try_from(now.tv_sec), u64::try_from(now.tv_nsec)) {
        (Ok(secs), Ok(nanos)) if !failed => (secs, nanos),
        _ => (0, 0),
    }
}

/// Milliseconds since the Unix epoch (0 if the system clock is before it).
///
/// Read with `clock_gettime` itself: every state store request reads it,
/// and `SystemTime::now().duration_since(UNIX_EPOCH)` added ~60
/// instructions of checked arithmetic to the call.
pub fn now_ms() -> u64 {
    let (secs, nanos) = read(libc::CLOCK_REALTIME);
    secs * 1_000 + nanos / 1_000_000
}

/// A reading of the monotonic clock, for how long something took
/// ([`Ticks::elapsed`]): what `std::time::Instant` is, without its checked
/// subtraction (~40 instructions, once a state store request).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ticks(u64);

impl Ticks {
    /// Now.
    pub fn now() -> Ticks {
        let (secs, nanos) = read(libc::CLOCK_MONOTONIC);
        Ticks(secs.saturating_mul(1_000_000_000).saturating_add(nanos))
    }

    /// The time since `self`.
    pub fn elapsed(self) -> Duration {
        Duration::from_nanos(Ticks::now().0.saturating_sub(self.0))
    }
}

/// Nanoseconds since the Unix epoch: a number that differs between two runs
/// of the broker (assigned client ids carry it).
pub fn now_nanos() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn now_ms_is_the_system_clock() {
        let before = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let now = now_ms();
        let after = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        assert!(before.as_millis() as u64 <= now && now <= after.as_millis() as u64);
    }

    #[test]
    fn ticks_measure_what_passed() {
        // Ticks read the clock `Instant` reads, inside the span `Instant`
        // measures: at least the sleep, at most the whole span.
        let outer = std::time::Instant::now();
        let start = Ticks::now();
        std::thread::sleep(Duration::from_millis(20));
        let took = start.elapsed();
        let whole = outer.elapsed();
        assert!(took >= Duration::from_millis(20), "{took:?}");
        assert!(took <= whole, "{took:?} > {whole:?}");
        assert!(Ticks::now() >= start);
    }
}
