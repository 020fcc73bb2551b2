//! How a store behaves: its node id, clock-skew allowance, SCAN page size,
//! quotas, and which keys it persists without being asked.

use crate::persist::PersistPolicy;

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
    /// Bytes of key names one client's KEYNOTIFY registrations may hold.
    pub max_watch_bytes_per_client: usize,
    /// KEYNOTIFY registrations of one user: all the connections and client
    /// ids counted against one [`crate::Caller::owner`] together.
    pub max_watches_per_user: usize,
    /// Bytes of key names of one user's KEYNOTIFY registrations.
    pub max_watch_bytes_per_user: usize,
    /// KEYNOTIFY registrations of all clients.
    pub max_watches: usize,
    /// Bytes of key names of all KEYNOTIFY registrations.
    pub max_watch_bytes: usize,
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
            max_watch_bytes_per_client: 1 << 20,
            // A tenth of the registrations and an eighth of the bytes of
            // the totals: no user takes more.
            max_watches_per_user: 100_000,
            max_watch_bytes_per_user: 32 << 20,
            max_watches: 1_000_000,
            max_watch_bytes: 256 << 20,
            persist_policy: PersistPolicy::default(),
            clock_lease_ms: None,
        }
    }
}
