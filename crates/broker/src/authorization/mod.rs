//! Authorization: who may connect, publish, subscribe, and read or write
//! which state store keys, by a policy in the shape of Azure IoT
//! Operations' `BrokerAuthorization` (`policy.rs` reads the file).
//!
//! Allow-only: with a policy loaded, whatever no rule allows is denied;
//! without one, everything is allowed (and nothing is checked, so the hot
//! path pays nothing). A rule applies to a client when any of its
//! principals matches: a client id (glob), a username, or every attribute of
//! one attribute map. `{principal.clientId}`, `{principal.username}` and
//! `{principal.attributes.NAME}` stand for the client's own values: in
//! topics, as a whole topic level; in keys, wherever they appear. A
//! placeholder the client has no value for matches nothing.
//!
//! What each operation needs:
//! - CONNECT: a `Connect` resource (with `clientIds`, one of them must match).
//! - PUBLISH: a `Publish` topic filter matching the topic.
//! - SUBSCRIBE: a `Subscribe` topic filter covering the whole filter
//!   (`a/+` is covered by `a/#` and `+/+`, not by `a/b`).
//! - State store: GET and KEYNOTIFY need `Read` of the key; SET, DEL, VDEL
//!   `Write`; SCAN returns only the keys the caller may read; the answer
//!   goes only to a Response Topic the caller may subscribe to.
//!
//! Publishing a state store request and subscribing to one's own
//! notification topic need no topic rule: the key rules govern the store.

mod policy;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::RwLock;

use statestore::KeyAccess;
use statestore::glob::Pattern;

use policy::{BrokerMethod, KeyType, StoreMethod};

/// Who a connected client is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Principal {
    /// The client id (assigned by the broker if the client sent none).
    pub client_id: String,
    /// The username, once verified (password file or client certificate).
    pub username: Option<String>,
    /// Attributes: the subject fields of a client certificate (`CN`, `O`, …).
    pub attributes: BTreeMap<String, String>,
}

/// A part of a topic or key that may stand for the client's own value.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Var {
    ClientId,
    Username,
    Attribute(String),
}

impl Var {
    fn parse(text: &str) -> Option<Var> {
        let name = text.strip_prefix("{principal.")?.strip_suffix('}')?;
        match name {
            "clientId" => Some(Var::ClientId),
            "username" => Some(Var::Username),
            _ => name
                .strip_prefix("attributes.")
                .map(|a| Var::Attribute(a.to_owned())),
        }
    }

    fn value<'p>(&self, principal: &'p Principal) -> Option<&'p str> {
        match self {
            Var::ClientId => Some(&principal.client_id),
            Var::Username => principal.username.as_deref(),
            Var::Attribute(name) => principal.attributes.get(name).map(String::as_str),
        }
    }
}

/// One level of a rule's topic filter.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Level {
    Literal(String),
    Var(Var),
    Plus,
    Hash,
}

/// A rule's topic filter, split into levels.
#[derive(Debug, Clone)]
struct TopicRule(Vec<Level>);

impl TopicRule {
    fn parse(text: &str) -> Result<TopicRule, String> {
        if text.is_empty() {
            return Err("an empty topic".to_owned());
        }
        let parts: Vec<&str> = text.split('/').collect();
        let mut levels = Vec::with_capacity(parts.len());
        for (i, part) in parts.iter().enumerate() {
            levels.push(match *part {
                "+" => Level::Plus,
                "#" if i == parts.len() - 1 => Level::Hash,
                p if p.contains(['+', '#']) => {
                    return Err(format!(
                        "`{text}`: + and # must be whole levels, # the last"
                    ));
                }
                p => match Var::parse(p) {
                    Some(var) => Level::Var(var),
                    None if p.contains("{principal.") => {
                        return Err(format!("`{text}`: unknown placeholder `{p}`"));
                    }
                    None => Level::Literal(p.to_owned()),
                },
            });
        }
        Ok(TopicRule(levels))
    }

