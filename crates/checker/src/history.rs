//! The record format: what clients did and saw, one JSON object a line.
//!
//! ```text
//! {"type":"invoke","id":17,"process":3,"time_ns":123,"op":{"f":"set","key":"k1","value":"v","condition":"nx","px":null,"ft":null}}
//! {"type":"ok","id":17,"time_ns":456,"answer":"+OK","version":"001700000000000:00001:node1"}
//! {"type":"fail","id":18,"time_ns":470}
//! {"type":"info","id":19,"time_ns":900}
//! ```
//!
//! - `invoke`: a client sent a request. `op.f` is `set`, `get`, `del` or
//!   `vdel`; `set` has `value`, `condition` (`"nx"`, `"nex"` or null) and
//!   `px` (ms or null); `vdel` has `value`; `set`, `del` and `vdel` have `ft`
//!   (the `__ft` fencing token sent, an HLC string, or null). Absent optional
//!   fields count as null.
//! - `ok`: the answer came back. `answer` is the RESP3 answer as text
//!   without its CRLF: `+OK`, `:-1`, `:0`, `:1`, `$-1` (nil), `$hello` (a
//!   bulk value), `-ERR <text>` (see [`Answer`]). `version` is the `__ts` of
//!   the response (optional).
//! - `fail`: the request definitely did not take effect.
//! - `info`: unknown (a timeout): it may or may not have taken effect, at
//!   any time after its invoke. An operation with no completion at all by the
//!   end of the history counts as `info`.
//!
//! `time_ns` is a monotonic clock shared by every process of the history
//! ([`Recorder`] uses nanoseconds since it was made). `id` is unique in the
//! history; a process has at most one operation open at a time (a process
//! whose operation ended in `info` should go on under a new process id, as
//! in Jepsen, but the checker does not rely on it).

use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// `NX` or `NEX` on a SET.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Condition {
    /// `NX`: only if the key does not exist.
    Nx,
    /// `NEX`: only if the key does not exist or holds the same value.
    Nex,
}

/// One state store request.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "f", rename_all = "lowercase")]
pub enum Op {
    /// `SET key value [NX|NEX] [PX ms]`, with `__ft` if `ft` is set.
    Set {
        /// The key.
        key: String,
        /// The value.
        value: String,
        /// `NX`, `NEX` or neither.
        #[serde(default)]
        condition: Option<Condition>,
        /// `PX` in milliseconds (the checker ignores expiry: see the crate
        /// documentation).
        #[serde(default)]
        px: Option<u64>,
        /// The `__ft` fencing token sent.
        #[serde(default)]
        ft: Option<String>,
    },
    /// `GET key`
    Get {
        /// The key.
        key: String,
    },
    /// `DEL key`
    Del {
        /// The key.
        key: String,
        /// The `__ft` fencing token sent.
        #[serde(default)]
        ft: Option<String>,
    },
    /// `VDEL key value`
    Vdel {
        /// The key.
        key: String,
        /// The value the key must hold.
        value: String,
        /// The `__ft` fencing token sent.
        #[serde(default)]
        ft: Option<String>,
    },
}

impl Op {
    /// A plain `SET key value`.
    pub fn set(key: impl Into<String>, value: impl Into<String>) -> Op {
        Op::Set {
            key: key.into(),
            value: value.into(),
            condition: None,
            px: None,
            ft: None,
        }
    }

    /// `GET key`.
    pub fn get(key: impl Into<String>) -> Op {
        Op::Get { key: key.into() }
    }

    /// `DEL key` without a fencing token.
    pub fn del(key: impl Into<String>) -> Op {
        Op::Del {
            key: key.into(),
            ft: None,
        }
    }

    /// `VDEL key value` without a fencing token.
    pub fn vdel(key: impl Into<String>, value: impl Into<String>) -> Op {
        Op::Vdel {
            key: key.into(),
            value: value.into(),
            ft: None,
        }
    }

    /// The key the request names.
    pub fn key(&self) -> &str {
        match self {
            Op::Set { key, .. } | Op::Get { key } | Op::Del { key, .. } | Op::Vdel { key, .. } => {
                key
            }
        }
    }

    /// The `__ft` fencing token sent, if any.
    pub fn fencing_token(&self) -> Option<&str> {
        match self {
            Op::Set { ft, .. } | Op::Del { ft, .. } | Op::Vdel { ft, .. } => ft.as_deref(),
            Op::Get { .. } => None,
        }
    }

