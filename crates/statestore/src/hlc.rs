//! Versions as hybrid logical clocks (HLC).
//!
//! Every key carries a version: the HLC timestamp of the SET that wrote it.
//! On the wire an HLC is `{wallClockMs}:{counter}:{nodeId}`; the official
//! clients write it zero-padded (`{ms:015}:{counter:05}:{nodeId}`) and parse
//! plain integers, so both forms are accepted here and the padded one is
//! written.
//!
//! The clock follows the HLC update rules: a new version takes the largest of
//! the store's last version, the wall clock, and the timestamp the request
//! carries (`__ts`), and bumps the counter on a tie. So a version is always
//! strictly greater than the request's `__ts` and than anything the store
//! handed out before, even if the wall clock steps back.
//!
//! Timestamps that come from clients ([`Hlc`]: `__ts`, fencing tokens `__ft`)
//! keep their own node id and a 64-bit counter. Versions minted here
//! ([`Version`]) always carry the store's node id, so they are stored as just
//! wall time and a 32-bit counter; when a counter would pass `u32::MAX` the
//! clock moves its wall time one millisecond ahead instead, which keeps every
//! ordering promise.

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

use smallvec::SmallVec;

mod stamp;
pub use stamp::Stamp;

/// A timestamp as a client sends it (`__ts`, `__ft`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Hlc {
    /// Milliseconds since the Unix epoch.
    pub wall_ms: u64,
    /// Logical counter for events within the same millisecond.
    pub counter: u64,
    /// The id of the node that made the timestamp.
    pub node: String,
}

/// An `__ts` or `__ft` that is not `{integer}:{integer}:{nodeId}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MalformedTimestamp;

impl FromStr for Hlc {
    type Err = MalformedTimestamp;

    /// ```
    /// use statestore::hlc::Hlc;
    /// let t: Hlc = "000001700000000000:00003:node-a".parse().unwrap();
    /// assert_eq!((t.wall_ms, t.counter, t.node.as_str()), (1_700_000_000_000, 3, "node-a"));
    /// assert!("1700000000000:3".parse::<Hlc>().is_err());
    /// assert!("1700000000000:+3:n".parse::<Hlc>().is_err());
    /// ```
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (wall_ms, counter, at) = time_of(s)?;
        Ok(Hlc {
            wall_ms,
            counter,
            // After an ASCII colon: a character boundary.
            node: s[at..].to_owned(),
        })
    }
}

impl Hlc {
    /// A timestamp read for its time alone (a request's `__ts`, of which
    /// only the time is used): checked as [`Hlc::from_str`] checks it, its
    /// node id not kept (empty), which spares every request an
    /// allocation.
    ///
    /// ```
    /// use statestore::hlc::Hlc;
    /// let t = Hlc::time_only("000001700000000000:00003:node-a").unwrap();
    /// assert_eq!((t.wall_ms, t.counter, t.node.as_str()), (1_700_000_000_000, 3, ""));
    /// assert!(Hlc::time_only("1:2:a:b").is_err());
    /// ```
    pub fn time_only(s: &str) -> Result<Hlc, MalformedTimestamp> {
        let (wall_ms, counter, _) = time_of(s)?;
        Ok(Hlc {
            wall_ms,
            counter,
            node: String::new(),
        })
    }
}

/// The wall time and counter of `{integer}:{integer}:{nodeId}`, and where
/// the node id starts. Every request carries one or two: one pass over the
/// bytes, not `split_once` (a memchr call per colon) and then the digits.
fn time_of(s: &str) -> Result<(u64, u64, usize), MalformedTimestamp> {
    let bytes = s.as_bytes();
    if let Some(time) = fixed_width_time(bytes) {
        return Ok(time);
    }
    let (wall_ms, at) = digits_to_colon(bytes, 0)?;
    let (counter, at) = digits_to_colon(bytes, at)?;
    if has_colon(&bytes[at..]) {
        return Err(MalformedTimestamp);
    }
    Ok((wall_ms, counter, at))
}

