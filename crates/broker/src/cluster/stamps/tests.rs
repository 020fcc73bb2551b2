//! The unit tests of [`super::Stamps`].

use super::*;

fn stamps() -> Stamps {
    Stamps::new("b", 7)
}

#[test]
fn stamps_number_this_runs_publishes_from_one() {
    let s = stamps();
    assert_eq!(s.stamp(), "b/7/1");
    let second = s.stamp();
    assert_eq!(second, "b/7/2");
    assert_eq!(parse(&second), Some(("b/7", 2)));
}

#[test]
fn a_stamp_is_read_back_or_refused() {
    assert_eq!(parse("b/7/2"), Some(("b/7", 2)));
    assert_eq!(
        parse("node-1/18c5a3/1234567"),
        Some(("node-1/18c5a3", 1_234_567))
    );
    assert_eq!(
        parse("b/7/9999999999999999999"),
        Some(("b/7", 9_999_999_999_999_999_999))
    );
    for bad in [
        "b/7/0",
        "7/2",
        "b/7/x",
        "b/7/1x",
        "b/7/",
        "/",
        "//",
        "",
        "12",
        "b/7/18446744073709551616",
        "b/7/99999999999999999999",
        "b/7/+1",
    ] {
        assert_eq!(parse(bad), None, "{bad:?}");
    }
}

#[test]
fn a_message_that_arrived_after_the_session_was_taken_was_had() {
    let s = stamps();
    for n in 1..=5 {
        s.arrived(&format!("a/1/{n}"));
    }
    s.taken("c", ["t/#", "$share/g/u"]);
    for n in 6..=8 {
        s.arrived(&format!("a/1/{n}"));
    }
    // Before the session was taken: the router did not give it.
    assert!(!s.had("c", "a/1/5", "t/x"));
    assert!(s.had("c", "a/1/6", "t/x"));
    assert!(s.had("c", "a/1/8", "t/x"));
    // Not come yet.
    assert!(!s.had("c", "a/1/9", "t/x"));
    // Only a shared subscription matches: maybe another member's.
    assert!(!s.had("c", "a/1/7", "u"));
    // Another session, another origin, no stamp.
    assert!(!s.had("d", "a/1/7", "t/x"));
    assert!(!s.had("c", "e/1/7", "t/x"));
    assert!(!s.had("c", "", "t/x"));
}

#[test]
fn an_origin_first_heard_of_after_the_session_was_taken_counts_from_its_first() {
    let s = stamps();
    s.taken("c", ["t"]);
    s.arrived("a/2/40");
    s.arrived("a/2/41");
    assert!(!s.had("c", "a/2/39", "t"));
    assert!(s.had("c", "a/2/40", "t"));
    assert!(s.had("c", "a/2/41", "t"));
}

#[test]
fn a_number_lost_on_the_way_was_not_had_and_one_late_was() {
    let s = stamps();
    s.arrived("a/1/1");
    s.taken("c", ["t"]);
    s.arrived("a/1/2");
    // 3 and 4 not passed on.
    s.arrived("a/1/5");
    assert!(s.had("c", "a/1/2", "t"));
    assert!(!s.had("c", "a/1/3", "t"));
    assert!(s.had("c", "a/1/5", "t"));
    // Sent again after the link reconnected: given to the session.
    s.arrived("a/1/4");
    assert!(s.had("c", "a/1/4", "t"));
    assert!(!s.had("c", "a/1/3", "t"));
}

#[test]
fn a_qos2_publish_counts_from_its_release() {
    let s = stamps();
    let _ = s.held("a", 7, "a/1/1");
    let _ = s.held("a", 8, "a/1/2");
    s.arrived("a/1/3");
    let _ = s.released("a", 7, true, &mut Vec::new());
    // 2 waits for its PUBREL while the session is taken: the router
    // gives it to the session at the release.
    s.taken("c", ["t"]);
    let _ = s.released("a", 8, true, &mut Vec::new());
    assert!(!s.had("c", "a/1/1", "t"));
    assert!(s.had("c", "a/1/2", "t"));
    assert!(!s.had("c", "a/1/3", "t"));
    // Held after the session was taken, released or not.
    let _ = s.held("a", 9, "a/1/4");
    let _ = s.held("a", 10, "a/1/5");
    assert!(!s.had("c", "a/1/4", "t"));
    let _ = s.released("a", 9, true, &mut Vec::new());
    let _ = s.released("a", 10, false, &mut Vec::new());
    assert!(s.had("c", "a/1/4", "t"));
    // A copy the router discarded at its PUBREL.
    assert!(!s.had("c", "a/1/5", "t"));
    // A PUBREL of nothing held.
    let _ = s.released("a", 11, true, &mut Vec::new());
}

#[test]
fn a_qos2_publish_is_in_the_router_once_its_pubrel_was_sent() {
    let s = stamps();
    let _ = s.held("a", 7, "a/1/1");
    let _ = s.held("a", 8, "a/1/2");
    let _ = s.held("b", 8, "a/1/2");
    assert!(!s.in_router("a/1/1"));
    let mut sending = Vec::new();
    let _ = s.released("a", 7, true, &mut sending);
    assert_eq!(sending, ["a/1/1"]);
    // Released, its PUBREL not yet in the router's queue.
    assert!(s.state.lock().came("a/1/1"));
    assert!(!s.in_router("a/1/1"));
    s.sent(&mut sending);
    assert!(sending.is_empty());
    assert!(s.in_router("a/1/1"));
    // Two copies of one stamp in transit: in the router once both went.
    let (mut one, mut two) = (Vec::new(), Vec::new());
    let _ = s.released("a", 8, true, &mut one);
    let _ = s.released("b", 8, true, &mut two);
    s.sent(&mut one);
    assert!(!s.in_router("a/1/2"));
    s.sent(&mut two);
    assert!(s.in_router("a/1/2"));
    // A copy the router discards is not in transit, nor in the router.
    let _ = s.held("a", 9, "a/1/3");
    let mut discarded = Vec::new();
    let _ = s.released("a", 9, false, &mut discarded);
    assert!(discarded.is_empty());
    assert!(!s.in_router("a/1/3"));
}

