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
//! `&str`.
//!
//! # Cost
//!
//! A key is matched in at most [`Pattern::cost`] steps, which SCAN charges
//! against its page budget before it matches the key. The pattern is cut at
//! its stars into segments of single-byte tokens: the segment before the
//! first star must match the start of the key and the one after the last
//! star its end (one step per token), and the segments between stars are
//! found one after the other, each at its leftmost place after the previous
//! one (greedy is exact for globs: a leftmost place leaves the most room
//! for the rest). That search is a bit-parallel automaton (Shift-And): one
//! step is one 64-bit word of "the first i tokens of the segment match
//! here" updated for one key byte, so a key byte costs one step for a
//! segment of up to 64 tokens and `segment / 64` for a longer one, or less:
//! only the states that can still fit in the key are updated, at most
//! `key − fixed tokens + 1` of them. In all, a key of `n` bytes costs at most
//! `n × min(⌈longest segment / 64⌉, ⌈(n − fixed + 1) / 64⌉ + 1)` steps,
//! whatever the pattern's length: about `n²/128` for the worst pattern. For
//! a key of 64 KiB of `a` and `*` + 32768 `a` + `b*` that is 33.6 million
//! steps (114 million instructions measured with callgrind, 7 to 18 ms on a
//! shared 2-core VM), where the classic backtracking matcher this replaces
//! took `pattern × key` (about 22 billion instructions, 2 to 3 s).
//! Patterns without stars, `prefix*`, `*suffix` and keys shorter than the
//! pattern's fixed tokens cost a step per pattern token at most. A step of
//! a short segment (one word) is the dearest, about 17 instructions with
//! the loop around it; a word of a long segment's state about 4.
//!
//! The search's tables (a row of bits per byte value: 32 to 64 bytes per
//! token between stars, 2 KiB at least) are built the first time a key is
//! long enough to need them, so a huge pattern that no key can match costs
//! only its parsing; [`Pattern::cost`] counts building them until they
//! are. The tests check the matcher against an independent naive matcher
//! and `regex::bytes`, and that no match takes more steps than its cost.

use std::sync::OnceLock;

/// A compiled pattern.
#[derive(Clone)]
pub struct Pattern {
    tokens: Vec<Token>,
    /// Whether there is a `*` at all.
    star: bool,
    /// Tokens that match one byte each: the shortest key that can match.
    fixed: usize,
    /// Tokens before the first star (all of them without a star).
    head: usize,
    /// Tokens after the last star.
    tail: usize,
    /// The segments between two stars, in order.
    middles: Vec<Segment>,
    /// Tokens of the longest segment in `middles`.
    longest: usize,
    /// Bits of the search tables: the sum of the middle segments' tokens,
    /// each segment placed so that one of up to 64 tokens sits in one word
    /// and a longer one starts a word.
    bits: usize,
    /// Classes (`[…]`) between stars.
    classes: usize,
    /// The search tables, built on first use.
    tables: OnceLock<Box<[u64]>>,
}

/// A run of single-byte tokens between two stars.
#[derive(Debug, Clone, Copy)]
struct Segment {
    /// Index of its first token.
    start: usize,
    /// Number of tokens.
    len: usize,
    /// Its first bit in each row of the tables.
    bit: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Byte(u8),
    AnyByte,
    AnyRun,
    /// The bytes a class matches, negation applied: bit `b` of the 256.
    Class([u64; 4]),
}

impl PartialEq for Pattern {
    fn eq(&self, other: &Pattern) -> bool {
        self.tokens == other.tokens
    }
}

impl Eq for Pattern {}

