//! What every PUBLISH and state store request counts, one set of counts
//! per thread, added up when read: by `$SYS` (`totals`) and by `/metrics`
//! (`publish_traffic`, into the Prometheus counters).
//!
//! Each thread counts into its own slot (the thread_local crate, already
//! in the tree through tracing-subscriber: a thread's slot is kept, with
//! its counts, for the next thread that takes its id). Shared counters
//! took four locked additions a state store request for the `$SYS`
//! totals, and with the HTTP endpoint on four more for the Prometheus
//! counters (and their generations), each waiting for the core's store
//! buffer to drain: the endpoint alone cost 3% of the requests a second
//! at 64 connections (0.93-0.98x without it).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use thread_local::ThreadLocal;

/// Verbs with counters of their own, in [`Command::NAMES`] order (the
/// rest count under their name, looked up each time: rare).
///
/// [`Command::NAMES`]: statestore::command::Command::NAMES
pub(super) const VERBS: usize = statestore::command::Command::NAMES.len();

/// The counts: `AtomicU64`s in a thread's slot, `u64`s once added up.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Counts<T> {
    /// PUBLISH packets received, by QoS.
    pub received: [T; 3],
    pub bytes_received: T,
    /// PUBLISH packets sent, by QoS.
    pub sent: [T; 3],
    pub bytes_sent: T,
    /// `[ok, error]` of each verb (see [`VERBS`]).
    pub requests: [[T; 2]; VERBS],
}

/// A thread's counts.
type Slot = Counts<AtomicU64>;

static SLOTS: ThreadLocal<Slot> = ThreadLocal::new();

/// This thread's counts.
pub(super) fn here() -> &'static Slot {
    SLOTS.get_or_default()
}

/// Every thread's counts added up.
pub(super) fn sum() -> Counts<u64> {
    add_up(&SLOTS)
}

/// Adds `n` to `counter`, which only this thread writes (a plain load and
/// store: the slot is this thread's while it runs).
fn count(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Relaxed).wrapping_add(n), Relaxed);
}

impl Slot {
    /// On the thread that owns it: a PUBLISH of `payload` bytes came.
    pub fn received(&self, qos: u8, payload: u64) {
        count(&self.received[usize::from(qos.min(2))], 1);
        count(&self.bytes_received, payload);
    }

    /// On the thread that owns it: a PUBLISH of `bytes` went.
    pub fn sent(&self, qos: u8, bytes: u64) {
        count(&self.sent[usize::from(qos.min(2))], 1);
        count(&self.bytes_sent, bytes);
    }

    /// On the thread that owns it: a request of the `verb`th verb was
    /// answered.
    pub fn request(&self, verb: usize, ok: bool) {
        count(&self.requests[verb][usize::from(!ok)], 1);
    }
}

/// The counts of every slot in `all`.
fn add_up(all: &ThreadLocal<Slot>) -> Counts<u64> {
    let mut sum = Counts::<u64>::default();
    let add = |to: &mut u64, from: &AtomicU64| *to += from.load(Relaxed);
    for slot in all.iter() {
        for q in 0..3 {
            add(&mut sum.received[q], &slot.received[q]);
            add(&mut sum.sent[q], &slot.sent[q]);
        }
        add(&mut sum.bytes_received, &slot.bytes_received);
        add(&mut sum.bytes_sent, &slot.bytes_sent);
        for (to, from) in sum.requests.iter_mut().zip(&slot.requests) {
            add(&mut to[0], &from[0]);
            add(&mut to[1], &from[1]);
        }
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each thread counts into its own slot; the sums add up every slot,
    /// those of threads that have ended included.
    #[test]
    fn counted_per_thread_adds_up() {
        let all = ThreadLocal::<Slot>::new();
        std::thread::scope(|scope| {
            for qos in 0..4 {
                let all = &all;
                scope.spawn(move || {
                    for _ in 0..1_000 {
                        all.get_or_default().received(qos, 3);
                        all.get_or_default().sent(1, 5);
                        all.get_or_default().request(1, qos != 1);
                    }
                });
            }
        });
        all.get_or_default().received(0, 7);
        let sum = add_up(&all);
        // QoS 3 (not one) counts as 2, as the Prometheus counters did.
        assert_eq!(sum.received, [1_001, 1_000, 2_000]);
        assert_eq!(sum.bytes_received, 12_007);
        assert_eq!(sum.sent, [0, 4_000, 0]);
        assert_eq!(sum.bytes_sent, 20_000);
        assert_eq!(sum.requests[1], [3_000, 1_000]);
        assert_eq!(sum.requests[0], [0, 0]);
    }
}
