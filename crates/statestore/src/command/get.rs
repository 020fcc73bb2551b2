//! `GET key`
//!
//! Answers the value as a bulk string (`$len\r\n<value>\r\n`) with the key's
//! version in `__ts`, or `$-1\r\n` if there is no such key.

use super::KeyCommand;
use super::{Answer, Parse};
use crate::db::Entry;
use crate::error::Error;
use crate::plan::{Plan, Stamp};
use crate::resp3::Frame;
use crate::state::{Ctx, State};

/// A parsed GET.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Get<'a> {
    /// The key.
    pub key: &'a [u8],
}

impl<'a> Get<'a> {
    pub(crate) fn parse(parse: &mut Parse<'a, '_>) -> Result<Get<'a>, Error> {
        let key = parse.key()?;
        parse.finish()?;
        Ok(Get { key })
    }

    pub(crate) fn apply(self, state: &mut State, ctx: &Ctx<'_>) -> Result<Answer, Error> {
        super::apply_key(KeyCommand::Get(self), state, ctx)
    }
}

/// GET against the key's entry: its value and version, or nil.
pub(super) fn plan<'a>(current: Option<&Entry>) -> Plan<'a> {
    match current {
        Some(entry) => Plan::unchanged(
            Frame::Bulk(entry.value().to_vec()),
            Stamp::Of(entry.version()),
        ),
        None => Plan::unchanged(Frame::Null, Stamp::ClockNow),
    }
}
