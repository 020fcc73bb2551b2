//! `PING [message]`
//!
//! As in Redis: `+PONG`, or the message back as a bulk string. Costs one
//! round trip and nothing else, so clients and tools use it to check that
//! the store answers. Not in the public protocol article; unknown to the
//! 2023 topic.

use super::{Answer, Parse};
use crate::error::Error;
use crate::resp3::Frame;
use crate::state::{Ctx, State};

/// A parsed PING.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ping<'a> {
    /// Echoed back, if given.
    pub message: Option<&'a [u8]>,
}

impl<'a> Ping<'a> {
    pub(crate) fn parse(parse: &mut Parse<'a, '_>) -> Result<Ping<'a>, Error> {
        let message = parse.optional();
        parse.finish()?;
        Ok(Ping { message })
    }

    pub(crate) fn apply(self, state: &mut State, ctx: &Ctx<'_>) -> Result<Answer, Error> {
        Ok(Answer {
            frame: match self.message {
                Some(message) => Frame::Bulk(message.to_vec()),
                None => Frame::Simple("PONG"),
            },
            version: state.clock_now(ctx.now),
        })
    }
}