/// [`time_of`] of the form every version is written in (15 digits, a
/// colon, 5 digits, a colon, a node id without one), straight through:
/// the digit-by-digit loop cost ~400 instructions a request. `None`: not
/// of that form (the general reading decides).
fn fixed_width_time(bytes: &[u8]) -> Option<(u64, u64, usize)> {
    if bytes.len() < 22 || bytes[15] != b':' || bytes[21] != b':' {
        return None;
    }
    // Digits 0-7 and 7-14 (the eighth in both).
    let high = eight_digits(&bytes[0..8])?;
    let low = eight_digits(&bytes[7..15])?;
    let wall_ms = high / 10 * 100_000_000 + low;
    // Five digits up to the colon at 21 (one at a time, unrolled: the
    // general loop cost ~70 instructions).
    let counter = bytes[16..21].iter().try_fold(0u64, |n, &b| {
        let digit = b.wrapping_sub(b'0');
        (digit < 10).then(|| n * 10 + u64::from(digit))
    })?;
    if has_colon(&bytes[22..]) {
        return None;
    }
    Some((wall_ms, counter, 22))
}

/// Whether a node id holds a colon: a fold over every byte, which the
/// compiler does a vector at a time (a node id is short: `memchr`'s
/// set-up cost ~110 instructions, `<[u8]>::contains` goes a byte at a
/// time).
fn has_colon(node: &[u8]) -> bool {
    node.iter().fold(false, |colon, &b| colon | (b == b':'))
}

/// The value of eight ASCII digits, if all eight are digits, in a few
/// word operations.
fn eight_digits(chunk: &[u8]) -> Option<u64> {
    const ZEROS: u64 = 0x3030_3030_3030_3030;
    const HIGH: u64 = 0xF0F0_F0F0_F0F0_F0F0;
    let word = u64::from_le_bytes(chunk.try_into().ok()?);
    // Every byte 0x30..=0x3f, and none above 0x39 (with every byte below
    // 0x40, adding 6 to each carries into none).
    if word & HIGH != ZEROS || word.wrapping_add(0x0606_0606_0606_0606) & HIGH != ZEROS {
        return None;
    }
    // The first digit is the lowest byte: pairs, then fours, then eight.
    let d = word - ZEROS;
    let d = (d * 10 + (d >> 8)) & 0x00FF_00FF_00FF_00FF;
    let d = (d * 100 + (d >> 16)) & 0x0000_FFFF_0000_FFFF;
    Some((d * 10_000 + (d >> 32)) & 0xFFFF_FFFF)
}

/// Plain decimal digits from `start` up to the next `:` (at least one
/// digit; `u64::from_str` would also take a leading `+`; at most
/// `u64::MAX`): their value and where the text after the colon starts.
///
/// Up to 19 digits cannot overflow a `u64` (10^19 - 1 < 2^64), so the
/// digits are summed without a check each; only a 20th digit or more
/// takes the checked path (each digit checked and multiplied with an
/// overflow test cost ~11 instructions, ~440 a request's `__ts`).
fn digits_to_colon(bytes: &[u8], start: usize) -> Result<(u64, usize), MalformedTimestamp> {
    const UNCHECKED: usize = 19;
    let mut n = 0u64;
    for (i, &b) in bytes.get(start..).unwrap_or_default().iter().enumerate() {
        let digit = b.wrapping_sub(b'0');
        if digit < 10 {
            if i >= UNCHECKED {
                return checked_digits_to_colon(bytes, start);
            }
            n = n * 10 + u64::from(digit);
        } else if b == b':' && i > 0 {
            return Ok((n, start + i + 1));
        } else {
            return Err(MalformedTimestamp);
        }
    }
    Err(MalformedTimestamp)
}

/// [`digits_to_colon`] for 20 digits or more: each step checked.
#[cold]
fn checked_digits_to_colon(bytes: &[u8], start: usize) -> Result<(u64, usize), MalformedTimestamp> {
    let mut n = 0u64;
    let mut at = start;
    loop {
        match bytes.get(at) {
            Some(b':') if at > start => return Ok((n, at + 1)),
            Some(&digit @ b'0'..=b'9') => {
                n = n
                    .checked_mul(10)
                    .and_then(|n| n.checked_add(u64::from(digit - b'0')))
                    .ok_or(MalformedTimestamp)?;
            }
            _ => return Err(MalformedTimestamp),
        }
        at += 1;
    }
}

