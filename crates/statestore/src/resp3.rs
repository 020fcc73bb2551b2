//! RESP3, the framing of every state store payload.
//!
//! A **request** is always an array of bulk strings: `*N\r\n`, then for each
//! argument `$len\r\n` followed by exactly `len` bytes and `\r\n`. The bytes are
//! arbitrary (CR and LF included), which is why lengths, not delimiters, frame
//! them:
//!
//! ```text
//! *3\r\n$3\r\nSET\r\n$4\r\nkey1\r\n$6\r\nvalue1\r\n     SET key1 value1
//! ```
//!
//! A **response** is one frame: `+OK\r\n` (simple string), `-ERR text\r\n`
//! (error), `:1\r\n` (integer), `$6\r\nvalue1\r\n` (bulk string), `$-1\r\n`
//! (null bulk: "no such key"), or an array of frames (SCAN pages).
//!
//! [`parse_request`] is strict: anything that is not exactly one array of bulk
//! strings (other frame types inside, null bulks, lengths that overflow or point
//! past the end, a missing `\r\n`, bytes after the array) is a
//! [`SyntaxError`], which the store answers with `-ERR syntax error`.

use std::fmt;

/// A payload that is not a well-formed RESP3 request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyntaxError;

impl fmt::Display for SyntaxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("syntax error")
    }
}

impl std::error::Error for SyntaxError {}

/// A request's arguments, borrowed from its payload: up to 8 kept in
/// place (the arguments of every valid command fit; more go to the heap),
/// so parsing a request allocates nothing.
pub type Args<'a> = smallvec::SmallVec<[&'a [u8]; 8]>;

/// Parses a request payload into its arguments, borrowing from `payload`.
///
/// ```
/// use statestore::resp3::parse_request;
/// let args = parse_request(b"*2\r\n$3\r\nGET\r\n$2\r\n\r\n\r\n").unwrap();
/// assert_eq!(args[..], [&b"GET"[..], &b"\r\n"[..]]);
/// assert!(parse_request(b"*1\r\n$3\r\nGET\r\nextra").is_err());
/// ```
pub fn parse_request(payload: &[u8]) -> Result<Args<'_>, SyntaxError> {
    let mut args = Args::new();
    parse_request_into(payload, &mut args)?;
    Ok(args)
}

/// [`parse_request`], appending the arguments to `args`, which the caller
/// keeps (the store's path passes an empty one): returned, the 136 bytes
/// of `Args` were copied three times on their way.
pub fn parse_request_into<'a>(payload: &'a [u8], args: &mut Args<'a>) -> Result<(), SyntaxError> {
    let mut cursor = Cursor::new(payload);
    let count = cursor.length_line(b'*')?;
    // Every element takes at least 6 bytes (`$0\r\n\r\n`): never trust the
    // count for an allocation before the bytes are there to back it.
    if count > cursor.remaining() / 6 {
        return Err(SyntaxError);
    }
    args.reserve(count);
    for _ in 0..count {
        let len = cursor.length_line(b'$')?;
        args.push(cursor.take(len)?);
        cursor.crlf()?;
    }
    if cursor.remaining() != 0 {
        return Err(SyntaxError);
    }
    Ok(())
}

/// A parse position in a payload: the "parse cursor" of the request codec.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Cursor { buf, pos: 0 }
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Reads `<prefix><digits>\r\n` and returns the number. Only canonical
    /// decimal is accepted: no sign, no spaces, no leading zeros, no null
    /// (`-1`) lengths; so an accepted request re-encodes to the same bytes.
    fn length_line(&mut self, prefix: u8) -> Result<usize, SyntaxError> {
        if self.buf.get(self.pos) != Some(&prefix) {
            return Err(SyntaxError);
        }
        self.pos += 1;
        let start = self.pos;
        let mut value: usize = 0;
        while let Some(&b) = self.buf.get(self.pos) {
            if !b.is_ascii_digit() {
                break;
            }
            value = value
                .checked_mul(10)
                .and_then(|v| v.checked_add(usize::from(b - b'0')))
                .ok_or(SyntaxError)?;
            self.pos += 1;
        }
        let digits = self.pos - start;
        if digits == 0 || (digits > 1 && self.buf[start] == b'0') {
            return Err(SyntaxError);
        }
        self.crlf()?;
        Ok(value)
    }

    fn take(&mut self, len: usize) -> Result<&'a [u8], SyntaxError> {
        if len > self.remaining() {
            return Err(SyntaxError);
        }
        let bytes = &self.buf[self.pos..self.pos + len];
        self.pos += len;
        Ok(bytes)
    }

    fn crlf(&mut self) -> Result<(), SyntaxError> {
        if self.buf.get(self.pos..self.pos + 2) == Some(b"\r\n") {
            self.pos += 2;
            Ok(())
        } else {
            Err(SyntaxError)
        }
    }
}

