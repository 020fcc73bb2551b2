//! `DEL key`
//!
//! Deletes the key and answers `:1`, with the version the key had in `__ts`;
//! `:0` if there was no such key. Watchers get a `DELETE` notification. A key
//! protected by a fencing token needs an equal or newer `__ft`.

use super::{Answer, Parse};
use crate::db::Entry;
use crate::error::Error;
use crate::fencing;
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
        delete(state, ctx, self.key, None)
    }
}

/// Deletes `key` for DEL (`expected` is `None`) and VDEL (`expected` is the
/// value the key must hold): `:0` if missing, the fencing check, `:-1` with
/// the key's version if it holds another value, else `:1` with the version
/// it had.
pub(super) fn delete(
    state: &mut State,
    ctx: &Ctx<'_>,
    key: &[u8],
    expected: Option<&[u8]>,
) -> Result<Answer, Error> {
    let Some(entry) = state.get(key) else {
        return Ok(Answer {
            frame: Frame::Integer(0),
            version: state.clock_now(ctx.now),
        });
    };
    fencing::check(Entry::fencing_token(entry), ctx.fencing_token.as_ref())?;
    if expected.is_some_and(|value| entry.value() != value) {
        return Ok(Answer {
            frame: Frame::Integer(-1),
            version: entry.version(),
        });
    }
    let version = state.delete(key);
    Ok(Answer {
        frame: Frame::Integer(1),
        version,
    })
}
