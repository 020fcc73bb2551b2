//! `SCAN pattern [token]`
//!
//! Lists the keys matching a glob `pattern` (see [`crate::glob`]) one page at
//! a time. The first request has no token; each page that is not the last
//! carries an opaque continuation token to send back for the next one:
//!
//! ```text
//! *2\r\n*K\r\n$len\r\nkey…(K keys)…$len\r\ntoken\r\n    a page, more to come
//! *1\r\n*K\r\n$len\r\nkey…(K keys)                       the last page
//! ```
//!
//! A page holds at most the configured page size of keys. It may hold fewer,
//! even none, and still not be the last: each request visits at most 16
//! slots per key of page size, so that a pattern matching nothing cannot make
//! one request walk a million keys, and matches keys for at most
//! [`STEPS_PER_PAGE`] steps of the glob (see [`Pattern::cost`]), so that a
//! costly pattern on long keys cannot hold the store for long (a page
//! always looks at one slot at least, whatever that key costs).
//! A scan always ends; it never returns a key twice while the store is
//! unchanged; a key deleted before its page is served does not appear; the
//! server keeps no state between pages (the token is a position in the
//! store's slots, see [`crate::db::Db::scan`]). A token the store did not
//! make is a `syntax error`.

use super::{Answer, Parse};
use crate::error::Error;
use crate::glob::Pattern;
use crate::resp3::{Frame, Reply, SyntaxError, parse_reply};
use crate::state::{Ctx, State};

/// How many slots one page may visit per key of page size: bounds the work
/// of one request when the pattern matches few keys.
const SLOTS_PER_KEY: usize = 16;

/// How many steps of the glob (see [`Pattern::cost`]) one page may spend
/// matching keys: the page ends before the key that would go over, except
/// at its first slot. About 4 ms of CPU at the slowest step measured (2 ns,
/// a pattern with short segments between stars; a step of a long segment
/// takes about 0.3 ns); a page of 100-byte keys never gets there (1,600
/// slots × 100 steps at most for `*mid*`), keys of a few KiB seldom.
pub const STEPS_PER_PAGE: u64 = 1 << 21;

/// A parsed SCAN.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scan<'a> {
    /// The glob pattern.
    pub pattern: &'a [u8],
    /// Where to continue; `None` for the first page.
    pub token: Option<&'a [u8]>,
}

impl<'a> Scan<'a> {
    pub(crate) fn parse(parse: &mut Parse<'a, '_>) -> Result<Scan<'a>, Error> {
        let pattern = parse.required()?;
        let token = parse.optional();
        parse.finish()?;
        Ok(Scan { pattern, token })
    }

    pub(crate) fn apply(self, state: &mut State, ctx: &Ctx<'_>) -> Result<Answer, Error> {
        let start = match self.token {
            None => 0,
            Some(token) => decode_token(token)?,
        };
        let pattern = Pattern::new(self.pattern);
        let page_size = state.config().scan_page_size;
        let (keys, resume) = state.scan(
            start,
            page_size,
            page_size.saturating_mul(SLOTS_PER_KEY),
            STEPS_PER_PAGE,
            usize::MAX,
            &pattern,
        );
        let visible = keys
            .into_iter()
            .filter(|key| ctx.access.is_none_or(|access| access.may_read(key)));
        let mut page = vec![Frame::Array(visible.map(Frame::Bulk).collect())];
        if let Some(next) = resume {
            page.push(Frame::Bulk(encode_token(next)));
        }
        Ok(Answer {
            frame: Frame::Array(page),
            version: state.clock_now(ctx.now),
        })
    }
}

/// One SCAN answer as a client reads it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Page {
    /// The keys on this page.
    pub keys: Vec<Vec<u8>>,
    /// The token for the next page; `None` on the last page.
    pub token: Option<Vec<u8>>,
}

impl Page {
    /// Decodes a SCAN response payload (the client side of the shape above).
    ///
    /// ```
    /// use statestore::command::Page;
    /// let page = Page::decode(b"*2\r\n*1\r\n$1\r\nk\r\n$2\r\ns7\r\n").unwrap();
    /// assert_eq!(page.keys, vec![b"k".to_vec()]);
    /// assert_eq!(page.token, Some(b"s7".to_vec()));
    /// assert!(Page::decode(b"-ERR syntax error\r\n").is_err());
    /// ```
    pub fn decode(payload: &[u8]) -> Result<Page, SyntaxError> {
        let Reply::Array(parts) = parse_reply(payload)? else {
            return Err(SyntaxError);
        };
        let mut parts = parts.into_iter();
        let Some(Reply::Array(keys)) = parts.next() else {
            return Err(SyntaxError);
        };
        let keys = keys
            .into_iter()
            .map(|key| match key {
                Reply::Bulk(key) => Ok(key),
                _ => Err(SyntaxError),
            })
            .collect::<Result<_, _>>()?;
        let token = match parts.next() {
            None => None,
            Some(Reply::Bulk(token)) => Some(token),
            Some(_) => return Err(SyntaxError),
        };
        if parts.next().is_some() {
            return Err(SyntaxError);
        }
        Ok(Page { keys, token })
    }
}

/// Tokens are `s` followed by the decimal slot number.
fn encode_token(slot: usize) -> Vec<u8> {
    format!("s{slot}").into_bytes()
}

fn decode_token(token: &[u8]) -> Result<usize, Error> {
    let digits = token.strip_prefix(b"s").ok_or(Error::Syntax)?;
    if digits.is_empty() || digits.len() > 12 || !digits.iter().all(u8::is_ascii_digit) {
        return Err(Error::Syntax);
    }
    std::str::from_utf8(digits)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or(Error::Syntax)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_foreign_ones_are_refused() {
        assert_eq!(decode_token(&encode_token(12345)), Ok(12345));
        for bad in [
            &b""[..],
            b"s",
            b"12",
            b"sx",
            b"s-1",
            b"s9999999999999",
            b"\x00\xff",
        ] {
            assert_eq!(decode_token(bad), Err(Error::Syntax), "{bad:?}");
        }
    }
}
