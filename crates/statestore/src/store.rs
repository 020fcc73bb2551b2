//! The store: where a request meets the data.
//!
//! [`Store::execute`] takes one request (its RESP3 payload and the user
//! properties that matter), the identity of the caller as the broker knows it
//! (the MQTT client id of the connection the request came in on, never one
//! written in the payload, and the user its quotas count against), and the
//! broker's wall clock. It returns the
//! response payload, the `__ts` to send with it, and the notifications the
//! change causes. Nothing here knows about MQTT, so everything is testable
//! without a network.
//!
//! Order of checks, and the answer of each:
//!
//! 1. the payload is RESP3: else `syntax error`;
//! 2. `__ts`, `__ft` parse as HLCs: else `malformed timestamp`; they are not
//!    more than the allowed skew ahead of the broker's clock: else the
//!    matching "too far in the future" error;
//! 3. the verb, arity and options: `unknown command`, `wrong number of
//!    arguments`, `the key length is zero`, `syntax error`;
//! 4. the command itself: `missing timestamp` (SET), fencing, conditions,
//!    quotas.

use crate::access::KeyAccess;
use crate::command::{Command, Dialect};
use crate::config::Config;
use crate::error::Error;
use crate::hlc::{Hlc, Version};
use crate::notify::Notice;
use crate::persist::Record;
use crate::persist::{Observed, Write};
use crate::resp3;
use crate::state::{Caller, Ctx, Effects, Restored, State};

/// One request, as the broker received it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Request<'a> {
    /// The RESP3 payload.
    pub payload: &'a [u8],
    /// User property `__ts`.
    pub timestamp: Option<&'a str>,
    /// User property `__ft`.
    pub fencing_token: Option<&'a str>,
    /// User property `aio-persistence` = `true`.
    pub persist: bool,
    /// The topic it came in on.
    pub dialect: Dialect,
    /// Which keys the caller may read and write; `None`: all of them.
    pub access: Option<&'a dyn KeyAccess>,
}

/// What the broker sends back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The response payload.
    pub payload: Vec<u8>,
    /// `__ts` of the response.
    pub timestamp: crate::hlc::Stamp,
    /// Notifications to publish (from this request, and from keys that
    /// expired just before it).
    pub notices: Vec<Notice>,
    /// What must be durable before the answer and notifications go out.
    pub writes: Vec<Write>,
    /// What the answer can show of the store, so also what it must wait for
    /// besides its own writes (see [`crate::persist`]).
    pub observed: Observed,
    /// The verb, if the request got that far (for logs).
    pub command: Option<&'static str>,
    /// The error answered, if any (for logs).
    pub error: Option<Error>,
}

/// A request taken apart for a backend that keeps the keys elsewhere (a
/// cluster's shared engine; see [`crate::plan`]): [`Store::prepare`].
pub enum Prepared<'a> {
    /// Served by this store: refused, or a command that touches no key's
    /// entry (KEYNOTIFY, PING, INFO).
    Done(Outcome),
    /// A command on one key's entry, to plan and commit.
    Key(Keyed<'a>),
    /// SCAN, to run over the backend's keys.
    Scan(Scanned<'a>),
}

/// A key command and what it sees of its request.
#[derive(Debug)]
pub struct Keyed<'a> {
    /// The command.
    pub command: crate::command::KeyCommand<'a>,
    /// `__ts`, checked.
    pub timestamp: Option<Hlc>,
    /// `__ft`, checked.
    pub fencing_token: Option<Hlc>,
    /// `aio-persistence: true`.
    pub persist: bool,
}

impl Keyed<'_> {
    /// The context to plan with at `now`.
    pub fn context(&self, now: u64) -> crate::plan::Context<'_> {
        crate::plan::Context {
            now,
            timestamp: self.timestamp.as_ref(),
            fencing_token: self.fencing_token.as_ref(),
            persist: self.persist,
        }
    }
}

/// A SCAN and which keys its caller may see.
pub struct Scanned<'a> {
    /// The glob and the token.
    pub scan: crate::command::Scan<'a>,
    /// Which keys the caller may read; `None`: all.
    pub access: Option<&'a dyn KeyAccess>,
}

/// The state store.
pub struct Store {
    pub(crate) state: State,
}

impl Store {
    /// An empty store.
    pub fn new(config: Config) -> Store {
        Store {
            state: State::new(config),
        }
    }

    /// A store holding the persisted `records` of an earlier run, whose last
    /// clock mark was `clock_mark`: versions start above both. Records that
    /// expired by `now_ms` are left out (and reported, to delete them).
    pub fn restore(
        config: Config,
        records: impl IntoIterator<Item = Record>,
        clock_mark: Option<u64>,
        now_ms: u64,
    ) -> (Store, Restored) {
        let (state, restored) = State::restore(config, records, clock_mark, now_ms);
        (Store { state }, restored)
    }

