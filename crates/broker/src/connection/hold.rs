//! Answers that wait for the disk, seen from the connection: their
//! acknowledgements held to leave with them (one write instead of two),
//! and a bound on how many a connection may wait for.
//!
//! A state store request is acknowledged (PUBACK, or PUBREC at QoS 2) when
//! it is read, and answered when its answer may go out. In memory that is at
//! once, and the acknowledgement and the answer leave in one write. A
//! persisted change is answered only once it is on disk (see
//! [`crate::persistence`]), so the acknowledgement used to leave alone, a
//! write and a wake-up of the client each, and the answer a group commit
//! later: two `sendto`s per persisted SET instead of one.
//!
//! Now, while the write buffer holds nothing but such acknowledgements, the
//! connection does not flush it: the answer, when it comes, goes out in the
//! same write. Anything else queued for the client (a delivery, a PINGRESP,
//! an in-memory answer, another acknowledgement) flushes everything, and so
//! does the store saying the answers of that batch are out. An answer that
//! went elsewhere (another client's response topic, the router, nowhere)
//! does not wake the connection: the store's durable task tells the
//! requester so, once the answered position covers it
//! ([`crate::sessions::ToConnection::AnswersOut`]), and the connection
//! looks at that position again. Only a request sent again, whose answer
//! went (or goes) with its first run's, is waited for on the position
//! itself (`StateStoreService::answered`, a watch every connection may
//! wait on: every connection waited on it for every held
//! acknowledgement, and a group commit woke them all: 1,280 instructions
//! of the runtime's 13,110 a persisted SET at 64 connections). Nothing is
//! reordered, only delayed, and never past the moment the change is
//! durable and answered; in `fsync` mode a persisted change is thereby
//! acknowledged only once it is on disk.
//!
//! Measured (64 connections, persisted SETs, pinned, alternating runs):
//! `sendto` per request 2.00 -> 1.00; `fsync` mode 33,300 -> 42,200 SETs/s,
//! `interval` mode 41,700 -> 62,300.

use crate::persistence::{Batch, Position};

/// Answers a connection may wait for (its persisted changes not yet on
/// disk) before it stops reading: however fast a client sends and however
/// slow the disk, what waits for the disk stays bounded (the store's list
/// of waiting answers and the writer's queue with it).
pub(crate) const MAX_AWAITED: usize = 256;

/// The batches this connection's answers wait for, oldest first.
#[derive(Debug, Default)]
pub(crate) struct Awaited {
    batches: std::collections::VecDeque<Batch>,
}

impl Awaited {
    /// A request whose answer waits for `batch` (`None`: answered
    /// already); `answered` is how far the answers are out.
    pub fn push(&mut self, batch: Option<Batch>, answered: Position) {
        while self.batches.front().is_some_and(|&b| answered.covers(b)) {
            self.batches.pop_front();
        }
        self.batches.extend(batch);
    }

    /// Whether no answer waits.
    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// Whether [`Awaited::full`] may find it full (cheap, without the
    /// disk's position).
    pub fn may_be_full(&self) -> bool {
        self.batches.len() >= MAX_AWAITED
    }

    /// When [`MAX_AWAITED`] answers are still to come: the batch to wait
    /// for before reading again (the oldest one).
    pub fn full(&self, answered: Position) -> Option<Batch> {
        if self.batches.len() < MAX_AWAITED {
            return None;
        }
        let out = self.batches.partition_point(|&b| answered.covers(b));
        (self.batches.len() - out >= MAX_AWAITED).then(|| self.batches[out])
    }
}

/// What the write buffer holds back, and until when.
#[derive(Debug, Default)]
pub(crate) struct AckHold {
    /// The batch the held answers wait for; `None`: nothing held.
    batch: Option<Batch>,
    /// The buffer's length when the last held acknowledgement was queued.
    len: usize,
    /// Whether a held acknowledgement is a request's sent again: no answer
    /// and no `AnswersOut` comes for it, the answered position is waited
    /// on.
    again: bool,
}

impl AckHold {
    /// An acknowledgement took the write buffer from `before` to `after`
    /// bytes, and its request's answer waits for `batch` (`None`: it was
    /// answered at once); `again`: the request was sent again (its answer
    /// is its first run's). It is held if nothing but held
    /// acknowledgements precede it.
    pub fn acknowledged(&mut self, before: usize, after: usize, batch: Option<Batch>, again: bool) {
        let held = if self.batch.is_some() { self.len } else { 0 };
        if let Some(batch) = batch
            && after > before
            && before == held
        {
            self.batch = self.batch.max(Some(batch));
            self.len = after;
            self.again |= again;
        }
    }

    /// The batch to wait for, while something is held.
    pub fn waiting_for(&self) -> Option<Batch> {
        self.batch
    }

