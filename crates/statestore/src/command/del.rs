//! `DEL key`
//!
//! Deletes the key and answers `:1`, with the version the key had in `__ts`;
//! `:0` if there was no such key. Watchers get a `DELETE` notification. A key
//! protected by a fencing token needs an equal or newer `__ft`.

use super::{Answer, Parse};
use crate::error::Error;
use crate::plan::KeyCommand;
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