/// A response frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// `+OK\r\n`
    Simple(&'static str),
    /// `-ERR <text>\r\n`; the text is one of [`crate::Error`]'s.
    Error(&'static str),
    /// `:<n>\r\n`
    Integer(i64),
    /// `$<len>\r\n<bytes>\r\n`
    Bulk(Vec<u8>),
    /// `$-1\r\n`
    Null,
    /// `*<n>\r\n` followed by n frames.
    Array(Vec<Frame>),
}

impl Frame {
    /// Appends the wire form of this frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Frame::Simple(s) => {
                out.push(b'+');
                out.extend_from_slice(s.as_bytes());
                out.extend_from_slice(b"\r\n");
            }
            Frame::Error(text) => encode_error(text, out),
            Frame::Integer(n) => {
                out.push(b':');
                out.extend_from_slice(itoa::Buffer::new().format(*n).as_bytes());
                out.extend_from_slice(b"\r\n");
            }
            Frame::Bulk(bytes) => encode_bulk(bytes, out),
            Frame::Null => out.extend_from_slice(b"$-1\r\n"),
            Frame::Array(items) => {
                out.push(b'*');
                out.extend_from_slice(itoa::Buffer::new().format(items.len()).as_bytes());
                out.extend_from_slice(b"\r\n");
                for item in items {
                    item.encode(out);
                }
            }
        }
    }

    /// The wire form of this frame.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        self.encode(&mut out);
        out
    }

    /// How long [`Frame::encode`] makes it, near enough to size a buffer
    /// once (a number's digits counted as 20).
    fn encoded_len(&self) -> usize {
        match self {
            Frame::Simple(s) => s.len() + 3,
            Frame::Error(text) => text.len() + 7,
            Frame::Integer(_) => 23,
            Frame::Bulk(bytes) => bytes.len() + 25,
            Frame::Null => 5,
            Frame::Array(items) => 23 + items.iter().map(Frame::encoded_len).sum::<usize>(),
        }
    }
}

/// Appends `-ERR <text>\r\n` to `out` (any text: the broker's own
/// refusals and fault rules answer with texts [`Frame::Error`] does not
/// hold).
pub fn encode_error(text: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(b"-ERR ");
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Appends `$<len>\r\n<bytes>\r\n` to `out`.
pub fn encode_bulk(bytes: &[u8], out: &mut Vec<u8>) {
    out.push(b'$');
    out.extend_from_slice(itoa::Buffer::new().format(bytes.len()).as_bytes());
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

/// Encodes a request the way the official clients do; for tests and tools.
///
/// ```
/// use statestore::resp3::{encode_request, parse_request};
/// let wire = encode_request(&["GET", "k"]);
/// assert_eq!(wire, b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n");
/// assert_eq!(parse_request(&wire).unwrap()[..], [&b"GET"[..], &b"k"[..]]);
/// ```
pub fn encode_request<A: AsRef<[u8]>>(args: &[A]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + args.iter().map(|a| a.as_ref().len() + 8).sum::<usize>());
    out.push(b'*');
    out.extend_from_slice(itoa::Buffer::new().format(args.len()).as_bytes());
    out.extend_from_slice(b"\r\n");
    for arg in args {
        encode_bulk(arg.as_ref(), &mut out);
    }
    out
}

/// A response frame as a client reads it: what [`Frame`] encodes, owned.
///
/// Clients, tools and tests decode responses with [`parse_reply`]; the store
/// itself never needs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `+<text>\r\n`
    Simple(String),
    /// `-<text>\r\n`, the whole text (for the store: `ERR <reason>`).
    Error(String),
    /// `:<n>\r\n`
    Integer(i64),
    /// `$<len>\r\n<bytes>\r\n`
    Bulk(Vec<u8>),
    /// `$-1\r\n`
    Null,
    /// `*<n>\r\n` followed by n frames.
    Array(Vec<Reply>),
}

