//! Reading a session's queued messages back from etcd: in pages at one
//! revision, in the order they were written; what cannot be read or has
//! expired is removed.

use std::collections::HashSet;

use etcd_client::{GetOptions, SortOrder, SortTarget};

use super::pending::Keys;
use super::{PAGE, Queue, Queued};
use crate::durable::format::decode_queued;

impl Queue {
    /// The messages kept in etcd for `client_id`, in the order they were
    /// written, each with its key (those that cannot be read, or have
    /// expired, are removed). Read in pages at one revision.
    pub async fn read(&self, client_id: &str) -> Result<Vec<Queued>, String> {
        let prefix = Keys::session(&self.cluster.settings.etcd_prefix, client_id);
        self.read_prefix(client_id, prefix).await
    }

    /// The same, of those node `node` wrote.
    pub async fn read_from(&self, client_id: &str, node: &str) -> Result<Vec<Queued>, String> {
        let prefix = Keys::node(&self.cluster.settings.etcd_prefix, client_id, node);
        self.read_prefix(client_id, prefix).await
    }

    async fn read_prefix(&self, client_id: &str, prefix: Vec<u8>) -> Result<Vec<Queued>, String> {
        let mut client = self.cluster.client.clone();
        let timeout = self.cluster.settings.request_timeout;
        let now = crate::clock::now_ms();
        let (mut revision, mut from) = (0, 0);
        let mut seen = HashSet::new();
        let mut messages = Vec::new();
        let mut gone = Vec::new();
        loop {
            let mut options = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend)
                .with_limit(PAGE)
                .with_min_create_revision(from);
            if revision > 0 {
                options = options.with_revision(revision);
            }
            let response = tokio::time::timeout(timeout, client.get(prefix.clone(), Some(options)))
                .await
                .map_err(|_| "etcd did not answer in time".to_owned())?
                .map_err(|e| e.to_string())?;
            if revision == 0 {
                revision = response.header().map_or(0, |h| h.revision());
            }
            let mut new = 0;
            for kv in response.kvs() {
                // A page starts at the last one's revision: keys written
                // together share it.
                from = kv.create_revision();
                if !seen.insert(kv.key().to_vec()) {
                    continue;
                }
                new += 1;
                match decode_queued(kv.value(), now) {
                    Ok(Some((message, in_flight))) => {
                        tracing::trace!(
                            client_id,
                            key = %String::from_utf8_lossy(kv.key()),
                            topic = %String::from_utf8_lossy(&message.publish.topic),
                            payload = %String::from_utf8_lossy(&message.publish.payload[..message.publish.payload.len().min(32)]),
                            in_flight = ?in_flight,
                            "clustering: a queued message read back from etcd"
                        );
                        let queued = Queued {
                            key: kv.key().to_vec(),
                            message,
                            in_flight,
                        };
                        messages.push((kv.create_revision(), queued));
                    }
                    Ok(None) => gone.push(kv.key().to_vec()),
                    Err(why) => {
                        tracing::error!(
                            client_id,
                            why,
                            "clustering: a queued message in etcd cannot be read: skipped"
                        );
                        gone.push(kv.key().to_vec());
                    }
                }
            }
            if !response.more() || new == 0 {
                break;
            }
        }
        if !gone.is_empty() {
            self.remove(gone);
        }
        // Written together, in the order of their numbers (etcd's sort
        // leaves keys of one revision in any order).
        messages.sort_by(|a, b| (a.0, &a.1.key).cmp(&(b.0, &b.1.key)));
        Ok(messages.into_iter().map(|(_, queued)| queued).collect())
    }
}