    /// The request's arguments, as sent in its RESP3 payload.
    pub fn args(&self) -> Vec<String> {
        match self {
            Op::Set {
                key,
                value,
                condition,
                px,
                ..
            } => {
                let mut args = vec!["SET".to_owned(), key.clone(), value.clone()];
                match condition {
                    Some(Condition::Nx) => args.push("NX".to_owned()),
                    Some(Condition::Nex) => args.push("NEX".to_owned()),
                    None => {}
                }
                if let Some(px) = px {
                    args.push("PX".to_owned());
                    args.push(px.to_string());
                }
                args
            }
            Op::Get { key } => vec!["GET".to_owned(), key.clone()],
            Op::Del { key, .. } => vec!["DEL".to_owned(), key.clone()],
            Op::Vdel { key, value, .. } => vec!["VDEL".to_owned(), key.clone(), value.clone()],
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let args = self.args();
        for (i, arg) in args.iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            if i == 0 {
                f.write_str(arg)?;
            } else {
                write!(f, "{arg:?}")?;
            }
        }
        if let Some(ft) = self.fencing_token() {
            write!(f, " __ft={ft}")?;
        }
        Ok(())
    }
}

/// A RESP3 answer, written in histories as text without the CRLF.
///
/// `$-1` is nil, so a bulk value of exactly `-1` cannot be told from nil:
/// histories must not use `-1` as a value.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Answer {
    /// `+<text>` (`+OK`).
    Simple(String),
    /// `:<n>`
    Integer(i64),
    /// `$-1`
    Nil,
    /// `$<value>`
    Bulk(String),
    /// `-<text>`, the whole text (`ERR ...`).
    Error(String),
}

/// An answer that is not `+text`, `:n`, `$value` or `-text`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not an answer: {0:?} (expected +text, :integer, $value, $-1 or -ERR text)")]
pub struct BadAnswer(pub String);

impl Answer {
    /// `+OK`
    pub fn ok() -> Answer {
        Answer::Simple("OK".to_owned())
    }

    /// The answer in a raw RESP3 response payload (CRLF included), as a
    /// client receives it. Bulk values that are not UTF-8 are converted
    /// lossily.
    pub fn from_resp3(payload: &[u8]) -> Result<Answer, BadAnswer> {
        use statestore::resp3::{Reply, parse_reply};
        let bad = || BadAnswer(String::from_utf8_lossy(payload).into_owned());
        Ok(match parse_reply(payload).map_err(|_| bad())? {
            Reply::Simple(s) => Answer::Simple(s),
            Reply::Error(s) => Answer::Error(s),
            Reply::Integer(n) => Answer::Integer(n),
            Reply::Bulk(b) => Answer::Bulk(String::from_utf8_lossy(&b).into_owned()),
            Reply::Null => Answer::Nil,
            Reply::Array(_) => return Err(bad()),
        })
    }

    /// Whether this is `+OK`.
    pub fn is_ok(&self) -> bool {
        matches!(self, Answer::Simple(s) if s == "OK")
    }
}

impl FromStr for Answer {
    type Err = BadAnswer;

    fn from_str(s: &str) -> Result<Answer, BadAnswer> {
        let bad = || BadAnswer(s.to_owned());
        let (Some(first), Some(rest)) = (s.as_bytes().first(), s.get(1..)) else {
            return Err(bad());
        };
        Ok(match first {
            b'+' => Answer::Simple(rest.to_owned()),
            b'-' if !rest.is_empty() => Answer::Error(rest.to_owned()),
            b':' => Answer::Integer(rest.parse().map_err(|_| bad())?),
            b'$' if rest == "-1" => Answer::Nil,
            b'$' => Answer::Bulk(rest.to_owned()),
            _ => return Err(bad()),
        })
    }
}

impl TryFrom<String> for Answer {
    type Error = BadAnswer;

    fn try_from(s: String) -> Result<Answer, BadAnswer> {
        s.parse()
    }
}

impl From<Answer> for String {
    fn from(a: Answer) -> String {
        a.to_string()
    }
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Answer::Simple(s) => write!(f, "+{s}"),
            Answer::Integer(n) => write!(f, ":{n}"),
            Answer::Nil => f.write_str("$-1"),
            Answer::Bulk(s) => write!(f, "${s}"),
            Answer::Error(s) => write!(f, "-{s}"),
        }
    }
}

