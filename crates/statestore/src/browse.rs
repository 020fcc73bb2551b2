//! A read-only view of the keys for people and tools (the broker's web
//! view): a page of keys matching a glob, each with its value, version,
//! expiry, fencing token, whether it is persisted, and who watches it.
//!
//! Not part of the protocol: clients list keys with SCAN. Like SCAN, a
//! page walks a bounded number of slots and spends a bounded number of
//! glob steps, so the store's lock is held for a bounded time however
//! sparse the matches and however costly the pattern; `next` resumes.

use crate::KeyAccess;
use crate::command::STEPS_PER_PAGE;
use crate::glob::Pattern;
use crate::store::Store;

/// Slots one page may walk, per key it may return.
const SLOTS_PER_KEY: usize = 64;

/// Bytes of its value a key on a page shows at most ([`KeyView::value_len`]
/// says how long the whole is): a page of large values is neither copied
/// under the store's lock nor sent whole.
pub const VALUE_SHOWN: usize = 1024;

/// Bytes of keys one page holds at most (but always its first key).
pub const KEY_BYTES_PER_PAGE: usize = 256 << 10;

/// One key as the view shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyView {
    /// The key.
    pub key: Vec<u8>,
    /// Its value (on a page of [`Store::browse`], its first
    /// [`VALUE_SHOWN`] bytes).
    pub value: Vec<u8>,
    /// The length of the whole value.
    pub value_len: usize,
    /// Its version, in wire form.
    pub version: String,
    /// When it expires, milliseconds since the Unix epoch.
    pub expires_at_ms: Option<u64>,
    /// The fencing token protecting it, in wire form.
    pub fencing_token: Option<String>,
    /// Whether it is kept on disk.
    pub persisted: bool,
    /// Client ids with a KEYNOTIFY registration on it.
    pub watchers: Vec<String>,
}

/// A page of [`KeyView`]s.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Page {
    /// The keys.
    pub keys: Vec<KeyView>,
    /// Where the next page starts; `None` after the last.
    pub next: Option<usize>,
}

impl Store {
    /// Up to `limit` keys matching `pattern` from position `start` (0 for
    /// the first page), of those `access` lets the viewer read (`None`:
    /// all), each with the first [`VALUE_SHOWN`] bytes of its value; at
    /// most [`KEY_BYTES_PER_PAGE`] of keys.
    pub fn browse(
        &self,
        pattern: &[u8],
        start: usize,
        limit: usize,
        access: Option<&dyn KeyAccess>,
    ) -> Page {
        let limit = limit.clamp(1, 1000);
        let (keys, next) = self.state.scan(
            start,
            limit,
            limit.saturating_mul(SLOTS_PER_KEY),
            STEPS_PER_PAGE,
            KEY_BYTES_PER_PAGE,
            &Pattern::new(pattern),
        );
        let keys = keys
            .into_iter()
            .filter(|key| access.is_none_or(|a| a.may_read(key)))
            .filter_map(|key| self.view_with(key, VALUE_SHOWN))
            .collect();
        Page { keys, next }
    }

    /// The client ids of this store's KEYNOTIFY registrations on `key`
    /// (on a cluster node, whose keys are in etcd: the registrations of
    /// that node's connections).
    pub fn watchers(&self, key: &[u8]) -> Vec<String> {
        self.state
            .watchers_of(key)
            .iter()
            .map(|w| w.to_string())
            .collect()
    }

    /// One key as the view shows it, if it exists (for tools and test
    /// kits: a read that is not a request, so no version is handed out).
    pub fn view(&self, key: impl Into<Vec<u8>>) -> Option<KeyView> {
        self.view_with(key.into(), usize::MAX)
    }

    /// [`Store::view`] with at most `shown` bytes of the value.
    fn view_with(&self, key: Vec<u8>, shown: usize) -> Option<KeyView> {
        let state = &self.state;
        let entry = state.get(&key)?;
        let value = entry.value();
        Some(KeyView {
            value: value[..value.len().min(shown)].to_vec(),
            value_len: value.len(),
            version: entry.version().format(&state.config().node_id).into(),
            expires_at_ms: entry.expires_at(),
            fencing_token: entry.fencing_token().map(ToString::to_string),
            persisted: entry.persisted(),
            watchers: self.watchers(&key),
            key,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::{Caller, Config, Dialect, Request, Store};

    fn run(store: &mut Store, args: &[&str], persist: bool) {
        let payload = crate::resp3::encode_request(args);
        let request = Request {
            payload: &payload,
            timestamp: Some("1700000000000:0:c"),
            fencing_token: None,
            persist,
            dialect: Dialect::V1,
            access: None,
        };
        let caller = Caller {
            client_id: "c1",
            connection: 1,
            owner: "c1",
        };
        let out = store.execute(&request, caller, 1_700_000_000_000);
        assert!(out.error.is_none(), "{args:?}: {:?}", out.error);
    }

    #[test]
    fn pages_of_matching_keys_with_their_details() {
        let mut store = Store::new(Config::default());
        run(&mut store, &["SET", "door", "open", "PX", "5000"], true);
        run(&mut store, &["KEYNOTIFY", "door"], false);
        for i in 0..5 {
            run(&mut store, &["SET", &format!("sensor-{i}"), "v"], false);
        }
        let page = store.browse(b"door", 0, 10, None);
        assert_eq!(page.keys.len(), 1);
        let door = &page.keys[0];
        assert_eq!(
            (door.key.as_slice(), door.value.as_slice()),
            (&b"door"[..], &b"open"[..])
        );
        assert_eq!(door.expires_at_ms, Some(1_700_000_005_000));
        assert!(door.persisted && door.version.ends_with(":statebroker"));
        assert_eq!(door.watchers, ["c1"]);

        let mut seen = Vec::new();
        let mut start = Some(0);
        while let Some(at) = start {
            let page = store.browse(b"sensor-*", at, 2, None);
            assert!(page.keys.len() <= 2);
            seen.extend(
                page.keys
                    .into_iter()
                    .map(|k| String::from_utf8(k.key).unwrap()),
            );
            start = page.next;
        }
        seen.sort();
        assert_eq!(
            seen,
            ["sensor-0", "sensor-1", "sensor-2", "sensor-3", "sensor-4"]
        );
    }

    /// Reads keys that start with `mine`.
    #[derive(Debug)]
    struct Mine;

    impl crate::KeyAccess for Mine {
        fn may_read(&self, key: &[u8]) -> bool {
            key.starts_with(b"mine")
        }
        fn may_write(&self, _: &[u8]) -> bool {
            false
        }
    }

    #[test]
    fn a_page_shows_what_the_viewer_may_read_and_the_start_of_large_values() {
        let mut store = Store::new(Config::default());
        let large = "x".repeat(super::VALUE_SHOWN * 3);
        run(&mut store, &["SET", "mine-large", &large], false);
        run(&mut store, &["SET", "theirs", "secret"], false);
        let page = store.browse(b"*", 0, 10, Some(&Mine));
        assert_eq!(page.keys.len(), 1, "{page:?}");
        let shown = &page.keys[0];
        assert_eq!(shown.key, b"mine-large");
        assert_eq!(shown.value, &large.as_bytes()[..super::VALUE_SHOWN]);
        assert_eq!(shown.value_len, large.len());
        // A key's whole value for tools.
        assert_eq!(
            store.view(&b"mine-large"[..]).unwrap().value,
            large.as_bytes()
        );
        assert_eq!(store.browse(b"*", 0, 10, None).keys.len(), 2);
    }
}
