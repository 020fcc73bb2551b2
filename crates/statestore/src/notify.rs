//! KEYNOTIFY: who watches which key, and what they are told.
//!
//! `KEYNOTIFY key` registers the caller's **client id** for changes of `key`;
//! `KEYNOTIFY key STOP` removes the registration. When a watched key changes,
//! every watcher gets a message on
//!
//! ```text
//! clients/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/{HEX(clientId)}/command/notify/{HEX(key)}
//! ```
//!
//! (upper-case base16 of the raw bytes), carrying the key's version in `__ts`
//! and one of two payloads:
//!
//! ```text
//! *4\r\n$6\r\nNOTIFY\r\n$3\r\nSET\r\n$5\r\nVALUE\r\n$<len>\r\n<value>\r\n   after a SET
//! *2\r\n$6\r\nNOTIFY\r\n$6\r\nDELETE\r\n                                   after DEL, VDEL, expiry
//! ```
//!
//! A key whose topic would be longer than an MQTT topic may be (65,535
//! bytes: about 32,700 bytes of client id and key together) cannot be
//! notified: its KEYNOTIFY is refused, `-ERR the quota has been exceeded`
//! ([`notification_topic_len`]).
//!
//! Registrations belong to the client's current network connection: when it
//! ends, for whatever reason and whatever its session settings, they are
//! gone ([`Watchers::connection_closed`]), and a client that reconnects must
//! register again. Each registration remembers the connection that made it,
//! so the late clean-up of a connection that was taken over by a new one
//! (same client id) never removes the new connection's registrations.
//!
//! Registrations count against three limits ([`WatchLimits`]): the client's,
//! its **owner's** (the user the broker counts the connection against: its
//! authenticated username, or for an anonymous client its network address;
//! see [`crate::Caller::owner`]), and everyone's. The owner's limit is what
//! keeps one user, whatever number of connections or client ids it uses,
//! from taking the whole of the global limit.

/// The notification namespace (without the trailing `/`).
pub const NOTIFY_NAMESPACE: &str = "clients/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8";

/// The length of the topic on which a client id of `client_id_len` bytes
/// hears about a key of `key_len` bytes.
pub fn notification_topic_len(client_id_len: usize, key_len: usize) -> usize {
    NOTIFY_NAMESPACE.len() + "/".len() + 2 * client_id_len + "/command/notify/".len() + 2 * key_len
}

/// The longest topic MQTT carries.
pub const MAX_TOPIC_LEN: usize = u16::MAX as usize;

use std::collections::HashMap;
use std::sync::Arc;

use crate::resp3::encode_bulk;

/// What happened to a watched key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The key was set to this value.
    Set(Vec<u8>),
    /// The key was deleted (DEL, VDEL) or expired.
    Delete,
}

/// One change of one watched key, and who must hear of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// The key that changed.
    pub key: Vec<u8>,
    /// What happened.
    pub event: Event,
    /// The key's version, in wire form, for `__ts`.
    pub version: crate::hlc::Stamp,
    /// Client ids of the watchers.
    pub watchers: Vec<Arc<str>>,
}

impl Notice {
    /// The notification payload.
    ///
    /// ```
    /// use statestore::notify::{Event, Notice};
    /// let n = Notice { key: b"k".to_vec(), event: Event::Delete, version: Default::default(), watchers: vec![] };
    /// assert_eq!(n.payload(), b"*2\r\n$6\r\nNOTIFY\r\n$6\r\nDELETE\r\n");
    /// ```
    pub fn payload(&self) -> Vec<u8> {
        match &self.event {
            Event::Set(value) => {
                let mut out = b"*4\r\n$6\r\nNOTIFY\r\n$3\r\nSET\r\n$5\r\nVALUE\r\n".to_vec();
                encode_bulk(value, &mut out);
                out
            }
            Event::Delete => b"*2\r\n$6\r\nNOTIFY\r\n$6\r\nDELETE\r\n".to_vec(),
        }
    }
}

