//! `SET key value [NX | NEX] [PX milliseconds]`
//!
//! Writes `value` under `key` and answers `+OK`, with the new version in
//! `__ts`. The version is strictly greater than the request's `__ts` (which a
//! SET must carry: without it the answer is `missing timestamp`) and than
//! every version handed out before.
//!
//! - `NX`: only if the key does not exist; otherwise `:-1` (not applied).
//! - `NEX`: only if the key does not exist or already holds exactly `value`;
//!   otherwise `:-1`. `NEX` takes no argument of its own: it compares with the
//!   value being set, which makes `SET lock me NEX PX 10000` the acquire *and*
//!   the renew of a lease.
//! - `PX ms`: the key expires `ms` milliseconds (a positive integer) from now.
//!   A SET without `PX` clears an earlier expiry.
//!
//! A key protected by a fencing token is only written with an equal or newer
//! `__ft` (see [`crate::fencing`]); an `aio-persistence: true` SET keeps the
//! key on disk, and later SETs keep it there until it is deleted.

use super::KeyCommand;
use super::{Answer, Parse};
use crate::db::{Entry, Extras};
use crate::error::Error;
use crate::fencing;
use crate::plan::{Change, Context, Plan, Planner, Stamp};
use crate::resp3::Frame;
use crate::state::{Ctx, State};

/// When a SET applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Condition {
    /// Always.
    #[default]
    Always,
    /// `NX`: only if the key does not exist.
    IfAbsent,
    /// `NEX`: only if the key does not exist or already has this value.
    IfAbsentOrEqual,
}

/// A parsed SET.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Set<'a> {
    /// The key.
    pub key: &'a [u8],
    /// The value.
    pub value: &'a [u8],
    /// `NX`, `NEX` or neither.
    pub condition: Condition,
    /// `PX`: time to live in milliseconds.
    pub expires_in_ms: Option<u64>,
}

impl<'a> Set<'a> {
    pub(crate) fn parse(parse: &mut Parse<'a, '_>) -> Result<Set<'a>, Error> {
        let key = parse.key()?;
        let value = parse.required()?;
        let mut condition = None;
        let mut expires_in_ms = None;
        while let Some(option) = parse.optional() {
            let (slot_taken, new_condition) = if parse.is_option(option, "NX") {
                (condition.is_some(), Some(Condition::IfAbsent))
            } else if parse.is_option(option, "NEX") {
                (condition.is_some(), Some(Condition::IfAbsentOrEqual))
            } else if parse.is_option(option, "PX") {
                (expires_in_ms.is_some(), None)
            } else {
                return Err(Error::Syntax);
            };
            if slot_taken {
                return Err(Error::Syntax);
            }
            match new_condition {
                Some(c) => condition = Some(c),
                None => expires_in_ms = Some(positive_ms(parse.optional())?),
            }
        }
        Ok(Set {
            key,
            value,
            condition: condition.unwrap_or_default(),
            expires_in_ms,
        })
    }

    pub(crate) fn apply(self, state: &mut State, ctx: &Ctx<'_>) -> Result<Answer, Error> {
        super::apply_key(KeyCommand::Set(self), state, ctx)
    }

    /// Decides the answer and the change against the key's entry.
    pub fn plan(
        &self,
        existing: Option<&Entry>,
        ctx: &Context<'_>,
        planner: &dyn Planner,
    ) -> Result<Plan<'a>, Error> {
        let set = self;
        if ctx.timestamp.is_none() {
            return Err(Error::TimestampMissing);
        }
        let protecting = existing.and_then(Entry::fencing_token);
        fencing::check(protecting, ctx.fencing_token)?;
        if let Some(old) = existing {
            let applies = match set.condition {
                Condition::Always => true,
                Condition::IfAbsent => false,
                Condition::IfAbsentOrEqual => old.value() == set.value,
            };
            if !applies {
                return Ok(Plan::unchanged(
                    Frame::Integer(-1),
                    Stamp::Of(old.version()),
                ));
            }
        }
        planner.check_quota(set.key, set.value, existing)?;
        let extras = Extras {
            expires_at: set.expires_in_ms.map(|ms| ctx.now.saturating_add(ms)),
            fencing_token: fencing::kept_after_set(protecting, ctx.fencing_token),
            persisted: ctx.persist
                || existing.is_some_and(Entry::persisted)
                || planner.persists_by_policy(set.key),
        };
        Ok(Plan {
            frame: Frame::Simple("OK"),
            stamp: Stamp::New,
            change: Some(Change::Put {
                key: set.key,
                value: set.value,
                extras,
            }),
        })
    }
}

/// The argument of `PX`: a positive decimal integer.
fn positive_ms(arg: Option<&[u8]>) -> Result<u64, Error> {
    let arg = arg.ok_or(Error::Syntax)?;
    if arg.is_empty() || !arg.iter().all(u8::is_ascii_digit) {
        return Err(Error::Syntax);
    }
    let ms: u64 = std::str::from_utf8(arg)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or(Error::Syntax)?;
    if ms == 0 {
        return Err(Error::Syntax);
    }
    Ok(ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::{Command, Dialect};

    fn parse(args: &[&'static [u8]]) -> Result<Set<'static>, Error> {
        match Command::parse(args, Dialect::V1)? {
            Command::Set(set) => Ok(set),
            other => panic!("not a SET: {other:?}"),
        }
    }

    #[test]
    fn options() {
        let s = parse(&[b"SET", b"k", b"v", b"NEX", b"PX", b"10000"]).unwrap();
        assert_eq!(
            (s.condition, s.expires_in_ms),
            (Condition::IfAbsentOrEqual, Some(10_000))
        );
        let s = parse(&[b"SET", b"k", b"v", b"px", b"5", b"nx"]).unwrap();
        assert_eq!(
            (s.condition, s.expires_in_ms),
            (Condition::IfAbsent, Some(5))
        );
        let s = parse(&[b"SET", b"k", b""]).unwrap();
        assert_eq!(
            (s.value, s.condition, s.expires_in_ms),
            (&b""[..], Condition::Always, None)
        );
    }

    #[test]
    fn bad_options_are_syntax_errors() {
        for args in [
            &[&b"SET"[..], b"k", b"v", b"XX"][..],
            &[b"SET", b"k", b"v", b"NX", b"NEX"],
            &[b"SET", b"k", b"v", b"NX", b"NX"],
            &[b"SET", b"k", b"v", b"PX"],
            &[b"SET", b"k", b"v", b"PX", b"0"],
            &[b"SET", b"k", b"v", b"PX", b"-5"],
            &[b"SET", b"k", b"v", b"PX", b"+5"],
            &[b"SET", b"k", b"v", b"PX", b"1.5"],
            &[b"SET", b"k", b"v", b"PX", b""],
            &[b"SET", b"k", b"v", b"PX", b"99999999999999999999999"],
            &[b"SET", b"k", b"v", b"PX", b"5", b"PX", b"6"],
        ] {
            assert_eq!(parse(args), Err(Error::Syntax), "{args:?}");
        }
    }
}
