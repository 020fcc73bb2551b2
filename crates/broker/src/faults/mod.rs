//! Faults on demand, for client developers testing their retry, timeout,
//! lock and failover paths: state store requests delayed, answered with an
//! `-ERR`, left unanswered (executed or not), clients disconnected after so
//! many requests, new connections refused for a while. (The store's clock
//! offset, "expire this key now" and a stalled disk belong to the store
//! service and its persistence; the
//! control surface over all of them is [`crate::fault_control`].)
//!
//! Off unless the configuration says `[faults] enabled = true`: a broker
//! without it refuses every fault request, so a production broker cannot be
//! made to misbehave. With no rule, a request costs one atomic load here.
//!
//! Every fault injected is logged (INFO, `fault = ...`) and counted, here
//! ([`Faults::injected`]) and in `statebroker_faults_injected_total{kind}`.

mod rules;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use router::protocol::DisconnectReasonCode;
use serde::{Deserialize, Serialize};

pub use rules::{Action, DelaySpec, Rule, RuleSpec, VERBS, reason_code};

/// `[faults]`
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FaultsSection {
    /// Faults may be injected at all.
    #[serde(default)]
    pub enabled: bool,
    /// Added to the wall clock the state store reads, in milliseconds.
    #[serde(default)]
    pub clock_offset_ms: i64,
    /// The rules at start.
    #[serde(default)]
    pub rules: Vec<RuleSpec>,
    /// A cluster node: each client's ownership claim waits this long, in
    /// milliseconds, before it goes to etcd (as if etcd took it late), for
    /// tests of which of two CONNECTs of one client id wins.
    #[serde(default)]
    pub claim_delay_ms: u64,
}

impl FaultsSection {
    /// `claim_delay_ms` when faults are on and it is set.
    pub fn claim_delay(&self) -> Option<Duration> {
        (self.enabled && self.claim_delay_ms > 0)
            .then(|| Duration::from_millis(self.claim_delay_ms))
    }
}

/// Why a fault request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FaultError {
    /// The broker was started without `[faults] enabled = true`.
    #[error("faults are off: start the broker with [faults] enabled = true to inject them")]
    Disabled,
    /// The request itself is wrong (the text says how).
    #[error("{0}")]
    Invalid(String),
}

/// The kinds of fault, as counted and logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A request waited before running.
    Delay,
    /// A request was answered `-ERR` without running.
    Error,
    /// A request was neither executed nor answered.
    DropBefore,
    /// A request was executed and not answered.
    DropAfter,
    /// A client was disconnected (after N requests, or on demand).
    Disconnect,
    /// A CONNECT was refused with "server busy".
    RefuseConnection,
    /// A key was expired on demand.
    ExpireKey,
    /// The disk was stalled (persisted changes wait, unacknowledged).
    DiskStall,
}

impl Kind {
    const ALL: [Kind; 8] = [
        Kind::Delay,
        Kind::Error,
        Kind::DropBefore,
        Kind::DropAfter,
        Kind::Disconnect,
        Kind::RefuseConnection,
        Kind::ExpireKey,
        Kind::DiskStall,
    ];

    /// The metric label and log name.
    pub fn label(self) -> &'static str {
        match self {
            Kind::Delay => "delay",
            Kind::Error => "error",
            Kind::DropBefore => "drop_before",
            Kind::DropAfter => "drop_after",
            Kind::Disconnect => "disconnect",
            Kind::RefuseConnection => "refuse_connection",
            Kind::ExpireKey => "expire_key",
            Kind::DiskStall => "disk_stall",
        }
    }
}

/// What to do with one request a rule matched (the default: execute it
/// now, as without faults).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Wait this long before running it.
    pub delay: Option<Duration>,
    /// Then: execute, answer an error, or drop.
    pub action: Action,
    /// After executing it, disconnect the client with this reason.
    pub disconnect: Option<DisconnectReasonCode>,
}

/// The faults of one broker.
#[derive(Debug)]
pub struct Faults {
    enabled: bool,
    /// There is at least one rule (the request path's only question
    /// otherwise).
    has_rules: AtomicBool,
    /// New connections are being refused (until `State::refuse_until`).
    refusing: AtomicBool,
    state: Mutex<State>,
    injected: [AtomicU64; 8],
}

#[derive(Debug, Default)]
struct State {
    /// Each rule with how many requests it matched since its last
    /// `disconnect_after`.
    rules: Vec<(Rule, u32)>,
    refuse_until: Option<Instant>,
}

