//! The topics the broker treats specially, and the rules about them.
//!
//! - Requests to the state store arrive on [`REQUEST_TOPIC`] (and, when the
//!   2023 protocol is on, on [`LEGACY_REQUEST_TOPIC`]). They are served in
//!   process and never routed to subscribers.
//! - Notifications go out on `clients/statestore/v1/{GUID}/{HEX(clientId)}/command/notify/{HEX(key)}`.
//!   That namespace ([`NOTIFY_NAMESPACE`]) belongs to the store: no client
//!   may publish into it, subscribe to another client's part of it by name,
//!   or receive another client's notifications through a wildcard.
//! - A request whose Response Topic is a request topic, lies in
//!   `clients/statestore/v1/{GUID}…` or in `$SYS/` is an attempt to make the
//!   store publish where only it (or the broker) may: the client is
//!   disconnected. A will on such a topic refuses the CONNECT.

/// The state store's request topic.
pub const REQUEST_TOPIC: &str = "statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke";

/// The request topic of the 2023 protocol.
pub const LEGACY_REQUEST_TOPIC: &str = "$services/statestore/_any_/command/invoke/request";

/// The notification namespace (without the trailing `/`): the store's.
pub use statestore::notify::NOTIFY_NAMESPACE;

/// The topic on which `client_id` hears about `key`: the namespace, then
/// both in upper-case hex (`c1` and `k\0`: `.../6331/command/notify/6B00`).
pub fn notification_topic(client_id: &str, key: &[u8]) -> String {
    format!(
        "{NOTIFY_NAMESPACE}/{}/command/notify/{}",
        hex::encode_upper(client_id),
        hex::encode_upper(key)
    )
}

/// Where the broker's `$SYS` topics start.
pub const SYS_PREFIX: &str = "$SYS/";

/// Whether `topic` is one of the broker's `$SYS` topics (see
/// [`crate::sys`]).
pub fn is_sys_topic(topic: &str) -> bool {
    topic.starts_with(SYS_PREFIX)
}

/// Whether a request may not use `topic` as its Response Topic (nor a
/// will as its topic): the broker's own topics, where an answer (or a
/// will) would pass for the broker's word.
pub fn is_reserved_response_topic(topic: &str) -> bool {
    topic == REQUEST_TOPIC
        || topic == LEGACY_REQUEST_TOPIC
        || topic.starts_with(NOTIFY_NAMESPACE)
        || is_sys_topic(topic)
}

/// Whether `topic` is in the store's notification namespace.
pub fn in_notify_namespace(topic: &str) -> bool {
    topic
        .strip_prefix(NOTIFY_NAMESPACE)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// For a topic in the notification namespace, the hex client id it is for.
pub fn notify_owner(topic: &str) -> Option<&str> {
    let rest = topic.strip_prefix(NOTIFY_NAMESPACE)?.strip_prefix('/')?;
    Some(rest.split('/').next().unwrap_or(rest))
}

/// Whether a client whose id hex-encodes to `own_hex` may subscribe to
/// `filter` by name. Filters that reach into the namespace only through a
/// wildcard are allowed; what they would deliver of other clients'
/// notifications is dropped at delivery ([`may_receive`]).
pub fn may_subscribe(filter: &str, own_hex: &str) -> bool {
    // A shared subscription's filter starts after `$share/{group}/`.
    let filter = match filter.strip_prefix("$share/") {
        Some(rest) => rest.split_once('/').map_or("", |(_, f)| f),
        None => filter,
    };
    let mut levels = filter.split('/');
    for expected in NOTIFY_NAMESPACE.split('/') {
        match levels.next() {
            Some(level) if level == expected => {}
            _ => return true, // not literally inside the namespace
        }
    }
    match levels.next() {
        Some("+" | "#") | None => true,
        Some(client) => client == own_hex,
    }
}

/// Whether a publish on `topic` may be delivered to the client `own_hex`.
pub fn may_receive(topic: &str, own_hex: &str) -> bool {
    notify_owner(topic).is_none_or(|owner| owner == own_hex)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWN: &str = "6331"; // "c1"

    #[test]
    fn reserved_response_topics() {
        assert!(is_reserved_response_topic(REQUEST_TOPIC));
        assert!(is_reserved_response_topic(LEGACY_REQUEST_TOPIC));
        assert!(is_reserved_response_topic(NOTIFY_NAMESPACE));
        assert!(is_reserved_response_topic(&format!("{NOTIFY_NAMESPACE}/x")));
        assert!(is_reserved_response_topic(&format!(
            "{NOTIFY_NAMESPACE}-suffix"
        )));
        assert!(!is_reserved_response_topic(
            "clients/c1/services/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke/response"
        ));
    }

    #[test]
    fn subscriptions() {
        let ns = NOTIFY_NAMESPACE;
        assert!(may_subscribe(&format!("{ns}/{OWN}/command/notify/+"), OWN));
        assert!(may_subscribe(&format!("{ns}/{OWN}/#"), OWN));
        assert!(!may_subscribe(&format!("{ns}/6332/command/notify/+"), OWN));
        assert!(!may_subscribe(&format!("$share/g/{ns}/6332/#"), OWN));
        // Wildcards are allowed, filtered at delivery.
        assert!(may_subscribe(&format!("{ns}/+/command/notify/+"), OWN));
        assert!(may_subscribe(&format!("{ns}/#"), OWN));
        assert!(may_subscribe("#", OWN));
        assert!(may_subscribe("clients/+/v1/#", OWN));
        assert!(may_subscribe("sensors/temp", OWN));
    }

    #[test]
    fn notification_topics_name_client_and_key_in_hex() {
        assert_eq!(
            notification_topic("c1", b"k\x00"),
            "clients/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/6331/command/notify/6B00",
        );
    }

    #[test]
    fn delivery() {
        let ns = NOTIFY_NAMESPACE;
        assert!(may_receive(&format!("{ns}/{OWN}/command/notify/6B"), OWN));
        assert!(!may_receive(&format!("{ns}/6332/command/notify/6B"), OWN));
        assert!(may_receive("sensors/temp", OWN));
        assert!(in_notify_namespace(&format!("{ns}/x")));
        assert!(!in_notify_namespace(&format!("{ns}x")));
    }
}
