//! The seam between the key commands and where keys live.
//!
//! A key command (SET, GET, DEL, VDEL) looks at one entry, the key's
//! current one, and decides its answer and its change: a [`Plan`]. Where
//! the change is committed is the backend's business:
//!
//! - the single node's [`crate::Store`] commits into its own
//!   [`crate::db::Db`], under its lock, so the entry cannot change between
//!   plan and commit;
//! - a cluster (the broker's etcd backend) commits by compare-and-swap on
//!   the entry it planned against, and plans again from the entry it finds
//!   when another node got there first.
//!
//! Either way the answers, errors and their order are the commands' own,
//! decided here once. What a plan cannot know by itself (the store-wide
//! quota and which keys configuration persists) it asks a [`Planner`].
//!
//! ```
//! use statestore::hlc::{Hlc, Version};
//! use statestore::plan::{Change, Context, KeyCommand, Planner, Stamp};
//! use statestore::command::{Command, Dialect};
//! use statestore::Error;
//!
//! struct Unlimited;
//! impl Planner for Unlimited {
//!     fn check_quota(&self, _: &[u8], _: &[u8], _: Option<&statestore::db::Entry>) -> Result<(), Error> { Ok(()) }
//!     fn persists_by_policy(&self, _: &[u8]) -> bool { false }
//! }
//!
//! let args: [&[u8]; 4] = [b"SET", b"lock", b"me", b"NX"];
//! let command = KeyCommand::of(Command::parse(&args, Dialect::V1).unwrap()).unwrap();
//! let ts: Hlc = "1700000000000:0:me".parse().unwrap();
//! let ctx = Context { now: 1_700_000_000_000, timestamp: Some(&ts), fencing_token: None, persist: false };
//! let plan = command.plan(None, &ctx, &Unlimited).unwrap();
//! assert!(matches!(plan.stamp, Stamp::New));
//! assert!(matches!(plan.change, Some(Change::Put { .. })));
//! ```

use crate::command::{Command, Condition};
use crate::db::{Entry, Extras};
use crate::error::Error;
use crate::fencing;
use crate::hlc::{Hlc, Version};
use crate::resp3::Frame;

/// What a plan asks of the store it plans for.
pub trait Planner {
    /// Whether writing `value` under `key`, replacing `existing`, stays
    /// within the quota: `Err(QuotaExceeded)` otherwise.
    fn check_quota(&self, key: &[u8], value: &[u8], existing: Option<&Entry>) -> Result<(), Error>;
    /// Whether configuration keeps `key` on disk without being asked.
    fn persists_by_policy(&self, key: &[u8]) -> bool;
}

/// What a key command sees of its request besides its arguments.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    /// The broker's wall clock, milliseconds since the Unix epoch.
    pub now: u64,
    /// The request's `__ts`.
    pub timestamp: Option<&'a Hlc>,
    /// The request's `__ft`.
    pub fencing_token: Option<&'a Hlc>,
    /// `aio-persistence: true`.
    pub persist: bool,
}

/// Which version the answer carries in `__ts`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stamp {
    /// The entry's version, as found.
    Of(Version),
    /// The clock's reading: the answer shows no version (`$-1`, `:0`).
    ClockNow,
    /// A new version, handed out when the change is committed (`+OK`).
    New,
}

/// The change a plan makes to its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change<'a> {
    /// Write `value` with `extras`, at the new version.
    Put {
        /// The key.
        key: &'a [u8],
        /// The value.
        value: &'a [u8],
        /// Expiry, fencing token, persistence.
        extras: Extras,
    },
    /// Delete the key (its watchers get DELETE with the version it had).
    Delete,
}

/// A key command's answer and change, decided against one entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan<'a> {
    /// The answer.
    pub frame: Frame,
    /// Its `__ts`.
    pub stamp: Stamp,
    /// What to commit; `None` answers without a change.
    pub change: Option<Change<'a>>,
}

impl Plan<'_> {
    fn unchanged(frame: Frame, stamp: Stamp) -> Self {
        Plan {
            frame,
            stamp,
            change: None,
        }
    }
}

/// A command on one key: what [`KeyCommand::plan`] serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyCommand<'a> {
    /// `SET`
    Set(crate::command::Set<'a>),
    /// `GET`
    Get(crate::command::Get<'a>),
    /// `DEL`
    Del(crate::command::Del<'a>),
    /// `VDEL`
    VDel(crate::command::VDel<'a>),
}

impl<'a> KeyCommand<'a> {
    /// The command, if it is one on a key's entry; `None` for KEYNOTIFY,
    /// SCAN, PING and INFO.
    pub fn of(command: Command<'a>) -> Option<KeyCommand<'a>> {
        match command {
            Command::Set(c) => Some(KeyCommand::Set(c)),
            Command::Get(c) => Some(KeyCommand::Get(c)),
            Command::Del(c) => Some(KeyCommand::Del(c)),
            Command::VDel(c) => Some(KeyCommand::VDel(c)),
            _ => None,
        }
    }

    /// The key.
    pub fn key(&self) -> &'a [u8] {
        match self {
            KeyCommand::Set(c) => c.key,
            KeyCommand::Get(c) => c.key,
            KeyCommand::Del(c) => c.key,
            KeyCommand::VDel(c) => c.key,
        }
    }

    /// The verb.
    pub fn name(&self) -> &'static str {
        match self {
            KeyCommand::Set(_) => "SET",
            KeyCommand::Get(_) => "GET",
            KeyCommand::Del(_) => "DEL",
            KeyCommand::VDel(_) => "VDEL",
        }
    }

    /// Whether the command can change its key (GET cannot).
    pub fn writes(&self) -> bool {
        !matches!(self, KeyCommand::Get(_))
    }

    /// Decides the answer and the change against `current`, the key's
    /// entry (`None`: the key does not exist, or expired).
    pub fn plan(
        &self,
        current: Option<&Entry>,
        ctx: &Context<'_>,
        planner: &dyn Planner,
    ) -> Result<Plan<'a>, Error> {
        match self {
            KeyCommand::Set(set) => plan_set(set, current, ctx, planner),
            KeyCommand::Get(_) => Ok(match current {
                Some(entry) => Plan::unchanged(
                    Frame::Bulk(entry.value().to_vec()),
                    Stamp::Of(entry.version()),
                ),
                None => Plan::unchanged(Frame::Null, Stamp::ClockNow),
            }),
            KeyCommand::Del(_) => plan_delete(current, ctx, None),
            KeyCommand::VDel(vdel) => plan_delete(current, ctx, Some(vdel.value)),
        }
    }
}

fn plan_set<'a>(
    set: &crate::command::Set<'a>,
    existing: Option<&Entry>,
    ctx: &Context<'_>,
    planner: &dyn Planner,
) -> Result<Plan<'a>, Error> {
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

fn plan_delete<'a>(
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