impl Faults {
    /// The faults of `[faults]`, its rules checked.
    pub fn new(section: &FaultsSection) -> Result<Faults, FaultError> {
        let faults = Faults {
            enabled: section.enabled,
            has_rules: AtomicBool::new(false),
            refusing: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            injected: Default::default(),
        };
        if !section.enabled && (!section.rules.is_empty() || section.clock_offset_ms != 0) {
            return Err(FaultError::Invalid(
                "faults: rules or clock_offset_ms are given but enabled is not true".into(),
            ));
        }
        if section.enabled {
            faults.set_rules(section.rules.clone())?;
        }
        Ok(faults)
    }

    /// Whether faults may be injected at all.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// `Err(Disabled)` unless enabled.
    pub fn check_enabled(&self) -> Result<(), FaultError> {
        if self.enabled {
            Ok(())
        } else {
            Err(FaultError::Disabled)
        }
    }

    /// Replaces every rule (checked all first: a wrong one changes nothing).
    pub fn set_rules(&self, specs: Vec<RuleSpec>) -> Result<(), FaultError> {
        self.check_enabled()?;
        let rules = specs
            .into_iter()
            .enumerate()
            .map(|(i, spec)| Rule::new(spec, &format!("faults.rules[{i}]")).map(|r| (r, 0)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(FaultError::Invalid)?;
        let mut state = self.state.lock();
        self.has_rules.store(!rules.is_empty(), Ordering::Release);
        state.rules = rules;
        Ok(())
    }

    /// Adds a rule after the others; returns how many there are now.
    pub fn add_rule(&self, spec: RuleSpec) -> Result<usize, FaultError> {
        self.check_enabled()?;
        let rule = Rule::new(spec, "rule").map_err(FaultError::Invalid)?;
        let mut state = self.state.lock();
        state.rules.push((rule, 0));
        self.has_rules.store(true, Ordering::Release);
        Ok(state.rules.len())
    }

    /// The rules in force, as written.
    pub fn rules(&self) -> Vec<RuleSpec> {
        let state = self.state.lock();
        state.rules.iter().map(|(r, _)| r.spec.clone()).collect()
    }

    /// What to do with a request of `client` (its RESP3 `payload`): `None`
    /// when no rule matches. The first rule that matches decides.
    pub fn plan(&self, client: &str, payload: &[u8]) -> Option<Plan> {
        if !self.has_rules.load(Ordering::Acquire) {
            return None;
        }
        let args = statestore::resp3::parse_request(payload).ok()?;
        let command = String::from_utf8_lossy(args.first()?).to_ascii_uppercase();
        let key = args.get(1).copied();
        let mut state = self.state.lock();
        let (rule, count) = state
            .rules
            .iter_mut()
            .find(|(rule, _)| rule.matches(&command, key, client))?;
        let disconnect = rule.disconnect.and_then(|(after, code)| {
            *count += 1;
            (*count >= after).then(|| {
                *count = 0;
                code
            })
        });
        let plan = Plan {
            delay: rule.pick_delay(),
            action: rule.action.clone(),
            disconnect,
        };
        drop(state);
        let key = key.map(String::from_utf8_lossy);
        let key = key.as_deref().unwrap_or("");
        if let Some(delay) = plan.delay {
            self.count(Kind::Delay);
            tracing::info!(
                fault = "delay",
                client_id = client,
                command,
                key,
                delay_ms = delay.as_millis() as u64,
                "fault injected"
            );
        }
        let kind = match &plan.action {
            Action::Execute => None,
            Action::Error(_) => Some(Kind::Error),
            Action::DropBefore => Some(Kind::DropBefore),
            Action::DropAfter => Some(Kind::DropAfter),
        };
        if let Some(kind) = kind {
            self.count(kind);
            tracing::info!(
                fault = kind.label(),
                client_id = client,
                command,
                key,
                "fault injected"
            );
        }
        if let Some(code) = plan.disconnect {
            self.count(Kind::Disconnect);
            tracing::info!(fault = "disconnect", client_id = client, command, key, reason = ?code, "fault injected: disconnecting after this request");
        }
        Some(plan)
    }

    /// Refuses new connections (CONNACK "server busy") for `period`; zero
    /// stops refusing.
    pub fn refuse_connections(&self, period: Duration) -> Result<(), FaultError> {
        self.check_enabled()?;
        let mut state = self.state.lock();
        state.refuse_until = (!period.is_zero()).then(|| Instant::now() + period);
        self.refusing
            .store(state.refuse_until.is_some(), Ordering::Release);
        tracing::info!(
            fault = "refuse_connection",
            for_ms = period.as_millis() as u64,
            "refusing new connections"
        );
        Ok(())
    }

    /// Whether a new connection is to be refused now (counted when so).
    pub fn refusing(&self) -> bool {
        if !self.refusing.load(Ordering::Acquire) {
            return false;
        }
        let mut state = self.state.lock();
        let now_refusing = state
            .refuse_until
            .is_some_and(|until| Instant::now() < until);
        if !now_refusing {
            state.refuse_until = None;
            self.refusing.store(false, Ordering::Release);
            return false;
        }
        drop(state);
        self.count(Kind::RefuseConnection);
        true
    }

    /// Counts one fault of `kind` (logging is the caller's).
    pub fn count(&self, kind: Kind) {
        self.injected[kind as usize].fetch_add(1, Ordering::Relaxed);
        crate::metrics::fault_injected(kind.label());
    }

    /// How many faults of each kind were injected so far.
    pub fn injected(&self) -> Vec<(&'static str, u64)> {
        Kind::ALL
            .iter()
            .map(|&k| (k.label(), self.injected[k as usize].load(Ordering::Relaxed)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use statestore::resp3::encode_request;

    fn enabled(rules: Vec<RuleSpec>) -> Faults {
        Faults::new(&FaultsSection {
            enabled: true,
            rules,
            ..FaultsSection::default()
        })
        .unwrap()
    }

    #[test]
    fn off_unless_enabled() {
        let off = Faults::new(&FaultsSection::default()).unwrap();
        assert_eq!(off.set_rules(vec![]), Err(FaultError::Disabled));
        assert_eq!(
            off.refuse_connections(Duration::from_secs(1)),
            Err(FaultError::Disabled)
        );
        assert!(off.plan("c", &encode_request(&["GET", "k"])).is_none());
        let given = Faults::new(&FaultsSection {
            rules: vec![RuleSpec::default()],
            ..FaultsSection::default()
        });
        assert!(matches!(given, Err(FaultError::Invalid(e)) if e.contains("enabled")));
    }

    #[test]
    fn the_first_matching_rule_decides_and_disconnects_count() {
        let faults = enabled(vec![
            RuleSpec {
                keys: "boom*".into(),
                error: Some("the quota has been exceeded".into()),
                ..RuleSpec::default()
            },
            RuleSpec {
                commands: vec!["GET".into()],
                disconnect_after: Some(2),
                ..RuleSpec::default()
            },
        ]);
        let get = |key: &str| faults.plan("c", &encode_request(&["get", key]));
        assert_eq!(
            get("boom1").unwrap().action,
            Action::Error("the quota has been exceeded".into())
        );
        assert_eq!(get("k").unwrap().disconnect, None);
        assert_eq!(
            get("k").unwrap().disconnect,
            Some(DisconnectReasonCode::UnspecifiedError)
        );
        assert_eq!(get("k").unwrap().disconnect, None, "the count starts again");
        assert!(
            faults
                .plan("c", &encode_request(&["SET", "k", "v"]))
                .is_none()
        );
        let counts = faults.injected();
        assert!(counts.contains(&("error", 1)), "{counts:?}");
        assert!(counts.contains(&("disconnect", 1)), "{counts:?}");
        // A wrong rule among good ones changes nothing.
        let wrong = faults.set_rules(vec![
            RuleSpec {
                error: Some("x".into()),
                ..RuleSpec::default()
            },
            RuleSpec::default(),
        ]);
        assert!(matches!(wrong, Err(FaultError::Invalid(e)) if e.starts_with("faults.rules[1]")));
        assert_eq!(faults.rules().len(), 2);
        faults.set_rules(vec![]).unwrap();
        assert!(get("boom1").is_none());
    }

    #[test]
    fn refusing_ends_by_itself() {
        let faults = enabled(vec![]);
        assert!(!faults.refusing());
        faults
            .refuse_connections(Duration::from_millis(50))
            .unwrap();
        assert!(faults.refusing());
        std::thread::sleep(Duration::from_millis(80));
        assert!(!faults.refusing());
        faults.refuse_connections(Duration::from_secs(60)).unwrap();
        faults.refuse_connections(Duration::ZERO).unwrap();
        assert!(!faults.refusing());
    }
}
