use serde::{Deserialize, Serialize};

use crate::protocol::PublishProperties;

/// A User Property of a publish: the shared subscription it names
/// (`$share/g/filter`) does not get it here; one property per group
/// (statebroker patch 28). A cluster node marks so the groups another
/// node delivers the message to. Never delivered: the router removes it.
pub const NOT_FOR_GROUP: &str = "statebroker:not-for-group";

/// Whether a publish with `properties` is marked not for `group`.
pub(crate) fn not_for(properties: Option<&PublishProperties>, group: &str) -> bool {
    properties.is_some_and(|p| {
        p.user_properties
            .iter()
            .any(|(k, v)| k == NOT_FOR_GROUP && v == group)
    })
}

/// Removes the [`NOT_FOR_GROUP`] marks before delivery.
pub(crate) fn unmark(properties: &mut Option<PublishProperties>) {
    if let Some(p) = properties
        && !p.user_properties.is_empty()
    {
        p.user_properties.retain(|(k, _)| k != NOT_FOR_GROUP);
    }
}

pub struct SharedGroup {
    // using Vec over HashSet for maintaining order of iter
    clients: Vec<String>,
    // Index into clients, allows us to skip doing iter everytime
    current_client_index: usize,
    pub cursor: (u64, u64),
    pub strategy: Strategy,
}

impl SharedGroup {
    pub fn new(cursor: (u64, u64), strategy: Strategy) -> Self {
        SharedGroup {
            clients: vec![],
            current_client_index: 0,
            cursor,
            strategy,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.clients.is_empty()
    }

    pub fn current_client(&self) -> Option<&String> {
        self.clients.get(self.current_client_index)
    }

    /// Adds `client` to the members (once: subscribing again changes
    /// nothing here).
    pub fn add_client(&mut self, client: String) {
        if !self.clients.contains(&client) {
            self.clients.push(client)
        }
    }

    pub fn remove_client(&mut self, client: &str) {
        // remove client from vec
        self.clients.retain(|c| c != client);

        // if there are no clients left, we have to avoid % by 0
        if !self.clients.is_empty() {
            // Make sure that we are within bounds and that next client is the correct client.
            self.current_client_index %= self.clients.len();
        }
    }

    pub fn update_next_client(&mut self) {
        match self.strategy {
            Strategy::RoundRobin => {
                self.current_client_index = (self.current_client_index + 1) % self.clients.len();
            }
            Strategy::Random => {
                self.current_client_index = fastrand::usize(0..self.clients.len());
            }
            Strategy::Sticky => {}
        }
    }
}

#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    #[default]
    RoundRobin,
    Random,
    Sticky,
}

#[cfg(test)]
mod tests {
    use crate::router::shared_subs::Strategy;

    use super::SharedGroup;

    #[test]
    fn performs_round_robin() {
        let mut group = SharedGroup {
            clients: vec!["A".into(), "B".into(), "C".into()],
            current_client_index: 0,
            cursor: (0, 0),
            strategy: Strategy::RoundRobin,
        };
        group.update_next_client();
        assert_eq!(group.current_client_index, 1);
        group.update_next_client();
        assert_eq!(group.current_client_index, 2);
        group.update_next_client();
        assert_eq!(group.current_client_index, 0);
        group.add_client("D".into());
        assert_eq!(group.current_client_index, 0);
    }

    #[test]
    fn handles_round_robin_when_start_removed() {
        // [ A, B, C ] => 0
        // we remove A
        // [ B, C ] => Should be the next client (B)
        let mut group = SharedGroup {
            clients: vec!["A".into(), "B".into(), "C".into()],
            current_client_index: 0,
            cursor: (0, 0),
            strategy: Strategy::RoundRobin,
        };
        group.remove_client("A");
        assert_eq!(group.current_client_index, 0);
        group.update_next_client();
        assert_eq!(group.current_client_index, 1);
        group.update_next_client();
        assert_eq!(group.current_client_index, 0);
    }

    #[test]
    fn handles_round_robin_when_last_removed() {
        // [ A, B, C ] => 2 (C)
        // we remove C
        // [ A, B ] => Should be the next client (A)
        let mut group = SharedGroup {
            clients: vec!["A".into(), "B".into(), "C".into()],
            current_client_index: 0,
            cursor: (0, 0),
            strategy: Strategy::RoundRobin,
        };
        group.update_next_client();
        assert_eq!(group.current_client_index, 1);
        group.update_next_client();
        assert_eq!(group.current_client_index, 2);
        group.remove_client("C");
        assert_eq!(group.current_client_index, 0);
    }
}
