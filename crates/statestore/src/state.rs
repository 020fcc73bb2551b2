//! What commands work on: the keys ([`Db`]), the KEYNOTIFY registrations
//! ([`Watchers`]), the hybrid logical clock and the limits, behind a small
//! API.
//!
//! As in mini-redis, where `Db` sits below the commands: the modules in
//! [`crate::command`] use this API and nothing else, and [`crate::Store`]
//! sits above both, turning a request into a command and the command's
//! answer into a response. Nothing here parses requests.

use crate::config::Config;
use crate::db::{Db, Entry, Extras};
use crate::error::Error;
use crate::glob::Pattern;
use crate::hlc::{Hlc, HybridClock, Version};
use crate::notify::{Event, Notice, WatchLimits, Watchers};
use crate::persist::{Record, Write};
use crate::plan::{Answer, Change, Context, Plan, Planner, Stamp};

/// Who sent a request: the connection it came in on.
#[derive(Debug, Clone, Copy)]
pub struct Caller<'a> {
    /// The MQTT client id of that connection.
    pub client_id: &'a str,
    /// A number the broker gives each network connection (never reused).
    pub connection: u64,
    /// Who this caller's quotas count against: the user behind the
    /// connection, shared by all its connections and client ids. The broker
    /// gives the authenticated username, or for an anonymous client its
    /// network address (see the broker's `authentication::quota_owner`).
    /// Used by the per-user KEYNOTIFY limit ([`Config::max_watches_per_user`]).
    pub owner: &'a str,
}

/// What a command sees of its request besides its arguments.
pub(crate) struct Ctx<'a> {
    pub now: u64,
    pub timestamp: Option<Hlc>,
    pub fencing_token: Option<Hlc>,
    pub persist: bool,
    pub caller: Caller<'a>,
    /// Which keys the caller may see (SCAN leaves out the others).
    pub access: Option<&'a dyn crate::KeyAccess>,
}

/// What serving a request causes besides its answer.
#[derive(Debug, Default)]
pub struct Effects {
    /// Notifications to publish.
    pub notices: Vec<Notice>,
    /// Durable changes to make first.
    pub writes: Vec<Write>,
}

/// What [`crate::Store::restore`] found.
#[derive(Debug, Default)]
pub struct Restored {
    /// Keys restored.
    pub keys: usize,
    /// Keys that expired while the broker was down (to delete from disk).
    pub expired: Vec<Vec<u8>>,
}

/// The store's data and clock, and what the request being served causes.
pub(crate) struct State {
    /// Notifications and durable writes of the current request, taken by
    /// [`State::take_effects`].
    fx: Effects,
    db: Db,
    watchers: Watchers,
    clock: HybridClock,
    config: Config,
    /// The last clock mark (see [`crate::persist`]).
    clock_mark: u64,
    /// Keys and bytes kept elsewhere (a cluster node's keys are in etcd),
    /// reported instead of `db`'s (see [`crate::Store::set_keyspace`]).
    keyspace: Option<(usize, u64)>,
}

impl State {
    pub(crate) fn new(config: Config) -> State {
        State {
            fx: Effects::default(),
            db: Db::new(),
            watchers: Watchers::default(),
            clock: HybridClock::starting_after(Version::default()),
            config,
            clock_mark: 0,
            keyspace: None,
        }
    }

