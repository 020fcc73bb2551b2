//! The store: where a request meets the data.
//!
//! [`Store::execute`] takes one request (its RESP3 payload and the user
//! properties that matter), the identity of the caller as the broker knows it
//! (the MQTT client id of the connection the request came in on, never one
//! written in the payload), and the broker's wall clock. It returns the
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

use crate::command::{Command, Dialect};
use crate::db::{Db, Entry, Extras};
use crate::error::Error;
use crate::hlc::{Hlc, HybridClock, Version};
use crate::notify::{Event, Notice, Watchers};
use crate::persist::{PersistPolicy, Record, Write};
use crate::resp3;

/// Limits on what the store holds. Beyond them: `the quota has been exceeded`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quota {
    /// Number of keys.
    pub max_keys: u64,
    /// Sum of the lengths of all keys and values.
    pub max_bytes: u64,
    /// Length of one key.
    pub max_key_size: usize,
    /// Length of one value.
    pub max_value_size: usize,
}

impl Default for Quota {
    fn default() -> Self {
        Quota {
            max_keys: 10_000_000,
            max_bytes: 1 << 30,
            max_key_size: 64 << 10,
            max_value_size: 1 << 20,
        }
    }
}

/// How the store behaves.
#[derive(Debug, Clone)]
pub struct Config {
    /// The node id in every version this store hands out.
    pub node_id: String,
    /// How far ahead of the broker's clock `__ts` and `__ft` may be.
    pub max_clock_skew_ms: u64,
    /// Keys per SCAN page.
    pub scan_page_size: usize,
    /// Limits on keys and bytes.
    pub quota: Quota,
    /// KEYNOTIFY registrations one client may hold.
    pub max_watches_per_client: usize,
    /// Keys persisted by configuration (besides `aio-persistence: true`).
    pub persist_policy: PersistPolicy,
    /// With persistence: how far ahead of the clock each clock mark is set
    /// (see [`crate::persist`]). `None`: no marks (memory only).
    pub clock_lease_ms: Option<u64>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            node_id: "statebroker".to_owned(),
            max_clock_skew_ms: 60_000,
            scan_page_size: 100,
            quota: Quota::default(),
            max_watches_per_client: 10_000,
            persist_policy: PersistPolicy::default(),
            clock_lease_ms: None,
        }
    }
}

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
}

/// Who sent a request: the connection it came in on.
#[derive(Debug, Clone, Copy)]
pub struct Caller<'a> {
    /// The MQTT client id of that connection.
    pub client_id: &'a str,
    /// A number the broker gives each network connection (never reused).
    pub connection: u64,
}

/// What the broker sends back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The response payload.
    pub payload: Vec<u8>,
    /// `__ts` of the response.
    pub timestamp: String,
    /// Notifications to publish (from this request, and from keys that
    /// expired just before it).
    pub notices: Vec<Notice>,
    /// What must be durable before the answer and notifications go out.
    pub writes: Vec<Write>,
    /// The verb, if the request got that far (for logs).
    pub command: Option<&'static str>,
    /// The error answered, if any (for logs).
    pub error: Option<Error>,
}

/// What serving a request causes besides its answer.
#[derive(Debug, Default)]
pub struct Effects {
    /// Notifications to publish.
    pub notices: Vec<Notice>,
    /// Durable changes to make first.
    pub writes: Vec<Write>,
}

/// What [`Store::restore`] found.
#[derive(Debug, Default)]
pub struct Restored {
    /// Keys restored.
    pub keys: usize,
    /// Keys that expired while the broker was down (to delete from disk).
    pub expired: Vec<Vec<u8>>,
}

/// What a command sees of its request besides its arguments.
pub(crate) struct Ctx<'a> {
    pub now: u64,
    pub timestamp: Option<Hlc>,
    pub fencing_token: Option<Hlc>,
    pub persist: bool,
    pub caller: Caller<'a>,
}

/// The state store.
pub struct Store {
    pub(crate) db: Db,
    pub(crate) watchers: Watchers,
    pub(crate) clock: HybridClock,
    pub(crate) config: Config,
    /// The last clock mark (see [`crate::persist`]).
    clock_mark: u64,
}

impl Store {
    /// An empty store.
    pub fn new(config: Config) -> Store {
        Store {
            db: Db::new(),
            watchers: Watchers::default(),
            clock: HybridClock::starting_after(Version::default()),
            config,
            clock_mark: 0,
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
        let mut store = Store::new(config);
        let mut restored = Restored::default();
        let mut floor = Version {
            wall_ms: clock_mark.unwrap_or(0),
            counter: 0,
        };
        for record in records {
            floor = floor.max(record.version);
            if record.expires_at.is_some_and(|at| at <= now_ms) {
                restored.expired.push(record.key);
                continue;
            }
            let extras = Extras {
                expires_at: record.expires_at,
                fencing_token: record.fencing_token,
                persisted: true,
            };
            store.db.insert(Entry::new(
                &record.key,
                &record.value,
                record.version,
                extras,
            ));
            restored.keys += 1;
        }
        store.clock = HybridClock::starting_after(floor);
        store.clock_mark = clock_mark.unwrap_or(0);
        (store, restored)
    }

    /// Serves one request.
    ///
    /// ```
    /// use statestore::{Caller, Config, Request, Store, resp3::encode_request};
    /// let mut store = Store::new(Config::default());
    /// let me = Caller { client_id: "client-1", connection: 1 };
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
        let mut fx = Effects::default();
        self.expire_into(now_ms, &mut fx);
        let mut command = None;
        let result = self.run(request, caller, now_ms, &mut fx, &mut command);
        let (frame, version, error) = match result {
            Ok(answer) => (answer.frame, answer.version, None),
            Err(e) => (e.frame(), self.clock.now(now_ms), Some(e)),
        };
        Outcome {
            payload: frame.to_vec(),
            timestamp: version.format(&self.config.node_id),
            notices: fx.notices,
            writes: fx.writes,
            command,
            error,
        }
    }

