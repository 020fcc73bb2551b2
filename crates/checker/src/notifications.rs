//! KEYNOTIFY notifications against the history of the changes.
//!
//! A watcher registered on the keys before the workload started, and
//! connected through it, must get every committed change of them once, in
//! the order the changes were made. [`check`] compares what a watcher got
//! ([`Note`]s, in the order received) with the [`History`] of the
//! workload:
//!
//! - every acknowledged SET (`+OK`) is notified once, with its value and
//!   the version its answer carried; every acknowledged DEL or VDEL (`:1`)
//!   is notified as a delete with the version of the entry it deleted (the
//!   version its answer carried);
//! - a SET whose answer never came (`info`) may be notified or not, but at
//!   most once; a value nobody wrote, or a SET answered otherwise (`:-1`,
//!   an error), is never notified;
//! - per key, the SETs are notified in increasing version order (versions
//!   increase with each change of a key, so that is the order they were
//!   made in), and a delete follows the SET of the version it carries
//!   (never two deletes in a row).
//!
//! Values must be unique per SET operation (the workload writes
//! `p<process>-<n>`).

use std::collections::{HashMap, HashSet};
use std::fmt;

use statestore::hlc::Hlc;

use crate::history::{Answer, History, Op, Outcome};

/// One notification as a watcher received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    /// The key.
    pub key: String,
    /// `Some(value)`: a SET; `None`: a delete.
    pub value: Option<String>,
    /// The notification's `__ts`.
    pub version: String,
}

/// What [`check`] found; each list holds a description per case.
#[derive(Debug, Default, Clone)]
pub struct Report {
    /// Notifications checked.
    pub notes: usize,
    /// Acknowledged changes (SETs and deletes) of the keys notified.
    pub acknowledged: usize,
    /// Acknowledged changes not notified.
    pub missing: Vec<String>,
    /// Changes notified more than once.
    pub duplicates: Vec<String>,
    /// Notifications of nothing that committed: a value no SET wrote, a SET
    /// answered otherwise than `+OK`, a version other than the answer's.
    pub wrong: Vec<String>,
    /// Notifications out of the order of the changes.
    pub out_of_order: Vec<String>,
}

impl Report {
    /// Whether the watcher got every change once, in order, and nothing
    /// else.
    pub fn is_valid(&self) -> bool {
        self.missing.is_empty()
            && self.duplicates.is_empty()
            && self.wrong.is_empty()
            && self.out_of_order.is_empty()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} notifications, {} acknowledged changes: {} missing, {} duplicated, {} wrong, {} out of order",
            self.notes,
            self.acknowledged,
            self.missing.len(),
            self.duplicates.len(),
            self.wrong.len(),
            self.out_of_order.len()
        )?;
        let first = [
            &self.missing,
            &self.duplicates,
            &self.wrong,
            &self.out_of_order,
        ]
        .into_iter()
        .find_map(|cases| cases.first());
        if let Some(first) = first {
            write!(f, " (first: {first})")?;
        }
        Ok(())
    }
}

/// A SET of the history, by its value.
struct Set {
    /// `Some(true)`: `+OK`; `Some(false)`: answered otherwise; `None`: no
    /// answer.
    acknowledged: Option<bool>,
    version: Option<String>,
}

