//! `statebroker-cli faults ...`: a statebroker's faults on demand, through
//! its HTTP endpoint's `/api/faults` (the broker must run with `[faults]
//! enabled = true`; others answer "faults are off"). Not part of the state
//! store protocol: this one subcommand talks HTTP, to `--http ADDR`.
//!
//! ureq does the HTTP (blocking, small, no TLS compiled in: the endpoint
//! is plain HTTP, on loopback by default).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand};
use serde_json::{Value, json};

/// `faults` and its own flags.
#[derive(Args, Debug)]
pub struct Faults {
    /// The broker's HTTP endpoint.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9883")]
    http: String,

    #[command(subcommand)]
    action: Action,
}

#[derive(Subcommand, Debug)]
enum Action {
    /// Print whether faults are on, the rules, the clock offset and the
    /// counts of faults injected (JSON).
    Status,
    /// Add a rule after the others (flags as `[[faults.rules]]`' keys).
    Add(Rule),
    /// Replace every rule with those of FILE: a JSON array of rules
    /// (`-` reads stdin).
    Set { file: PathBuf },
    /// Remove every rule.
    Clear,
    /// Disconnect CLIENT_ID now (MQTT 5 DISCONNECT with --reason-code).
    Disconnect {
        client_id: String,
        /// 0x80 unspecified, 0x89 server busy, 0x8B shutting down, 0x98
        /// administrative action, 0x9C use another server, ...
        #[arg(long, value_parser = parse_u8, default_value = "0x80")]
        reason_code: u8,
    },
    /// Refuse new connections (CONNACK "server busy") for MS milliseconds
    /// (0: stop refusing).
    Refuse { ms: u64 },
    /// Expire KEY now: its watchers get DELETE.
    Expire { key: String },
    /// Stall the broker's disk for MS milliseconds (0: stop): persisted
    /// changes are not written, their answers wait.
    StallDisk { ms: u64 },
    /// Move the state store's clock OFFSET_MS from the machine's
    /// (negative: behind; 0: back to normal).
    Clock {
        #[arg(allow_hyphen_values = true)]
        offset_ms: i64,
    },
}

/// A rule's fields as flags.
#[derive(Args, Debug)]
struct Rule {
    /// State store verbs it matches, comma-separated (empty: all).
    #[arg(long, value_delimiter = ',')]
    commands: Vec<String>,
    /// Glob over the key (empty: any).
    #[arg(long, default_value = "")]
    keys: String,
    /// Glob over the caller's client id (empty: any).
    #[arg(long, default_value = "")]
    clients: String,
    /// Delay in ms, or a range "50..500".
    #[arg(long, value_name = "MS")]
    delay_ms: Option<String>,
    /// Answer `-ERR <TEXT>` without executing.
    #[arg(long, value_name = "TEXT")]
    error: Option<String>,
    /// "before" (never execute, never answer) or "after" (execute, never answer).
    #[arg(long, value_name = "WHEN")]
    drop_response: Option<String>,
    /// Disconnect the client sending the Nth matching request.
    #[arg(long, value_name = "N")]
    disconnect_after: Option<u32>,
    /// The DISCONNECT reason code of --disconnect-after.
    #[arg(long, value_parser = parse_u8)]
    reason_code: Option<u8>,
}

/// `0x98` or `152`.
fn parse_u8(text: &str) -> Result<u8, String> {
    let parsed = match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u8::from_str_radix(hex, 16),
        None => text.parse(),
    };
    parsed.map_err(|_| format!("`{text}` is not a byte (0x98 or 152)"))
}

impl Rule {
    fn json(self) -> Value {
        let mut rule = serde_json::Map::new();
        if !self.commands.is_empty() {
            rule.insert("commands".into(), json!(self.commands));
        }
        for (name, value) in [("keys", self.keys), ("clients", self.clients)] {
            if !value.is_empty() {
                rule.insert(name.into(), json!(value));
            }
        }
        if let Some(delay) = self.delay_ms {
            let value = delay
                .parse::<u64>()
                .map_or_else(|_| json!(delay), |ms| json!(ms));
            rule.insert("delay_ms".into(), value);
        }
        let optional = [
            ("error", self.error.map(Value::from)),
            ("drop_response", self.drop_response.map(Value::from)),
            ("disconnect_after", self.disconnect_after.map(Value::from)),
            ("reason_code", self.reason_code.map(Value::from)),
        ];
        for (name, value) in optional {
            if let Some(value) = value {
                rule.insert(name.into(), value);
            }
        }
        Value::Object(rule)
    }
}

