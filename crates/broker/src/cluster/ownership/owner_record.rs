//! The owner record's format (see the module's documentation above):
//! `<node id>\n<connection>\nids <block>`, then `\nat <revision> <ms>`
//! where its CONNECT read the session, and a mark: `\nclean` (a clean
//! start), `\nqueue` (its queued messages came from etcd) or `\nleaving`
//! (a stopping node's offer). Written here, read here.

use crate::sessions::PacketIdBlock;

/// The node an owner's record (`<node id>\n<connection>[\nids
/// <block>][\nclean|\nqueue]`) names.
pub fn owner_of(value: &[u8]) -> Option<&str> {
    let mut lines = std::str::from_utf8(value).ok()?.split('\n');
    let node = lines.next()?;
    lines.next()?.parse::<u64>().ok().map(|_| node)
}

/// An owner record's value: `<node id>\n<connection>\nids <block>`, then
/// `\nat <revision> <ms>` where its CONNECT read the session (`at`), and
/// `mark` (`\nclean`, `\nqueue`, `\nleaving` or none).
pub(super) fn owner_record(
    node_id: &str,
    connection: u64,
    ids: PacketIdBlock,
    at: Option<(i64, u64)>,
    mark: &str,
) -> String {
    let at = at.map_or(String::new(), |(revision, ms)| {
        format!("\nat {revision} {ms}")
    });
    format!("{node_id}\n{connection}\nids {}{at}{mark}", ids.number())
}

/// The etcd revision an owner's record says its CONNECT read the session
/// at, and the wall clock's ms then (`None`: it read nothing, a clean
/// start, or a record of an earlier version).
pub(super) fn owner_read(value: &[u8]) -> Option<(i64, u64)> {
    let lines = std::str::from_utf8(value).ok()?.split('\n');
    lines.skip(2).find_map(|line| {
        let (revision, ms) = line.strip_prefix("at ")?.split_once(' ')?;
        Some((revision.parse().ok()?, ms.parse().ok()?))
    })
}

/// The packet ids an owner's record says its claim's session takes
/// (`None`: a record without them, of an earlier version).
pub fn owner_ids(value: &[u8]) -> Option<PacketIdBlock> {
    let lines = std::str::from_utf8(value).ok()?.split('\n');
    lines
        .skip(2)
        .find_map(|line| line.strip_prefix("ids ")?.parse().ok())
        .map(PacketIdBlock::new)
}

/// Whether the node an owner's record names wants the session's queued
/// messages handed over: not after a CONNECT with Clean Start 1 (the
/// session before it ended), nor when it took them from etcd (`\nqueue`).
pub(super) fn wants_handover(value: &[u8]) -> bool {
    !value.ends_with(b"\nclean") && !value.ends_with(b"\nqueue")
}

/// Whether an owner record's CONNECT started clean (ending the session).
pub(super) fn started_clean(value: &[u8]) -> bool {
    value.ends_with(b"\nclean")
}

/// Whether an owner record is a stopping node's offer of the session (see
/// [`super::Ownership::offer_kept`]).
pub fn offered(value: &[u8]) -> bool {
    value.ends_with(b"\nleaving")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_record_names_its_node_block_and_whether_to_hand_over() {
        let value = b"sb3\n42\nids 5\nclean";
        assert_eq!(owner_of(value), Some("sb3"));
        assert_eq!(owner_ids(value), Some(PacketIdBlock::new(5)));
        assert!(!wants_handover(value));
        let from_etcd = b"sb3\n42\nids 5\nqueue";
        assert_eq!(owner_ids(from_etcd), Some(PacketIdBlock::new(5)));
        assert!(!wants_handover(from_etcd));
        assert!(wants_handover(b"sb3\n42\nids 5"));
        let earlier = b"sb3\n42";
        assert_eq!(owner_of(earlier), Some("sb3"));
        assert_eq!(owner_ids(earlier), None);
        assert!(wants_handover(earlier));
        assert_eq!(owner_of(b"sb3"), None);
    }

    /// What a claim and a stopping node's offer write reads back.
    #[test]
    fn an_owner_record_written_reads_back() {
        let claim = owner_record("sb3", 42, PacketIdBlock::new(5), Some((1207, 9)), "\nqueue");
        assert_eq!(claim, "sb3\n42\nids 5\nat 1207 9\nqueue");
        let value = claim.as_bytes();
        assert_eq!(owner_of(value), Some("sb3"));
        assert_eq!(owner_ids(value), Some(PacketIdBlock::new(5)));
        assert_eq!(owner_read(value), Some((1207, 9)));
        assert!(!wants_handover(value) && !offered(value));
        let clean = owner_record("sb3", 42, PacketIdBlock::new(5), None, "\nclean");
        assert_eq!(owner_read(clean.as_bytes()), None);
        assert!(started_clean(clean.as_bytes()));
        let offer = owner_record("sb1", 7, PacketIdBlock::new(2), Some((0, 0)), "\nleaving");
        assert_eq!(offer, "sb1\n7\nids 2\nat 0 0\nleaving");
        assert!(offered(offer.as_bytes()));
        assert_eq!(owner_read(offer.as_bytes()), Some((0, 0)));
    }

    #[test]
    fn an_owner_record_says_where_its_connect_read_the_session() {
        let read = b"sb3\n42\nids 5\nat 1207 1795900000123\nqueue";
        assert_eq!(owner_read(read), Some((1207, 1_795_900_000_123)));
        assert_eq!(owner_ids(read), Some(PacketIdBlock::new(5)));
        assert!(!wants_handover(read));
        assert!(wants_handover(b"sb3\n42\nids 5\nat 1207 1795900000123"));
        // A clean start reads nothing; an earlier version wrote no time.
        assert_eq!(owner_read(b"sb3\n42\nids 5\nclean"), None);
        assert_eq!(owner_read(b"sb3\n42\nids 5\nat 1207"), None);
    }
}