/// One line of a history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Event {
    /// A request was sent.
    Invoke {
        /// The operation's id, unique in the history.
        id: u64,
        /// The client that sent it.
        process: u64,
        /// When, on the history's monotonic clock.
        time_ns: u64,
        /// What.
        op: Op,
    },
    /// Its answer came back.
    Ok {
        /// The operation's id.
        id: u64,
        /// When.
        time_ns: u64,
        /// The answer.
        answer: Answer,
        /// The response's `__ts`.
        #[serde(default)]
        version: Option<String>,
    },
    /// It definitely did not take effect.
    Fail {
        /// The operation's id.
        id: u64,
        /// When.
        time_ns: u64,
    },
    /// Unknown whether it took effect (timed out).
    Info {
        /// The operation's id.
        id: u64,
        /// When.
        time_ns: u64,
    },
}

impl Event {
    /// The operation this event belongs to.
    pub fn id(&self) -> u64 {
        match self {
            Event::Invoke { id, .. }
            | Event::Ok { id, .. }
            | Event::Fail { id, .. }
            | Event::Info { id, .. } => *id,
        }
    }

    /// When it happened.
    pub fn time_ns(&self) -> u64 {
        match self {
            Event::Invoke { time_ns, .. }
            | Event::Ok { time_ns, .. }
            | Event::Fail { time_ns, .. }
            | Event::Info { time_ns, .. } => *time_ns,
        }
    }
}

/// How an operation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Answered.
    Ok {
        /// When the answer came.
        time_ns: u64,
        /// The answer.
        answer: Answer,
        /// The response's `__ts`.
        version: Option<String>,
    },
    /// Definitely not applied.
    Fail {
        /// When.
        time_ns: u64,
    },
    /// Unknown: may take effect at any time after the invoke, or never.
    /// `time_ns` is `None` when the history ended with the operation open.
    Info {
        /// When the client gave up, if it said so.
        time_ns: Option<u64>,
    },
}

/// One operation: its invoke and how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operation {
    /// Unique in the history.
    pub id: u64,
    /// The client.
    pub process: u64,
    /// The request.
    pub op: Op,
    /// When it was sent.
    pub invoke_ns: u64,
    /// How it ended.
    pub outcome: Outcome,
}

impl Operation {
    /// When it completed (`ok` or `fail`); `None` for unknown outcomes.
    pub fn return_ns(&self) -> Option<u64> {
        match &self.outcome {
            Outcome::Ok { time_ns, .. } | Outcome::Fail { time_ns } => Some(*time_ns),
            Outcome::Info { .. } => None,
        }
    }

    /// The answer, if it came.
    pub fn answer(&self) -> Option<&Answer> {
        match &self.outcome {
            Outcome::Ok { answer, .. } => Some(answer),
            _ => None,
        }
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{} p{} [{} .. ", self.id, self.process, self.invoke_ns)?;
        match &self.outcome {
            Outcome::Ok {
                time_ns,
                answer,
                version,
            } => {
                write!(f, "{time_ns}] {} -> {answer}", self.op)?;
                if let Some(v) = version {
                    write!(f, " ({v})")?;
                }
                Ok(())
            }
            Outcome::Fail { time_ns } => write!(f, "{time_ns}] {} -> fail", self.op),
            Outcome::Info { .. } => write!(f, "?] {} -> unknown (info)", self.op),
        }
    }
}

/// A history that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    /// The file cannot be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A line is not an event.
    #[error("line {line}: {source}")]
    Json {
        /// 1-based.
        line: usize,
        /// Why.
        source: serde_json::Error,
    },
    /// An event does not fit the ones before it.
    #[error("{at}: {problem}")]
    Inconsistent {
        /// `line N` or `event N` (1-based).
        at: String,
        /// What is wrong.
        problem: String,
    },
}

/// A complete history: every operation, by invoke time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct History {
    ops: Vec<Operation>,
}

