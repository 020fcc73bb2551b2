//! A fault rule: which state store requests it matches (verb, key glob,
//! client id glob) and what it does to them (delay, `-ERR`, a dropped
//! answer, a disconnect after so many), as written in `[[faults.rules]]`
//! or sent to the HTTP endpoint as JSON.

use std::time::Duration;

use router::protocol::DisconnectReasonCode;
use serde::{Deserialize, Serialize};
use statestore::glob::Pattern;

/// The verbs a rule may name.
pub const VERBS: &[&str] = &statestore::command::Command::NAMES;

/// A rule as written: every field optional; see docs/faults.md's rule
/// reference.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RuleSpec {
    /// Verbs it matches (`GET`, `SET`, ...); empty: all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub commands: Vec<String>,
    /// Glob over the key (the argument after the verb); empty: any.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub keys: String,
    /// Glob over the caller's client id; empty: any.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub clients: String,
    /// Milliseconds before the request runs: `200`, or `"50..500"` (picked
    /// at random, both ends included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay_ms: Option<DelaySpec>,
    /// Answer `-ERR <error>` without executing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// `"before"`: never execute, never answer; `"after"`: execute, never
    /// answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drop_response: Option<String>,
    /// The client sending the Nth matching request is disconnected once it
    /// is executed, before its answer is written (a session that outlives
    /// the connection gets the answer when it comes back); the count
    /// starts again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disconnect_after: Option<u32>,
    /// The DISCONNECT reason code of `disconnect_after` (MQTT 5), default
    /// 0x80 (unspecified error).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason_code: Option<u8>,
}

/// `delay_ms`: a number, or a range `"MIN..MAX"`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum DelaySpec {
    /// Exactly this many milliseconds.
    Fixed(u64),
    /// `"MIN..MAX"` milliseconds.
    Range(String),
}

/// What a matching rule does to the request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Action {
    /// Execute and answer (after the delay, if any).
    #[default]
    Execute,
    /// Answer `-ERR <text>` without executing.
    Error(String),
    /// Never execute, never answer.
    DropBefore,
    /// Execute, never answer.
    DropAfter,
}

/// A rule, checked.
#[derive(Debug)]
pub struct Rule {
    pub(super) spec: RuleSpec,
    commands: Vec<String>,
    keys: Option<Pattern>,
    clients: Option<Pattern>,
    /// Milliseconds, both ends included.
    pub(super) delay: Option<(u64, u64)>,
    pub(super) action: Action,
    pub(super) disconnect: Option<(u32, DisconnectReasonCode)>,
}

/// The longest delay a rule may ask for.
const MAX_DELAY_MS: u64 = 10 * 60 * 1000;

impl Rule {
    /// Checks `spec`; the error names the field (`what` prefixes it, as
    /// `faults.rules[2]`).
    pub fn new(spec: RuleSpec, what: &str) -> Result<Rule, String> {
        let mut commands = Vec::with_capacity(spec.commands.len());
        for command in &spec.commands {
            let upper = command.to_ascii_uppercase();
            if !VERBS.contains(&upper.as_str()) {
                return Err(format!(
                    "{what}.commands: `{command}` is not a state store verb ({})",
                    VERBS.join(", ")
                ));
            }
            commands.push(upper);
        }
        let glob = |g: &str| (!g.is_empty() && g != "*").then(|| Pattern::new(g.as_bytes()));
        let delay = match &spec.delay_ms {
            None => None,
            Some(DelaySpec::Fixed(ms)) => Some((*ms, *ms)),
            Some(DelaySpec::Range(text)) => Some(parse_range(text).ok_or_else(|| {
                format!(
                    "{what}.delay_ms: `{text}` is neither milliseconds nor a range like \"50..500\""
                )
            })?),
        };
        if delay.is_some_and(|(_, max)| max > MAX_DELAY_MS) {
            return Err(format!(
                "{what}.delay_ms: at most {MAX_DELAY_MS} (10 minutes)"
            ));
        }
        let action = match (&spec.error, spec.drop_response.as_deref()) {
            (Some(_), Some(_)) => {
                return Err(format!(
                    "{what}: `error` and `drop_response` exclude each other"
                ));
            }
            (Some(text), None) => {
                if text.is_empty() || text.contains(['\r', '\n']) {
                    return Err(format!(
                        "{what}.error: one line of text, not empty (it is answered as `-ERR <text>`)"
                    ));
                }
                Action::Error(text.clone())
            }
            (None, Some("before")) => Action::DropBefore,
            (None, Some("after")) => Action::DropAfter,
            (None, Some(other)) => {
                return Err(format!(
                    "{what}.drop_response: `{other}` is neither \"before\" nor \"after\""
                ));
            }
            (None, None) => Action::Execute,
        };
        let disconnect = match (spec.disconnect_after, spec.reason_code) {
            (None, Some(_)) => {
                return Err(format!("{what}.reason_code: only with disconnect_after"));
            }
            (None, None) => None,
            (Some(0), _) => return Err(format!("{what}.disconnect_after: at least 1")),
            (Some(n), code) => Some((n, reason_code(code.unwrap_or(0x80), what)?)),
        };
        if delay.is_none() && action == Action::Execute && disconnect.is_none() {
            return Err(format!(
                "{what}: does nothing (give delay_ms, error, drop_response or disconnect_after)"
            ));
        }
        Ok(Rule {
            keys: glob(&spec.keys),
            clients: glob(&spec.clients),
            commands,
            delay,
            action,
            disconnect,
            spec,
        })
    }