    fn run(
        &mut self,
        request: &Request<'_>,
        caller: Caller<'_>,
        now: u64,
        fx: &mut Effects,
        name: &mut Option<&'static str>,
    ) -> Result<crate::command::Answer, Error> {
        let args = resp3::parse_request(request.payload).map_err(|_| Error::Syntax)?;
        let skew = self.config.max_clock_skew_ms;
        let timestamp = parse_hlc(request.timestamp, now, skew, Error::TimestampSkew)?;
        let fencing_token = parse_hlc(request.fencing_token, now, skew, Error::FencingTokenSkew)?;
        let command = Command::parse(&args, request.dialect)?;
        *name = Some(command.name());
        let ctx = Ctx {
            now,
            timestamp,
            fencing_token,
            persist: request.persist,
            caller,
        };
        command.apply(self, &ctx, fx)
    }

    /// Removes the keys that expired by `now_ms`, and returns the DELETE
    /// notifications for their watchers and the deletes to persist. The
    /// broker calls it when [`Store::next_expiry`] is due; [`Store::execute`]
    /// calls it first thing.
    pub fn expire(&mut self, now_ms: u64) -> Effects {
        let mut fx = Effects::default();
        self.expire_into(now_ms, &mut fx);
        fx
    }

    fn expire_into(&mut self, now_ms: u64, fx: &mut Effects) {
        for entry in self.db.expire_due(now_ms) {
            if entry.persisted() {
                fx.writes.push(Write::Delete(entry.key().to_vec()));
            }
            self.changed(entry.key(), Event::Delete, entry.version(), fx);
        }
    }

    /// Hands out a new version for a change, raising the clock mark first
    /// when the version comes near it.
    pub(crate) fn new_version(&mut self, now: u64, received: &Hlc, fx: &mut Effects) -> Version {
        let version = self.clock.next(now, Some(received));
        if let Some(lease) = self.config.clock_lease_ms
            && version.wall_ms.saturating_add(lease / 2) >= self.clock_mark
        {
            self.clock_mark = version.wall_ms.saturating_add(lease);
            fx.writes.push(Write::ClockMark(self.clock_mark));
        }
        version
    }

    /// When the next key expires, if any does.
    pub fn next_expiry(&self) -> Option<u64> {
        self.db.next_expiry()
    }

    /// Drops the KEYNOTIFY registrations made on `connection` of `client_id`;
    /// the broker calls it whenever a network connection ends.
    pub fn connection_closed(&mut self, client_id: &str, connection: u64) -> usize {
        self.watchers.connection_closed(client_id, connection)
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.db.len()
    }

    /// Whether the store holds no keys.
    pub fn is_empty(&self) -> bool {
        self.db.is_empty()
    }

    /// Bytes of keys and values.
    pub fn bytes(&self) -> u64 {
        self.db.bytes()
    }

    /// Number of KEYNOTIFY registrations.
    pub fn watch_count(&self) -> usize {
        self.watchers.len()
    }

    /// The entry of `key` as it stands (expired keys included until the next
    /// call that expires them): for tests and tools.
    pub fn entry(&self, key: &[u8]) -> Option<&Entry> {
        self.db.get(key)
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The highest version handed out so far.
    pub fn last_version(&self) -> Version {
        self.clock.last()
    }

    pub(crate) fn check_quota(
        &self,
        key: &[u8],
        value: &[u8],
        existing: Option<&Entry>,
    ) -> Result<(), Error> {
        let quota = &self.config.quota;
        if key.len() > quota.max_key_size || value.len() > quota.max_value_size {
            return Err(Error::QuotaExceeded);
        }
        if existing.is_none() && self.db.len() as u64 >= quota.max_keys {
            return Err(Error::QuotaExceeded);
        }
        let freed = existing.map_or(0, Entry::size);
        let needed = (key.len() + value.len()) as u64;
        if self.db.bytes() - freed + needed > quota.max_bytes {
            return Err(Error::QuotaExceeded);
        }
        Ok(())
    }

    /// Deletes `key` (which must exist), tells its watchers, and returns the
    /// version it had.
    pub(crate) fn delete(&mut self, key: &[u8], fx: &mut Effects) -> Version {
        let entry = self.db.remove(key).expect("deleting a key that exists");
        if entry.persisted() {
            fx.writes.push(Write::Delete(key.to_vec()));
        }
        self.changed(key, Event::Delete, entry.version(), fx);
        entry.version()
    }

    /// Records a notification for the watchers of `key`, if there are any.
    pub(crate) fn changed(&self, key: &[u8], event: Event, version: Version, fx: &mut Effects) {
        let watchers = self.watchers.of_key(key);
        if !watchers.is_empty() {
            fx.notices.push(Notice {
                key: key.to_vec(),
                event,
                version: version.format(&self.config.node_id),
                watchers: watchers.to_vec(),
            });
        }
    }
}

fn parse_hlc(
    value: Option<&str>,
    now: u64,
    max_skew_ms: u64,
    skew_error: Error,
) -> Result<Option<Hlc>, Error> {
    let Some(value) = value else {
        return Ok(None);
    };
    let hlc: Hlc = value.parse().map_err(|_| Error::TimestampMalformed)?;
    if hlc.is_ahead_of(now, max_skew_ms) {
        return Err(skew_error);
    }
    Ok(Some(hlc))
}