/// Checks the notes one watcher got for `keys` against `history`.
pub fn check(history: &History, keys: &[String], notes: &[Note]) -> Report {
    let mut report = Report::default();
    let keys: HashSet<&str> = keys.iter().map(String::as_str).collect();
    let mut sets: HashMap<(&str, &str), Set> = HashMap::new();
    // Acknowledged deletes: (key, version of the entry deleted).
    let mut deletes: Vec<(&str, &str)> = Vec::new();
    for op in history.ops() {
        if !keys.contains(op.op.key()) {
            continue;
        }
        let (answer, version) = match &op.outcome {
            Outcome::Ok {
                answer, version, ..
            } => (Some(answer), version.as_deref()),
            _ => (None, None),
        };
        match &op.op {
            Op::Set { key, value, .. } => {
                let acknowledged = answer.map(Answer::is_ok);
                report.acknowledged += usize::from(acknowledged == Some(true));
                sets.insert(
                    (key, value),
                    Set {
                        acknowledged,
                        version: version.map(str::to_owned),
                    },
                );
            }
            Op::Del { key, .. } | Op::Vdel { key, .. } => {
                if let (Some(Answer::Integer(1)), Some(version)) = (answer, version) {
                    report.acknowledged += 1;
                    deletes.push((key, version));
                }
            }
            Op::Get { .. } => {}
        }
    }
    // Per key: the last SET notified (its version), and whether a delete
    // followed it.
    let mut last: HashMap<&str, (Hlc, String, bool)> = HashMap::new();
    let mut notified: HashSet<(&str, &str)> = HashSet::new();
    let mut deleted: HashSet<(&str, &str)> = HashSet::new();
    for note in notes {
        report.notes += 1;
        let key = note.key.as_str();
        let Ok(version) = note.version.parse::<Hlc>() else {
            report
                .wrong
                .push(format!("{key}: version {:?} does not parse", note.version));
            continue;
        };
        match &note.value {
            Some(value) => {
                let Some(set) = sets.get(&(key, value.as_str())) else {
                    report
                        .wrong
                        .push(format!("{key}: value {value:?} no SET wrote"));
                    continue;
                };
                if set.acknowledged == Some(false) {
                    report
                        .wrong
                        .push(format!("{key}: {value:?} of a SET that was refused"));
                }
                if set.acknowledged == Some(true)
                    && set.version.as_deref() != Some(note.version.as_str())
                {
                    report.wrong.push(format!(
                        "{key}: {value:?} notified with version {}, answered with {:?}",
                        note.version, set.version
                    ));
                }
                if !notified.insert((key, value.as_str())) {
                    report.duplicates.push(format!("{key}: SET {value:?}"));
                    continue;
                }
                if let Some((previous, text, _)) = last.get(key)
                    && version.cmp_time(previous) != std::cmp::Ordering::Greater
                {
                    report.out_of_order.push(format!(
                        "{key}: SET {value:?} at {} after {text}",
                        note.version
                    ));
                }
                last.insert(key, (version, note.version.clone(), false));
            }
            None => match last.get_mut(key) {
                Some((_, text, after)) if *text == note.version && !*after => {
                    *after = true;
                    deleted.insert((key, note.version.as_str()));
                }
                Some((_, text, true)) if *text == note.version => {
                    report
                        .duplicates
                        .push(format!("{key}: delete of {}", note.version));
                }
                _ => report.out_of_order.push(format!(
                    "{key}: delete of {} not after the SET of that version",
                    note.version
                )),
            },
        }
    }
    for ((key, value), set) in &sets {
        if set.acknowledged == Some(true) && !notified.contains(&(*key, *value)) {
            report.missing.push(format!("{key}: SET {value:?}"));
        }
    }
    for (key, version) in deletes {
        if !deleted.contains(&(key, version)) {
            report.missing.push(format!("{key}: delete of {version}"));
        }
    }
    report.missing.sort();
    report
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::{Op, Recorder};

    fn history(ops: &[(Op, Option<(Answer, &str)>)]) -> History {
        let recorder = Recorder::new();
        for (p, (op, outcome)) in ops.iter().enumerate() {
            let id = recorder.invoke(p as u64, op.clone());
            match outcome {
                Some((answer, version)) => {
                    recorder.ok(id, answer.clone(), Some((*version).to_owned()))
                }
                None => recorder.info(id),
            }
        }
        recorder.history().unwrap()
    }

    fn set(value: &str, version: &str) -> Note {
        Note {
            key: "k".into(),
            value: Some(value.into()),
            version: version.into(),
        }
    }

    fn delete(version: &str) -> Note {
        Note {
            key: "k".into(),
            value: None,
            version: version.into(),
        }
    }

    const V1: &str = "000000000000100:00000:n1";
    const V2: &str = "000000000000200:00000:n2";
    const V3: &str = "000000000000300:00000:n1";

    fn workload() -> History {
        history(&[
            (Op::set("k", "a"), Some((Answer::ok(), V1))),
            (Op::del("k"), Some((Answer::Integer(1), V1))),
            (Op::set("k", "b"), Some((Answer::ok(), V2))),
            // No answer: it committed (V3) or not.
            (Op::set("k", "c"), None),
            (
                Op::Set {
                    key: "k".into(),
                    value: "d".into(),
                    condition: Some(crate::history::Condition::Nx),
                    px: None,
                    ft: None,
                },
                Some((Answer::Integer(-1), V3)),
            ),
        ])
    }

    fn keys() -> Vec<String> {
        vec!["k".into()]
    }

    #[test]
    fn every_change_once_in_order_is_valid() {
        let notes = [set("a", V1), delete(V1), set("b", V2), set("c", V3)];
        let report = check(&workload(), &keys(), &notes);
        assert!(report.is_valid(), "{report}");
        assert_eq!(report.acknowledged, 3);
        // The unanswered SET may also not have committed.
        let report = check(&workload(), &keys(), &notes[..3]);
        assert!(report.is_valid(), "{report}");
    }

    #[test]
    fn a_missing_change_is_flagged() {
        let report = check(&workload(), &keys(), &[set("a", V1), set("b", V2)]);
        assert_eq!(report.missing, ["k: delete of 000000000000100:00000:n1"]);
        let report = check(&workload(), &keys(), &[set("a", V1), delete(V1)]);
        assert_eq!(report.missing, ["k: SET \"b\""]);
    }

    #[test]
    fn a_duplicate_is_flagged() {
        let notes = [set("a", V1), delete(V1), delete(V1), set("b", V2)];
        assert_eq!(check(&workload(), &keys(), &notes).duplicates.len(), 1);
        let notes = [set("a", V1), delete(V1), set("b", V2), set("b", V2)];
        assert_eq!(check(&workload(), &keys(), &notes).duplicates.len(), 1);
    }

    #[test]
    fn out_of_order_is_flagged() {
        let notes = [set("b", V2), set("a", V1), delete(V1)];
        let report = check(&workload(), &keys(), &notes);
        assert!(!report.out_of_order.is_empty(), "{report}");
        // A delete must follow the SET it deleted.
        let notes = [set("a", V1), set("b", V2), delete(V1)];
        let report = check(&workload(), &keys(), &notes);
        assert!(!report.out_of_order.is_empty(), "{report}");
    }

    #[test]
    fn changes_that_did_not_happen_are_flagged() {
        // A refused SET, a value never written, a wrong version.
        let notes = [set("a", V1), delete(V1), set("b", V2), set("d", V3)];
        assert_eq!(check(&workload(), &keys(), &notes).wrong.len(), 1);
        let notes = [set("a", V1), delete(V1), set("b", V2), set("x", V3)];
        assert_eq!(check(&workload(), &keys(), &notes).wrong.len(), 1);
        let notes = [set("a", V3), delete(V3), set("b", V2)];
        let report = check(&workload(), &keys(), &notes);
        assert!(!report.wrong.is_empty(), "{report}");
    }
}