/// The registry of KEYNOTIFY registrations.
#[derive(Debug, Default)]
pub struct Watchers {
    /// key -> client ids watching it
    by_key: HashMap<Box<[u8]>, Vec<Arc<str>>>,
    /// client id -> its registrations
    by_client: HashMap<Arc<str>, ClientWatches>,
    /// owner -> what its registrations hold (owners holding none are
    /// removed)
    by_owner: HashMap<Arc<str>, Usage>,
    /// What all registrations hold.
    total: Usage,
    /// Registrations made and ended since the last
    /// [`Watchers::take_changes`], when kept ([`Watchers::keep_changes`]).
    changes: Option<KeptChanges>,
}

/// The changes kept for [`Watchers::take_changes`].
#[derive(Debug, Default)]
struct KeptChanges {
    list: Vec<WatchChange>,
    /// How many the list holds at most.
    limit: usize,
    /// More were made: the list was dropped.
    overflowed: bool,
}

impl KeptChanges {
    fn push(&mut self, change: WatchChange) {
        if self.overflowed {
            return;
        }
        if self.list.len() >= self.limit {
            self.list = Vec::new();
            self.overflowed = true;
            return;
        }
        self.list.push(change);
    }
}

/// A registration made or ended, for a broker that tells others of them
/// (a cluster node publishes its registrations for the other nodes' key
/// pages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchChange {
    /// `client` registered for changes of `key`.
    Made {
        /// The client id.
        client: Arc<str>,
        /// The key.
        key: Box<[u8]>,
    },
    /// `client`'s registration for `key` ended.
    Ended {
        /// The client id.
        client: Arc<str>,
        /// The key.
        key: Box<[u8]>,
    },
}

/// Registrations, and the bytes of key names they keep.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Usage {
    count: usize,
    bytes: usize,
}

impl Usage {
    /// Whether one more registration of `key_len` bytes stays within
    /// `count` registrations and `bytes` bytes.
    fn has_room(self, key_len: usize, count: usize, bytes: usize) -> bool {
        self.count < count && self.bytes.saturating_add(key_len) <= bytes
    }

    fn add(&mut self, key_len: usize) {
        self.count += 1;
        self.bytes += key_len;
    }

    fn remove(&mut self, key_len: usize) {
        self.count -= 1;
        self.bytes -= key_len;
    }
}

/// One client's registrations.
#[derive(Debug, Default)]
struct ClientWatches {
    /// key -> who registered it
    keys: HashMap<Box<[u8]>, Registration>,
    /// What those registrations hold.
    usage: Usage,
}

/// Who made one registration.
#[derive(Debug)]
struct Registration {
    /// The connection that made it.
    connection: u64,
    /// Whom it counts against (see [`crate::Caller::owner`]).
    owner: Arc<str>,
}

/// How many registrations there may be, and how many bytes of key names
/// they may hold, per client, per user (owner) and in all: every
/// registration keeps its key, so a quota in bytes is what bounds the
/// memory one client or user can take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchLimits {
    /// Registrations of one client.
    pub per_client: usize,
    /// Key bytes of one client's registrations.
    pub per_client_bytes: usize,
    /// Registrations of one user: all the clients of one owner together.
    pub per_user: usize,
    /// Key bytes of one user's registrations.
    pub per_user_bytes: usize,
    /// Registrations of all clients.
    pub total: usize,
    /// Key bytes of all registrations.
    pub total_bytes: usize,
}

impl Default for WatchLimits {
    /// The defaults of [`crate::Config`]: one user may take at most a tenth
    /// of all registrations, and an eighth of their bytes.
    fn default() -> Self {
        WatchLimits {
            per_client: 10_000,
            per_client_bytes: 1 << 20,
            per_user: 100_000,
            per_user_bytes: 32 << 20,
            total: 1_000_000,
            total_bytes: 256 << 20,
        }
    }
}

