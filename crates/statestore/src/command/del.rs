//! `DEL key`
//!
//! Deletes the key and answers `:1`, with the version the key had in `__ts`;
//! `:0` if there was no such key. Watchers get a `DELETE` notification. A key
//! protected by a fencing token needs an equal or newer `__ft`.

use super::KeyCommand;
use super::{Answer, Parse};
use crate::db::Entry;
use crate::error::Error;
use crate::fencing;
use crate::plan::{Change, Context, Plan, Stamp};
use crate::resp3::Frame;
use crate::state::{Ctx, State};

/// A parsed DEL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Del<'a> {
    /// The key.
    pub key: &'a [u8],
}

impl<'a> Del<'a> {
    pub(crate) fn parse(parse: &mut Parse<'a, '_>) -> Result<Del<'a>, Error> {
        let key = parse.key()?;
        parse.finish()?;
        Ok(Del { key })
    }

    pub(crate) fn apply(self, state: &mut State, ctx: &Ctx<'_>) -> Result<Answer, Error> {
        super::apply_key(KeyCommand::Del(self), state, ctx)
    }
}

/// Decides DEL (`expected: None`) and VDEL against the key's entry.
pub(super) fn plan<'a>(
    current: Option<&Entry>,
    ctx: &Context<'_>,
    expected: Option<&[u8]>,
) -> Result<Plan<'a>, Error> {
    let Some(entry) = current else {
        return Ok(Plan::unchanged(Frame::Integer(0), Stamp::ClockNow));
    };
    fencing::check(entry.fencing_token(), ctx.fencing_token)?;
    if expected.is_some_and(|value| entry.value() != value) {
        return Ok(Plan::unchanged(
            Frame::Integer(-1),
            Stamp::Of(entry.version()),
        ));
    }
    Ok(Plan {
        frame: Frame::Integer(1),
        stamp: Stamp::Of(entry.version()),
        change: Some(Change::Delete),
    })
}