impl fmt::Display for Hlc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:015}:{:05}:{}", self.wall_ms, self.counter, self.node)
    }
}

impl Hlc {
    /// Orders two timestamps by time (wall clock, then counter); node ids
    /// only break exact ties, so that equal times from different nodes do not
    /// compare equal by accident.
    pub fn cmp_time(&self, other: &Hlc) -> Ordering {
        (self.wall_ms, self.counter).cmp(&(other.wall_ms, other.counter))
    }

    /// Whether this timestamp is more than `max_skew_ms` ahead of `now_ms`.
    pub fn is_ahead_of(&self, now_ms: u64, max_skew_ms: u64) -> bool {
        self.wall_ms > now_ms.saturating_add(max_skew_ms)
    }
}

/// A version minted by this store (the node id is the store's own).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Version {
    /// Milliseconds since the Unix epoch.
    pub wall_ms: u64,
    /// Logical counter within `wall_ms`.
    pub counter: u32,
}

impl Version {
    /// This version as an [`Hlc`] of node `node`.
    pub fn to_hlc(self, node: &str) -> Hlc {
        Hlc {
            wall_ms: self.wall_ms,
            counter: u64::from(self.counter),
            node: node.to_owned(),
        }
    }

    /// The wire form, `{ms:015}:{counter:05}:{node}`: every answer carries
    /// one, so the digits are written by hand (`format!` with padding cost
    /// 1,900 instructions, 7% of a request), into a [`Stamp`] (a `String`
    /// was an allocation and a free a request).
    pub fn format(self, node: &str) -> Stamp {
        if self.wall_ms < 1_000_000_000_000_000 && self.counter < 100_000 {
            // Every version until the year 33658: both numbers at their
            // fixed widths, two digits at a time.
            let mut text = [0u8; Stamp::INLINE];
            text[..15].copy_from_slice(&wall_digits(self.wall_ms));
            text[15..22].copy_from_slice(b":00000:");
            put_digits(&mut text[16..21], u64::from(self.counter));
            let len = 22 + node.len();
            return Stamp(if len <= Stamp::INLINE {
                text[22..len].copy_from_slice(node.as_bytes());
                SmallVec::from_buf_and_len(text, len)
            } else {
                let mut long = SmallVec::with_capacity(len);
                long.extend_from_slice(&text[..22]);
                long.extend_from_slice(node.as_bytes());
                long
            });
        }
        let mut s = String::with_capacity(23 + node.len());
        push_padded(&mut s, self.wall_ms, 15);
        s.push(':');
        push_padded(&mut s, u64::from(self.counter), 5);
        s.push(':');
        s.push_str(node);
        Stamp::from(s.as_str())
    }

    fn time(self) -> (u64, u64) {
        (self.wall_ms, u64::from(self.counter))
    }
}

/// `wall_ms` as 15 digits, zero-padded (it must fit). The wall time of
/// one version is nearly always the one before's (a millisecond holds
/// tens of requests under load): the last one's digits are kept, per
/// thread, and used again (writing them was ~80 instructions an answer).
fn wall_digits(wall_ms: u64) -> [u8; 15] {
    thread_local! {
        static LAST: std::cell::Cell<(u64, [u8; 15])> =
            const { std::cell::Cell::new((0, *b"000000000000000")) };
    }
    LAST.with(|last| {
        let (ms, digits) = last.get();
        if ms == wall_ms {
            return digits;
        }
        let mut digits = *b"000000000000000";
        put_digits(&mut digits, wall_ms);
        last.set((wall_ms, digits));
        digits
    })
}