    /// Holds nothing more: what is held goes with the next write.
    pub fn end(&mut self) {
        *self = AckHold::default();
    }

    /// The batch to wait for on the answered position itself: while a
    /// request sent again is among what is held (the others' answers, or
    /// the store's `AnswersOut`, wake the connection).
    pub fn watched(&self) -> Option<Batch> {
        self.batch.filter(|_| self.again)
    }

    /// Whether a write buffer of `len` bytes may stay unwritten for now: it
    /// holds only acknowledgements whose answers have not come, and the
    /// answers are not out at `answered` yet. Otherwise the hold ends:
    /// write it all.
    pub fn may_wait(&mut self, len: usize, answered: Position) -> bool {
        if let Some(batch) = self.batch
            && len == self.len
            && !answered.covers(batch)
        {
            return true;
        }
        self.end();
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(n: u64) -> Option<Batch> {
        Batch::new(n)
    }

    fn at(n: u64) -> Position {
        Position::after(Batch::new(n))
    }

    const NOT_YET: Position = Position::after_nothing();

    #[test]
    fn an_acknowledgement_alone_waits_for_its_answer() {
        let mut hold = AckHold::default();
        hold.acknowledged(0, 4, b(7), false);
        assert_eq!(hold.waiting_for(), b(7));
        assert!(hold.may_wait(4, NOT_YET), "only the PUBACK: it waits");
        // The answer arrives: the buffer grew, everything goes.
        assert!(!hold.may_wait(60, NOT_YET));
        assert_eq!(hold.waiting_for(), None);
    }

    #[test]
    fn acknowledgements_of_pipelined_requests_wait_together() {
        let mut hold = AckHold::default();
        hold.acknowledged(0, 4, b(7), false);
        hold.acknowledged(4, 8, b(9), false);
        assert_eq!(hold.waiting_for(), b(9), "until the later batch");
        assert!(hold.may_wait(8, NOT_YET));
        assert!(!hold.may_wait(8, at(9)), "answered: written");
    }

    #[test]
    fn nothing_else_is_held() {
        // Something (a PINGRESP) was queued before the acknowledgement.
        let mut hold = AckHold::default();
        hold.acknowledged(2, 6, b(7), false);
        assert_eq!(hold.waiting_for(), None);
        assert!(!hold.may_wait(6, NOT_YET));

        // An acknowledgement answered at once follows a held one.
        let mut hold = AckHold::default();
        hold.acknowledged(0, 4, b(7), false);
        hold.acknowledged(4, 8, None, false);
        assert!(!hold.may_wait(8, NOT_YET), "its answer is ready: all goes");

        // An acknowledgement that was not queued (held behind the router's).
        let mut hold = AckHold::default();
        hold.acknowledged(0, 0, b(7), false);
        assert_eq!(hold.waiting_for(), None);
    }

    #[test]
    fn reading_stops_while_too_many_answers_wait() {
        let mut awaited = Awaited::default();
        let mut published = at(0);
        for n in 1..=MAX_AWAITED as u64 {
            assert_eq!(awaited.full(published), None, "{n}");
            awaited.push(b(n), published);
        }
        assert_eq!(awaited.full(published), b(1), "full: wait for the oldest");
        awaited.push(None, published);
        assert_eq!(awaited.full(published), b(1), "an answer given at once");
        published = at(1);
        assert_eq!(awaited.full(published), None, "one answered: read again");
        awaited.push(b(MAX_AWAITED as u64 + 1), published);
        assert_eq!(awaited.full(published), b(2));
        published = at(u64::MAX);
        awaited.push(None, published);
        assert!(awaited.batches.is_empty(), "the answered are forgotten");
    }

    #[test]
    fn only_a_request_sent_again_is_waited_for_on_the_position() {
        let mut hold = AckHold::default();
        hold.acknowledged(0, 4, b(7), false);
        assert_eq!(hold.watched(), None, "its answer, or AnswersOut, wakes");
        hold.acknowledged(4, 8, b(5), true);
        assert_eq!(hold.watched(), b(7), "sent again: all that is held");
        assert!(hold.may_wait(8, at(5)));
        assert!(!hold.may_wait(8, at(7)), "answered: written");
        assert_eq!(hold.watched(), None, "nothing held");
        // Not held (something else precedes it): not waited for either.
        hold.acknowledged(2, 6, b(9), true);
        assert_eq!(hold.watched(), None);
    }

    #[test]
    fn a_hold_ends_once_answered() {
        let mut hold = AckHold::default();
        hold.acknowledged(0, 4, b(7), false);
        assert!(!hold.may_wait(4, at(7)));
        assert_eq!(hold.waiting_for(), None);
        assert!(!hold.may_wait(0, NOT_YET), "nothing held: nothing waits");
    }
}