    /// The state holding the persisted `records` of an earlier run whose last
    /// clock mark was `clock_mark`: versions start above both. Records that
    /// expired by `now_ms` are left out (and reported, to delete them).
    pub(crate) fn restore(
        config: Config,
        records: impl IntoIterator<Item = Record>,
        clock_mark: Option<u64>,
        now_ms: u64,
    ) -> (State, Restored) {
        let mut state = State::new(config);
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
            state.db.insert(Entry::new(
                &record.key,
                &record.value,
                record.version,
                extras,
            ));
            restored.keys += 1;
        }
        state.clock = HybridClock::starting_after(floor);
        state.clock_mark = clock_mark.unwrap_or(0);
        (state, restored)
    }

    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    /// The entry of `key`, if it exists (expired keys are removed before a
    /// command runs, see [`State::expire_into`]).
    pub(crate) fn get(&self, key: &[u8]) -> Option<&Entry> {
        self.db.get(key)
    }

    /// The clock's reading at `now` without handing out a version: the
    /// `__ts` of answers that change nothing.
    pub(crate) fn clock_now(&self, now: u64) -> Version {
        self.clock.now(now)
    }

    /// Takes in a version another node handed out.
    pub(crate) fn observe(&mut self, seen: Version) {
        self.clock.observe(seen);
    }

    /// The highest version handed out so far.
    pub(crate) fn last_version(&self) -> Version {
        self.clock.last()
    }

    /// Hands out a new version for a change, raising the clock mark first
    /// when the wall clock comes within half a lease of it (a lease ahead
    /// of the wall clock), or the version within [`MARK_MARGIN_MS`] (just
    /// past the version). The second is the case of a clock ahead of the
    /// wall clock (after a crash it starts at the last mark): its versions
    /// stay at that millisecond, the counter rising, until the wall clock
    /// catches up, and a mark a lease ahead of *them* would put the next
    /// crash's clock further ahead (ten quick crashes, ten leases).
    pub(crate) fn new_version(&mut self, now: u64, received: Option<&Hlc>) -> Version {
        let version = self.clock.next(now, received);
        if let Some(lease) = self.config.clock_lease_ms
            && (now.saturating_add(lease / 2) >= self.clock_mark
                || version.wall_ms.saturating_add(MARK_MARGIN_MS / 2) >= self.clock_mark)
        {
            self.clock_mark = now
                .saturating_add(lease)
                .max(version.wall_ms.saturating_add(MARK_MARGIN_MS));
            self.fx.writes.push(Write::ClockMark(self.clock_mark));
        }
        version
    }
}

/// How far past a version the clock mark is put at least (see
/// [`State::new_version`]): a clock ahead of the wall clock hands out
/// versions of one millisecond (the counter rising) until the wall clock
/// catches up, and 100,000 of them before it moves one.
const MARK_MARGIN_MS: u64 = 10;

impl Planner for State {
    /// Sizes of keys and values, and the number and bytes of all keys.
    fn check_quota(&self, key: &[u8], value: &[u8], existing: Option<&Entry>) -> Result<(), Error> {
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

    fn persists_by_policy(&self, key: &[u8]) -> bool {
        self.config.persist_policy.persists(key)
    }
}

impl State {
    /// Commits a key command's plan (see [`crate::plan`]) into this
    /// node's keys: a new version for a write, the durable write, the
    /// watchers' notifications. Returns the answer.
    pub(crate) fn commit(&mut self, key: &[u8], plan: Plan<'_>, ctx: &Context<'_>) -> Answer {
        let version = match (plan.change, plan.stamp) {
            (Some(Change::Put { key, value, extras }), _) => {
                let version = self.new_version(ctx.now, ctx.timestamp);
                if extras.persisted {
                    self.persist(Write::Put(Record {
                        key: key.to_vec(),
                        value: value.to_vec(),
                        version,
                        fencing_token: extras.fencing_token.clone(),
                        expires_at: extras.expires_at,
                    }));
                }
                self.db.insert(Entry::new(key, value, version, extras));
                self.changed(key, Event::Set(value.to_vec()), version);
                version
            }
            (Some(Change::Delete), _) => self.delete(key),
            (None, Stamp::Of(version)) => version,
            (None, Stamp::ClockNow | Stamp::New) => self.clock_now(ctx.now),
        };
        Answer {
            frame: plan.frame,
            version,
        }
    }

    /// Deletes `key` (which must exist), tells its watchers, and returns the
    /// version it had.
    pub(crate) fn delete(&mut self, key: &[u8]) -> Version {
        let entry = self.db.remove(key).expect("deleting a key that exists");
        if entry.persisted() {
            self.fx.writes.push(Write::Delete(key.to_vec()));
        }
        self.changed(key, Event::Delete, entry.version());
        entry.version()
    }

    /// Notifications of a change made elsewhere (another node), for this
    /// node's watchers of `key`; `version` as the change's node wrote it.
    pub(crate) fn changed_elsewhere(
        &self,
        key: &[u8],
        event: Event,
        version: crate::hlc::Stamp,
    ) -> Option<Notice> {
        let watchers = self.watchers.of_key(key);
        (!watchers.is_empty()).then(|| Notice {
            key: key.to_vec(),
            event,
            version,
            watchers: watchers.to_vec(),
        })
    }

    /// Records a notification for the watchers of `key`, if there are any.
    pub(crate) fn changed(&mut self, key: &[u8], event: Event, version: Version) {
        let watchers = self.watchers.of_key(key);
        if !watchers.is_empty() {
            self.fx.notices.push(Notice {
                key: key.to_vec(),
                event,
                version: version.format(&self.config.node_id),
                watchers: watchers.to_vec(),
            });
        }
    }