    /// Whether the rule applies to `command` on `key` from `client`.
    pub fn matches(&self, command: &str, key: Option<&[u8]>, client: &str) -> bool {
        (self.commands.is_empty() || self.commands.iter().any(|c| c == command))
            && self
                .keys
                .as_ref()
                .is_none_or(|p| key.is_some_and(|k| p.matches(k)))
            && self
                .clients
                .as_ref()
                .is_none_or(|p| p.matches(client.as_bytes()))
    }

    /// A delay to wait, picked in the rule's range.
    pub fn pick_delay(&self) -> Option<Duration> {
        self.delay
            .map(|(min, max)| Duration::from_millis(fastrand::u64(min..=max)))
    }
}

/// `"50..500"`, `"50..=500"`, or one number.
fn parse_range(text: &str) -> Option<(u64, u64)> {
    let text = text.trim();
    let (min, max) = match text.split_once("..") {
        Some((min, max)) => (min.trim(), max.trim().trim_start_matches('=').trim()),
        None => (text, text),
    };
    let (min, max) = (min.parse().ok()?, max.parse().ok()?);
    (min <= max).then_some((min, max))
}

/// The DISCONNECT reason codes a server may send that a fault can choose.
pub fn reason_code(code: u8, what: &str) -> Result<DisconnectReasonCode, String> {
    use DisconnectReasonCode as R;
    Ok(match code {
        0x00 => R::NormalDisconnection,
        0x80 => R::UnspecifiedError,
        0x83 => R::ImplementationSpecificError,
        0x87 => R::NotAuthorized,
        0x89 => R::ServerBusy,
        0x8B => R::ServerShuttingDown,
        0x8D => R::KeepAliveTimeout,
        0x8E => R::SessionTakenOver,
        0x97 => R::QuotaExceeded,
        0x98 => R::AdministrativeAction,
        0x9C => R::UseAnotherServer,
        0x9D => R::ServerMoved,
        0x9F => R::ConnectionRateExceeded,
        0xA0 => R::MaximumConnectTime,
        other => {
            return Err(format!(
                "{what}: reason code {other:#04x} is not one a fault may send \
                 (0x00, 0x80, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x97, 0x98, 0x9C, 0x9D, 0x9F, 0xA0)"
            ));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(spec: RuleSpec) -> Result<Rule, String> {
        Rule::new(spec, "faults.rules[0]")
    }

    #[test]
    fn rules_match_by_verb_key_and_client() {
        let r = rule(RuleSpec {
            commands: vec!["get".into(), "SET".into()],
            keys: "slow*".into(),
            clients: "app-?".into(),
            delay_ms: Some(DelaySpec::Fixed(200)),
            ..RuleSpec::default()
        })
        .unwrap();
        assert!(r.matches("GET", Some(b"slow-1"), "app-1"));
        assert!(r.matches("SET", Some(b"slow"), "app-2"));
        assert!(!r.matches("DEL", Some(b"slow"), "app-1"));
        assert!(!r.matches("GET", Some(b"fast"), "app-1"));
        assert!(!r.matches("GET", None, "app-1"));
        assert!(!r.matches("GET", Some(b"slow"), "app-10"));
        assert_eq!(r.pick_delay(), Some(Duration::from_millis(200)));
        // Empty and "*" match everything, a missing key included.
        let any = rule(RuleSpec {
            keys: "*".into(),
            error: Some("boom".into()),
            ..RuleSpec::default()
        })
        .unwrap();
        assert!(any.matches("PING", None, "x"));
        assert_eq!(any.action, Action::Error("boom".into()));
    }

    #[test]
    fn ranges_and_mistakes() {
        let r = rule(RuleSpec {
            delay_ms: Some(DelaySpec::Range("50..500".into())),
            drop_response: Some("after".into()),
            ..RuleSpec::default()
        })
        .unwrap();
        assert_eq!((r.delay, &r.action), (Some((50, 500)), &Action::DropAfter));
        for _ in 0..100 {
            let d = r.pick_delay().unwrap().as_millis();
            assert!((50..=500).contains(&d), "{d}");
        }
        assert_eq!(parse_range("7"), Some((7, 7)));
        assert_eq!(parse_range("1..=2"), Some((1, 2)));
        assert_eq!(parse_range("5..1"), None);
        let error = |spec: RuleSpec| rule(spec).unwrap_err();
        assert!(error(RuleSpec::default()).contains("does nothing"));
        assert!(
            error(RuleSpec {
                commands: vec!["HGET".into()],
                error: Some("x".into()),
                ..RuleSpec::default()
            })
            .contains("faults.rules[0].commands: `HGET`")
        );
        assert!(
            error(RuleSpec {
                error: Some("x".into()),
                drop_response: Some("before".into()),
                ..RuleSpec::default()
            })
            .contains("exclude each other")
        );
        assert!(
            error(RuleSpec {
                drop_response: Some("later".into()),
                ..RuleSpec::default()
            })
            .contains("drop_response")
        );
        assert!(
            error(RuleSpec {
                error: Some("two\nlines".into()),
                ..RuleSpec::default()
            })
            .contains("one line")
        );
        assert!(
            error(RuleSpec {
                delay_ms: Some(DelaySpec::Range("soon".into())),
                ..RuleSpec::default()
            })
            .contains("delay_ms")
        );
        assert!(
            error(RuleSpec {
                disconnect_after: Some(1),
                reason_code: Some(0x81),
                ..RuleSpec::default()
            })
            .contains("0x81")
        );
        let d = rule(RuleSpec {
            disconnect_after: Some(3),
            reason_code: Some(0x98),
            ..RuleSpec::default()
        })
        .unwrap();
        assert_eq!(
            d.disconnect,
            Some((3, DisconnectReasonCode::AdministrativeAction))
        );
    }
}