/// Runs `faults ...`: exit status 0, 1 (the broker said no) or 2 (no
/// answer).
pub fn run(faults: Faults, login: Option<(String, String)>, timeout: Duration) -> u8 {
    let (method, path, body) = match faults.action {
        Action::Status => ("GET", "/api/faults", None),
        Action::Add(rule) => ("POST", "/api/faults/rules", Some(rule.json())),
        Action::Set { file } => {
            let text = if file.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin())
            } else {
                std::fs::read_to_string(&file)
            };
            let rules = text
                .map_err(|e| e.to_string())
                .and_then(|t| serde_json::from_str::<Value>(&t).map_err(|e| e.to_string()));
            match rules {
                Ok(rules) => ("PUT", "/api/faults/rules", Some(rules)),
                Err(e) => {
                    eprintln!("statebroker-cli: {}: {e}", file.display());
                    return 1;
                }
            }
        }
        Action::Clear => ("DELETE", "/api/faults/rules", None),
        Action::Disconnect {
            client_id,
            reason_code,
        } => (
            "POST",
            "/api/faults/disconnect",
            Some(json!({ "client_id": client_id, "reason_code": reason_code })),
        ),
        Action::Refuse { ms } => ("POST", "/api/faults/refuse", Some(json!({ "ms": ms }))),
        Action::Expire { key } => ("POST", "/api/faults/expire", Some(json!({ "key": key }))),
        Action::StallDisk { ms } => ("POST", "/api/faults/stall-disk", Some(json!({ "ms": ms }))),
        Action::Clock { offset_ms } => (
            "POST",
            "/api/faults/clock",
            Some(json!({ "offset_ms": offset_ms })),
        ),
    };
    let url = format!("http://{}{path}", faults.http);
    match call(method, &url, body, login, timeout) {
        Ok((status, answer)) if status < 300 => {
            println!(
                "{}",
                serde_json::to_string_pretty(&answer).unwrap_or_default()
            );
            0
        }
        Ok((status, answer)) => {
            let text = answer["error"]
                .as_str()
                .map_or_else(|| answer.to_string(), str::to_owned);
            eprintln!("statebroker-cli: {text} (HTTP {status})");
            1
        }
        Err(e) => {
            eprintln!("statebroker-cli: {url}: {e}");
            2
        }
    }
}

fn call(
    method: &str,
    url: &str,
    body: Option<Value>,
    login: Option<(String, String)>,
    timeout: Duration,
) -> Result<(u16, Value), ureq::Error> {
    use base64::Engine;
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(timeout))
        .build()
        .into();
    let authorization = login.map(|(user, password)| {
        let encoded =
            base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        format!("Basic {encoded}")
    });
    let auth = authorization.as_deref();
    let mut response = match (method, body) {
        ("GET", _) => authorized(agent.get(url), auth).call()?,
        ("DELETE", _) => authorized(agent.delete(url), auth).call()?,
        ("PUT", Some(body)) => authorized(agent.put(url), auth).send_json(body)?,
        (_, body) => authorized(agent.post(url), auth).send_json(body.unwrap_or(Value::Null))?,
    };
    let status = response.status().as_u16();
    let text = response.body_mut().read_to_string()?;
    let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    Ok((status, value))
}

/// `request` with the `Authorization` header, if there is one.
fn authorized<B>(request: ureq::RequestBuilder<B>, auth: Option<&str>) -> ureq::RequestBuilder<B> {
    match auth {
        Some(auth) => request.header("Authorization", auth),
        None => request,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_become_a_rule() {
        let rule = Rule {
            commands: vec!["GET".into(), "SET".into()],
            keys: "slow*".into(),
            clients: String::new(),
            delay_ms: Some("50..500".into()),
            error: None,
            drop_response: None,
            disconnect_after: Some(2),
            reason_code: Some(0x98),
        };
        assert_eq!(
            rule.json(),
            json!({"commands": ["GET", "SET"], "keys": "slow*", "delay_ms": "50..500",
                   "disconnect_after": 2, "reason_code": 152})
        );
        assert_eq!(parse_u8("0x98"), Ok(0x98));
        assert_eq!(parse_u8("137"), Ok(137));
        assert!(parse_u8("0x100").is_err());
    }
}
