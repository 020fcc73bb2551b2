//! The broker's clocks: the wall clock, and the counter that measures how
//! long something took.
//!
//! One place, so that the store service, persistence and anything else
//! that stamps time read the same clock (and nothing imports the service
//! just to know the time).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch (0 if the system clock is before it,
/// or cannot be read).
///
/// Read with `clock_gettime` itself: every state store request reads it,
/// and `SystemTime::now().duration_since(UNIX_EPOCH)` added ~60
/// instructions of checked arithmetic to the call.
pub fn now_ms() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec for the call.
    let failed = unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut now) } != 0;
    match (u64::try_from(now.tv_sec), u64::try_from(now.tv_nsec)) {
        (Ok(secs), Ok(nanos)) if !failed => secs * 1_000 + nanos / 1_000_000,
        _ => 0,
    }
}

/// A reading of the processor's time-stamp counter, for how long something
/// took ([`Ticks::elapsed`]), by the quanta crate: calibrated once against
/// the monotonic clock, read without a call into the vDSO. Three are read
/// a state store request (the client heard, the request's start, its
/// answer): `clock_gettime(CLOCK_MONOTONIC)` took 18 ns each, 1.7% of a
/// saturated core's samples; a counter read takes 9 ns. Where the counter
/// is not invariant (or not there), quanta reads the monotonic clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ticks(u64);

/// The calibrated counter (its calibration takes ~1 ms: done at start, see
/// [`warm_up`], not at the first request).
fn counter() -> &'static quanta::Clock {
    static COUNTER: std::sync::OnceLock<quanta::Clock> = std::sync::OnceLock::new();
    COUNTER.get_or_init(quanta::Clock::new)
}

/// Calibrates the counter [`Ticks`] read, if not done yet.
pub fn warm_up() {
    counter();
}

impl Ticks {
    /// Now.
    pub fn now() -> Ticks {
        Ticks(counter().raw())
    }

    /// The time since `self` (zero if the counter reads earlier now).
    pub fn elapsed(self) -> Duration {
        let counter = counter();
        counter.delta(self.0, counter.raw())
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
        // Ticks measure what `Instant` measures, up to the counter's
        // calibration (well under 1%): at least the sleep, at most the
        // whole span around it.
        let outer = std::time::Instant::now();
        let start = Ticks::now();
        std::thread::sleep(Duration::from_millis(50));
        let took = start.elapsed();
        let whole = outer.elapsed();
        assert!(took >= Duration::from_millis(49), "{took:?}");
        assert!(took <= whole.mul_f64(1.01), "{took:?} > {whole:?}");
        assert!(Ticks::now() >= start);
        // Earlier from later is nothing, not a wrapped-around eternity.
        assert_eq!(Ticks(u64::MAX).elapsed(), Duration::ZERO);
    }
}
