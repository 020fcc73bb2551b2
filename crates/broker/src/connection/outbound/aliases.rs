//! Topic aliases of the router's publishes to one client.

use std::collections::HashMap;

use bytes::Bytes;
use router::protocol::Packet;

/// Topic aliases for the router's publishes to one client (MQTT 5
/// 3.3.2.3.4): the first publish of a topic carries the topic and a new
/// alias, the next ones the alias and an empty topic. Aliases go to the
/// first topics seen, up to the client's Topic Alias Maximum and
/// [`TopicAliases::MAX`] of them, and [`TopicAliases::MAX_BYTES`] of
/// topics (what one client can make the broker keep); later topics go
/// without. Only the router's publishes use them: they are written in the
/// order they are encoded, so a topic's first publish reaches the client
/// before those that use its alias.
#[derive(Debug, Default)]
pub(crate) struct TopicAliases {
    by_topic: HashMap<Bytes, u16>,
    /// The largest alias the client accepts, or our own bound.
    max: u16,
    bytes: usize,
}

impl TopicAliases {
    /// At most this many aliases per connection.
    pub const MAX: u16 = 64;
    /// At most this many bytes of aliased topics per connection.
    pub const MAX_BYTES: usize = 16 * 1024;

    pub(super) fn new(client_max: u16) -> TopicAliases {
        TopicAliases {
            by_topic: HashMap::new(),
            max: client_max.min(TopicAliases::MAX),
            bytes: 0,
        }
    }

    /// `publish` with its alias (and empty topic if the client knows the
    /// alias already); the topic when the alias is new (only if `may_add`:
    /// the publish is written at once).
    pub(super) fn apply(&mut self, publish: Packet, may_add: bool) -> (Packet, Option<Bytes>) {
        let Packet::Publish(mut publish, properties) = publish else {
            return (publish, None);
        };
        if self.max == 0 || publish.topic.is_empty() {
            return (Packet::Publish(publish, properties), None);
        }
        let mut properties = properties.unwrap_or_default();
        let (alias, new) = match self.by_topic.get(&publish.topic) {
            Some(&alias) => {
                publish.topic = Bytes::new();
                (alias, None)
            }
            None if may_add
                && self.by_topic.len() < usize::from(self.max)
                && self.bytes + publish.topic.len() <= TopicAliases::MAX_BYTES =>
            {
                let alias = self.by_topic.len() as u16 + 1;
                self.bytes += publish.topic.len();
                self.by_topic.insert(publish.topic.clone(), alias);
                (alias, Some(publish.topic.clone()))
            }
            None => return (Packet::Publish(publish, Some(properties)), None),
        };
        properties.topic_alias = Some(alias);
        (Packet::Publish(publish, Some(properties)), new)
    }

    /// Takes back the newest alias (its publish was not sent).
    pub(super) fn unassign(&mut self, topic: &Bytes) {
        if self.by_topic.remove(topic).is_some() {
            self.bytes -= topic.len();
        }
    }
}
