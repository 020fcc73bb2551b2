//! The seam between the key commands and where keys live.
//!
//! A key command (SET, GET, DEL, VDEL: [`crate::command::KeyCommand`]) looks at one entry, the key's
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
//! use statestore::plan::{Change, Context, Planner, Stamp};
//! use statestore::command::{Command, Dialect, KeyCommand};
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

use crate::db::{Entry, Extras};
use crate::error::Error;
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

/// What a command answers: the frame, and the version for `__ts`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The RESP3 response.
    pub frame: Frame,
    /// The key's version, or the store's clock for commands without one.
    pub version: Version,
}

impl Plan<'_> {
    /// An answer that changes nothing.
    pub fn unchanged(frame: Frame, stamp: Stamp) -> Self {
        Plan {
            frame,
            stamp,
            change: None,
        }
    }
}