/// A registration refused: it would pass one of the [`WatchLimits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooManyWatches;

impl Watchers {
    /// Registers `client` (on `connection`, counted against `owner`) for
    /// changes of `key`, within `limits`. Registering again is not an error
    /// and costs nothing more; it moves the registration to `connection`
    /// (and to `owner`, if the client now counts against another one: then
    /// only if that owner has room).
    pub fn register(
        &mut self,
        client: &str,
        owner: &str,
        connection: u64,
        key: &[u8],
        limits: &WatchLimits,
    ) -> Result<(), TooManyWatches> {
        let user_has_room = |by_owner: &HashMap<Arc<str>, Usage>| {
            by_owner.get(owner).copied().unwrap_or_default().has_room(
                key.len(),
                limits.per_user,
                limits.per_user_bytes,
            )
        };
        if let Some(watches) = self.by_client.get_mut(client)
            && let Some(registration) = watches.keys.get_mut(key)
        {
            if &*registration.owner != owner {
                if !user_has_room(&self.by_owner) {
                    return Err(TooManyWatches);
                }
                let (new_owner, usage) = owner_entry(&mut self.by_owner, owner);
                usage.add(key.len());
                let old_owner = std::mem::replace(&mut registration.owner, new_owner);
                release(&mut self.by_owner, &old_owner, key.len());
            }
            registration.connection = connection;
            return Ok(());
        }
        let client_usage = self
            .by_client
            .get(client)
            .map_or_else(Usage::default, |w| w.usage);
        if !client_usage.has_room(key.len(), limits.per_client, limits.per_client_bytes)
            || !user_has_room(&self.by_owner)
            || !self
                .total
                .has_room(key.len(), limits.total, limits.total_bytes)
        {
            return Err(TooManyWatches);
        }
        let client_id = match self.by_client.get_key_value(client) {
            Some((id, _)) => id.clone(),
            None => Arc::from(client),
        };
        let (owner, owner_usage) = owner_entry(&mut self.by_owner, owner);
        owner_usage.add(key.len());
        let watches = self.by_client.entry(client_id.clone()).or_default();
        watches
            .keys
            .insert(key.into(), Registration { connection, owner });
        watches.usage.add(key.len());
        self.total.add(key.len());
        self.by_key
            .entry(key.into())
            .or_default()
            .push(client_id.clone());
        if let Some(kept) = &mut self.changes {
            kept.push(WatchChange::Made {
                client: client_id,
                key: key.into(),
            });
        }
        Ok(())
    }

    /// Removes `client`'s registration for `key`; `false` if there was none.
    pub fn unregister(&mut self, client: &str, key: &[u8]) -> bool {
        let Some(watches) = self.by_client.get_mut(client) else {
            return false;
        };
        let Some(registration) = watches.keys.remove(key) else {
            return false;
        };
        watches.usage.remove(key.len());
        if watches.keys.is_empty() {
            self.by_client.remove(client);
        }
        release(&mut self.by_owner, &registration.owner, key.len());
        self.total.remove(key.len());
        self.remove_from_key(client, key);
        if let Some(kept) = &mut self.changes {
            kept.push(WatchChange::Ended {
                client: Arc::from(client),
                key: key.into(),
            });
        }
        true
    }

    /// Keeps the registrations made and ended from now on, `limit` at
    /// most until [`Watchers::take_changes`] takes them.
    pub fn keep_changes(&mut self, limit: usize) {
        self.changes = Some(KeptChanges {
            limit,
            ..KeptChanges::default()
        });
    }

    /// The registrations made and ended since the last call, in order
    /// (none unless [`Watchers::keep_changes`]); `None` if more than its
    /// limit were made (then [`Watchers::all`] is what there is).
    pub fn take_changes(&mut self) -> Option<Vec<WatchChange>> {
        let Some(kept) = &mut self.changes else {
            return Some(Vec::new());
        };
        if std::mem::take(&mut kept.overflowed) {
            return None;
        }
        Some(std::mem::take(&mut kept.list))
    }