    /// Serves one request.
    ///
    /// ```
    /// use statestore::{Caller, Config, Request, Store, resp3::encode_request};
    /// let mut store = Store::new(Config::default());
    /// let me = Caller { client_id: "client-1", connection: 1, owner: "user-1" };
    /// let set = encode_request(&["SET", "greeting", "hello"]);
    /// let ts = "1700000000000:0:client-1";
    /// let req = Request { payload: &set, timestamp: Some(ts), ..Request::default() };
    /// let out = store.execute(&req, me, 1_700_000_000_000);
    /// assert_eq!(out.payload, b"+OK\r\n");
    /// assert_eq!(out.timestamp, "001700000000000:00001:statebroker");
    ///
    /// let get = encode_request(&["GET", "greeting"]);
    /// let out = store.execute(&Request { payload: &get, ..Request::default() }, me, 1_700_000_000_001);
    /// assert_eq!(out.payload, b"$5\r\nhello\r\n");
    /// ```
    pub fn execute(&mut self, request: &Request<'_>, caller: Caller<'_>, now_ms: u64) -> Outcome {
        self.state.expire(now_ms);
        let mut command = None;
        let mut observed = Observed::Nothing;
        let result = self.run(request, caller, now_ms, &mut command, &mut observed);
        let (frame, version, error) = match result {
            Ok(answer) => (answer.frame, answer.version, None),
            Err(e) => (e.frame(), self.state.clock_now(now_ms), Some(e)),
        };
        let fx = self.state.take_effects();
        Outcome {
            payload: frame.to_vec(),
            timestamp: version.format(&self.state.config().node_id),
            notices: fx.notices,
            writes: fx.writes,
            observed,
            command,
            error,
        }
    }

