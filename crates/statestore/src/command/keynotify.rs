//! `KEYNOTIFY key [STOP]`
//!
//! Registers the caller (its MQTT client id, on its current connection) for
//! notifications of changes to `key`, which need not exist yet: `+OK`.
//! `KEYNOTIFY key STOP` removes the registration: `+OK`, or `:0` if the caller
//! was not watching the key. See [`crate::notify`] for what watchers receive.

use super::{Answer, Parse};
use crate::error::Error;
use crate::resp3::Frame;
use crate::state::{Ctx, State};

/// A parsed KEYNOTIFY.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyNotify<'a> {
    /// The key.
    pub key: &'a [u8],
    /// `STOP`: end the registration instead of starting it.
    pub stop: bool,
}

impl<'a> KeyNotify<'a> {
    pub(crate) fn parse(parse: &mut Parse<'a, '_>) -> Result<KeyNotify<'a>, Error> {
        let key = parse.key()?;
        let stop = match parse.optional() {
            None => false,
            Some(arg) if parse.is_option(arg, "STOP") => true,
            Some(_) => return Err(Error::Syntax),
        };
        parse.finish()?;
        Ok(KeyNotify { key, stop })
    }

    pub(crate) fn apply(self, state: &mut State, ctx: &Ctx<'_>) -> Result<Answer, Error> {
        let frame = if self.stop {
            if state.unwatch(ctx.caller.client_id, self.key) {
                Frame::Simple("OK")
            } else {
                Frame::Integer(0)
            }
        } else {
            state.watch(ctx.caller, self.key)?;
            Frame::Simple("OK")
        };
        Ok(Answer {
            frame,
            version: state.clock_now(ctx.now),
        })
    }
}
