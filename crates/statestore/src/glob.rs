//! Glob patterns for SCAN, matched against raw key bytes.
//!
//! | pattern | matches |
//! |---|---|
//! | `*` | any run of bytes, the empty one included |
//! | `?` | exactly one byte |
//! | `[abc]` | one of the listed bytes |
//! | `[a-z]` | one byte in the range (a reversed range `[z-a]` means the same) |
//! | `[!abc]` | one byte not listed |
//! | `[^abc]` | `^`, `a`, `b` or `c`: `^` is an ordinary member, not a negation |
//! | `\x` | the byte `x` itself (so `\*` is a literal star) |
//!
//! `^` follows the official client rather than Redis: its tests assert that
//! `[^0-9]` matches a digit or a `^`, and a client developer must see here
//! what the real broker answers. A `[` without a closing `]` is a literal
//! `[`. Keys and patterns are bytes,
//! not text: `?` matches one byte of a multi-byte UTF-8 character.
//!
//! Why not a crate: `globset` matches *paths* (`**` and `{a,b}` alternates are
//! always special, patterns must be UTF-8) and `wildmatch`/`glob-match` take
//! `&str`. The matcher here is the classic single-backtrack-point algorithm,
//! so its cost is at most `O(pattern × key)` whatever the pattern (no
//! exponential blow-up on `*a*a*a*…`), and the tests check it against an
//! independent naive matcher.

/// A compiled pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    tokens: Vec<Token>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Byte(u8),
    AnyByte,
    AnyRun,
    Class {
        negated: bool,
        ranges: Vec<(u8, u8)>,
    },
}

impl Pattern {
    /// Compiles a pattern; every byte string is a valid pattern.
    pub fn new(pattern: &[u8]) -> Pattern {
        let mut tokens = Vec::with_capacity(pattern.len());
        let mut i = 0;
        while i < pattern.len() {
            let token = match pattern[i] {
                b'*' => {
                    // `**` is the same as `*`.
                    if tokens.last() != Some(&Token::AnyRun) {
                        tokens.push(Token::AnyRun);
                    }
                    i += 1;
                    continue;
                }
                b'?' => Token::AnyByte,
                b'\\' if i + 1 < pattern.len() => {
                    i += 1;
                    Token::Byte(pattern[i])
                }
                b'[' => match parse_class(pattern, i + 1) {
                    Some((token, next)) => {
                        tokens.push(token);
                        i = next;
                        continue;
                    }
                    None => Token::Byte(b'['),
                },
                b => Token::Byte(b),
            };
            tokens.push(token);
            i += 1;
        }
        Pattern { tokens }
    }

    /// Whether `key` matches the whole pattern.
    ///
    /// ```
    /// use statestore::glob::Pattern;
    /// assert!(Pattern::new(b"sensor-[0-9]?/*").matches(b"sensor-1a/temp"));
    /// assert!(!Pattern::new(b"sensor-[!0-9]*").matches(b"sensor-1"));
    /// ```
    pub fn matches(&self, key: &[u8]) -> bool {
        let tokens = &self.tokens;
        let (mut t, mut k) = (0, 0);
        // Where to resume after the last `*`: (token after it, key position).
        let mut backtrack: Option<(usize, usize)> = None;
        while k < key.len() {
            if let Some(token) = tokens.get(t) {
                if *token == Token::AnyRun {
                    backtrack = Some((t + 1, k));
                    t += 1;
                    continue;
                }
                if token.matches_byte(key[k]) {
                    t += 1;
                    k += 1;
                    continue;
                }
            }
            // Mismatch: let the last `*` swallow one more byte, or fail.
            match backtrack {
                Some((bt, bk)) => {
                    backtrack = Some((bt, bk + 1));
                    t = bt;
                    k = bk + 1;
                }
                None => return false,
            }
        }
        tokens[t..].iter().all(|token| *token == Token::AnyRun)
    }

    /// Whether the pattern is `*`: SCAN then skips matching altogether.
    pub fn matches_everything(&self) -> bool {
        self.tokens == [Token::AnyRun]
    }
}

impl Token {
    fn matches_byte(&self, b: u8) -> bool {
        match self {
            Token::Byte(x) => *x == b,
            Token::AnyByte => true,
            Token::AnyRun => true,
            Token::Class { negated, ranges } => {
                ranges.iter().any(|&(lo, hi)| lo <= b && b <= hi) != *negated
            }
        }
    }
}

/// Parses a class body starting after `[`; `None` if no `]` closes it.
fn parse_class(pattern: &[u8], mut i: usize) -> Option<(Token, usize)> {
    let negated = pattern.get(i) == Some(&b'!');
    if negated {
        i += 1;
    }
    let mut ranges = Vec::new();
    loop {
        let mut lo = *pattern.get(i)?;
        match lo {
            b']' => return Some((Token::Class { negated, ranges }, i + 1)),
            b'\\' => {
                i += 1;
                lo = *pattern.get(i)?;
            }
            _ => {}
        }
        i += 1;
        let mut hi = lo;
        if pattern.get(i) == Some(&b'-') && !matches!(pattern.get(i + 1), None | Some(b']')) {
            i += 1;
            hi = pattern[i];
            if hi == b'\\' {
                i += 1;
                hi = *pattern.get(i)?;
            }
            i += 1;
        }
        ranges.push((lo.min(hi), lo.max(hi)));
    }
}

#[cfg(test)]
mod tests {
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
}