    /// Whether this rule covers every topic `filter` matches (a topic name
    /// is a filter without wildcards).
    fn covers(&self, filter: &str, principal: &Principal) -> bool {
        // `$` topics are only matched by rules starting with their own level.
        let mut wanted = filter.split('/');
        for (i, level) in self.0.iter().enumerate() {
            let Some(part) = wanted.next() else {
                // `a/#` covers `a` too.
                return *level == Level::Hash && i > 0;
            };
            let first_dollar = i == 0 && part.starts_with('$');
            match level {
                Level::Hash => return !first_dollar,
                Level::Plus if part == "#" || first_dollar => return false,
                Level::Plus => {}
                Level::Literal(l) if l == part => {}
                Level::Var(var) if var.value(principal) == Some(part) => {}
                _ => return false,
            }
        }
        wanted.next().is_none()
    }
}

/// One rule's key, compiled.
#[derive(Debug, Clone)]
enum KeyRule {
    /// A glob without placeholders, compiled once.
    Glob(Pattern),
    /// A glob with placeholders: compiled per check, with the caller's values.
    GlobFor(String),
    Exact(Vec<u8>),
}

impl KeyRule {
    fn glob(text: String) -> KeyRule {
        if text.contains("{principal.") {
            KeyRule::GlobFor(text)
        } else {
            KeyRule::Glob(Pattern::new(text.as_bytes()))
        }
    }

    fn matches(&self, key: &[u8], principal: &Principal) -> bool {
        match self {
            KeyRule::Exact(k) => k == key,
            KeyRule::Glob(pattern) => pattern.matches(key),
            KeyRule::GlobFor(text) => match substitute(text, principal) {
                Some(pattern) => Pattern::new(pattern.as_bytes()).matches(key),
                None => false,
            },
        }
    }
}

/// `text` with each placeholder replaced by the principal's value (glob
/// characters in a value escaped); `None` if one has no value.
fn substitute(text: &str, principal: &Principal) -> Option<String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("{principal.") {
        out.push_str(&rest[..start]);
        let end = start + rest[start..].find('}')? + 1;
        let value = Var::parse(&rest[start..end])?.value(principal)?;
        push_escaped(&mut out, value);
        rest = &rest[end..];
    }
    out.push_str(rest);
    Some(out)
}

#[derive(Debug, Clone)]
struct Rule {
    client_ids: Vec<Pattern>,
    usernames: Vec<String>,
    attributes: Vec<BTreeMap<String, String>>,
    /// `None`: no Connect resource; `Some(empty)`: any client id.
    connect: Option<Vec<Pattern>>,
    publish: Vec<TopicRule>,
    subscribe: Vec<TopicRule>,
    read: Vec<KeyRule>,
    write: Vec<KeyRule>,
}

impl Rule {
    fn applies_to(&self, p: &Principal) -> bool {
        self.client_ids
            .iter()
            .any(|c| c.matches(p.client_id.as_bytes()))
            || p.username
                .as_ref()
                .is_some_and(|u| self.usernames.contains(u))
            || self.attributes.iter().any(|wanted| {
                wanted
                    .iter()
                    .all(|(k, v)| p.attributes.get(k).is_some_and(|have| have == v))
            })
    }
}

/// A loaded policy.
#[derive(Debug, Clone)]
pub struct Policy {
    rules: Vec<Rule>,
}