impl History {
    /// Reads a JSON Lines history (blank lines are skipped).
    pub fn load(path: impl AsRef<Path>) -> Result<History, HistoryError> {
        let path = path.as_ref();
        let io_error = |source| HistoryError::Io {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(io_error)?;
        Self::read(BufReader::new(file)).map_err(|e| match e {
            HistoryError::Io { source, .. } => io_error(source),
            other => other,
        })
    }

    /// Reads a JSON Lines history from `reader`.
    pub fn read(reader: impl BufRead) -> Result<History, HistoryError> {
        let mut events = Vec::new();
        for (n, line) in reader.lines().enumerate() {
            let line = line.map_err(|source| HistoryError::Io {
                path: PathBuf::from("<history>"),
                source,
            })?;
            if line.trim().is_empty() {
                continue;
            }
            let event = serde_json::from_str(&line).map_err(|source| HistoryError::Json {
                line: n + 1,
                source,
            })?;
            events.push((format!("line {}", n + 1), event));
        }
        Self::build(events)
    }

    /// A history from its events, in the order they happened.
    pub fn from_events(events: impl IntoIterator<Item = Event>) -> Result<History, HistoryError> {
        Self::build(
            events
                .into_iter()
                .enumerate()
                .map(|(n, e)| (format!("event {}", n + 1), e)),
        )
    }

    fn build(events: impl IntoIterator<Item = (String, Event)>) -> Result<History, HistoryError> {
        let mut ops: Vec<Operation> = Vec::new();
        let mut index = std::collections::HashMap::new();
        for (at, event) in events {
            let problem = |problem: String| HistoryError::Inconsistent {
                at: at.clone(),
                problem,
            };
            let id = event.id();
            if let Event::Invoke {
                id,
                process,
                time_ns,
                op,
            } = event
            {
                if index.insert(id, ops.len()).is_some() {
                    return Err(problem(format!("operation {id} invoked twice")));
                }
                ops.push(Operation {
                    id,
                    process,
                    op,
                    invoke_ns: time_ns,
                    outcome: Outcome::Info { time_ns: None },
                });
                continue;
            }
            let Some(&i) = index.get(&id) else {
                return Err(problem(format!(
                    "operation {id} completes but was never invoked"
                )));
            };
            let operation = &mut ops[i];
            if operation.outcome != (Outcome::Info { time_ns: None }) {
                return Err(problem(format!("operation {id} completes twice")));
            }
            if event.time_ns() < operation.invoke_ns {
                return Err(problem(format!(
                    "operation {id} completes at {} ns, before its invoke at {} ns",
                    event.time_ns(),
                    operation.invoke_ns
                )));
            }
            operation.outcome = match event {
                Event::Ok {
                    time_ns,
                    answer,
                    version,
                    ..
                } => Outcome::Ok {
                    time_ns,
                    answer,
                    version,
                },
                Event::Fail { time_ns, .. } => Outcome::Fail { time_ns },
                Event::Info { time_ns, .. } => Outcome::Info {
                    time_ns: Some(time_ns),
                },
                Event::Invoke { .. } => unreachable!("handled above"),
            };
        }
        ops.sort_by_key(|op| (op.invoke_ns, op.id));
        Ok(History { ops })
    }

    /// The operations, by invoke time.
    pub fn ops(&self) -> &[Operation] {
        &self.ops
    }

    /// Number of operations.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// The events of this history, by time (invokes before completions at
    /// the same time).
    pub fn events(&self) -> Vec<Event> {
        let mut events = Vec::with_capacity(self.ops.len() * 2);
        for op in &self.ops {
            events.push(Event::Invoke {
                id: op.id,
                process: op.process,
                time_ns: op.invoke_ns,
                op: op.op.clone(),
            });
            match &op.outcome {
                Outcome::Ok {
                    time_ns,
                    answer,
                    version,
                } => events.push(Event::Ok {
                    id: op.id,
                    time_ns: *time_ns,
                    answer: answer.clone(),
                    version: version.clone(),
                }),
                Outcome::Fail { time_ns } => events.push(Event::Fail {
                    id: op.id,
                    time_ns: *time_ns,
                }),
                Outcome::Info {
                    time_ns: Some(time_ns),
                } => events.push(Event::Info {
                    id: op.id,
                    time_ns: *time_ns,
                }),
                Outcome::Info { time_ns: None } => {}
            }
        }
        events.sort_by_key(|e| (e.time_ns(), !matches!(e, Event::Invoke { .. })));
        events
    }

    /// Writes this history as JSON Lines.
    pub fn write_jsonl(&self, mut out: impl Write) -> io::Result<()> {
        for event in self.events() {
            serde_json::to_writer(&mut out, &event)?;
            out.write_all(b"\n")?;
        }
        out.flush()
    }
}

/// Records a history as it happens: thread-safe, share it in an `Arc`.
///
/// Times are nanoseconds of one monotonic clock ([`Instant`]) since the
/// recorder was made, read under the recorder's lock, so the events are
/// written in time order.
///
/// ```
/// use statebroker_checker::history::{Answer, Op, Recorder};
/// let recorder = Recorder::new();
/// let id = recorder.invoke(1, Op::set("k", "v"));
/// recorder.ok(id, Answer::ok(), Some("001700000000000:00001:node1".to_owned()));
/// let id = recorder.invoke(2, Op::get("k"));
/// recorder.info(id);
/// let history = recorder.history().unwrap();
/// assert_eq!(history.len(), 2);
/// assert!(statebroker_checker::check(&history).is_valid());
/// ```
pub struct Recorder {
    start: Instant,
    inner: Mutex<Inner>,
}

struct Inner {
    next_id: u64,
    events: Option<Vec<Event>>,
    file: Option<BufWriter<File>>,
    error: Option<io::Error>,
}

impl Default for Recorder {
    fn default() -> Self {
        Self::new()
    }
}

impl Recorder {
    /// A recorder that keeps the events in memory.
    pub fn new() -> Recorder {
        Self::with(Some(Vec::new()), None)
    }

