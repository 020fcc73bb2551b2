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
use crate::store::{Ctx, Effects, Store};

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

    pub(crate) fn apply(
        self,
        store: &mut Store,
        ctx: &Ctx<'_>,
        fx: &mut Effects,
    ) -> Result<Answer, Error> {
        let Some(entry) = store.db.get(self.key) else {
            return Ok(Answer {
                frame: Frame::Integer(0),
                version: store.clock.now(ctx.now),
            });
        };
        fencing::check(Entry::fencing_token(entry), ctx.fencing_token.as_ref())?;
        let version = store.delete(self.key, fx);
        Ok(Answer {
            frame: Frame::Integer(1),
            version,
        })
    }
}
