//! The error answers of the state store.
//!
//! A request that cannot be served still gets an answer on its response
//! topic: `-ERR <text>\r\n`. The official clients map these exact texts to
//! typed errors, so the texts are part of the protocol (note "lower version
//! **than**", where the public article's table has a typo).

use crate::resp3::Frame;

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// `__ts` is more than the allowed skew ahead of the broker's clock.
    #[error(
        "the request timestamp is too far in the future; ensure that the client and broker system clocks are synchronized"
    )]
    TimestampSkew,
    /// The key is protected by a fencing token and the request carries none.
    #[error("a fencing token is required for this request")]
    FencingTokenRequired,
    /// `__ft` is more than the allowed skew ahead of the broker's clock.
    #[error(
        "the request fencing token timestamp is too far in the future; ensure that the client and broker system clocks are synchronized"
    )]
    FencingTokenSkew,
    /// `__ft` is older than the token protecting the key.
    #[error(
        "the request fencing token is a lower version than the fencing token protecting the resource"
    )]
    FencingTokenLowerVersion,
    /// A configured limit (keys, bytes, key or value size, watches) would be passed.
    #[error("the quota has been exceeded")]
    QuotaExceeded,
    /// Not RESP3, or an option the command does not know, or a bad option value.
    #[error("syntax error")]
    Syntax,
    /// The verb is not one the store serves (in this protocol generation).
    #[error("unknown command")]
    UnknownCommand,
    /// Too few or too many arguments for the verb.
    #[error("wrong number of arguments")]
    WrongNumberOfArguments,
    /// A SET without `__ts`.
    #[error("missing timestamp")]
    TimestampMissing,
    /// `__ts` or `__ft` that is not an HLC.
    #[error("malformed timestamp")]
    TimestampMalformed,
    /// An empty key.
    #[error("the key length is zero")]
    KeyLengthZero,
    /// The broker's authorization policy does not let the caller read or
    /// write this key.
    #[error("not authorized")]
    NotAuthorized,
}

impl Error {
    /// The exact text after `-ERR `.
    pub fn text(self) -> &'static str {
        match self {
            Error::TimestampSkew => {
                "the request timestamp is too far in the future; ensure that the client and broker system clocks are synchronized"
            }
            Error::FencingTokenRequired => "a fencing token is required for this request",
            Error::FencingTokenSkew => {
                "the request fencing token timestamp is too far in the future; ensure that the client and broker system clocks are synchronized"
            }
            Error::FencingTokenLowerVersion => {
                "the request fencing token is a lower version than the fencing token protecting the resource"
            }
            Error::QuotaExceeded => "the quota has been exceeded",
            Error::Syntax => "syntax error",
            Error::UnknownCommand => "unknown command",
            Error::WrongNumberOfArguments => "wrong number of arguments",
            Error::TimestampMissing => "missing timestamp",
            Error::TimestampMalformed => "malformed timestamp",
            Error::KeyLengthZero => "the key length is zero",
            Error::NotAuthorized => "not authorized",
        }
    }

    /// The `-ERR` frame for this error.
    pub fn frame(self) -> Frame {
        Frame::Error(self.text())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_matches_wire_text() {
        for e in [
            Error::TimestampSkew,
            Error::FencingTokenRequired,
            Error::FencingTokenSkew,
            Error::FencingTokenLowerVersion,
            Error::QuotaExceeded,
            Error::Syntax,
            Error::UnknownCommand,
            Error::WrongNumberOfArguments,
            Error::TimestampMissing,
            Error::TimestampMalformed,
            Error::KeyLengthZero,
        ] {
            assert_eq!(e.to_string(), e.text());
        }
        assert_eq!(Error::Syntax.frame().to_vec(), b"-ERR syntax error\r\n");
    }
}