    /// A recorder that writes the events to a new file at `path` (and keeps
    /// them in memory too when `keep_in_memory`). Write errors are kept and
    /// returned by [`Recorder::flush`].
    pub fn create(path: impl AsRef<Path>, keep_in_memory: bool) -> io::Result<Recorder> {
        let file = BufWriter::new(File::create(path)?);
        Ok(Self::with(keep_in_memory.then(Vec::new), Some(file)))
    }

    fn with(events: Option<Vec<Event>>, file: Option<BufWriter<File>>) -> Recorder {
        Recorder {
            start: Instant::now(),
            inner: Mutex::new(Inner {
                next_id: 0,
                events,
                file,
                error: None,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn record(&self, inner: &mut Inner, event: Event) {
        if let Some(file) = &mut inner.file
            && inner.error.is_none()
        {
            let written = serde_json::to_writer(&mut *file, &event)
                .map_err(io::Error::from)
                .and_then(|()| file.write_all(b"\n"));
            if let Err(e) = written {
                inner.error = Some(e);
            }
        }
        if let Some(events) = &mut inner.events {
            events.push(event);
        }
    }

    /// `process` sends `op`: returns the operation's id.
    pub fn invoke(&self, process: u64, op: Op) -> u64 {
        let mut inner = self.lock();
        let id = inner.next_id;
        inner.next_id += 1;
        let time_ns = self.now();
        self.record(
            &mut inner,
            Event::Invoke {
                id,
                process,
                time_ns,
                op,
            },
        );
        id
    }

    /// Operation `id` was answered `answer`, with `__ts` `version`.
    pub fn ok(&self, id: u64, answer: Answer, version: Option<String>) {
        let mut inner = self.lock();
        let time_ns = self.now();
        self.record(
            &mut inner,
            Event::Ok {
                id,
                time_ns,
                answer,
                version,
            },
        );
    }

    /// Operation `id` definitely did not take effect.
    pub fn fail(&self, id: u64) {
        let mut inner = self.lock();
        let time_ns = self.now();
        self.record(&mut inner, Event::Fail { id, time_ns });
    }

    /// Operation `id` timed out: it may or may not take effect.
    pub fn info(&self, id: u64) {
        let mut inner = self.lock();
        let time_ns = self.now();
        self.record(&mut inner, Event::Info { id, time_ns });
    }

    /// Flushes the file, and returns the first write error, if any.
    pub fn flush(&self) -> io::Result<()> {
        let mut inner = self.lock();
        if let Some(e) = inner.error.take() {
            return Err(e);
        }
        match &mut inner.file {
            Some(file) => file.flush(),
            None => Ok(()),
        }
    }

    /// The events recorded so far (empty if they are not kept in memory).
    pub fn events(&self) -> Vec<Event> {
        self.lock().events.clone().unwrap_or_default()
    }

    /// The history recorded so far (operations still open count as
    /// unknown).
    pub fn history(&self) -> Result<History, HistoryError> {
        History::from_events(self.events())
    }
}
