//! What everything that waits for the disk waits for: a [`Batch`] of
//! writes, and how far the disk has got ([`Position`]).
//!
//! The state store's persisted changes and the MQTT side's (retained
//! messages, sessions, queued messages; the router's journal) go to one
//! writer, which numbers each batch as it is submitted and makes them
//! durable in that order. So one number says it all: an answer, an
//! acknowledgement or a held packet waits for its batch, and may go once
//! the disk's position covers it. Something that waits for nothing has no
//! batch (`Option<Batch>` is `None`), rather than a number 0.

use std::num::NonZeroU64;

/// A batch of writes submitted to the disk, numbered in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Batch(NonZeroU64);

impl Batch {
    /// The batch numbered `n` (`None` for 0).
    pub fn new(n: u64) -> Option<Batch> {
        NonZeroU64::new(n).map(Batch)
    }

    /// The batch numbered after `previous` (the first is 1).
    pub fn after(previous: u64) -> Batch {
        Batch(NonZeroU64::MIN.saturating_add(previous))
    }

    /// Its number.
    pub fn number(self) -> u64 {
        self.0.get()
    }
}

/// How far the disk (or what follows it: answers published) has got:
/// every batch up to this one is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Position(u64);

impl Position {
    /// No batch is done yet.
    pub const fn after_nothing() -> Position {
        Position(0)
    }

    /// Every batch up to `batch` is done (the start: none is).
    pub fn after(batch: Option<Batch>) -> Position {
        Position(batch.map_or(0, Batch::number))
    }

    /// Whether `batch` is done.
    pub fn covers(self, batch: Batch) -> bool {
        self.0 >= batch.number()
    }

    /// Whether whatever waits for `batch`, if anything, may go.
    pub fn covers_all(self, batch: Option<Batch>) -> bool {
        batch.is_none_or(|batch| self.covers(batch))
    }

    /// The last batch done, if any.
    pub fn last(self) -> Option<Batch> {
        Batch::new(self.0)
    }
}

/// The router's journal numbers its writes as the disk does: a receipt is
/// the batch it went in.
impl From<router::Receipt> for Batch {
    fn from(receipt: router::Receipt) -> Batch {
        Batch(receipt.into())
    }
}

impl From<Batch> for router::Receipt {
    fn from(batch: Batch) -> router::Receipt {
        batch.0.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_position_covers_every_batch_up_to_it() {
        let (one, two) = (Batch::new(1).unwrap(), Batch::new(2).unwrap());
        assert_eq!(Batch::new(0), None);
        let start = Position::default();
        assert!(!start.covers(one));
        assert!(start.covers_all(None), "nothing to wait for");
        let at_one = Position::after(Some(one));
        assert!(at_one.covers(one) && !at_one.covers(two));
        assert_eq!(at_one.last(), Some(one));
        let receipt: router::Receipt = two.into();
        assert_eq!(Batch::from(receipt), two);
    }
}
