//! The web view's key pages on a cluster node: the keys read from etcd.
//!
//! A page lists up to `limit` live keys (not deleted, not expired)
//! matching the pattern that the viewer may read, in key order, after the
//! key the previous page ended at, each with the first
//! [`VALUE_SHOWN`] bytes of its value, as a single node's page does
//! (`statestore::browse`). etcd gives whole records, so the page reads
//! them a few at a time and ends after [`READ_BYTES`] of them (a page of
//! large values is short), after [`KEY_BYTES_PER_PAGE`] of keys, or when
//! its glob steps are spent. Reads are linearizable (a page shows every
//! write committed before it was asked for), the later ones at the
//! first's revision: a page is one moment of the store. The watchers are the
//! caller's to add (this node's in its store, the others' in
//! [`super::registrations`]).

use std::time::Duration;

use etcd_client::GetOptions;
use statestore::KeyAccess;
use statestore::browse::{KEY_BYTES_PER_PAGE, KeyView, VALUE_SHOWN};
use statestore::command::STEPS_PER_PAGE;
use statestore::glob::{Pattern, StepBudget};

use super::Cluster;
use super::kv::prefix_end;
use super::record::Record;

/// Records asked for at a time.
const CHUNK: i64 = 16;

/// Bytes of records a page reads at most (past the first chunk).
const READ_BYTES: usize = 4 << 20;

/// A page of keys.
pub struct Browsed {
    pub keys: Vec<KeyView>,
    /// The key the next page starts after (`None`: no more).
    pub next: Option<Vec<u8>>,
}

impl Cluster {
    /// A page of the keys matching `pattern` after `after` (`None`: from
    /// the first), `limit` at most (1 to 1,000). `Err`: etcd did not
    /// answer.
    pub async fn browse(
        &self,
        pattern: &[u8],
        after: Option<&[u8]>,
        limit: usize,
        access: Option<&(dyn KeyAccess + Sync)>,
        now_ms: u64,
    ) -> Result<Browsed, String> {
        let limit = limit.clamp(1, 1000);
        let pattern = Pattern::new(pattern);
        let mut steps = StepBudget::new(STEPS_PER_PAGE);
        let end = prefix_end(&self.keys_prefix);
        let mut from = match after {
            Some(key) => {
                let mut from = self.key(key);
                from.push(0);
                from
            }
            None => self.keys_prefix.clone(),
        };
        let (mut keys, mut key_bytes, mut read) = (Vec::new(), 0, 0);
        let mut looked: Option<Vec<u8>> = None;
        let mut revision = None;
        let timeout: Duration = self.settings.request_timeout;
        loop {
            let mut options = GetOptions::new().with_range(end.clone()).with_limit(CHUNK);
            if let Some(revision) = revision {
                // Linearizable too: a member behind the first read's
                // (requests go to any member) would refuse a serializable
                // read of a revision it has not applied yet.
                options = options.with_revision(revision);
            }
            let response =
                tokio::time::timeout(timeout, self.kv.clone().get(from.clone(), Some(options)))
                    .await
                    .map_err(|_| "etcd did not answer in time".to_owned())?
                    .map_err(|e| e.to_string())?;
            revision = revision.or(response.header().map(|h| h.revision()));
            for kv in response.kvs() {
                let key = &kv.key()[self.keys_prefix.len()..];
                if !steps.take(pattern.cost(key.len()), looked.is_none()) {
                    return Ok(Browsed { keys, next: looked });
                }
                looked = Some(key.to_vec());
                read += kv.value().len();
                let Ok(record) = Record::decode(kv.value()) else {
                    continue;
                };
                let readable = access.is_none_or(|a| a.may_read(key));
                if record.entry(key, now_ms).is_some() && readable && pattern.matches(key) {
                    key_bytes += key.len();
                    keys.push(view(key, &record));
                }
                if keys.len() >= limit || key_bytes >= KEY_BYTES_PER_PAGE || read >= READ_BYTES {
                    return Ok(Browsed { keys, next: looked });
                }
            }
            match &looked {
                Some(last) if response.more() => {
                    from = self.key(last);
                    from.push(0);
                }
                _ => return Ok(Browsed { keys, next: None }),
            }
        }
    }
}

/// `key`'s record as the page shows it.
fn view(key: &[u8], record: &Record) -> KeyView {
    KeyView {
        key: key.to_vec(),
        value: record.value[..record.value.len().min(VALUE_SHOWN)].to_vec(),
        value_len: record.value.len(),
        version: record.version_text().into(),
        expires_at_ms: record.expires_at,
        fencing_token: record.fencing_token.as_ref().map(ToString::to_string),
        persisted: false,
        watchers: Vec::new(),
    }
}