    /// Whether [`Watchers::take_changes`] has something to give.
    pub fn changes_waiting(&self) -> bool {
        self.changes
            .as_ref()
            .is_some_and(|kept| kept.overflowed || !kept.list.is_empty())
    }

    /// Every registration: its client and key.
    pub fn all(&self) -> Vec<(Arc<str>, Box<[u8]>)> {
        self.by_client
            .iter()
            .flat_map(|(client, watches)| {
                watches.keys.keys().map(|key| (client.clone(), key.clone()))
            })
            .collect()
    }

    fn remove_from_key(&mut self, client: &str, key: &[u8]) {
        if let Some(list) = self.by_key.get_mut(key) {
            list.retain(|c| &**c != client);
            if list.is_empty() {
                self.by_key.remove(key);
            }
        }
    }

    /// Drops every registration that `connection` of `client` made. Returns
    /// how many there were.
    pub fn connection_closed(&mut self, client: &str, connection: u64) -> usize {
        self.drop_made(client, |made_on| made_on == connection)
    }

    /// `connection` of `client` opened (a client id's new connection takes
    /// over its earlier one): the registrations its earlier connections
    /// made are dropped now, not when the earlier connection's clean-up
    /// comes (after it said goodbye to its client), so that the new
    /// connection hears only of what it registers itself. Returns how many
    /// there were.
    pub fn connection_opened(&mut self, client: &str, connection: u64) -> usize {
        self.drop_made(client, |made_on| made_on != connection)
    }

    /// Drops `client`'s registrations made on the connections `made`
    /// picks; returns how many.
    fn drop_made(&mut self, client: &str, made: impl Fn(u64) -> bool) -> usize {
        let Some(watches) = self.by_client.get(client) else {
            return 0;
        };
        let gone: Vec<Box<[u8]>> = watches
            .keys
            .iter()
            .filter(|(_, registration)| made(registration.connection))
            .map(|(key, _)| key.clone())
            .collect();
        for key in &gone {
            self.unregister(client, key);
        }
        gone.len()
    }

    /// The client ids watching `key`.
    pub fn of_key(&self, key: &[u8]) -> &[Arc<str>] {
        self.by_key.get(key).map_or(&[], Vec::as_slice)
    }

    /// Number of registrations in all.
    pub fn len(&self) -> usize {
        self.total.count
    }

    /// Key bytes of all registrations.
    pub fn bytes(&self) -> usize {
        self.total.bytes
    }

    /// Whether there are no registrations.
    pub fn is_empty(&self) -> bool {
        self.total.count == 0
    }

    /// Registrations counted against `owner`, and their key bytes.
    pub fn of_owner(&self, owner: &str) -> (usize, usize) {
        self.by_owner
            .get(owner)
            .map_or((0, 0), |usage| (usage.count, usage.bytes))
    }

    /// Number of owners holding registrations.
    pub fn owners(&self) -> usize {
        self.by_owner.len()
    }
}

/// `owner`'s entry (made if it has none), with the shared name to keep in
/// registrations.
fn owner_entry<'m>(
    by_owner: &'m mut HashMap<Arc<str>, Usage>,
    owner: &str,
) -> (Arc<str>, &'m mut Usage) {
    let name = match by_owner.get_key_value(owner) {
        Some((name, _)) => Arc::clone(name),
        None => Arc::from(owner),
    };
    let usage = by_owner.entry(Arc::clone(&name)).or_default();
    (name, usage)
}

/// Takes one registration of `key_len` bytes off `owner`'s usage, and
/// forgets the owner when it holds none.
fn release(by_owner: &mut HashMap<Arc<str>, Usage>, owner: &str, key_len: usize) {
    if let Some(usage) = by_owner.get_mut(owner) {
        usage.remove(key_len);
        if usage.count == 0 {
            by_owner.remove(owner);
        }
    }
}

#[cfg(test)]
mod tests;
