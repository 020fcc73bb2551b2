//! `VDEL key value`
//!
//! Deletes the key only if it holds exactly `value`: `:1` if deleted (with
//! the version the key had in `__ts`), `:-1` if it holds another value, `:0`
//! if there is no such key. This is how a lease holder releases a lock
//! without releasing someone else's. Fencing tokens apply as for DEL.

use super::KeyCommand;
use super::{Answer, Parse};
use crate::error::Error;
use crate::state::{Ctx, State};

/// A parsed VDEL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VDel<'a> {
    /// The key.
    pub key: &'a [u8],
    /// The value the key must hold.
    pub value: &'a [u8],
}

impl<'a> VDel<'a> {
    pub(crate) fn parse(parse: &mut Parse<'a, '_>) -> Result<VDel<'a>, Error> {
        let key = parse.key()?;
        let value = parse.required()?;
        parse.finish()?;
        Ok(VDel { key, value })
    }

    pub(crate) fn apply(self, state: &mut State, ctx: &Ctx<'_>) -> Result<Answer, Error> {
        super::apply_key(KeyCommand::VDel(self), state, ctx)
    }
}