    /// Checks a request as [`Store::execute`] does (RESP3, `__ts` and
    /// `__ft`, the verb and its arguments, access) and hands back what a
    /// backend keeping the keys elsewhere must serve; serves the rest here.
    pub fn prepare<'a>(
        &mut self,
        request: &Request<'a>,
        caller: Caller<'_>,
        now_ms: u64,
    ) -> Prepared<'a> {
        let checked = self.check(request, now_ms).and_then(|checked| {
            if let Some(access) = request.access {
                crate::access::check(&checked.0, access)?;
            }
            Ok(checked)
        });
        match checked {
            Ok((Command::Scan(scan), _, _)) => Prepared::Scan(Scanned {
                scan,
                access: request.access,
            }),
            Ok((command, timestamp, fencing_token)) => {
                match crate::command::KeyCommand::of(command) {
                    Some(command) => Prepared::Key(Keyed {
                        command,
                        timestamp,
                        fencing_token,
                        persist: request.persist,
                    }),
                    None => Prepared::Done(self.execute(request, caller, now_ms)),
                }
            }
            Err(_) => Prepared::Done(self.execute(request, caller, now_ms)),
        }
    }

    /// The checks before a command runs but access (which needs the
    /// command's name and key for logs first); the command and its
    /// timestamps.
    fn check<'a>(
        &self,
        request: &Request<'a>,
        now: u64,
    ) -> Result<(Command<'a>, Option<Hlc>, Option<Hlc>), Error> {
        let mut args = resp3::Args::new();
        if resp3::parse_request_into(request.payload, &mut args).is_err() {
            return Err(Error::Syntax);
        }
        let skew = self.state.config().max_clock_skew_ms;
        // Of the request's `__ts` only the time is used (see `State::new_version`).
        let timestamp = parse_hlc(
            request.timestamp,
            Hlc::time_only,
            (now, skew),
            Error::TimestampSkew,
        )?;
        let fencing_token = parse_hlc(
            request.fencing_token,
            str::parse,
            (now, skew),
            Error::FencingTokenSkew,
        )?;
        let command = Command::parse(&args, request.dialect)?;
        Ok((command, timestamp, fencing_token))
    }

    /// Hands out a new version at `now_ms`: greater than `received` and
    /// every version handed out or observed before.
    pub fn mint(&mut self, now_ms: u64, received: Option<&Hlc>) -> Version {
        self.state.new_version(now_ms, received)
    }

    /// Takes in a version handed out elsewhere (another node): every
    /// version minted after it is greater.
    pub fn observe(&mut self, seen: Version) {
        self.state.observe(seen);
    }

    /// The clock's reading at `now_ms`: the `__ts` of answers that show no
    /// version.
    pub fn clock_now(&self, now_ms: u64) -> Version {
        self.state.clock_now(now_ms)
    }

    /// How the store was configured.
    pub fn config(&self) -> &Config {
        self.state.config()
    }

    /// The notification of a change made elsewhere (another node) for this
    /// store's watchers of `key`, if it has any; `version` is the change's,
    /// as its node wrote it.
    pub fn changed_elsewhere(
        &self,
        key: &[u8],
        event: crate::notify::Event,
        version: crate::hlc::Stamp,
    ) -> Option<Notice> {
        self.state.changed_elsewhere(key, event, version)
    }

    fn run(
        &mut self,
        request: &Request<'_>,
        caller: Caller<'_>,
        now: u64,
        name: &mut Option<&'static str>,
        observed: &mut Observed,
    ) -> Result<crate::command::Answer, Error> {
        let (command, timestamp, fencing_token) = self.check(request, now)?;
        *name = Some(command.name());
        *observed = match command.key() {
            Some(key) => Observed::key_in(request.payload, key),
            None if matches!(command, Command::Ping(_)) => Observed::Nothing,
            None => Observed::All,
        };
        if let Some(access) = request.access {
            crate::access::check(&command, access)?;
        }
        let ctx = Ctx {
            now,
            timestamp,
            fencing_token,
            persist: request.persist,
            caller,
            access: request.access,
        };
        command.apply(&mut self.state, &ctx)
    }

    /// Answers a request the broker refused before it reached the store
    /// (for example one published at QoS 0): `-ERR <text>`, with the store's
    /// clock reading in `__ts`, so that no answer ever reports a version
    /// lower than one already handed out.
    pub fn refuse(&self, text: &str, now_ms: u64) -> Outcome {
        let mut payload = Vec::with_capacity(text.len() + 7);
        resp3::encode_error(text, &mut payload);
        Outcome {
            payload,
            timestamp: self
                .state
                .clock_now(now_ms)
                .format(&self.state.config().node_id),
            notices: Vec::new(),
            writes: Vec::new(),
            observed: Observed::Nothing,
            command: None,
            error: None,
        }
    }

    /// Removes the keys that expired by `now_ms`, and returns the DELETE
    /// notifications for their watchers and the deletes to persist. The
    /// broker calls it when [`Store::next_expiry`] is due; [`Store::execute`]
    /// calls it first thing.
    pub fn expire(&mut self, now_ms: u64) -> Effects {
        self.state.expire(now_ms);
        self.state.take_effects()
    }

    /// Removes `key` now, as if its expiry had come (a fault for tests, see
    /// the broker's `[faults]`): DELETE notifications for its watchers, the
    /// delete persisted. `None` if there is no such key.
    pub fn expire_key(&mut self, key: &[u8]) -> Option<Effects> {
        self.state
            .expire_key(key)
            .then(|| self.state.take_effects())
    }

    /// When the next key expires, if any does.
    pub fn next_expiry(&self) -> Option<u64> {
        self.state.next_expiry()
    }

    /// Drops the KEYNOTIFY registrations made on `connection` of `client_id`;
    /// the broker calls it whenever a network connection ends.
    pub fn connection_closed(&mut self, client_id: &str, connection: u64) -> usize {
        self.state.connection_closed(client_id, connection)
    }

    /// Drops the KEYNOTIFY registrations `client_id` made on connections
    /// other than `connection`: the broker calls it when a connection is
    /// accepted (one that takes over the client id's earlier connection
    /// must not hear of what that one registered, in the moment before
    /// the earlier one's [`Store::connection_closed`]).
    pub fn connection_opened(&mut self, client_id: &str, connection: u64) -> usize {
        self.state.connection_opened(client_id, connection)
    }

    /// Reports `keyspace` (keys, bytes of keys and values) as the store's
    /// in [`Store::len`], [`Store::bytes`] and INFO, for a node whose keys
    /// are kept elsewhere (a cluster node's are in etcd); `None`: its own.
    pub fn set_keyspace(&mut self, keyspace: Option<(usize, u64)>) {
        self.state.set_keyspace(keyspace);
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.state.len()
    }

    /// Whether the store holds no keys.
    pub fn is_empty(&self) -> bool {
        self.state.len() == 0
    }

    /// Bytes of keys and values.
    pub fn bytes(&self) -> u64 {
        self.state.bytes()
    }

    /// Number of KEYNOTIFY registrations.
    pub fn watch_count(&self) -> usize {
        self.state.watch_count()
    }

    /// Keeps the KEYNOTIFY registrations made and ended from now on, for
    /// [`Store::take_watch_changes`] (a cluster node tells the other nodes
    /// of its registrations), `limit` at most between two takes.
    pub fn keep_watch_changes(&mut self, limit: usize) {
        self.state.watchers_mut().keep_changes(limit);
    }

    /// The registrations made and ended since the last call, in order;
    /// `None` if more than the limit were made (then
    /// [`Store::all_watches`] is what there is).
    pub fn take_watch_changes(&mut self) -> Option<Vec<crate::notify::WatchChange>> {
        self.state.watchers_mut().take_changes()
    }

    /// Whether registrations were made or ended since the last
    /// [`Store::take_watch_changes`].
    pub fn watch_changes_waiting(&self) -> bool {
        self.state.watchers().changes_waiting()
    }

    /// Every KEYNOTIFY registration: its client id and key.
    pub fn all_watches(&self) -> Vec<(std::sync::Arc<str>, Box<[u8]>)> {
        self.state.watchers().all()
    }

    /// The highest version handed out so far.
    pub fn last_version(&self) -> Version {
        self.state.last_version()
    }
}