/// Writes `n` in decimal into `digits`, right-aligned, two digits a step
/// (the zeros before it are the caller's): `n` must fit.
fn put_digits(digits: &mut [u8], mut n: u64) {
    const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
        2021222324252627282930313233343536373839\
        4041424344454647484950515253545556575859\
        6061626364656667686970717273747576777879\
        8081828384858687888990919293949596979899";
    let mut end = digits.len();
    while n >= 10 && end >= 2 {
        let pair = (n % 100) as usize * 2;
        digits[end - 2..end].copy_from_slice(&PAIRS[pair..pair + 2]);
        n /= 100;
        end -= 2;
    }
    if n > 0 && end >= 1 {
        digits[end - 1] = b'0' + n as u8;
    }
}

/// Appends `n` in decimal, zero-padded to at least `width` digits (the
/// digits by `itoa`, two at a time: the loop of one digit at a time and
/// its UTF-8 check cost ~270 instructions a number).
fn push_padded(s: &mut String, n: u64, width: usize) {
    let mut buffer = itoa::Buffer::new();
    let digits = buffer.format(n);
    const ZEROS: &str = "00000000000000000000";
    let pad = width.saturating_sub(digits.len()).min(ZEROS.len());
    s.push_str(&ZEROS[..pad]);
    s.push_str(digits);
}

/// The largest counter a version is handed out with: five digits, as the
/// wire form pads it.
pub const MAX_COUNTER: u64 = 99_999;

/// The store's clock: hands out strictly increasing [`Version`]s.
#[derive(Debug, Clone)]
pub struct HybridClock {
    last: Version,
}

impl HybridClock {
    /// A clock whose versions are all greater than `floor` (for a restart,
    /// pass the highest version handed out before it).
    pub fn starting_after(floor: Version) -> Self {
        HybridClock { last: floor }
    }

    /// Takes in a version seen elsewhere (another node's): every version
    /// handed out after this is greater.
    pub fn observe(&mut self, seen: Version) {
        self.last = self.last.max(seen);
    }

    /// The last version handed out.
    pub fn last(&self) -> Version {
        self.last
    }

    /// The clock's reading at `wall_ms` without handing out a version: what
    /// responses that change nothing report in `__ts`.
    pub fn now(&self, wall_ms: u64) -> Version {
        if wall_ms > self.last.wall_ms {
            Version {
                wall_ms,
                counter: 0,
            }
        } else {
            self.last
        }
    }

    /// Hands out a new version: greater than every earlier one, than
    /// `received` (the request's `__ts`), and not behind the wall clock.
    ///
    /// ```
    /// use statestore::hlc::{HybridClock, Hlc, Version};
    /// let mut clock = HybridClock::starting_after(Version::default());
    /// let a = clock.next(1_000, None);
    /// let b = clock.next(999, None); // the wall clock stepped back
    /// assert!(b > a);
    /// let ahead: Hlc = "5000:7:other".parse().unwrap();
    /// let c = clock.next(1_000, Some(&ahead));
    /// assert_eq!((c.wall_ms, c.counter), (5_000, 8));
    /// ```
    pub fn next(&mut self, wall_ms: u64, received: Option<&Hlc>) -> Version {
        let last = self.last.time();
        let recv = received.map_or((0, 0), |h| (h.wall_ms, h.counter));
        let wall = wall_ms.max(last.0).max(recv.0);
        // The counter must beat every candidate that shares the winning wall time.
        let floor = [last, recv]
            .iter()
            .filter(|(w, _)| *w == wall)
            .map(|(_, c)| c.checked_add(1))
            .max();
        let next = match floor {
            None => Some((wall, 0)),
            Some(Some(c)) => u32::try_from(c).ok().map(|c| (wall, u64::from(c))),
            Some(None) => None,
        };
        // A counter past the five digits the wire form gives it (the
        // official clients write and read `{:05}`), or past u32::MAX: move
        // to the next millisecond instead.
        let (wall, counter) = match next {
            Some((wall, counter)) if counter <= MAX_COUNTER => (wall, counter),
            _ => (wall.saturating_add(1), 0),
        };
        self.last = Version {
            wall_ms: wall,
            counter: counter as u32,
        };
        self.last
    }
}

/// Compares a store version with a client timestamp by time.
pub fn cmp_version_hlc(v: Version, h: &Hlc) -> Ordering {
    v.time().cmp(&(h.wall_ms, h.counter))
}

#[cfg(test)]
mod tests;
