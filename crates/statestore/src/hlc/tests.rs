use super::*;
use proptest::prelude::*;

/// 100,000 versions in one millisecond: the counter stays within five
/// digits (the clients' `{:05}`), the versions keep increasing.
#[test]
fn the_counter_keeps_five_digits() {
    let mut clock = HybridClock::starting_after(Version::default());
    let mut last = clock.next(1_000, None);
    for _ in 0..250_000 {
        let v = clock.next(1_000, None);
        assert!(v > last);
        assert!(u64::from(v.counter) <= MAX_COUNTER, "{v:?}");
        assert_eq!(v.format("n").len(), "000000000001000:00000:n".len());
        last = v;
    }
    assert!(last.wall_ms > 1_000);
    // A client's __ts at the last counter: the next millisecond.
    let at_edge: Hlc = "5000:99999:c".parse().unwrap();
    let v = clock.next(1_000, Some(&at_edge));
    assert_eq!((v.wall_ms, v.counter), (5_001, 0));
}

proptest! {
    /// The hand-written digits are `format!`'s, padding and all, and
    /// read back as the same time.
    #[test]
    fn format_is_the_padded_wire_form(
        // About the fixed widths' limits (10^15 ms, 10^5), and anything.
        wall_ms in prop_oneof![0u64..2_000_000_000_000_000, any::<u64>()],
        counter in prop_oneof![0u32..200_000, any::<u32>()],
        // Node ids kept inline (up to 26 bytes) and longer ones.
        node in "[a-z0-9-]{0,40}",
    ) {
        let v = Version { wall_ms, counter };
        let text = v.format(&node);
        let expected = format!("{wall_ms:015}:{counter:05}:{node}");
        prop_assert_eq!(&text, &expected);
        prop_assert_eq!(text.clone(), Stamp::from(expected.as_str()));
        prop_assert_eq!(text.to_string(), expected);
        if !node.is_empty() {
            let back: Hlc = text.parse().unwrap();
            prop_assert_eq!((back.wall_ms, back.counter), (wall_ms, u64::from(counter)));
        }
    }
}

proptest! {
    /// The byte parser accepts exactly what the old one (`splitn`,
    /// all-digits check, `u64::from_str`) accepted, with the same value.
    #[test]
    fn parse_is_the_strict_wire_form(s in prop_oneof![
        "[0-9:+a-z-]{0,30}",
        // The fixed-width form and near misses: bytes about the digits'
        // range ('/' below, ':' to '@' above) where digits go.
        "[0-9]{15}:[0-9]{5}:[a-z0-9:-]{0,12}",
        "[0-9/:;@]{15}:[0-9/:;@]{5}:[a-z]{0,3}",
        "[0-9]{14,16}:[0-9]{4,6}:[a-z]{0,3}",
        "[0-9]{0,21}:[+0-9]{0,6}:[a-z:]{0,4}",
        // About u64::MAX: 19, 20 and 21 digits, in range and not.
        "(1844674407370955161[0-9]|[0-9]{19}|0[0-9]{19}|1[0-8][0-9]{18}):[0-9]{1,21}:[a-z]{0,3}",
    ]) {
        let old = || -> Option<(u64, u64, String)> {
            let mut parts = s.splitn(3, ':');
            let digits = |p: Option<&str>| {
                p.filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))?
                    .parse::<u64>()
                    .ok()
            };
            let (w, c) = (digits(parts.next())?, digits(parts.next())?);
            let node = parts.next()?;
            (!node.contains(':')).then(|| (w, c, node.to_owned()))
        };
        let new = s.parse::<Hlc>().ok().map(|h| (h.wall_ms, h.counter, h.node));
        prop_assert_eq!(new, old());
    }
}

/// Eight bytes at a time: every byte value at every position, the
/// others digits, against a digit-by-digit reading.
#[test]
fn eight_digits_is_the_digit_by_digit_value() {
    for at in 0..8 {
        for b in 0..=255u8 {
            let mut chunk = *b"31415926";
            chunk[at] = b;
            let expected = chunk.iter().try_fold(0u64, |n, &c| {
                c.is_ascii_digit().then(|| n * 10 + u64::from(c - b'0'))
            });
            assert_eq!(super::eight_digits(&chunk), expected, "{chunk:?}");
        }
    }
    assert_eq!(super::eight_digits(b"00000000"), Some(0));
    assert_eq!(super::eight_digits(b"99999999"), Some(99_999_999));
}