impl std::fmt::Debug for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pattern")
            .field("tokens", &self.tokens)
            .finish_non_exhaustive()
    }
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
        Pattern::plan(tokens)
    }

    fn plan(tokens: Vec<Token>) -> Pattern {
        let stars: Vec<usize> = (0..tokens.len())
            .filter(|&i| tokens[i] == Token::AnyRun)
            .collect();
        let (head, tail) = match (stars.first(), stars.last()) {
            (Some(&first), Some(&last)) => (first, tokens.len() - last - 1),
            _ => (tokens.len(), 0),
        };
        let mut middles = Vec::new();
        let mut bits = 0;
        for pair in stars.windows(2) {
            let (start, len) = (pair[0] + 1, pair[1] - pair[0] - 1);
            // Stars are collapsed, so no segment between two is empty.
            if len > 64 || bits % 64 + len > 64 {
                bits = bits.next_multiple_of(64);
            }
            middles.push(Segment {
                start,
                len,
                bit: bits,
            });
            bits += len;
        }
        let classes = middles
            .iter()
            .flat_map(|s| &tokens[s.start..s.start + s.len])
            .filter(|t| matches!(t, Token::Class(_)))
            .count();
        Pattern {
            star: !stars.is_empty(),
            fixed: tokens.len() - stars.len(),
            head,
            tail,
            longest: middles.iter().map(|s| s.len).max().unwrap_or(0),
            middles,
            bits,
            classes,
            tables: OnceLock::new(),
            tokens,
        }
    }

    /// Whether `key` matches the whole pattern.
    ///
    /// ```
    /// use statestore::glob::Pattern;
    /// assert!(Pattern::new(b"sensor-[0-9]?/*").matches(b"sensor-1a/temp"));
    /// assert!(!Pattern::new(b"sensor-[!0-9]*").matches(b"sensor-1"));
    /// ```
    pub fn matches(&self, key: &[u8]) -> bool {
        let n = key.len();
        let tokens = &self.tokens;
        if !self.star {
            return n == tokens.len() && anchored(tokens, key);
        }
        if n < self.fixed
            || !anchored(&tokens[tokens.len() - self.tail..], &key[n - self.tail..])
            || !anchored(&tokens[..self.head], key)
        {
            return false;
        }
        if self.middles.is_empty() {
            return true;
        }
        let tables = self.tables.get_or_init(|| self.build_tables());
        let words = self.bits.div_ceil(64);
        // Room the segments still to be found need at the end.
        let mut rest = self.fixed - self.head - self.tail;
        let (mut at, end) = (self.head, n - self.tail);
        let mut state = Vec::new();
        for segment in &self.middles {
            rest -= segment.len;
            let text = &key[at..end - rest];
            let found = if segment.len <= 64 {
                find_short(tables, words, segment, text)
            } else {
                find_long(tables, words, segment, text, &mut state)
            };
            match found {
                Some(len) => at += len,
                None => return false,
            }
        }
        true
    }

    /// At most how many steps [`Pattern::matches`] takes for a key of
    /// `key_len` bytes (see the module docs; at least 1), building the
    /// search tables included while they are not built.
    ///
    /// ```
    /// use statestore::glob::Pattern;
    /// assert_eq!(Pattern::new(b"sensor-*").cost(100), 7);
    /// // Segments of up to 64 tokens between stars: a step per key byte
    /// // (and 2 × 256 + 3 to build the tables the first time).
    /// let pattern = Pattern::new(b"*mid*");
    /// assert_eq!(pattern.cost(100), 100 + 515);
    /// assert!(pattern.matches(b"pyramids"));
    /// assert_eq!(pattern.cost(100), 100);
    /// ```
    pub fn cost(&self, key_len: usize) -> u64 {
        let n = key_len as u64;
        let anchored = (self.head + self.tail) as u64;
        let fixed = self.fixed as u64;
        let steps = if !self.star {
            if n == fixed { n } else { 0 }
        } else if n < fixed {
            0
        } else if self.middles.is_empty() {
            anchored
        } else {
            let longest = (self.longest as u64).div_ceil(64);
            let window = (n - fixed + 1).div_ceil(64) + 1;
            let per_byte = if self.longest <= 64 {
                1
            } else {
                longest.min(window)
            };
            let build = match self.tables.get() {
                Some(_) => 0,
                None => self.build_cost(),
            };
            anchored + (n - anchored) * per_byte + build
        };
        steps.max(1)
    }

    /// Whether the pattern is `*`: SCAN then skips matching altogether.
    pub fn matches_everything(&self) -> bool {
        self.tokens == [Token::AnyRun]
    }

    /// The search tables: for each byte value, a row of `bits` bits, bit
    /// `segment.bit + i` set when the segment's token `i` matches that byte.
    /// Filled a row at a time (a row per byte value, `bits / 8` bytes
    /// apart, rather than a token at a time, which touches 256 rows per
    /// `?`): `build_cost` steps.
    fn build_tables(&self) -> Box<[u64]> {
        let words = self.bits.div_ceil(64);
        step(self.build_cost() as usize);
        let mut tables = vec![0u64; 256 * words].into_boxed_slice();
        let mut any = vec![0u64; words];
        let mut classes = Vec::new();
        for segment in &self.middles {
            for i in 0..segment.len {
                let bit = segment.bit + i;
                let (word, mask) = (bit / 64, 1u64 << (bit % 64));
                match &self.tokens[segment.start + i] {
                    Token::Byte(b) => tables[usize::from(*b) * words + word] |= mask,
                    Token::AnyByte => any[word] |= mask,
                    Token::Class(bytes) => classes.push((word, mask, bytes)),
                    Token::AnyRun => unreachable!("no star inside a segment"),
                }
            }
        }
        if classes.is_empty() && any.iter().all(|&w| w == 0) {
            return tables;
        }
        for (b, row) in tables.chunks_exact_mut(words).enumerate() {
            for (word, any) in row.iter_mut().zip(&any) {
                *word |= any;
            }
            for &(word, mask, bytes) in &classes {
                if bytes[b / 64] >> (b % 64) & 1 == 1 {
                    row[word] |= mask;
                }
            }
        }
        tables
    }

    /// Steps of [`Pattern::build_tables`]: two passes over the tables, a
    /// step per token between stars, and 256 per class among them.
    fn build_cost(&self) -> u64 {
        let words = self.bits.div_ceil(64) as u64;
        let tokens = (self.fixed - self.head - self.tail) as u64;
        2 * 256 * words + tokens + 256 * self.classes as u64
    }
}

