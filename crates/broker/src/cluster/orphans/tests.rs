use super::*;

/// Every node picks the same adopter; a member's departure moves only
/// the sessions it was first for; sessions spread over the members.
#[test]
fn the_adopter_is_the_same_everywhere_and_departures_move_only_its_sessions() {
    let three: [&[u8]; 3] = [b"sb1", b"sb2", b"sb3"];
    let two: [&[u8]; 2] = [b"sb1", b"sb3"];
    let mut counts = HashMap::new();
    for i in 0..300 {
        let client = format!("client-{i}");
        let first = first_ranked(client.as_bytes(), &three).unwrap();
        let reversed: Vec<&[u8]> = three.iter().rev().copied().collect();
        assert_eq!(first_ranked(client.as_bytes(), &reversed), Some(first));
        let after = first_ranked(client.as_bytes(), &two).unwrap();
        if first != b"sb2" {
            assert_eq!(after, first, "{client} moved though its node stayed");
        }
        *counts.entry(first).or_insert(0) += 1;
    }
    assert_eq!(counts.len(), 3);
    assert!(counts.values().all(|&n| n > 50), "{counts:?}");
    assert_eq!(first_ranked(b"c", &[]), None);
}
