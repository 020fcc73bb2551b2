//! The one control surface over a broker's faults (see [`crate::faults`]),
//! used by the HTTP endpoint (`/api/faults`), by `RunningBroker::faults`
//! and so by `statebroker::testing::TestBroker` and `statebroker-cli
//! faults`. Every operation answers [`FaultError::Disabled`] on a broker
//! started without `[faults] enabled = true`.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::faults::{FaultError, RuleSpec, reason_code};
use crate::shared::Shared;

/// Controls the faults of one running broker.
#[derive(Clone)]
pub struct FaultControl {
    shared: Arc<Shared>,
}

/// What [`FaultControl::status`] reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FaultStatus {
    /// `[faults] enabled`.
    pub enabled: bool,
    /// The rules in force.
    pub rules: Vec<RuleSpec>,
    /// The store's clock offset, milliseconds.
    pub clock_offset_ms: i64,
    /// Faults injected so far, by kind.
    pub injected: std::collections::BTreeMap<&'static str, u64>,
}

impl FaultControl {
    pub(crate) fn new(shared: Arc<Shared>) -> FaultControl {
        FaultControl { shared }
    }

    fn check(&self) -> Result<(), FaultError> {
        self.shared.faults.check_enabled()
    }

    /// Whether faults are enabled, the rules, the clock offset and the
    /// counts (answered on any broker).
    pub fn status(&self) -> FaultStatus {
        FaultStatus {
            enabled: self.shared.faults.enabled(),
            rules: self.shared.faults.rules(),
            clock_offset_ms: self.shared.store.clock_offset(),
            injected: self.shared.faults.injected().into_iter().collect(),
        }
    }

    /// Replaces every rule (all are checked first).
    pub fn set_rules(&self, rules: Vec<RuleSpec>) -> Result<(), FaultError> {
        self.shared.faults.set_rules(rules)?;
        tracing::info!(rules = ?self.shared.faults.rules(), "fault rules replaced");
        Ok(())
    }

    /// Adds a rule after the others; returns how many there are.
    pub fn add_rule(&self, rule: RuleSpec) -> Result<usize, FaultError> {
        let text = format!("{rule:?}");
        let n = self.shared.faults.add_rule(rule)?;
        tracing::info!(rule = text, rules = n, "fault rule added");
        Ok(n)
    }

    /// Removes every rule.
    pub fn clear_rules(&self) -> Result<(), FaultError> {
        self.set_rules(Vec::new())
    }

    /// Disconnects `client_id` now with DISCONNECT `reason` (MQTT 5;
    /// a 3.1.1 client's connection is closed). `false`: not connected.
    pub fn disconnect(&self, client_id: &str, reason: u8) -> Result<bool, FaultError> {
        self.check()?;
        let code = reason_code(reason, "reason_code").map_err(FaultError::Invalid)?;
        let connected = self.shared.sessions.disconnect(client_id, code);
        if connected {
            self.shared.faults.count(crate::faults::Kind::Disconnect);
            tracing::info!(fault = "disconnect", client_id, reason = ?code, "fault injected: disconnecting on demand");
        }
        Ok(connected)
    }

    /// Refuses new connections (CONNACK 0x89 "server busy"; 3.1.1: 0x03
    /// "server unavailable") for `period`; zero stops refusing.
    pub fn refuse_connections(&self, period: Duration) -> Result<(), FaultError> {
        self.shared.faults.refuse_connections(period)
    }

    /// Removes `key` as if it had expired: its watchers get DELETE.
    /// `false`: no such key.
    pub fn expire_key(&self, key: &[u8]) -> Result<bool, FaultError> {
        self.check()?;
        let expired = self.shared.store.expire_key(key);
        if expired {
            self.shared.faults.count(crate::faults::Kind::ExpireKey);
            tracing::info!(fault = "expire_key", key = ?String::from_utf8_lossy(key), "fault injected: key expired on demand");
        }
        Ok(expired)
    }

    /// Stalls the disk for `period` (zero: ends a stall): persisted changes
    /// (state store keys, retained messages, persistent sessions) are not
    /// written, so their answers and acknowledgements wait, as on a slow
    /// or saturated disk; at the end everything is written and answered.
    pub fn stall_disk(&self, period: Duration) -> Result<(), FaultError> {
        self.check()?;
        if !self.shared.store.stall_disk(period) {
            return Err(FaultError::Invalid(
                "the broker has no data directory: there is no disk to stall".into(),
            ));
        }
        if !period.is_zero() {
            self.shared.faults.count(crate::faults::Kind::DiskStall);
        }
        tracing::info!(
            fault = "disk_stall",
            ms = period.as_millis() as u64,
            "fault injected: the disk stalls"
        );
        Ok(())
    }

    /// Moves the store's clock `offset_ms` from the machine's (0: back).
    pub fn set_clock_offset(&self, offset_ms: i64) -> Result<(), FaultError> {
        self.check()?;
        self.shared.store.set_clock_offset(offset_ms);
        tracing::info!(
            fault = "clock_offset",
            offset_ms,
            "the state store's clock moved"
        );
        Ok(())
    }
}
