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
//! Registrations belong to the client's current network connection: when it
//! ends, for whatever reason and whatever its session settings, they are
//! gone ([`Watchers::connection_closed`]), and a client that reconnects must
//! register again. Each registration remembers the connection that made it,
//! so the late clean-up of a connection that was taken over by a new one
//! (same client id) never removes the new connection's registrations.

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
    pub version: String,
    /// Client ids of the watchers.
    pub watchers: Vec<Arc<str>>,
}

impl Notice {
    /// The notification payload.
    ///
    /// ```
    /// use statestore::notify::{Event, Notice};
    /// let n = Notice { key: b"k".to_vec(), event: Event::Delete, version: String::new(), watchers: vec![] };
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
    /// Registrations in all.
    total: usize,
    /// Key bytes of all registrations.
    total_bytes: usize,
}

/// One client's registrations.
#[derive(Debug, Default)]
struct ClientWatches {
    /// key -> connection that registered it
    keys: HashMap<Box<[u8]>, u64>,
    /// Sum of the lengths of those keys.
    bytes: usize,
}

/// How many registrations there may be, and how many bytes of key names
/// they may hold, per client and in all: every registration keeps its key,
/// so a quota in bytes is what bounds the memory one client can take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchLimits {
    /// Registrations of one client.
    pub per_client: usize,
    /// Key bytes of one client's registrations.
    pub per_client_bytes: usize,
    /// Registrations of all clients.
    pub total: usize,
    /// Key bytes of all registrations.
    pub total_bytes: usize,
}

impl Default for WatchLimits {
    fn default() -> Self {
        WatchLimits {
            per_client: 10_000,
            per_client_bytes: 1 << 20,
            total: 1_000_000,
            total_bytes: 256 << 20,
        }
    }
}

/// A registration refused: it would pass one of the [`WatchLimits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooManyWatches;

impl Watchers {
    /// Registers `client` (on `connection`) for changes of `key`, within
    /// `limits`. Registering again is not an error; it moves the
    /// registration to `connection`.
    pub fn register(
        &mut self,
        client: &str,
        connection: u64,
        key: &[u8],
        limits: &WatchLimits,
    ) -> Result<(), TooManyWatches> {
        if let Some(watches) = self.by_client.get_mut(client)
            && let Some(conn) = watches.keys.get_mut(key)
        {
            *conn = connection;
            return Ok(());
        }
        let (count, bytes) = self
            .by_client
            .get(client)
            .map_or((0, 0), |w| (w.keys.len(), w.bytes));
        if count + 1 > limits.per_client
            || bytes + key.len() > limits.per_client_bytes
            || self.total + 1 > limits.total
            || self.total_bytes + key.len() > limits.total_bytes
        {
            return Err(TooManyWatches);
        }
        let client_id = match self.by_client.get_key_value(client) {
            Some((id, _)) => id.clone(),
            None => Arc::from(client),
        };
        let watches = self.by_client.entry(client_id.clone()).or_default();
        watches.keys.insert(key.into(), connection);
        watches.bytes += key.len();
        self.total += 1;
        self.total_bytes += key.len();
        self.by_key.entry(key.into()).or_default().push(client_id);
        Ok(())
    }

    /// Removes `client`'s registration for `key`; `false` if there was none.
    pub fn unregister(&mut self, client: &str, key: &[u8]) -> bool {
        let Some(watches) = self.by_client.get_mut(client) else {
            return false;
        };
        if watches.keys.remove(key).is_none() {
            return false;
        }
        watches.bytes -= key.len();
        if watches.keys.is_empty() {
            self.by_client.remove(client);
        }
        self.total -= 1;
        self.total_bytes -= key.len();
        self.remove_from_key(client, key);
        true
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
        let Some(watches) = self.by_client.get(client) else {
            return 0;
        };
        let gone: Vec<Box<[u8]>> = watches
            .keys
            .iter()
            .filter(|&(_, &conn)| conn == connection)
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
        self.total
    }

    /// Key bytes of all registrations.
    pub fn bytes(&self) -> usize {
        self.total_bytes
    }