fn parse_hlc(
    value: Option<&str>,
    parse: fn(&str) -> Result<Hlc, crate::hlc::MalformedTimestamp>,
    (now, max_skew_ms): (u64, u64),
    skew_error: Error,
) -> Result<Option<Hlc>, Error> {
    let Some(value) = value else {
        return Ok(None);
    };
    let hlc = parse(value).map_err(|_| Error::TimestampMalformed)?;
    if hlc.is_ahead_of(now, max_skew_ms) {
        return Err(skew_error);
    }
    Ok(Some(hlc))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resp3::encode_request;

    /// A refusal reports the store's clock: never a `__ts` below a version
    /// already handed out, even when a client's `__ts` pushed the clock
    /// ahead of the wall clock.
    #[test]
    fn refusals_use_the_stores_clock() {
        let mut store = Store::new(Config::default());
        let me = Caller {
            client_id: "c",
            connection: 1,
            owner: "c",
        };
        let now = 1_700_000_000_000;
        let set = encode_request(&["SET", "k", "v"]);
        let ahead = format!("{}:5:c", now + 30_000);
        let request = Request {
            payload: &set,
            timestamp: Some(&ahead),
            ..Request::default()
        };
        let set_version = store.execute(&request, me, now).timestamp;
        let refused = store.refuse("requests must be published with QoS 1", now);
        assert_eq!(
            refused.payload,
            b"-ERR requests must be published with QoS 1\r\n"
        );
        assert_eq!(refused.timestamp, set_version);
        assert!(refused.notices.is_empty() && refused.writes.is_empty());
        // Later on the wall clock, the reading moves on.
        let later = store.refuse("x", now + 60_000).timestamp;
        assert!(later > set_version, "{later} <= {set_version}");
    }

    /// Each answer says what it can show: the key its command names (found
    /// in the payload, refused or not), every key for SCAN and INFO,
    /// nothing for PING and for what did not parse.
    #[test]
    fn an_outcome_says_what_its_answer_can_show() {
        let mut store = Store::new(Config::default());
        let me = Caller {
            client_id: "c",
            connection: 1,
            owner: "c",
        };
        let now = 1_700_000_000_000;
        let ts = format!("{now}:0:c");
        let mut observed = |args: &[&str]| {
            let payload = encode_request(args);
            let request = Request {
                payload: &payload,
                timestamp: Some(&ts),
                ..Request::default()
            };
            match store.execute(&request, me, now).observed {
                Observed::Key(range) => Some(String::from_utf8(payload[range].to_vec()).unwrap()),
                Observed::All => Some("*all*".to_owned()),
                Observed::Nothing => None,
            }
        };
        let key = |k: &str| Some(k.to_owned());
        assert_eq!(observed(&["SET", "door", "open"]), key("door"));
        assert_eq!(
            observed(&["SET", "door", "open", "NX"]),
            key("door"),
            "refused"
        );
        assert_eq!(observed(&["GET", "door"]), key("door"));
        assert_eq!(observed(&["get", "gate"]), key("gate"));
        assert_eq!(observed(&["DEL", "door"]), key("door"));
        assert_eq!(observed(&["VDEL", "door", "closed"]), key("door"));
        assert_eq!(observed(&["KEYNOTIFY", "door"]), key("door"));
        assert_eq!(observed(&["SCAN", "*"]), key("*all*"));
        assert_eq!(observed(&["INFO"]), key("*all*"));
        assert_eq!(observed(&["PING"]), None);
        assert_eq!(observed(&["NOPE", "door"]), None);
        assert_eq!(observed(&["GET"]), None, "wrong number of arguments");
        let garbage = store.execute(
            &Request {
                payload: b"*1\r\n",
                ..Request::default()
            },
            me,
            now,
        );
        assert_eq!(garbage.observed, Observed::Nothing);
    }

    #[test]
    fn a_key_outside_the_payload_counts_as_every_key() {
        let payload = b"abcdef".to_vec();
        assert_eq!(
            Observed::key_in(&payload, &payload[2..4]),
            Observed::Key(2..4)
        );
        assert_eq!(
            Observed::key_in(&payload, &payload[6..]),
            Observed::Key(6..6)
        );
        assert_eq!(Observed::key_in(&payload, b"cd"), Observed::All);
    }
}