fn direct() -> Direct {
    Direct::handed_over(crate::codec::publish(b"t", b"x", 1, 0, false), None, None)
}

#[test]
fn a_handed_over_copy_of_one_held_for_its_pubrel_waits_for_the_release() {
    let s = stamps();
    s.taken("c", ["t"]);
    let _ = s.held("link", 4, "a/1/1");
    assert_eq!(s.judge("c", "a/1/1", "t"), Verdict::Coming);
    assert!(s.hold_back("a/1/1", "c", direct()).is_none());
    // Released, and the router delivers its copy: the one held back goes.
    assert!(s.released("link", 4, true, &mut Vec::new()).is_empty());
    assert_eq!(s.judge("c", "a/1/1", "t"), Verdict::Had);
    // Discarded at its release: the one held back is delivered.
    let _ = s.held("link", 5, "a/1/2");
    assert!(s.hold_back("a/1/2", "c", direct()).is_none());
    let back = s.released("link", 5, false, &mut Vec::new());
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].client, "c");
    // Not released in time: given back.
    let _ = s.held("link", 6, "a/1/3");
    assert!(s.hold_back("a/1/3", "c", direct()).is_none());
    assert_eq!(s.give_back("a/1/3").len(), 1);
    assert!(s.released("link", 6, true, &mut Vec::new()).is_empty());
    // Nothing held for it: not held back.
    assert_eq!(s.judge("c", "a/1/9", "t"), Verdict::New);
    assert!(s.hold_back("a/1/9", "c", direct()).is_some());
    // Its packet id taken by another publish (its copy forgotten):
    // given back.
    let _ = s.held("link", 7, "a/1/4");
    assert!(s.hold_back("a/1/4", "c", direct()).is_none());
    assert_eq!(s.held("link", 7, "a/1/5").len(), 1);
    // Two copies held (one sent again through another node): the
    // first delivered at its release, the other discarded at its own.
    let _ = s.held("link", 8, "a/1/6");
    let _ = s.held("other", 1, "a/1/6");
    assert!(s.hold_back("a/1/6", "c", direct()).is_none());
    assert!(s.released("other", 1, true, &mut Vec::new()).is_empty());
    assert!(s.released("link", 8, false, &mut Vec::new()).is_empty());
    assert_eq!(s.state.lock().held_back_count, 0);
}

#[test]
fn numbers_far_below_the_last_are_not_told() {
    let s = stamps();
    s.taken("c", ["t"]);
    s.arrived("a/1/1");
    s.arrived(&format!("a/1/{}", WINDOW + 1));
    assert!(!s.had("c", "a/1/1", "t"));
    assert!(s.had("c", &format!("a/1/{}", WINDOW + 1), "t"));
    s.arrived("a/1/2");
    assert!(s.had("c", "a/1/2", "t"));
}

#[test]
fn this_nodes_own_publishes_are_told_as_they_go_to_the_router() {
    let s = stamps();
    let before = s.stamp();
    s.arrived(&before);
    let (held, late) = (s.stamp(), s.stamp());
    let _ = s.held("client", 3, &held);
    s.taken("c", ["t"]);
    s.arrived(&late);
    let after = s.stamp();
    s.arrived(&after);
    let _ = s.released("client", 3, true, &mut Vec::new());
    assert!(!s.had("c", &before, "t"));
    assert!(s.had("c", &held, "t"));
    assert!(s.had("c", &late, "t"));
    assert!(s.had("c", &after, "t"));
    // Given, not passed on.
    assert!(!s.had("c", &s.stamp(), "t"));
    // Another run of this node: an origin like any other.
    assert!(!s.had("c", "b/6/2", "t"));
}

#[test]
fn a_session_taken_again_is_told_from_then() {
    let s = stamps();
    s.taken("c", ["t"]);
    s.arrived("a/1/1");
    s.taken("c", ["t"]);
    s.arrived("a/1/2");
    assert!(!s.had("c", "a/1/1", "t"));
    assert!(s.had("c", "a/1/2", "t"));
    // Not taken after all.
    s.forget("c");
    assert!(!s.had("c", "a/1/2", "t"));
}

#[test]
fn origins_and_sessions_are_bounded() {
    let s = stamps();
    for n in 0..MAX_ORIGINS + 5 {
        s.arrived(&format!("n{n}/1/1"));
    }
    for n in 0..MAX_TAKEN + 5 {
        s.taken(&format!("c{n}"), ["t"]);
    }
    for n in 0..MAX_HELD + 5 {
        let _ = s.held(&format!("n{}", n / 60_000), (n % 60_000) as u16, "a/1/1");
    }
    let state = s.state.lock();
    assert_eq!(state.arrived.len(), MAX_ORIGINS);
    assert_eq!(state.taken.len(), MAX_TAKEN);
    assert_eq!(state.held.len(), MAX_HELD);
    assert!(state.taken.values().all(|t| t.seen.len() <= MAX_ORIGINS));
    assert!(!state.arrived.contains_key("n0/1"));
    assert!(state.taken.contains_key(&format!("c{}", MAX_TAKEN + 4)));
}