/// The glob steps a page of matches may spend (a SCAN page's, see
/// `command::STEPS_PER_PAGE`; a cluster node's over etcd's records too).
#[derive(Debug, Clone, Copy)]
pub struct StepBudget {
    spent: u64,
    max: u64,
}

impl StepBudget {
    /// A budget of `max` steps.
    pub fn new(max: u64) -> StepBudget {
        StepBudget { spent: 0, max }
    }

    /// Charges a key's [`Pattern::cost`] before it is matched; `false`: the
    /// page ends before that key, which it never does at its `first`
    /// (every page moves on, so a scan ends).
    pub fn take(&mut self, cost: u64, first: bool) -> bool {
        let spent = self.spent.saturating_add(cost);
        if spent > self.max && !first {
            return false;
        }
        self.spent = spent;
        true
    }
}

#[cfg(test)]
thread_local! {
    /// Steps taken by this thread's matches, to check [`Pattern::cost`].
    static STEPS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts `n` steps (in tests only).
#[inline(always)]
fn step(n: usize) {
    #[cfg(test)]
    STEPS.with(|s| s.set(s.get() + n as u64));
    let _ = n;
}

/// Whether the key bytes match the tokens one for one (`key` may be
/// longer).
fn anchored(tokens: &[Token], key: &[u8]) -> bool {
    step(tokens.len());
    tokens
        .iter()
        .zip(key)
        .all(|(token, &b)| token.matches_byte(b))
}

/// The end of the leftmost place in `text` where `segment` (of up to 64
/// tokens) matches: one word of state, one step per byte.
fn find_short(tables: &[u64], words: usize, segment: &Segment, text: &[u8]) -> Option<usize> {
    let (word, shift) = (segment.bit / 64, segment.bit % 64);
    let last = 1u64 << (segment.len - 1);
    // Bit i: the segment's first i + 1 tokens match the bytes up to here.
    // Bits above the segment's last are left over from the tokens after it
    // in the row and never reach its bits.
    let mut state = 0u64;
    for (i, &b) in text.iter().enumerate() {
        step(1);
        state = ((state << 1) | 1) & (tables[usize::from(b) * words + word] >> shift);
        if state & last != 0 {
            return Some(i + 1);
        }
    }
    None
}

/// [`find_short`] for a segment of more than 64 tokens (which starts a
/// word): its state is `⌈len / 64⌉` words, of which each byte updates only
/// those holding states that can still end within `text`.
fn find_long(
    tables: &[u64],
    words: usize,
    segment: &Segment,
    text: &[u8],
    state: &mut Vec<u64>,
) -> Option<usize> {
    let (m, len) = (segment.len, text.len());
    if len < m {
        return None;
    }
    let first = segment.bit / 64;
    let top = (m - 1) / 64;
    let last = 1u64 << ((m - 1) % 64);
    state.clear();
    state.resize(top + 1, 0);
    for (i, &b) in text.iter().enumerate() {
        let row = &tables[usize::from(b) * words + first..][..=top];
        // State j (the first j + 1 tokens match, ending at byte i) can be
        // reached only if j <= i, and still end within the text only if
        // j >= m - (len - i). Words below the window keep stale bits, which
        // stand for states that can no longer end the segment in time, and
        // so, shifted up, only ever give such states.
        let low = (i + m).saturating_sub(len) / 64;
        let high = i.min(m - 1) / 64;
        step(high + 1 - low);
        let mut carry = if low == 0 { 1 } else { state[low - 1] >> 63 };
        for (word, &mask) in state[low..=high].iter_mut().zip(&row[low..=high]) {
            let old = *word;
            *word = ((old << 1) | carry) & mask;
            carry = old >> 63;
        }
        if high == top && state[top] & last != 0 {
            return Some(i + 1);
        }
    }
    None
}

impl Token {
    fn matches_byte(&self, b: u8) -> bool {
        match self {
            Token::Byte(x) => *x == b,
            Token::AnyByte => true,
            Token::AnyRun => true,
            Token::Class(bytes) => bytes[usize::from(b / 64)] >> (b % 64) & 1 == 1,
        }
    }
}

/// Parses a class body starting after `[`; `None` if no `]` closes it.
fn parse_class(pattern: &[u8], mut i: usize) -> Option<(Token, usize)> {
    let negated = pattern.get(i) == Some(&b'!');
    if negated {
        i += 1;
    }
    let mut bytes = [0u64; 4];
    loop {
        let mut lo = *pattern.get(i)?;
        match lo {
            b']' => {
                if negated {
                    bytes = bytes.map(|w| !w);
                }
                return Some((Token::Class(bytes), i + 1));
            }
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
        let (lo, hi) = (usize::from(lo.min(hi)), usize::from(lo.max(hi)));
        for (w, word) in bytes.iter_mut().enumerate() {
            // The range's bits within bytes 64w..64w+63.
            let (from, to) = (lo.max(64 * w), hi.min(64 * w + 63));
            if from <= to {
                *word |= (u64::MAX >> (63 - (to - from))) << (from - 64 * w);
            }
        }
    }
}

#[cfg(test)]
mod tests;
