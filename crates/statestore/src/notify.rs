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
    /// client id -> (key -> connection that registered it)
    by_client: HashMap<Arc<str>, HashMap<Box<[u8]>, u64>>,
}

/// A registration refused because the client has too many.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooManyWatches;

impl Watchers {
    /// Registers `client` (on `connection`) for changes of `key`. Registering
    /// again is not an error; it moves the registration to `connection`.
    pub fn register(
        &mut self,
        client: &str,
        connection: u64,
        key: &[u8],
        max_per_client: usize,
    ) -> Result<(), TooManyWatches> {
        let client_id = match self.by_client.get_key_value(client) {
            Some((id, _)) => id.clone(),
            None if max_per_client == 0 => return Err(TooManyWatches),
            None => Arc::from(client),
        };
        let keys = self.by_client.entry(client_id.clone()).or_default();
        if let Some(conn) = keys.get_mut(key) {
            *conn = connection;
            return Ok(());
        }
        if keys.len() >= max_per_client {
            return Err(TooManyWatches);
        }
        keys.insert(key.into(), connection);
        self.by_key.entry(key.into()).or_default().push(client_id);
        Ok(())
    }

    /// Removes `client`'s registration for `key`; `false` if there was none.
    pub fn unregister(&mut self, client: &str, key: &[u8]) -> bool {
        let Some(keys) = self.by_client.get_mut(client) else {
            return false;
        };
        if keys.remove(key).is_none() {
            return false;
        }
        if keys.is_empty() {
            self.by_client.remove(client);
        }
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
        let Some(keys) = self.by_client.get_mut(client) else {
            return 0;
        };
        let gone: Vec<Box<[u8]>> = keys
            .iter()
            .filter(|&(_, &conn)| conn == connection)
            .map(|(key, _)| key.clone())
            .collect();
        for key in &gone {
            keys.remove(key);
        }
        if keys.is_empty() {
            self.by_client.remove(client);
        }
        for key in &gone {
            self.remove_from_key(client, key);
        }
        gone.len()
    }

    /// The client ids watching `key`.
    pub fn of_key(&self, key: &[u8]) -> &[Arc<str>] {
        self.by_key.get(key).map_or(&[], Vec::as_slice)
    }

    /// Number of registrations in all.
    pub fn len(&self) -> usize {
        self.by_client.values().map(HashMap::len).sum()
    }

    /// Whether there are no registrations.
    pub fn is_empty(&self) -> bool {
        self.by_client.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(w: &Watchers, key: &[u8]) -> Vec<String> {
        let mut v: Vec<String> = w.of_key(key).iter().map(|c| c.to_string()).collect();
        v.sort();
        v
    }

    #[test]
    fn register_unregister() {
        let mut w = Watchers::default();
        w.register("a", 1, b"k", 10).unwrap();
        w.register("a", 1, b"k", 10).unwrap();
        w.register("b", 2, b"k", 10).unwrap();
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
        w.register("a", 1, b"old", 10).unwrap();
        w.register("a", 1, b"both", 10).unwrap();
        // The client reconnects (connection 2) before connection 1's clean-up ran.
        w.register("a", 2, b"both", 10).unwrap();
        w.register("a", 2, b"new", 10).unwrap();
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
        w.register("a", 1, b"1", 2).unwrap();
        w.register("a", 1, b"2", 2).unwrap();
        assert_eq!(w.register("a", 1, b"3", 2), Err(TooManyWatches));
        w.register("a", 1, b"2", 2).unwrap();
        w.register("b", 1, b"3", 2).unwrap();
        assert_eq!(w.register("c", 1, b"3", 0), Err(TooManyWatches));
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
