//! What the broker writes on a message for its own use while the message
//! is in the router: MQTT 5 user properties with names that clients cannot
//! use (removed from every client's publish on arrival, and from every
//! delivery before it is written).
//!
//! - `$statebroker/queued`: the number under which the message is saved
//!   for the persistent sessions it reaches; a session's copy is removed
//!   when its client acknowledges the delivery.
//! - `$statebroker/topic` and `$statebroker/ids`: on a message given back
//!   after a restart through [`crate::topics::restored_topic`], its own
//!   topic and the subscription identifiers it is delivered with.

use bytes::Bytes;
use router::protocol::{Publish, PublishProperties};

use crate::topics;

/// The prefix of the broker's own user properties.
const PREFIX: &str = "$statebroker/";
const QUEUED: &str = "$statebroker/queued";
const TOPIC: &str = "$statebroker/topic";
const IDS: &str = "$statebroker/ids";

/// Removes the broker's own user properties from a client's publish, so
/// nobody can forge them.
pub fn strip(properties: &mut Option<PublishProperties>) {
    if let Some(p) = properties
        && p.user_properties.iter().any(|(k, _)| k.starts_with(PREFIX))
    {
        p.user_properties.retain(|(k, _)| !k.starts_with(PREFIX));
    }
}

/// Marks a publish as saved under number `seq`.
pub fn mark(properties: &mut Option<PublishProperties>, seq: u64) {
    properties
        .get_or_insert_with(PublishProperties::default)
        .user_properties
        .push((QUEUED.to_owned(), seq.to_string()));
}

/// Marks a message given back after a restart: its own `topic`, and the
/// subscription identifiers `ids` it is delivered with.
pub(super) fn mark_restored(properties: &mut PublishProperties, topic: &[u8], ids: &[usize]) {
    properties.user_properties.push((
        TOPIC.to_owned(),
        String::from_utf8_lossy(topic).into_owned(),
    ));
    if !ids.is_empty() {
        let ids: Vec<String> = ids.iter().map(usize::to_string).collect();
        properties
            .user_properties
            .push((IDS.to_owned(), ids.join(",")));
    }
}

/// What the marks on a delivery said.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Marks {
    /// The number the message is saved under, if it is.
    pub queued: Option<u64>,
    /// The message was given back after a restart (its topic is restored).
    pub restored: bool,
}

/// Takes the broker's marks off a delivery to the client `own_hex`; a
/// message given back after a restart gets its own topic and subscription
/// identifiers back.
pub fn take(
    publish: &mut Publish,
    properties: &mut Option<PublishProperties>,
    own_hex: &str,
) -> Marks {
    let mut marks = Marks::default();
    let Some(p) = properties else {
        return marks;
    };
    if !p.user_properties.iter().any(|(k, _)| k.starts_with(PREFIX)) {
        return marks;
    }
    let restoring = std::str::from_utf8(&publish.topic)
        .is_ok_and(|topic| topics::is_restored_topic(topic, own_hex));
    for (key, value) in std::mem::take(&mut p.user_properties) {
        match key.as_str() {
            QUEUED => marks.queued = value.parse().ok(),
            TOPIC if restoring => {
                publish.topic = Bytes::from(value.into_bytes());
                marks.restored = true;
            }
            IDS if restoring => p
                .subscription_identifiers
                .extend(value.split(',').filter_map(|id| id.parse::<usize>().ok())),
            _ if key.starts_with(PREFIX) => {}
            _ => p.user_properties.push((key, value)),
        }
    }
    if p == &PublishProperties::default() {
        *properties = None;
    }
    marks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clients_own_marks_are_removed() {
        let mut props = Some(PublishProperties {
            user_properties: vec![
                (QUEUED.into(), "7".into()),
                ("a".into(), "b".into()),
                (TOPIC.into(), "elsewhere".into()),
            ],
            ..PublishProperties::default()
        });
        strip(&mut props);
        assert_eq!(
            props.unwrap().user_properties,
            vec![("a".into(), "b".into())]
        );
    }

    #[test]
    fn marks_are_taken_off_and_restored_messages_get_their_topic_back() {
        let own = hex::encode_upper("c1");
        let mut publish = crate::codec::publish(b"t/1", b"x", 1, 3, false);
        let mut props = None;
        mark(&mut props, 42);
        assert_eq!(
            take(&mut publish, &mut props, &own),
            Marks {
                queued: Some(42),
                restored: false
            }
        );
        assert_eq!(props, None, "nothing of the broker's is left");

        let mut restored =
            crate::codec::publish(topics::restored_topic("c1").as_bytes(), b"x", 1, 4, false);
        let mut p = PublishProperties {
            user_properties: vec![("k".into(), "v".into())],
            ..PublishProperties::default()
        };
        mark_restored(&mut p, b"sensors/1", &[5, 9]);
        let mut props = Some(p);
        mark(&mut props, 43);
        let marks = take(&mut restored, &mut props, &own);
        assert_eq!(
            marks,
            Marks {
                queued: Some(43),
                restored: true
            }
        );
        assert_eq!(&restored.topic[..], b"sensors/1");
        let props = props.unwrap();
        assert_eq!(props.subscription_identifiers, vec![5, 9]);
        assert_eq!(props.user_properties, vec![("k".into(), "v".into())]);

        // Another client's restore topic is never rewritten.
        let mut other =
            crate::codec::publish(topics::restored_topic("c2").as_bytes(), b"x", 1, 4, false);
        let mut p = PublishProperties::default();
        mark_restored(&mut p, b"sensors/1", &[]);
        let marks = take(&mut other, &mut Some(p), &own);
        assert!(!marks.restored);
        assert_eq!(other.topic, topics::restored_topic("c2").as_bytes());
    }
}