    /// Records a durable write for the current request.
    pub(crate) fn persist(&mut self, write: Write) {
        self.fx.writes.push(write);
    }

    /// What the requests served since the last call caused.
    pub(crate) fn take_effects(&mut self) -> Effects {
        std::mem::take(&mut self.fx)
    }

    /// Removes the keys that expired by `now_ms`, recording their DELETE
    /// notifications and the deletes to persist.
    pub(crate) fn expire(&mut self, now_ms: u64) {
        for entry in self.db.expire_due(now_ms) {
            if entry.persisted() {
                self.fx.writes.push(Write::Delete(entry.key().to_vec()));
            }
            self.changed(entry.key(), Event::Delete, entry.version());
        }
    }

    /// Removes `key` as [`State::expire`] would once its time came;
    /// `false` if there is no such key.
    pub(crate) fn expire_key(&mut self, key: &[u8]) -> bool {
        let Some(entry) = self.db.remove(key) else {
            return false;
        };
        if entry.persisted() {
            self.fx.writes.push(Write::Delete(entry.key().to_vec()));
        }
        self.changed(entry.key(), Event::Delete, entry.version());
        true
    }

    /// When the next key expires, if any does.
    pub(crate) fn next_expiry(&self) -> Option<u64> {
        self.db.next_expiry()
    }

    /// Registers `caller` for changes of `key`, within its client's, its
    /// owner's and everyone's watch quotas.
    pub(crate) fn watch(&mut self, caller: Caller<'_>, key: &[u8]) -> Result<(), Error> {
        // A notification that no MQTT topic could carry (see `notify.rs`).
        if crate::notify::notification_topic_len(caller.client_id.len(), key.len())
            > crate::notify::MAX_TOPIC_LEN
        {
            return Err(Error::QuotaExceeded);
        }
        let config = &self.config;
        let limits = WatchLimits {
            per_client: config.max_watches_per_client,
            per_client_bytes: config.max_watch_bytes_per_client,
            per_user: config.max_watches_per_user,
            per_user_bytes: config.max_watch_bytes_per_user,
            total: config.max_watches,
            total_bytes: config.max_watch_bytes,
        };
        self.watchers
            .register(
                caller.client_id,
                caller.owner,
                caller.connection,
                key,
                &limits,
            )
            .map_err(|_| Error::QuotaExceeded)
    }

    /// Ends `client`'s registration for `key`; `false` if there was none.
    pub(crate) fn unwatch(&mut self, client: &str, key: &[u8]) -> bool {
        self.watchers.unregister(client, key)
    }

    /// Drops the KEYNOTIFY registrations made on `connection` of `client_id`.
    pub(crate) fn connection_closed(&mut self, client_id: &str, connection: u64) -> usize {
        self.watchers.connection_closed(client_id, connection)
    }

    /// Drops the KEYNOTIFY registrations `client_id` made on connections
    /// other than `connection`, its new one.
    pub(crate) fn connection_opened(&mut self, client_id: &str, connection: u64) -> usize {
        self.watchers.connection_opened(client_id, connection)
    }

    /// One page of keys matching `pattern` from slot `start` (see
    /// [`Db::scan`]).
    pub(crate) fn scan(
        &self,
        start: usize,
        page_size: usize,
        max_slots: usize,
        max_steps: u64,
        max_key_bytes: usize,
        pattern: &Pattern,
    ) -> (Vec<Vec<u8>>, Option<usize>) {
        self.db.scan(
            start,
            page_size,
            max_slots,
            max_steps,
            max_key_bytes,
            pattern,
        )
    }

    pub(crate) fn len(&self) -> usize {
        self.keyspace
            .map_or_else(|| self.db.len(), |(keys, _)| keys)
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.keyspace
            .map_or_else(|| self.db.bytes(), |(_, bytes)| bytes)
    }

    pub(crate) fn set_keyspace(&mut self, keyspace: Option<(usize, u64)>) {
        self.keyspace = keyspace;
    }

    pub(crate) fn watch_count(&self) -> usize {
        self.watchers.len()
    }

    /// Client ids watching `key`.
    pub(crate) fn watchers_of(&self, key: &[u8]) -> &[std::sync::Arc<str>] {
        self.watchers.of_key(key)
    }

    pub(crate) fn watchers(&self) -> &Watchers {
        &self.watchers
    }

    pub(crate) fn watchers_mut(&mut self) -> &mut Watchers {
        &mut self.watchers
    }
}
