use super::*;
use proptest::prelude::*;

fn m(p: &str, k: &str) -> bool {
    Pattern::new(p.as_bytes()).matches(k.as_bytes())
}

#[test]
fn stars_and_question_marks() {
    assert!(m("*", ""));
    assert!(m("*", "anything"));
    assert!(m("a*", "a"));
    assert!(m("a*c", "abbbc"));
    assert!(!m("a*c", "abbbd"));
    assert!(m("*a*a*a*b", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaab"));
    assert!(!m("*a*a*a*b", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"));
    assert!(m("?", "x"));
    assert!(!m("?", ""));
    assert!(!m("?", "xy"));
    assert!(m("k?y", "key"));
}

#[test]
fn classes() {
    assert!(m("[abc]", "b"));
    assert!(!m("[abc]", "d"));
    assert!(m("[a-c]x", "cx"));
    assert!(m("[c-a]", "b"));
    assert!(m("[!a-c]", "d"));
    // `^` is a member, not a negation (the official client's semantics).
    assert!(!m("[^a-c]", "d"));
    assert!(m("[^a-c]", "b"));
    assert!(m("[^0-9]", "^"));
    assert!(m("[^0-9]", "7"));
    assert!(!m("[^0-9]", "x"));
    assert!(!m("[!a-c]", "a"));
    assert!(m("[a-]", "-"));
    assert!(m("[\\]]", "]"));
    assert!(!m("[]", "a"));
    assert!(m("[!]", "a"));
    assert!(m("[", "["));
    assert!(m("[ab", "[ab"));
}

#[test]
fn escapes_and_binary() {
    assert!(m("\\*", "*"));
    assert!(!m("\\*", "a"));
    assert!(m("a\\", "a\\"));
    assert!(Pattern::new(b"\x00?\xff*").matches(b"\x00\r\xff\n\n"));
    assert!(Pattern::new(b"*").matches_everything());
    assert!(Pattern::new(b"**").matches_everything());
    assert!(!Pattern::new(b"a*").matches_everything());
}

/// An independent, naive (exponential) matcher straight from the table
/// in the module docs.
fn naive(p: &[u8], k: &[u8]) -> bool {
    match p.first() {
        None => k.is_empty(),
        Some(b'*') => (0..=k.len()).any(|i| naive(&p[1..], &k[i..])),
        Some(b'?') => !k.is_empty() && naive(&p[1..], &k[1..]),
        Some(b'\\') if p.len() > 1 => k.first() == Some(&p[1]) && naive(&p[2..], &k[1..]),
        Some(b'[') => {
            let body_start = if p.get(1) == Some(&b'!') { 2 } else { 1 };
            let mut j = body_start;
            let mut items = Vec::new();
            let mut closed = None;
            while j < p.len() {
                let mut c = p[j];
                if c == b']' {
                    closed = Some(j);
                    break;
                }
                if c == b'\\' {
                    j += 1;
                    if j >= p.len() {
                        break;
                    }
                    c = p[j];
                }
                j += 1;
                let mut hi = c;
                if p.get(j) == Some(&b'-') && j + 1 < p.len() && p[j + 1] != b']' {
                    hi = p[j + 1];
                    j += 2;
                    if hi == b'\\' {
                        if j >= p.len() {
                            break;
                        }
                        hi = p[j];
                        j += 1;
                    }
                }
                items.push((c.min(hi), c.max(hi)));
            }
            match closed {
                None => k.first() == Some(&b'[') && naive(&p[1..], &k[1..]),
                Some(end) => {
                    let Some(&b) = k.first() else { return false };
                    let hit = items.iter().any(|&(lo, hi)| lo <= b && b <= hi);
                    hit != (body_start == 2) && naive(&p[end + 1..], &k[1..])
                }
            }
        }
        Some(&c) => k.first() == Some(&c) && naive(&p[1..], &k[1..]),
    }
}

fn small_bytes(alphabet: &'static [u8], max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(proptest::sample::select(alphabet), 0..max)
}

proptest! {
    #[test]
    fn agrees_with_naive_matcher(
        p in small_bytes(b"ab*?[]!^-\\", 8),
        k in small_bytes(b"ab[]-\\!", 8),
    ) {
        prop_assert_eq!(Pattern::new(&p).matches(&k), naive(&p, &k), "pattern {:?} key {:?}", p, k);
    }

    #[test]
    fn agrees_with_regex_on_star_and_question(
        p in small_bytes(b"ab*?", 10),
        k in small_bytes(b"ab", 12),
    ) {
        let mut re = String::from("(?s-u)^");
        for &c in &p {
            match c {
                b'*' => re.push_str(".*"),
                b'?' => re.push('.'),
                c => re.push(c as char),
            }
        }
        re.push('$');
        let re = regex::bytes::Regex::new(&re).unwrap();
        prop_assert_eq!(Pattern::new(&p).matches(&k), re.is_match(&k));
    }
}

/// A glob piece and the same in `regex::bytes` syntax.
fn piece() -> impl Strategy<Value = (String, String)> {
    let fixed = |glob: &str, re: &str| Just((glob.to_owned(), re.to_owned()));
    prop_oneof![
        2 => fixed("*", ".*"),
        1 => fixed("?", "."),
        1 => fixed("b", "b"),
        1 => fixed("[ab]", "[ab]"),
        1 => fixed("[!b]", "[^b]"),
        1 => fixed("[^b]", "[b^]"),
        1 => fixed("[a-b]", "[a-b]"),
        1 => fixed("\\?", "\\?"),
        3 => (1..150usize).prop_map(|n| ("a".repeat(n), "a".repeat(n))),
    ]
}

/// A key made to match the glob pieces, or nearly: stars become runs
/// of `a` (now and then a `b`), and `flip` changes one byte.
fn instance(pieces: &[(String, String)], run: usize, flip: Option<usize>) -> Vec<u8> {
    let mut key = Vec::new();
    for (i, (glob, _)) in pieces.iter().enumerate() {
        match glob.as_str() {
            "*" => {
                key.extend(std::iter::repeat_n(b'a', (run * (i + 1)) % 97));
                if i % 3 == 0 {
                    key.push(b'b');
                }
            }
            "?" | "[ab]" | "[!b]" | "[a-b]" => key.push(b'a'),
            "[^b]" => key.push(b'^'),
            "\\?" => key.push(b'?'),
            literal => key.extend_from_slice(literal.as_bytes()),
        }
    }
    if let Some(at) = flip.filter(|_| !key.is_empty()) {
        let at = at % key.len();
        key[at] = if key[at] == b'a' { b'b' } else { b'a' };
    }
    key
}

/// Runs the matcher and checks that it took no more steps than its cost.
fn counted(pattern: &Pattern, key: &[u8]) -> bool {
    let cost = pattern.cost(key.len());
    STEPS.with(|s| s.set(0));
    let matched = pattern.matches(key);
    let steps = STEPS.with(|s| s.get());
    assert!(
        steps <= cost,
        "{steps} steps over the cost {cost} ({pattern:?}, key of {})",
        key.len()
    );
    matched
}

proptest! {
    /// Long segments (the multi-word search and its window), classes and
    /// stars against `regex::bytes`, on keys made to (nearly) match.
    #[test]
    fn long_segments_agree_with_regex(
        pieces in proptest::collection::vec(piece(), 0..8),
        run in 0..200usize,
        flip in proptest::option::of(0..1000usize),
        noise in small_bytes(b"aab", 40),
    ) {
        let glob: String = pieces.iter().map(|(g, _)| g.as_str()).collect();
        let re: String = pieces.iter().map(|(_, r)| r.as_str()).collect();
        let re = regex::bytes::Regex::new(&format!("(?s-u)^{re}$")).unwrap();
        let pattern = Pattern::new(glob.as_bytes());
        let key = instance(&pieces, run, flip);
        prop_assert_eq!(counted(&pattern, &key), re.is_match(&key), "{} on {:?}", glob, key);
        for key in [&noise[..], &[&key[..], &noise[..]].concat(), &[&noise[..], &key[..]].concat()] {
            prop_assert_eq!(counted(&pattern, key), re.is_match(key), "{} on {:?}", glob, key);
        }
    }

    /// The steps of every small case stay within the cost.
    #[test]
    fn steps_stay_within_the_cost(
        p in small_bytes(b"ab*?[]!-", 12),
        k in small_bytes(b"ab", 40),
    ) {
        counted(&Pattern::new(&p), &k);
    }
}

/// The probe's shapes, scaled down: long runs of `a` between stars
/// against keys of `a` with a `b` in various places, checked against
/// the naive matcher (where it is fast enough: two stars) and
/// `regex::bytes`.
#[test]
fn adversarial_runs_agree_with_the_naive_matcher() {
    let run = "a".repeat(300);
    for (glob, re) in [
        (format!("*{run}b"), format!("{run}b$")),
        (format!("*{run}b*"), format!("{run}b")),
        (format!("*{run}?*"), format!("{run}.")),
        (format!("*[ab]{run}b*a"), format!("[ab]{run}b.*a$")),
        (format!("a*{run}*{run}b*"), format!("^a.*{run}.*{run}b")),
        (format!("*?{run}[!a]*"), format!(".{run}[^a]")),
    ] {
        let pattern = Pattern::new(glob.as_bytes());
        let re = regex::bytes::Regex::new(&format!("(?s-u){re}")).unwrap();
        for len in [0usize, 299, 300, 301, 302, 601, 602, 700, 1000] {
            for b_at in [0, 1, 300, 301, len / 2, len.saturating_sub(1), len] {
                let mut key = vec![b'a'; len];
                if let Some(b) = key.get_mut(b_at) {
                    *b = b'b';
                }
                let matched = counted(&pattern, &key);
                assert_eq!(
                    matched,
                    re.is_match(&key),
                    "{glob} on {len} bytes, b at {b_at}"
                );
                if glob.matches('*').count() <= 2 {
                    assert_eq!(matched, naive(glob.as_bytes(), &key), "{glob} on {len}");
                }
            }
        }
    }
}

/// Segments of every size around a word next to each other in the
/// tables (packed into one word, or starting the next).
#[test]
fn neighbouring_segments_of_all_sizes() {
    let sizes = [1, 2, 31, 33, 63, 64, 65, 127, 128, 129];
    for &x in &sizes {
        for &y in &sizes {
            let (a, b) = ("a".repeat(x), "[b]".repeat(y));
            let glob = format!("?*{a}*{b}*?{a}*");
            let re = format!("(?s-u)^..*{a}.*{}.*.{a}.*$", "b".repeat(y));
            let re = regex::bytes::Regex::new(&re).unwrap();
            let pattern = Pattern::new(glob.as_bytes());
            let fits = format!("xx{a}x{}xx{a}", "b".repeat(y));
            let short = format!("xx{a}x{}x{a}", "b".repeat(y.saturating_sub(1)));
            let swapped = format!("x{}x{a}xx{a}", "b".repeat(y));
            for key in [fits, short, swapped] {
                let key = key.as_bytes();
                assert_eq!(
                    counted(&pattern, key),
                    re.is_match(key),
                    "{glob} on {key:?}"
                );
            }
            assert!(pattern.matches(format!("xx{a}x{}xx{a}", "b".repeat(y)).as_bytes()));
        }
    }
}

#[test]
fn cost_of_the_probe_and_of_typical_patterns() {
    let run = "a".repeat(32768);
    // The probe's pattern ends without a star: its end is checked first.
    assert_eq!(
        Pattern::new(format!("*{run}b").as_bytes()).cost(65536),
        32769
    );
    // With a star after it: 513 words for each of the 65536 bytes.
    // The first key also builds the tables: 513 words of 256 rows
    // zeroed and filled, a step per token.
    let probe = Pattern::new(format!("*{run}b*").as_bytes());
    assert_eq!(probe.cost(65536), 65536 * 513 + 2 * 256 * 513 + 32769);
    assert!(!counted(&probe, &vec![b'a'; 65536]));
    assert_eq!(probe.cost(65536), 65536 * 513);
    // A key shorter than the pattern's fixed tokens: one step.
    assert_eq!(probe.cost(1000), 1);
    assert_eq!(Pattern::new(b"prefix*").cost(100), 6);
    assert_eq!(Pattern::new(b"*mid*").cost(100), 100 + 2 * 256 + 3);
    assert_eq!(Pattern::new(b"[a-z]?x*").cost(100), 3);
    assert_eq!(Pattern::new(b"exact").cost(5), 5);
    assert_eq!(Pattern::new(b"exact").cost(6), 1);
}
