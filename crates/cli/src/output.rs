//! How answers are printed: raw values (plain), with version and
//! properties (`-v`), or one JSON object per answer (`--json`). Errors go
//! to stderr; the returned number is the exit status.

use std::io::Write;

use serde_json::{Value, json};
use statestore::resp3::Reply;

use crate::client::{Answer, Notification};

/// Exit status when the store answered `-ERR`.
pub const EXIT_ERR: u8 = 1;

/// The output style.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Values as they are.
    Plain,
    /// Values, then `version:` and `property:` lines.
    Verbose,
    /// One JSON object per line.
    Json,
}

/// Writes answers to stdout.
pub struct Printer {
    format: Format,
    out: std::io::StdoutLock<'static>,
}

/// Bytes as JSON: a string when they are UTF-8, else `{"hex": "…"}`.
fn bytes_json(bytes: &[u8]) -> Value {
    match std::str::from_utf8(bytes) {
        Ok(text) => Value::String(text.to_owned()),
        Err(_) => json!({ "hex": hex::encode(bytes) }),
    }
}

fn reply_json(reply: &Reply) -> Value {
    match reply {
        Reply::Simple(text) => json!({ "simple": text }),
        Reply::Error(text) => json!({ "error": text }),
        Reply::Integer(n) => json!(n),
        Reply::Bulk(bytes) => bytes_json(bytes),
        Reply::Null => Value::Null,
        Reply::Array(items) => Value::Array(items.iter().map(reply_json).collect()),
    }
}

impl Printer {
    /// A printer in `format`.
    pub fn new(format: Format) -> Printer {
        Printer {
            format,
            out: std::io::stdout().lock(),
        }
    }

    fn line(&mut self, bytes: &[u8]) {
        let _ = self.out.write_all(bytes);
        let _ = self.out.write_all(b"\n");
        let _ = self.out.flush();
    }

    fn json(&mut self, value: Value) {
        self.line(value.to_string().as_bytes());
    }

    fn details(&mut self, answer: &Answer) {
        if let Some(version) = &answer.version {
            self.line(format!("version: {version}").as_bytes());
        }
        for (name, value) in &answer.properties {
            self.line(format!("property: {name}={value}").as_bytes());
        }
    }

    fn error(&mut self, answer: &Answer, text: &str) -> u8 {
        if self.format == Format::Json {
            self.json(json!({ "error": text, "version": answer.version }));
        }
        eprintln!("{text}");
        EXIT_ERR
    }

    /// The answer to GET: the value, or nothing for a missing key.
    pub fn value(&mut self, answer: &Answer) -> u8 {
        match (&answer.reply, self.format) {
            (Reply::Error(text), _) => self.error(answer, text),
            (Reply::Bulk(value), Format::Json) => {
                self.json(json!({ "value": bytes_json(value), "version": answer.version }));
                0
            }
            // A missing key has no version (the answer's `__ts` is only
            // the broker's clock).
            (Reply::Null, Format::Json) => {
                self.json(json!({ "value": null, "version": null }));
                0
            }
            (Reply::Bulk(value), format) => {
                self.line(value);
                if format == Format::Verbose {
                    self.details(answer);
                }
                0
            }
            (Reply::Null, Format::Verbose) => {
                self.line(b"(nil)");
                for (name, value) in &answer.properties {
                    self.line(format!("property: {name}={value}").as_bytes());
                }
                0
            }
            (Reply::Null, _) => 0,
            _ => self.reply(answer),
        }
    }

    /// Any answer: `OK`, a number, a value, one line per array element.
    pub fn reply(&mut self, answer: &Answer) -> u8 {
        if let Reply::Error(text) = &answer.reply {
            return self.error(answer, text);
        }
        if self.format == Format::Json {
            self.json(json!({ "reply": reply_json(&answer.reply), "version": answer.version }));
            return 0;
        }
        self.plain(&answer.reply);
        if self.format == Format::Verbose {
            self.details(answer);
        }
        0
    }

    fn plain(&mut self, reply: &Reply) {
        match reply {
            Reply::Simple(text) | Reply::Error(text) => self.line(text.as_bytes()),
            Reply::Integer(n) => self.line(n.to_string().as_bytes()),
            Reply::Bulk(bytes) => self.line(bytes),
            Reply::Null => self.line(b"(nil)"),
            Reply::Array(items) => items.iter().for_each(|item| self.plain(item)),
        }
    }

    /// One key of `keys`.
    pub fn key(&mut self, key: &[u8]) {
        match self.format {
            Format::Json => self.json(json!({ "key": bytes_json(key) })),
            _ => self.line(key),
        }
    }

    /// One change seen by `watch`: `SET<TAB>key<TAB>value<TAB>version` or
    /// `DELETE<TAB>key<TAB><TAB>version`.
    pub fn notification(&mut self, n: &Notification) {
        let operation = if n.value.is_some() { "SET" } else { "DELETE" };
        let version = n.version.clone().unwrap_or_default();
        match self.format {
            Format::Json => self.json(json!({
                "operation": operation,
                "key": bytes_json(&n.key),
                "value": n.value.as_deref().map(bytes_json),
                "version": n.version,
            })),
            _ => {
                let mut line = Vec::new();
                line.extend_from_slice(operation.as_bytes());
                line.push(b'\t');
                line.extend_from_slice(&n.key);
                line.push(b'\t');
                line.extend_from_slice(n.value.as_deref().unwrap_or_default());
                line.push(b'\t');
                line.extend_from_slice(version.as_bytes());
                self.line(&line);
            }
        }
    }

    /// A lock acquired: its fencing token (the version of the SET).
    pub fn token(&mut self, answer: &Answer, holder: &str) {
        let token = answer.version.clone().unwrap_or_default();
        match self.format {
            Format::Json => self.json(json!({ "fencing_token": token, "holder": holder })),
            Format::Verbose => {
                self.line(token.as_bytes());
                self.line(format!("holder: {holder}").as_bytes());
                self.details(answer);
            }
            Format::Plain => self.line(token.as_bytes()),
        }
    }

    /// A remark for a person (stderr, `-v` only).
    pub fn note(&mut self, text: &str) {
        if self.format == Format::Verbose {
            eprintln!("{text}");
        }
    }
}
