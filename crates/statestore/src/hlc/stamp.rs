//! A version's text (see [`super::Version::format`]) as a value: what
//! every answer's and notification's `__ts` carries.

use std::fmt;

use smallvec::SmallVec;

/// A version in its wire form (see [`super::Version::format`]), as text: kept
/// inline for a node id of up to 26 bytes (the single node's
/// `statebroker` among them), on the heap for a longer one. Every answer's
/// `__ts` is one.
#[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Stamp(pub(super) SmallVec<[u8; Stamp::INLINE]>);

impl Stamp {
    /// The longest text kept inline.
    pub(super) const INLINE: usize = 48;

    /// The text.
    pub fn as_str(&self) -> &str {
        // SAFETY: a `Stamp` is made from a `str` only (`format`, `From`).
        unsafe { std::str::from_utf8_unchecked(&self.0) }
    }
}

impl std::ops::Deref for Stamp {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for Stamp {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl From<&str> for Stamp {
    fn from(s: &str) -> Stamp {
        Stamp(SmallVec::from_slice(s.as_bytes()))
    }
}

impl From<Stamp> for String {
    fn from(s: Stamp) -> String {
        s.as_str().to_owned()
    }
}

impl fmt::Debug for Stamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Stamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<str> for Stamp {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for Stamp {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<String> for Stamp {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<Stamp> for &str {
    fn eq(&self, other: &Stamp) -> bool {
        *self == other.as_str()
    }
}

impl PartialEq<Stamp> for String {
    fn eq(&self, other: &Stamp) -> bool {
        self == other.as_str()
    }
}