impl Policy {
    /// Parses and compiles a policy (YAML or JSON).
    pub fn parse(text: &str) -> Result<Policy, String> {
        let doc = policy::parse(text)?;
        let mut rules = Vec::new();
        for (n, r) in doc.rules.into_iter().enumerate() {
            let at = |what: &str, e: String| format!("rules[{n}].{what}: {e}");
            let p = &r.principals;
            if p.client_ids.is_empty() && p.usernames.is_empty() && p.attributes.is_empty() {
                return Err(format!(
                    "rules[{n}].principals: name at least one of clientIds, usernames, attributes"
                ));
            }
            let mut rule = Rule {
                client_ids: p
                    .client_ids
                    .iter()
                    .map(|c| Pattern::new(c.as_bytes()))
                    .collect(),
                usernames: p.usernames.clone(),
                attributes: p.attributes.clone(),
                connect: None,
                publish: Vec::new(),
                subscribe: Vec::new(),
                read: Vec::new(),
                write: Vec::new(),
            };
            for (m, b) in r.broker_resources.iter().enumerate() {
                let topics = || {
                    if b.topics.is_empty() {
                        return Err(at(
                            &format!("brokerResources[{m}].topics"),
                            "Publish and Subscribe need topics".into(),
                        ));
                    }
                    b.topics
                        .iter()
                        .map(|t| {
                            TopicRule::parse(t)
                                .map_err(|e| at(&format!("brokerResources[{m}].topics"), e))
                        })
                        .collect::<Result<Vec<_>, _>>()
                };
                match b.method {
                    BrokerMethod::Connect => rule
                        .connect
                        .get_or_insert_with(Vec::new)
                        .extend(b.client_ids.iter().map(|c| Pattern::new(c.as_bytes()))),
                    BrokerMethod::Publish => rule.publish.extend(topics()?),
                    BrokerMethod::Subscribe => rule.subscribe.extend(topics()?),
                }
            }
            for (m, s) in r.state_store_resources.iter().enumerate() {
                let mut keys = Vec::new();
                for k in &s.keys {
                    keys.push(match s.key_type {
                        KeyType::Pattern => KeyRule::glob(k.clone()),
                        KeyType::String if k.contains("{principal.") => {
                            // Exact, but with the principal's value: a glob of the escaped text.
                            KeyRule::GlobFor(escape_glob(k))
                        }
                        KeyType::String => KeyRule::Exact(k.as_bytes().to_vec()),
                        KeyType::Binary => KeyRule::Exact(hex::decode(k).map_err(|e| {
                            at(
                                &format!("stateStoreResources[{m}].keys"),
                                format!("`{k}` is not hex ({e})"),
                            )
                        })?),
                    });
                }
                if matches!(s.method, StoreMethod::Read | StoreMethod::ReadWrite) {
                    rule.read.extend(keys.iter().cloned());
                }
                if matches!(s.method, StoreMethod::Write | StoreMethod::ReadWrite) {
                    rule.write.extend(keys);
                }
            }
            rules.push(rule);
        }
        Ok(Policy { rules })
    }

    fn rules_for<'a>(&'a self, p: &'a Principal) -> impl Iterator<Item = &'a Rule> + 'a {
        self.rules.iter().filter(move |r| r.applies_to(p))
    }

    /// Whether `p` may connect.
    pub fn may_connect(&self, p: &Principal) -> bool {
        self.rules_for(p).any(|r| {
            r.connect.as_ref().is_some_and(|ids| {
                ids.is_empty() || ids.iter().any(|c| c.matches(p.client_id.as_bytes()))
            })
        })
    }

    /// Whether `p` may publish to `topic`.
    pub fn may_publish(&self, p: &Principal, topic: &str) -> bool {
        self.rules_for(p)
            .any(|r| r.publish.iter().any(|t| t.covers(topic, p)))
    }

    /// Whether `p` may subscribe to `filter` (`$share/GROUP/` is looked through).
    pub fn may_subscribe(&self, p: &Principal, filter: &str) -> bool {
        let filter = match filter.strip_prefix("$share/") {
            Some(rest) => rest.split_once('/').map_or(rest, |(_, f)| f),
            None => filter,
        };
        self.rules_for(p)
            .any(|r| r.subscribe.iter().any(|t| t.covers(filter, p)))
    }

    /// Whether `p` may read `key`.
    pub fn may_read(&self, p: &Principal, key: &[u8]) -> bool {
        self.rules_for(p)
            .any(|r| r.read.iter().any(|k| k.matches(key, p)))
    }

    /// Whether `p` may write `key`.
    pub fn may_write(&self, p: &Principal, key: &[u8]) -> bool {
        self.rules_for(p)
            .any(|r| r.write.iter().any(|k| k.matches(key, p)))
    }
}

