//! The policy file: the `authorizationPolicies` of an Azure IoT Operations
//! `BrokerAuthorization` resource, in YAML or JSON (JSON is YAML).
//!
//! Accepted at any of three depths, so the very file deployed works: the
//! whole resource (`spec.authorizationPolicies` or
//! `properties.authorizationPolicies`), the `authorizationPolicies` object,
//! or just `{ rules: [...] }`.
//!
//! ```yaml
//! authorizationPolicies:
//!   rules:
//!     - principals:
//!         clientIds: ["sensor-*"]          # any of these matches
//!         usernames: ["alice"]
//!         attributes: [{ site: "site1", floor: "2" }]   # all of one map
//!       brokerResources:
//!         - method: Connect
//!         - method: Publish
//!           topics: ["telemetry/{principal.clientId}/#"]
//!         - method: Subscribe
//!           topics: ["commands/{principal.username}/+"]
//!       stateStoreResources:
//!         - keyType: Pattern               # glob; String: exact; Binary: hex
//!           keys: ["{principal.clientId}-*"]
//!           method: ReadWrite              # Read, Write or ReadWrite
//! ```

use std::collections::BTreeMap;

use serde::Deserialize;

/// `authorizationPolicies`
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct Policies {
    /// AIO's decision cache switch: accepted, nothing to cache here.
    #[serde(default)]
    #[allow(dead_code)]
    pub cache: Option<String>,
    pub rules: Vec<RuleDoc>,
}

/// One rule.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct RuleDoc {
    pub principals: PrincipalsDoc,
    #[serde(default)]
    pub broker_resources: Vec<BrokerResourceDoc>,
    #[serde(default)]
    pub state_store_resources: Vec<StoreResourceDoc>,
}

/// Who a rule is for: any listed client id, username or attribute set.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct PrincipalsDoc {
    #[serde(default)]
    pub client_ids: Vec<String>,
    #[serde(default)]
    pub usernames: Vec<String>,
    #[serde(default)]
    pub attributes: Vec<BTreeMap<String, String>>,
}

/// MQTT operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub(super) enum BrokerMethod {
    Connect,
    Publish,
    Subscribe,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct BrokerResourceDoc {
    pub method: BrokerMethod,
    #[serde(default)]
    pub client_ids: Vec<String>,
    #[serde(default)]
    pub topics: Vec<String>,
}

/// How the `keys` of a state store resource are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub(super) enum KeyType {
    Pattern,
    String,
    Binary,
}

/// State store operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub(super) enum StoreMethod {
    Read,
    Write,
    ReadWrite,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct StoreResourceDoc {
    pub key_type: KeyType,
    pub keys: Vec<String>,
    pub method: StoreMethod,
}

/// Parses a policy file's text (YAML or JSON).
pub(super) fn parse(text: &str) -> Result<Policies, String> {
    let value: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(text).map_err(|e| format!("not YAML or JSON: {}", brief(&e)))?;
    if !value.is_mapping() {
        // A password file, a certificate, a list: its text is not echoed
        // (it may be secret).
        return Err(
            "not a policy: the file is not a map of YAML or JSON keys (rules:, or the \
             authorizationPolicies of a BrokerAuthorization)"
                .into(),
        );
    }
    let inner = value
        .get("spec")
        .or_else(|| value.get("properties"))
        .and_then(|v| v.get("authorizationPolicies"))
        .or_else(|| value.get("authorizationPolicies"))
        .unwrap_or(&value);
    let policies = serde_yaml_ng::from_value::<Policies>(inner.clone());
    policies.map_err(|e| {
        format!("{} (expected the authorizationPolicies of a BrokerAuthorization: rules with principals, brokerResources, stateStoreResources)", brief(&e))
    })
}

/// A parser's message with each quoted text in it cut to its start: the
/// message names where and what is wrong; a log line must not carry a
/// whole file that was not meant to be a policy (a password file's
/// hashes, a key).
fn brief(error: &impl std::fmt::Display) -> String {
    const QUOTED: usize = 24;
    let message = error.to_string();
    let mut out = String::with_capacity(message.len().min(512));
    let mut parts = message.split('"');
    if let Some(first) = parts.next() {
        out.push_str(first);
    }
    for (i, part) in parts.enumerate() {
        out.push('"');
        // Odd parts (0, 2, ... after the first quote) are inside quotes.
        if i % 2 == 0 && part.chars().count() > QUOTED {
            out.extend(part.chars().take(QUOTED));
            out.push('…');
        } else {
            out.push_str(part);
        }
    }
    out
}
