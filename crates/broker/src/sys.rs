//! The `$SYS` topics: the broker's statistics, published every
//! `[broker] sys_interval` seconds (default 10; 0: never) as retained QoS 0
//! messages, under mosquitto's names where one applies, so tools written
//! for mosquitto read them unchanged.
//!
//! Clients may subscribe to `$SYS/...` (a filter starting with a wildcard,
//! such as `#`, does not match it: MQTT 5 §4.7.2) but not publish there.
//!
//! | topic | value |
//! |---|---|
//! | `$SYS/broker/version` | `statebroker 0.1.0` |
//! | `$SYS/broker/uptime` | `N seconds` |
//! | `$SYS/broker/clients/connected` | clients connected now |
//! | `$SYS/broker/clients/disconnected` | persistent sessions without a connection |
//! | `$SYS/broker/clients/total` | both |
//! | `$SYS/broker/messages/received`, `.../sent` | PUBLISH packets (mosquitto counts every packet here) |
//! | `$SYS/broker/publish/messages/received`, `.../sent` | PUBLISH packets |
//! | `$SYS/broker/bytes/received`, `.../sent` | payload bytes received; PUBLISH packet bytes sent |
//! | `$SYS/broker/subscriptions/count` | subscriptions, kept sessions' included |
//! | `$SYS/broker/retained messages/count` | retained messages (these included) |
//! | `$SYS/broker/store/keys`, `.../bytes`, `.../watches` | the state store: keys, bytes of keys and values, KEYNOTIFY registrations |
//! | `$SYS/broker/store/expired` | keys removed because their expiry passed |
//!
//! Counters are process-wide (several brokers in one test process share
//! them); the rest are this broker's.

use std::sync::Arc;
use std::time::Duration;

use crate::shared::Shared;
use crate::stats::Snapshot;

use crate::topics::SYS_PREFIX;

/// The messages for `now`.
pub fn messages(now: &Snapshot) -> Vec<(String, String)> {
    let c = &now.census;
    let t = &now.totals;
    let disconnected = c.clients.saturating_sub(c.connected);
    [
        (
            "version",
            format!("statebroker {}", env!("CARGO_PKG_VERSION")),
        ),
        ("uptime", format!("{} seconds", now.uptime.as_secs())),
        ("clients/connected", c.connected.to_string()),
        ("clients/disconnected", disconnected.to_string()),
        ("clients/total", c.clients.to_string()),
        ("messages/received", t.messages_received.to_string()),
        ("messages/sent", t.messages_sent.to_string()),
        ("publish/messages/received", t.messages_received.to_string()),
        ("publish/messages/sent", t.messages_sent.to_string()),
        ("bytes/received", t.bytes_received.to_string()),
        ("bytes/sent", t.bytes_sent.to_string()),
        ("subscriptions/count", c.subscriptions.to_string()),
        ("retained messages/count", now.retained.to_string()),
        ("store/keys", now.keys.to_string()),
        ("store/bytes", now.key_bytes.to_string()),
        ("store/watches", now.watches.to_string()),
        ("store/expired", t.keys_expired.to_string()),
    ]
    .into_iter()
    .map(|(name, value)| (format!("{SYS_PREFIX}broker/{name}"), value))
    .collect()
}

/// Publishes the `$SYS` topics every `interval` until the broker stops.
pub(crate) async fn publish_every(shared: Arc<Shared>, interval: Duration) {
    let mut shutdown = shared.shutdown.clone();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        let now = crate::stats::sample(&shared);
        shared.publisher.publish_retained(messages(&now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topics::is_sys_topic;

    #[test]
    fn names_and_values() {
        let mut now = Snapshot::default();
        now.census.clients = 5;
        now.census.connected = 3;
        now.uptime = Duration::from_secs(42);
        now.totals.messages_received = 7;
        let messages = messages(&now);
        let value = |topic: &str| {
            messages
                .iter()
                .find(|(t, _)| t == topic)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(value("$SYS/broker/uptime"), Some("42 seconds"));
        assert_eq!(value("$SYS/broker/clients/connected"), Some("3"));
        assert_eq!(value("$SYS/broker/clients/disconnected"), Some("2"));
        assert_eq!(value("$SYS/broker/clients/total"), Some("5"));
        assert_eq!(value("$SYS/broker/messages/received"), Some("7"));
        assert!(
            value("$SYS/broker/version")
                .unwrap()
                .starts_with("statebroker ")
        );
        assert!(messages.iter().all(|(t, _)| is_sys_topic(t)));
        assert!(!is_sys_topic("$SYSTEM/x") && !is_sys_topic("a/$SYS/x"));
    }
}