fn escape_glob(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    // Escape everything except the placeholders (substituted, escaped, later).
    while let Some(start) = rest.find("{principal.") {
        let end = rest[start..]
            .find('}')
            .map_or(rest.len(), |e| start + e + 1);
        push_escaped(&mut out, &rest[..start]);
        out.push_str(&rest[start..end]);
        rest = &rest[end..];
    }
    push_escaped(&mut out, rest);
    out
}

fn push_escaped(out: &mut String, text: &str) {
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
}

/// A policy applied to one client's state store requests.
#[derive(Debug, Clone)]
pub struct KeyRules {
    /// The policy.
    pub policy: Arc<Policy>,
    /// The caller.
    pub principal: Arc<Principal>,
}

impl KeyAccess for KeyRules {
    fn may_read(&self, key: &[u8]) -> bool {
        self.policy.may_read(&self.principal, key)
    }
    fn may_write(&self, key: &[u8]) -> bool {
        self.policy.may_write(&self.principal, key)
    }
}

/// The policy in use.
#[derive(Debug, Default)]
pub struct Authorizer {
    /// The file and the policy it holds, changed together.
    file: RwLock<PolicyFile>,
}

/// A policy file read and checked (or none), ready to be used.
#[derive(Debug, Default)]
pub struct PolicyFile {
    path: Option<PathBuf>,
    /// The file's text (to tell a change) and its policy.
    policy: Option<(String, Arc<Policy>)>,
}

impl PolicyFile {
    /// Reads and checks the policy file at `path` (`None`: no policy).
    pub fn read(path: Option<&Path>) -> Result<PolicyFile, String> {
        let policy = match path {
            None => None,
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    format!("cannot read authorization policy {}: {e}", path.display())
                })?;
                let policy = Policy::parse(&text)
                    .map_err(|e| format!("authorization policy {}: {e}", path.display()))?;
                Some((text, Arc::new(policy)))
            }
        };
        Ok(PolicyFile {
            path: path.map(Path::to_owned),
            policy,
        })
    }

    /// The file.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// How many rules it holds (`None`: no policy).
    pub fn rules(&self) -> Option<usize> {
        self.policy.as_ref().map(|(_, p)| p.rules.len())
    }
}

impl Authorizer {
    /// Loads the policy file, if any.
    pub fn load(path: Option<&Path>) -> Result<Authorizer, String> {
        let authorizer = Authorizer::default();
        authorizer.switch(path)?;
        Ok(authorizer)
    }

    /// Uses the policy file at `path` from now on (`None`: no policy,
    /// everything is allowed), read now; on error the policy in use stays.
    /// Returns the number of rules.
    pub fn switch(&self, path: Option<&Path>) -> Result<Option<usize>, String> {
        let file = PolicyFile::read(path)?;
        let rules = file.rules();
        self.install(file);
        Ok(rules)
    }

    /// Whether `file` differs from the policy in use (another file, none,
    /// or other text in the same file).
    pub fn differs(&self, file: &PolicyFile) -> bool {
        let current = self.file.read();
        current.path != file.path
            || current.policy.as_ref().map(|(text, _)| text)
                != file.policy.as_ref().map(|(text, _)| text)
    }

    /// Applies `file` (read and checked before) from now on.
    pub fn install(&self, file: PolicyFile) {
        *self.file.write() = file;
    }

    /// The policy file in use.
    pub fn path(&self) -> Option<PathBuf> {
        self.file.read().path.clone()
    }

    /// The policy in use; `None`: everything is allowed.
    pub fn current(&self) -> Option<Arc<Policy>> {
        self.file.read().policy.as_ref().map(|(_, p)| Arc::clone(p))
    }
}

#[cfg(test)]
mod tests;
