//! SCAN against etcd: a page of the keys in key order, read in chunks at
//! one revision (one snapshot), with the glob's step budget and the page's
//! resume token as the single node's (`statestore::command::scan`).

use etcd_client::GetOptions;
use statestore::command::STEPS_PER_PAGE;
use statestore::command::Scan;
use statestore::glob::{Pattern, StepBudget};
use statestore::resp3::Frame;
use statestore::{Error, KeyAccess};

use super::Cluster;
use super::kv::{Unanswered, prefix_end};
use super::record::Record;

impl Cluster {
    /// A page of SCAN over the keys in etcd, in key order; the token
    /// (`k` and the last key looked at) resumes after that key.
    pub async fn scan(
        &self,
        scan: &Scan<'_>,
        access: Option<&(dyn KeyAccess + Sync)>,
        page_size: usize,
        now: u64,
    ) -> Result<Result<Frame, Error>, Unanswered> {
        let mut from = self.keys_prefix.clone();
        if let Some(token) = scan.token {
            let Some(last) = token.strip_prefix(b"k") else {
                return Ok(Err(Error::Syntax));
            };
            from.extend_from_slice(last);
            from.push(0);
        }
        let end = prefix_end(&self.keys_prefix);
        let pattern = Pattern::new(scan.pattern);
        let page_size = page_size.max(1);
        let budget = page_size.saturating_mul(16);
        let mut keys = Vec::new();
        let mut looked = 0usize;
        // Glob steps spent (see `statestore::command::STEPS_PER_PAGE`): a
        // page ends before the key that would pass the budget, except at
        // its first key, so every page moves on.
        let mut steps = StepBudget::new(STEPS_PER_PAGE);
        let mut last_looked: Option<Vec<u8>> = None;
        // The page reads etcd in chunks of records an answer can hold, all
        // at the first chunk's revision: one snapshot.
        let mut revision = None;
        loop {
            let chunk = (budget - looked).min(super::reads::MAX_KEYS);
            let mut options = GetOptions::new()
                .with_range(end.clone())
                .with_limit(chunk as i64);
            if let Some(revision) = revision {
                options = options.with_revision(revision);
            }
            let response = self
                .kv
                .clone()
                .get(from.clone(), Some(options))
                .await
                .map_err(|e| Unanswered::Unreachable(e.to_string()))?;
            revision = revision.or(response.header().map(|h| h.revision()));
            let mut last = None;
            let mut full = false;
            for kv in response.kvs() {
                let key = &kv.key()[self.keys_prefix.len()..];
                if !steps.take(pattern.cost(key.len()), looked == 0) {
                    // Resumed at this key, after the one before it.
                    let mut token = b"k".to_vec();
                    token.extend_from_slice(last_looked.as_deref().unwrap_or_default());
                    return Ok(Ok(page(keys, Some(token))));
                }
                looked += 1;
                last = Some(key.to_vec());
                last_looked.clone_from(&last);
                let live = Record::decode(kv.value())
                    .ok()
                    .is_some_and(|r| r.entry(key, now).is_some());
                if live && pattern.matches(key) && access.is_none_or(|a| a.may_read(key)) {
                    keys.push(Frame::Bulk(key.to_vec()));
                    if keys.len() >= page_size {
                        full = true;
                        break;
                    }
                }
            }
            let Some(last) = last else {
                return Ok(Ok(page(keys, None)));
            };
            let rest_seen = !full && !response.more();
            if rest_seen {
                return Ok(Ok(page(keys, None)));
            }
            if full || looked >= budget {
                let mut token = b"k".to_vec();
                token.extend_from_slice(&last);
                return Ok(Ok(page(keys, Some(token))));
            }
            from = self.key(&last);
            from.push(0);
        }
    }
}

fn page(keys: Vec<Frame>, token: Option<Vec<u8>>) -> Frame {
    let mut parts = vec![Frame::Array(keys)];
    if let Some(token) = token {
        parts.push(Frame::Bulk(token));
    }
    Frame::Array(parts)
}