/// Parses one complete response frame; bytes after it are a [`SyntaxError`].
///
/// ```
/// use statestore::resp3::{parse_reply, Reply};
/// assert_eq!(parse_reply(b":-1\r\n"), Ok(Reply::Integer(-1)));
/// assert_eq!(
///     parse_reply(b"*2\r\n$1\r\nk\r\n$-1\r\n"),
///     Ok(Reply::Array(vec![Reply::Bulk(b"k".to_vec()), Reply::Null]))
/// );
/// assert!(parse_reply(b"+OK\r\n+OK\r\n").is_err());
/// ```
pub fn parse_reply(payload: &[u8]) -> Result<Reply, SyntaxError> {
    let mut cursor = Cursor::new(payload);
    let reply = cursor.reply(0)?;
    if cursor.remaining() != 0 {
        return Err(SyntaxError);
    }
    Ok(reply)
}

/// Arrays nested deeper than this are refused rather than recursed into.
const MAX_REPLY_DEPTH: usize = 8;

impl Cursor<'_> {
    /// Reads the rest of a line (without its `\r\n`) as UTF-8 text.
    fn text_line(&mut self) -> Result<&str, SyntaxError> {
        let rest = &self.buf[self.pos..];
        let end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or(SyntaxError)?;
        let text = std::str::from_utf8(&rest[..end]).map_err(|_| SyntaxError)?;
        self.pos += end + 2;
        Ok(text)
    }

    fn reply(&mut self, depth: usize) -> Result<Reply, SyntaxError> {
        match self.buf.get(self.pos) {
            Some(b'+') => {
                self.pos += 1;
                Ok(Reply::Simple(self.text_line()?.to_owned()))
            }
            Some(b'-') => {
                self.pos += 1;
                Ok(Reply::Error(self.text_line()?.to_owned()))
            }
            Some(b':') => {
                self.pos += 1;
                let n = self.text_line()?.parse().map_err(|_| SyntaxError)?;
                Ok(Reply::Integer(n))
            }
            Some(b'$') if self.buf[self.pos..].starts_with(b"$-1\r\n") => {
                self.pos += 5;
                Ok(Reply::Null)
            }
            Some(b'$') => {
                let len = self.length_line(b'$')?;
                let bytes = self.take(len)?.to_vec();
                self.crlf()?;
                Ok(Reply::Bulk(bytes))
            }
            Some(b'*') if depth < MAX_REPLY_DEPTH => {
                let count = self.length_line(b'*')?;
                // Every frame takes at least 3 bytes (`+\r\n`).
                if count > self.remaining() / 3 {
                    return Err(SyntaxError);
                }
                (0..count)
                    .map(|_| self.reply(depth + 1))
                    .collect::<Result<_, _>>()
                    .map(Reply::Array)
            }
            _ => Err(SyntaxError),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_arguments() {
        let args = parse_request(b"*3\r\n$3\r\nSET\r\n$1\r\n\n\r\n$0\r\n\r\n").unwrap();
        assert_eq!(args[..], [&b"SET"[..], &b"\n"[..], &b""[..]]);
    }

    #[test]
    fn rejects_malformed_payloads() {
        let bad: &[&[u8]] = &[
            b"",
            b"GET key\r\n",
            b"*",
            b"*1",
            b"*1\r\n",
            b"*1\r\n$3\r\nGE",
            b"*1\r\n$3\r\nGET",
            b"*1\r\n$3\r\nGETX\r\n",
            b"*1\r\n$3\r\nGET\r\n\r\n",
            b"*2\r\n$3\r\nGET\r\n",
            b"*1\r\n$-1\r\n",
            b"*-1\r\n",
            b"*1\r\n:1\r\n",
            b"*1\r\n+OK\r\n",
            b"*1\r\n*1\r\n$1\r\na\r\n",
            b"*1\r\n$+3\r\nGET\r\n",
            b"*1\r\n$ 3\r\nGET\r\n",
            b"*1\r\n$3\nGET\r\n",
            b"*99999999999999999999999\r\n",
            b"*1\r\n$99999999999999999999999\r\nx\r\n",
            b"*1\r\n$18446744073709551615\r\nx\r\n",
            b"*4294967295\r\n$1\r\na\r\n",
            b"$3\r\nGET\r\n",
            b"*00\r\n",
            b"*01\r\n$3\r\nGET\r\n",
            b"*1\r\n$03\r\nGET\r\n",
        ];
        for payload in bad {
            assert_eq!(parse_request(payload), Err(SyntaxError), "{payload:?}");
        }
    }

    #[test]
    fn empty_array_parses_to_no_arguments() {
        assert!(parse_request(b"*0\r\n").unwrap().is_empty());
    }

    #[test]
    fn encodes_every_frame_type() {
        assert_eq!(Frame::Simple("OK").to_vec(), b"+OK\r\n");
        assert_eq!(
            Frame::Error("syntax error").to_vec(),
            b"-ERR syntax error\r\n"
        );
        assert_eq!(Frame::Integer(-1).to_vec(), b":-1\r\n");
        assert_eq!(
            Frame::Bulk(b"a\r\nb".to_vec()).to_vec(),
            b"$4\r\na\r\nb\r\n"
        );
        assert_eq!(Frame::Null.to_vec(), b"$-1\r\n");
        assert_eq!(
            Frame::Array(vec![Frame::Array(vec![Frame::Bulk(b"k".to_vec())])]).to_vec(),
            b"*1\r\n*1\r\n$1\r\nk\r\n"
        );
    }

    /// An answer's buffer is sized once: its estimate is never short.
    #[test]
    fn an_answers_buffer_is_sized_once() {
        let frames = [
            Frame::Simple("OK"),
            Frame::Error("syntax error"),
            Frame::Integer(i64::MIN),
            Frame::Integer(i64::MAX),
            Frame::Bulk(vec![b'v'; 1_000_000]),
            Frame::Bulk(Vec::new()),
            Frame::Null,
            Frame::Array(vec![
                Frame::Array(vec![Frame::Bulk(b"k".to_vec()), Frame::Integer(-1)]),
                Frame::Null,
            ]),
            Frame::Array(Vec::new()),
        ];
        for frame in frames {
            let wire = frame.to_vec();
            assert!(frame.encoded_len() >= wire.len(), "{frame:?}");
            assert_eq!(wire.capacity(), frame.encoded_len(), "{frame:?}");
        }
    }

    #[test]
    fn replies_round_trip_through_the_encoder() {
        let frames = [
            (Frame::Simple("OK"), Reply::Simple("OK".into())),
            (
                Frame::Error("syntax error"),
                Reply::Error("ERR syntax error".into()),
            ),
            (Frame::Integer(-7), Reply::Integer(-7)),
            (
                Frame::Bulk(b"a\r\nb".to_vec()),
                Reply::Bulk(b"a\r\nb".to_vec()),
            ),
            (Frame::Null, Reply::Null),
            (
                Frame::Array(vec![
                    Frame::Array(vec![Frame::Bulk(b"k".to_vec())]),
                    Frame::Null,
                ]),
                Reply::Array(vec![
                    Reply::Array(vec![Reply::Bulk(b"k".to_vec())]),
                    Reply::Null,
                ]),
            ),
        ];
        for (frame, reply) in frames {
            assert_eq!(parse_reply(&frame.to_vec()), Ok(reply), "{frame:?}");
        }
    }

    #[test]
    fn rejects_malformed_replies() {
        let bad: &[&[u8]] = &[
            b"",
            b"OK\r\n",
            b"+OK",
            b"+OK\r\nx",
            b":x\r\n",
            b"$3\r\nab\r\n",
            b"$-2\r\n",
            b"*2\r\n+OK\r\n",
            b"*99999999\r\n",
            b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n",
        ];
        for payload in bad {
            assert_eq!(parse_reply(payload), Err(SyntaxError), "{payload:?}");
        }
    }
}