    /// Whether there are no registrations.
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count_limit(per_client: usize) -> WatchLimits {
        WatchLimits {
            per_client,
            ..WatchLimits::default()
        }
    }

    fn ids(w: &Watchers, key: &[u8]) -> Vec<String> {
        let mut v: Vec<String> = w.of_key(key).iter().map(|c| c.to_string()).collect();
        v.sort();
        v
    }

    #[test]
    fn register_unregister() {
        let mut w = Watchers::default();
        w.register("a", 1, b"k", &count_limit(10)).unwrap();
        w.register("a", 1, b"k", &count_limit(10)).unwrap();
        w.register("b", 2, b"k", &count_limit(10)).unwrap();
        assert_eq!(ids(&w, b"k"), ["a", "b"]);
        assert!(w.unregister("a", b"k"));
        assert!(!w.unregister("a", b"k"));
        assert!(!w.unregister("zz", b"k"));
        assert_eq!(ids(&w, b"k"), ["b"]);
        assert_eq!(w.len(), 1);
    }

    #[test]
    fn a_closed_connection_only_drops_its_own_registrations() {
        let mut w = Watchers::default();
        w.register("a", 1, b"old", &count_limit(10)).unwrap();
        w.register("a", 1, b"both", &count_limit(10)).unwrap();
        // The client reconnects (connection 2) before connection 1's clean-up ran.
        w.register("a", 2, b"both", &count_limit(10)).unwrap();
        w.register("a", 2, b"new", &count_limit(10)).unwrap();
        assert_eq!(w.connection_closed("a", 1), 1);
        assert!(w.of_key(b"old").is_empty());
        assert_eq!(ids(&w, b"both"), ["a"]);
        assert_eq!(ids(&w, b"new"), ["a"]);
        assert_eq!(w.connection_closed("a", 2), 2);
        assert!(w.is_empty());
        assert_eq!(w.connection_closed("a", 2), 0);
    }

    #[test]
    fn per_client_limit() {
        let mut w = Watchers::default();
        w.register("a", 1, b"1", &count_limit(2)).unwrap();
        w.register("a", 1, b"2", &count_limit(2)).unwrap();
        assert_eq!(
            w.register("a", 1, b"3", &count_limit(2)),
            Err(TooManyWatches)
        );
        w.register("a", 1, b"2", &count_limit(2)).unwrap();
        w.register("b", 1, b"3", &count_limit(2)).unwrap();
        assert_eq!(
            w.register("c", 1, b"3", &count_limit(0)),
            Err(TooManyWatches)
        );
    }

    #[test]
    fn byte_and_total_limits() {
        let limits = WatchLimits {
            per_client: 100,
            per_client_bytes: 10,
            total: 3,
            total_bytes: 15,
        };
        let mut w = Watchers::default();
        w.register("a", 1, b"123456", &limits).unwrap();
        assert_eq!(
            w.register("a", 1, b"12345", &limits),
            Err(TooManyWatches),
            "11 key bytes for one client"
        );
        w.register("a", 1, b"1234", &limits).unwrap();
        assert_eq!(w.bytes(), 10);
        assert_eq!(
            w.register("b", 1, b"123456", &limits),
            Err(TooManyWatches),
            "16 key bytes in all"
        );
        w.register("b", 1, b"x", &limits).unwrap();
        assert_eq!(
            w.register("c", 1, b"y", &limits),
            Err(TooManyWatches),
            "4 in all"
        );
        // Registering again costs nothing; ending frees the room.
        w.register("a", 2, b"1234", &limits).unwrap();
        assert_eq!(w.connection_closed("a", 2), 1);
        assert_eq!((w.len(), w.bytes()), (2, 7));
        w.register("c", 1, b"y", &limits).unwrap();
    }

    #[test]
    fn set_payload() {
        let n = Notice {
            key: b"k".to_vec(),
            event: Event::Set(b"v\r\n".to_vec()),
            version: String::new(),
            watchers: vec![],
        };
        assert_eq!(
            n.payload(),
            b"*4\r\n$6\r\nNOTIFY\r\n$3\r\nSET\r\n$5\r\nVALUE\r\n$3\r\nv\r\n\r\n"
        );
    }
}