/// The fixed widths at their edges, as `format!` writes them.
#[test]
fn the_fixed_widths_edges_are_formatted_and_read_back() {
    for (wall_ms, counter) in [
        (0, 0),
        (9, 9),
        (10, 10),
        (999_999_999_999_999, 99_999),
        (1_000_000_000_000_000, 100_000),
        (1_764_547_200_000, 12),
    ] {
        let text = Version { wall_ms, counter }.format("n");
        assert_eq!(text, format!("{wall_ms:015}:{counter:05}:n"));
        let back = hlc(&text);
        assert_eq!((back.wall_ms, back.counter), (wall_ms, u64::from(counter)));
    }
}

#[test]
fn the_largest_times_parse_and_one_more_is_refused() {
    let max = "18446744073709551615:18446744073709551615:n";
    assert_eq!(hlc(max).wall_ms, u64::MAX);
    assert_eq!(hlc(max).counter, u64::MAX);
    assert_eq!(
        hlc("9999999999999999999:0000000000000000000018446744073709551615:n").counter,
        u64::MAX
    );
    for s in [
        "18446744073709551616:0:n",
        "0:18446744073709551616:n",
        "99999999999999999999:0:n",
    ] {
        assert!(s.parse::<Hlc>().is_err(), "{s}");
    }
}

#[test]
fn format_pads_small_and_keeps_large_numbers() {
    let v = |wall_ms, counter| Version { wall_ms, counter }.format("n");
    assert_eq!(v(0, 0), "000000000000000:00000:n");
    assert_eq!(v(1_700_000_000_000, 3), "001700000000000:00003:n");
    assert_eq!(v(u64::MAX, u32::MAX), "18446744073709551615:4294967295:n");
}

fn hlc(s: &str) -> Hlc {
    s.parse().unwrap()
}

#[test]
fn parses_padded_and_plain_forms() {
    assert_eq!(hlc("000000000000010:00002:n"), hlc("10:2:n"));
    assert_eq!(hlc("10:2:").node, "");
}

#[test]
fn rejects_malformed() {
    for s in [
        "",
        "1",
        "1:2",
        "a:2:n",
        "1:b:n",
        "-1:2:n",
        "1:2:n:extra",
        " 1:2:n",
        "99999999999999999999:2:n",
        "1:99999999999999999999:n",
        // The fixed widths, each part wrong in turn.
        "00000170000000a:00003:n",
        "000001700000000:0a003:n",
        "000001700000000:+0003:n",
        "000001700000000:0000/:n",
        "000001700000000:00003:n:x",
    ] {
        assert!(s.parse::<Hlc>().is_err(), "{s}");
        assert!(Hlc::time_only(s).is_err(), "{s}");
    }
}

#[test]
fn formats_like_the_clients() {
    let v = Version {
        wall_ms: 1_700_000_000_123,
        counter: 7,
    };
    assert_eq!(v.format("sb"), "001700000000123:00007:sb");
    assert_eq!(hlc(&v.format("sb")), v.to_hlc("sb"));
}

#[test]
fn next_beats_received_on_the_same_millisecond() {
    let mut clock = HybridClock::starting_after(Version::default());
    let v = clock.next(100, Some(&hlc("100:41:x")));
    assert_eq!(
        v,
        Version {
            wall_ms: 100,
            counter: 42
        }
    );
    let v = clock.next(100, Some(&hlc("100:3:x")));
    assert_eq!(
        v,
        Version {
            wall_ms: 100,
            counter: 43
        }
    );
    let v = clock.next(101, None);
    assert_eq!(
        v,
        Version {
            wall_ms: 101,
            counter: 0
        }
    );
}

#[test]
fn counter_overflow_moves_to_the_next_millisecond() {
    let mut clock = HybridClock::starting_after(Version::default());
    let v = clock.next(100, Some(&hlc(&format!("100:{}:x", u64::MAX))));
    assert_eq!(
        v,
        Version {
            wall_ms: 101,
            counter: 0
        }
    );
    let v = clock.next(100, Some(&hlc(&format!("200:{}:x", u32::MAX))));
    assert_eq!(
        v,
        Version {
            wall_ms: 201,
            counter: 0
        }
    );
    assert_eq!(
        cmp_version_hlc(v, &hlc(&format!("200:{}:x", u32::MAX))),
        Ordering::Greater
    );
}

#[test]
fn skew_check() {
    assert!(!hlc("160000:0:n").is_ahead_of(100_000, 60_000));
    assert!(hlc("160001:0:n").is_ahead_of(100_000, 60_000));
    assert!(!hlc(&format!("{}:0:n", u64::MAX)).is_ahead_of(u64::MAX, 1));
}
