//! Version and fencing-token order, key by key.
//!
//! - **Versions rise in real time.** For acknowledged SETs A and B of one
//!   key (answered `+OK`, with a version), if A returned before B was
//!   invoked, B's version must be greater than A's. Versions are hybrid
//!   logical clocks `WWWWWWWWWWWWWWW:CCCCC:node`; they are parsed and compared
//!   as (wall, counter), the node id aside. A version that does not parse is
//!   a violation too.
//! - **No stale fencing token is accepted.** For acknowledged SETs A and B
//!   of one key that both carried `__ft`, if A returned before B was invoked
//!   and B's token is older than A's, the key was protected by at least A's
//!   token when B ran, so B should have been refused. Unless the key may
//!   have lost its token in between: a DEL or VDEL of the key that may have
//!   taken effect between them (answered `:1`, or unknown), or any SET with
//!   `PX` on the key (expiry is not tracked), excuses the pair.
//!
//! Both are implied by linearizability of the values only in part (versions
//! not at all), and they give a much shorter explanation when they fail.

use std::cmp::Ordering;
use std::collections::BTreeMap;

use statestore::hlc::Hlc;

use crate::history::{Answer, History, Op, Operation, Outcome};
use crate::{Violation, ViolationKind};

/// Violations of one kind reported per key at most; the last one says how
/// many more there were.
const MAX_PER_KEY: usize = 5;

/// An acknowledged SET with what the checks need.
struct AckedSet<'a> {
    op: &'a Operation,
    invoke: u64,
    ret: u64,
    version: Option<Hlc>,
    token: Option<Hlc>,
}

/// Checks versions and fencing tokens of every key of `history`.
pub fn check(history: &History) -> Vec<Violation> {
    let mut keys: BTreeMap<&str, Vec<&Operation>> = BTreeMap::new();
    for op in history.ops() {
        keys.entry(op.op.key()).or_default().push(op);
    }
    let mut violations = Vec::new();
    for (key, ops) in keys {
        check_key(key, &ops, &mut violations);
    }
    violations
}

fn check_key(key: &str, ops: &[&Operation], violations: &mut Vec<Violation>) {
    let mut sets = Vec::new();
    let mut malformed = Vec::new();
    for &op in ops {
        let (
            Op::Set { ft, .. },
            Outcome::Ok {
                time_ns,
                answer,
                version,
            },
        ) = (&op.op, &op.outcome)
        else {
            continue;
        };
        if !answer.is_ok() {
            continue;
        }
        let version = match version.as_deref().map(str::parse::<Hlc>) {
            Some(Ok(v)) => Some(v),
            Some(Err(_)) => {
                malformed.push(op);
                None
            }
            None => None,
        };
        sets.push(AckedSet {
            op,
            invoke: op.invoke_ns,
            ret: *time_ns,
            version,
            token: ft.as_deref().and_then(|t| t.parse().ok()),
        });
    }
    push_limited(
        violations,
        malformed.into_iter().map(|op| Violation {
            key: key.to_owned(),
            kind: ViolationKind::MalformedVersion,
            message: format!(
                "#{} was acknowledged with a version that is not an HLC \
                 (wall:counter:node)",
                op.id
            ),
            ops: vec![op.clone()],
        }),
    );

    // By invoke time, with the acknowledged SETs returned before each one
    // swept in by return time.
    let mut by_return: Vec<&AckedSet<'_>> = sets.iter().collect();
    by_return.sort_by_key(|s| s.ret);
    let mut by_invoke: Vec<&AckedSet<'_>> = sets.iter().collect();
    by_invoke.sort_by_key(|s| s.invoke);

    let mut found = Vec::new();
    let mut highest: Option<&AckedSet<'_>> = None;
    let mut swept = 0;
    for b in &by_invoke {
        while swept < by_return.len() && by_return[swept].ret < b.invoke {
            let a = by_return[swept];
            swept += 1;
            if let Some(v) = &a.version
                && highest.is_none_or(|h| {
                    h.version
                        .as_ref()
                        .is_none_or(|hv| v.cmp_time(hv) == Ordering::Greater)
                })
            {
                highest = Some(a);
            }
        }
        if let (Some(a), Some(bv)) = (highest, &b.version)
            && let Some(av) = &a.version
            && bv.cmp_time(av) != Ordering::Greater
        {
            found.push(Violation {
                key: key.to_owned(),
                kind: ViolationKind::VersionNotIncreasing,
                message: format!(
                    "#{} returned (version {av}) before #{} was invoked, but #{} got version \
                     {bv}, not a greater one",
                    a.op.id, b.op.id, b.op.id
                ),
                ops: vec![a.op.clone(), b.op.clone()],
            });
        }
    }
    push_limited(violations, found);

    // Stale fencing tokens.
    let loses_token = |op: &Operation| match (&op.op, &op.outcome) {
        (Op::Del { .. } | Op::Vdel { .. }, Outcome::Ok { answer, .. }) => {
            *answer == Answer::Integer(1)
        }
        (Op::Del { .. } | Op::Vdel { .. }, Outcome::Info { .. }) => true,
        (Op::Set { px: Some(_), .. }, Outcome::Fail { .. }) => false,
        (Op::Set { px: Some(_), .. }, _) => true,
        _ => false,
    };
    let token_losers: Vec<&Operation> = ops.iter().copied().filter(|op| loses_token(op)).collect();
    let mut found = Vec::new();
    for b in &by_invoke {
        let Some(bt) = &b.token else { continue };
        let stale_after = by_return
            .iter()
            .take_while(|a| a.ret < b.invoke)
            .filter(|a| {
                a.token
                    .as_ref()
                    .is_some_and(|at| bt.cmp_time(at) == Ordering::Less)
            })
            .find(|a| {
                // No loss of the token may fit between A and B.
                !token_losers
                    .iter()
                    .any(|d| d.invoke_ns < b.ret && d.return_ns().is_none_or(|r| r > a.invoke))
            });
        if let Some(a) = stale_after {
            let at = a
                .token
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default();
            found.push(Violation {
                key: key.to_owned(),
                kind: ViolationKind::StaleFencingTokenAccepted,
                message: format!(
                    "#{} was acknowledged with fencing token {bt}, but #{} had set the key \
                     with the newer token {at} and returned before #{} was invoked, and \
                     nothing could have removed that token in between",
                    b.op.id, a.op.id, b.op.id
                ),
                ops: vec![a.op.clone(), b.op.clone()],
            });
        }
    }
    push_limited(violations, found);
}

/// Adds at most [`MAX_PER_KEY`] of `found`, the last saying how many were
/// left out.
fn push_limited(violations: &mut Vec<Violation>, found: impl IntoIterator<Item = Violation>) {
    let mut found: Vec<Violation> = found.into_iter().collect();
    if found.len() > MAX_PER_KEY {
        let more = found.len() - MAX_PER_KEY;
        found.truncate(MAX_PER_KEY);
        if let Some(last) = found.last_mut() {
            last.message.push_str(&format!(
                " ({more} more of this kind on this key not shown)"
            ));
        }
    }
    violations.extend(found);
}
