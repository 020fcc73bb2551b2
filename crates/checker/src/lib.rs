//! A history checker for the state store, clustered or not, a check of
//! KEYNOTIFY notifications against it ([`notifications`]), and a check of
//! MQTT deliveries under faults ([`delivery`]).
//!
//! Clients record the invoke and the return of each state store operation
//! they perform, on one monotonic clock ([`history::Recorder`]); this crate
//! then checks the recorded [`History`]:
//!
//! - **Linearizability, per key** ([`linearizability`]): Wing & Gong's
//!   search with Lowe's memoization, as in porcupine. The sequential model is
//!   the `statestore` crate itself: an operation's answer must be what a
//!   single [`statestore::Store`] answers in the key's state at the point
//!   where the operation is linearized (values, `NX`/`NEX`, `DEL`/`VDEL`
//!   answers, fencing-token refusals). Stale reads and lost updates show up
//!   here. Operations that timed out (`info`) may take effect at any time
//!   after their invoke, or never; `fail` ones never did.
//! - **Versions and fencing tokens** ([`versions`]): a SET acknowledged
//!   after another one returned (real time) has a greater version (HLCs
//!   compared as (wall, counter)); a SET is not acknowledged with a fencing
//!   token older than one an earlier acknowledged SET of the key carried.
//!
//! Cost: valid histories check fast (20,000 operations on 40 keys from 12
//! processes: well under a second, even unoptimized). Proving a key *not*
//! linearizable may search every order of its concurrent operations, which
//! grows with the concurrency on that key and with open `info` writes
//! (each stays concurrent with everything after it); a key whose search
//! passes [`linearizability::Options::max_steps_per_key`] is reported as
//! undecided ([`Report::undecided`]) instead. Spread operations over
//! several keys to keep the concurrency per key moderate.
//!
//! Not checked: expiry. The model keeps keys set with `PX` for ever, so a
//! history whose answers depend on a key expiring during the run (a GET
//! answering nil after the PX ran out) is reported as a violation; give keys
//! under test a PX longer than the run, or none. `-ERR` answers that depend
//! on more than the key (clock skew, quota, authorization, broker errors)
//! count as `fail`. SCAN, KEYNOTIFY and other commands are not recorded.
//!
//! # The record format
//!
//! JSON Lines, one event a line (see [`history`] for every field):
//!
//! ```text
//! {"type":"invoke","id":17,"process":3,"time_ns":123,"op":{"f":"set","key":"k1","value":"v","condition":"nx","px":null,"ft":null}}
//! {"type":"ok","id":17,"time_ns":456,"answer":"+OK","version":"001700000000000:00001:node1"}
//! {"type":"invoke","id":18,"process":4,"time_ns":200,"op":{"f":"get","key":"k1"}}
//! {"type":"info","id":18,"time_ns":5000}
//! ```
//!
//! `op.f` is `set`, `get`, `del` or `vdel`. `answer` is the RESP3 answer
//! without CRLF: `+OK`, `:-1`, `:0`, `:1`, `$-1` (nil), `$hello` (bulk),
//! `-ERR <text>`. Completions: `ok`, `fail` (definitely not applied), `info`
//! (unknown; an operation never completed counts as `info`).
//!
//! # Use from a test
//!
//! ```
//! use std::sync::Arc;
//! use statebroker_checker::history::{Answer, Op, Recorder};
//!
//! let recorder = Arc::new(Recorder::new()); // or Recorder::create(path, true)
//! // In each client task, around each request:
//! let id = recorder.invoke(1, Op::set("k", "v1"));
//! // ... send it, await the response ...
//! recorder.ok(id, Answer::from_resp3(b"+OK\r\n").unwrap(), Some("001700000000000:00001:n1".into()));
//! let id = recorder.invoke(2, Op::get("k"));
//! recorder.ok(id, Answer::Bulk("v1".into()), Some("001700000000000:00001:n1".into()));
//! // A timeout: recorder.info(id); a refusal that surely did nothing: recorder.fail(id).
//!
//! let report = statebroker_checker::check(&recorder.history().unwrap());
//! assert!(report.is_valid(), "{report}");
//! ```
//!
//! From a file: `statebroker-check history.jsonl` prints the report and
//! exits 1 on violations, or [`History::load`] and [`check`].

pub mod delivery;
pub mod history;
pub mod linearizability;
mod model;
pub mod notifications;
pub mod versions;

use std::fmt;

pub use history::{Answer, Event, History, Op, Operation, Recorder};

/// What kind of violation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ViolationKind {
    /// No linearization of a key's operations explains their answers.
    NotLinearizable,
    /// An acknowledged SET got a version not greater than one acknowledged
    /// before it was invoked.
    VersionNotIncreasing,
    /// A SET was acknowledged with a fencing token older than the key's.
    StaleFencingTokenAccepted,
    /// An acknowledged SET's version is not an HLC.
    MalformedVersion,
}

/// One problem found, on one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The key.
    pub key: String,
    /// What kind.
    pub kind: ViolationKind,
    /// What is wrong, in words.
    pub message: String,
    /// The operations involved (a window of them, for linearizability).
    pub ops: Vec<Operation>,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{:?} on key {:?}: {}", self.kind, self.key, self.message)?;
        for op in &self.ops {
            writeln!(f, "    {op}")?;
        }
        Ok(())
    }
}

/// What a check found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Keys checked.
    pub keys: usize,
    /// Operations checked for linearizability (all but `fail` and
    /// `-ERR` answers outside the model).
    pub ops: usize,
    /// The problems found.
    pub violations: Vec<Violation>,
    /// Keys whose linearizability search gave up (see
    /// [`linearizability::Options::max_steps_per_key`]).
    pub undecided: Vec<String>,
}

impl Report {
    /// No violations, and every key decided.
    pub fn is_valid(&self) -> bool {
        self.violations.is_empty() && self.undecided.is_empty()
    }

    /// The violations of one kind.
    pub fn of_kind(&self, kind: ViolationKind) -> impl Iterator<Item = &Violation> {
        self.violations.iter().filter(move |v| v.kind == kind)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} keys, {} operations: {} violations{}",
            self.keys,
            self.ops,
            self.violations.len(),
            if self.undecided.is_empty() {
                String::new()
            } else {
                format!(", {} keys undecided", self.undecided.len())
            }
        )?;
        for v in &self.violations {
            write!(f, "{v}")?;
        }
        for key in &self.undecided {
            writeln!(f, "undecided (search limit reached) on key {key:?}")?;
        }
        Ok(())
    }
}

/// Runs every check on `history`: [`linearizability::check`] and
/// [`versions::check`].
pub fn check(history: &History) -> Report {
    check_with(history, &linearizability::Options::default())
}

/// [`check`] with limits for the linearizability search.
pub fn check_with(history: &History, options: &linearizability::Options) -> Report {
    let mut report = linearizability::check_with(history, options);
    report.violations.extend(versions::check(history));
    report
}
