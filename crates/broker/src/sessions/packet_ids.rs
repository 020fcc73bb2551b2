//! Which packet ids a session's deliveries from the router take.
//!
//! The router numbers a connection's QoS 1/2 deliveries `1..=`
//! [`router::MAX_ROUTER_PKID`] in turn. A client keeps a QoS 2 packet id
//! from the PUBLISH until the PUBREL (MQTT 5 4.3.3, method B): a
//! PUBLISH without DUP on an id it keeps is taken for the one it has and
//! dropped. When a session moves to another cluster node, the node it
//! leaves cannot send the PUBRELs it owed (it died, or its connection
//! ended), and the new node does not know which ids the client keeps;
//! nor does a broker restarted on its data directory.
//!
//! So each session's router deliveries take one of [`PacketIdBlock::COUNT`]
//! blocks of ids, `block × MAX_ROUTER_PKID + 1 ..= (block + 1) ×
//! MAX_ROUTER_PKID`: the connection adds the block's base to each id the
//! router gives and takes it off the client's acknowledgements. A session
//! starts in its run's block (`Shared::run_ids`: the count of starts its
//! data directory keeps, so that a session restored after a restart does
//! not reuse the ids of the run before either; block 0 without one); a
//! session that moved to another node goes on in the next block after
//! the one it had there (the cluster's session and owner records carry
//! it), so no id the client may still keep from the node it left comes
//! again until the session has moved [`PacketIdBlock::COUNT`] times. The
//! state store's own deliveries (QoS 0/1) take the ids above every block.

use router::MAX_ROUTER_PKID;

/// A CONNECT's session as its node found it before accepting it (see
/// `Shared::resume_session`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resumed {
    /// The packet ids its router deliveries take.
    pub ids: PacketIdBlock,
    /// A cluster node's etcd revision the session (and its owner record)
    /// was read at, for a CONNECT with Clean Start 0, and the node's wall
    /// clock (ms) when it was; `(0, 0)`: not read. Where the CONNECT
    /// comes among others of the client id (see `cluster::ownership`).
    pub read: (i64, u64),
    /// The router's session of the client is the one this node had before
    /// the CONNECT (it owned the client, or its own copy is current):
    /// a CONNECT not accepted after all leaves it. `false`: a cluster
    /// node's session replaced from etcd, discarded, or new, which such
    /// a CONNECT must not leave behind (see `connection::serve`).
    pub was_here: bool,
    /// The session came from a live node, which is to hand over what it
    /// had queued for it (a cluster node, see `cluster::handover`): the
    /// connection holds back what the router gives the session until that
    /// node says it has, so that the older messages come first.
    pub awaits_handover: bool,
}

/// One block of packet ids for the router's deliveries (see the module's
/// documentation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PacketIdBlock(u8);

impl PacketIdBlock {
    /// How many blocks there are.
    pub const COUNT: u8 = 64;

    /// The first packet id above every block.
    pub const END: u16 = MAX_ROUTER_PKID * Self::COUNT as u16 + 1;

    /// Block `number` (modulo [`Self::COUNT`]).
    pub fn new(number: u8) -> PacketIdBlock {
        PacketIdBlock(number % Self::COUNT)
    }

    /// The block's number, as records keep it.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub fn number(self) -> u8 {
        self.0
    }

    /// The block a session takes on a node it moved to from this one.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub fn next(self) -> PacketIdBlock {
        PacketIdBlock::new(self.0 + 1)
    }

    /// The later of two blocks of one session: the one ahead of the other
    /// by less than half the ring (blocks go on by one per move, so two
    /// records of a session are a few blocks apart at most).
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub fn later(self, other: PacketIdBlock) -> PacketIdBlock {
        let ahead = (other.0 + Self::COUNT - self.0) % Self::COUNT;
        if ahead > 0 && ahead < Self::COUNT / 2 {
            other
        } else {
            self
        }
    }

    fn base(self) -> u16 {
        u16::from(self.0) * MAX_ROUTER_PKID
    }

    /// The id the client sees for the router's packet id `pkid` (0, no
    /// id, stays 0).
    pub fn to_client(self, pkid: u16) -> u16 {
        if pkid == 0 { 0 } else { pkid + self.base() }
    }

    /// The router's packet id for the client's `pkid`; `None` if `pkid`
    /// is not of this block.
    pub fn to_router(self, pkid: u16) -> Option<u16> {
        pkid.checked_sub(self.base())
            .filter(|id| (1..=MAX_ROUTER_PKID).contains(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_do_not_overlap_and_stay_below_the_direct_ids() {
        let mut seen = std::collections::HashSet::new();
        for number in 0..PacketIdBlock::COUNT {
            let block = PacketIdBlock::new(number);
            for pkid in 1..=MAX_ROUTER_PKID {
                let wire = block.to_client(pkid);
                assert!(wire < PacketIdBlock::END);
                assert!(seen.insert(wire), "{wire} in two blocks");
                assert_eq!(block.to_router(wire), Some(pkid));
                assert_eq!(block.next().to_router(wire), None);
            }
            assert_eq!(block.to_client(0), 0);
            assert_eq!(block.to_router(0), None);
        }
        assert_eq!(seen.len(), usize::from(PacketIdBlock::END) - 1);
        assert_eq!(PacketIdBlock::END, 6_401);
    }

    #[test]
    fn the_later_block_is_the_one_ahead_around_the_ring() {
        let b = PacketIdBlock::new;
        assert_eq!(b(3).later(b(4)), b(4));
        assert_eq!(b(4).later(b(3)), b(4));
        assert_eq!(b(5).later(b(5)), b(5));
        assert_eq!(b(63).later(b(0)), b(0), "wrapped");
        assert_eq!(b(0).later(b(63)), b(0));
        assert_eq!(b(1).later(b(62)), b(1));
    }

    #[test]
    fn the_next_block_wraps_after_the_last() {
        assert_eq!(PacketIdBlock::default().next(), PacketIdBlock::new(1));
        let last = PacketIdBlock::new(PacketIdBlock::COUNT - 1);
        assert_eq!(last.next(), PacketIdBlock::default());
        assert_eq!(PacketIdBlock::new(PacketIdBlock::COUNT + 3).number(), 3);
        assert_eq!(PacketIdBlock::new(255).number(), 255 % PacketIdBlock::COUNT);
    }
}
