//! Wildcard and shared subscriptions in a tree of topic levels: a topic is
//! matched against the filters along its own levels (and the `+` and `#`
//! branches beside them), not against every wildcard filter of every
//! client (statebroker patch 16; moved here from the broker's subscription
//! mirror, which it served). Each state store answer asks whether its
//! requester is the only subscriber of its response topic; with every
//! wildcard filter scanned, 1,000 unrelated `sensors/<i>/+` subscriptions
//! took 64 connections from 87,500 to 24,300 requests/s, and 10,000 filters
//! under the response topics' own first level (`bench/wild/<i>/+`) to 1,700.

use std::collections::{HashMap, HashSet};
use std::str::Split;
use std::sync::Arc;

/// Whether `filter` belongs here (a wildcard or a shared subscription)
/// rather than among the exact filters.
pub(crate) fn is_wild(filter: &str) -> bool {
    crate::protocol::has_wildcards(filter) || filter.starts_with("$share/")
}

/// `filter` without its `$share/{group}/` prefix.
pub(crate) fn bare(filter: &str) -> &str {
    filter
        .strip_prefix("$share/")
        .and_then(|rest| rest.split_once('/'))
        .map_or(filter, |(_, f)| f)
}

/// Filters with wildcards, and shared ones, with their clients: each
/// stored at the node its (bare) levels lead to.
#[derive(Debug, Default)]
pub(crate) struct WildFilters {
    root: Node,
}

#[derive(Debug, Default)]
struct Node {
    /// By the next level: a name, `+` or `#`.
    children: HashMap<String, Node>,
    /// The filters that end here (as subscribed, with their clients): a
    /// set, so that one leaves at once however many share the node (with
    /// 200,000 kept sessions on `fleet/+/config`, each session ended
    /// scanned them all; statebroker patch 24).
    filters: HashSet<(String, Arc<str>)>,
}

impl Node {
    fn is_empty(&self) -> bool {
        self.children.is_empty() && self.filters.is_empty()
    }

    /// Removes the entry at the end of `levels`; prunes emptied nodes.
    fn remove(&mut self, levels: &[&str], filter: &str, client: &Arc<str>) {
        match levels.split_first() {
            None => {
                self.filters
                    .remove(&(filter.to_owned(), Arc::clone(client)));
            }
            Some((level, rest)) => {
                if let Some(child) = self.children.get_mut(*level) {
                    child.remove(rest, filter, client);
                    if child.is_empty() {
                        self.children.remove(*level);
                    }
                }
            }
        }
    }

    /// Adds the filters under this node that can match the rest of a
    /// topic, `levels`.
    fn collect<'a>(&'a self, mut levels: Split<'_, char>, out: &mut Vec<&'a (String, Arc<str>)>) {
        // `#` matches the rest, and the parent level alone ("a/#" matches "a").
        if let Some(any) = self.children.get("#") {
            out.extend(&any.filters);
        }
        match levels.next() {
            None => out.extend(&self.filters),
            Some(level) => {
                if let Some(child) = self.children.get(level) {
                    child.collect(levels.clone(), out);
                }
                if level != "+"
                    && let Some(child) = self.children.get("+")
                {
                    child.collect(levels, out);
                }
            }
        }
    }
}

impl WildFilters {
    pub fn insert(&mut self, filter: &str, client: &Arc<str>) {
        let mut node = &mut self.root;
        for level in bare(filter).split('/') {
            node = node.children.entry(level.to_owned()).or_default();
        }
        node.filters.insert((filter.to_owned(), Arc::clone(client)));
    }

    pub fn remove(&mut self, filter: &str, client: &Arc<str>) {
        let levels: Vec<&str> = bare(filter).split('/').collect();
        self.root.remove(&levels, filter, client);
    }

    /// The filters (and their clients) that may match `topic`: those along
    /// its levels. A superset: callers still match each (the tree knows
    /// nothing of `$` topics, which no leading wildcard matches).
    pub fn candidates<'a>(&'a self, topic: &str) -> Vec<&'a (String, Arc<str>)> {
        let mut out = Vec::new();
        if !self.root.is_empty() {
            self.root.collect(topic.split('/'), &mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol;

    fn matching(index: &WildFilters, topic: &str) -> Vec<String> {
        let mut found: Vec<String> = index
            .candidates(topic)
            .into_iter()
            .filter(|(f, _)| protocol::matches(topic, bare(f)))
            .map(|(f, c)| format!("{c}:{f}"))
            .collect();
        found.sort();
        found
    }

    #[test]
    fn a_topic_finds_every_filter_that_matches_it() {
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        let mut entries: Vec<(String, Arc<str>)> = [
            "sensors/+/t",
            "sensors/#",
            "+/1/t",
            "#",
            "$share/g/sensors/+/t",
            "$share/g/#",
            "other/+",
            "+/+",
            "$SYS/#",
        ]
        .iter()
        .map(|f| (f.to_string(), Arc::clone(&a)))
        .collect();
        entries.push(("sensors/#".into(), Arc::clone(&b)));
        let mut index = WildFilters::default();
        for (f, c) in &entries {
            index.insert(f, c);
        }
        let topics = [
            "sensors/1/t",
            "sensors/1/t/x",
            "other/x",
            "nothing/here",
            "sensors",
            "x",
            "$SYS/uptime",
            "a//b",
        ];
        // Against a scan of every filter: the same answer for each topic.
        let agree = |index: &WildFilters, entries: &[(String, Arc<str>)]| {
            for topic in topics {
                let mut scanned: Vec<String> = entries
                    .iter()
                    .filter(|(f, _)| protocol::matches(topic, bare(f)))
                    .map(|(f, c)| format!("{c}:{f}"))
                    .collect();
                scanned.sort();
                assert_eq!(matching(index, topic), scanned, "{topic}");
            }
        };
        agree(&index, &entries);
        assert_eq!(
            index.candidates("nothing/here/at/all").len(),
            2,
            "only # and $share/g/#"
        );
        for (f, c) in [("sensors/#", &a), ("sensors/+/t", &a), ("+/+", &a)] {
            index.remove(f, c);
            entries.retain(|(ef, ec)| !(ef == f && ec == c));
            agree(&index, &entries);
        }
        index.remove("sensors/#", &b);
        index.remove("$share/g/sensors/+/t", &a);
        assert!(
            !index.root.children.contains_key("sensors"),
            "emptied branches go"
        );
    }
}
