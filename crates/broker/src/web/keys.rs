//! `GET /api/keys`: a page of keys, from the store of a single node or
//! from etcd on a cluster node (`cluster/browse.rs`), each with the start
//! of its value as text (or hex when not UTF-8).

use axum::Json;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::viewer::Viewer;
use super::{Broker, starting};

#[derive(Debug, Deserialize)]
pub(super) struct KeysQuery {
    #[serde(default = "everything")]
    pattern: String,
    /// Where the page starts: the `next` of the page before (a position
    /// on a single node; on a cluster node the last key, in hex); empty
    /// or `0`: the first page.
    #[serde(default)]
    start: String,
    #[serde(default = "page_size")]
    limit: usize,
}

fn everything() -> String {
    "*".into()
}

fn page_size() -> usize {
    100
}

#[derive(Debug, Serialize)]
struct KeyJson {
    key: String,
    key_hex: Option<String>,
    /// The value's first [`statestore::browse::VALUE_SHOWN`] bytes.
    value: String,
    value_hex: Option<String>,
    /// The whole value's length in bytes.
    value_len: usize,
    version: String,
    expires_at_ms: Option<u64>,
    fencing_token: Option<String>,
    persisted: bool,
    watchers: Vec<String>,
}

/// Text when UTF-8 (then no hex), else the lossy text and the hex. `cut`:
/// the bytes are the start of a longer value, whose last character may
/// have been cut in two (left out: the value is still text).
fn text(bytes: &[u8], cut: bool) -> (String, Option<String>) {
    match std::str::from_utf8(bytes) {
        Ok(t) => (t.to_owned(), None),
        Err(e) if cut && e.error_len().is_none() => (
            String::from_utf8_lossy(&bytes[..e.valid_up_to()]).into_owned(),
            None,
        ),
        Err(_) => (
            String::from_utf8_lossy(bytes).into_owned(),
            Some(hex::encode(bytes)),
        ),
    }
}

pub(super) async fn keys(
    viewer: Viewer,
    State(broker): State<Broker>,
    Query(q): Query<KeysQuery>,
) -> Response {
    let Some(shared) = broker.get() else {
        return starting();
    };
    let rules = viewer.key_rules(shared);
    #[cfg(feature = "cluster")]
    if let Some(cluster) = shared.store.cluster() {
        let after = match q.start.as_str() {
            "" | "0" => None,
            start => match hex::decode(start) {
                Ok(key) => Some(key),
                Err(_) => return bad_start(),
            },
        };
        let access = rules
            .as_ref()
            .map(|r| r as &(dyn statestore::KeyAccess + Sync));
        let now = crate::clock::now_ms();
        return match cluster
            .browse(q.pattern.as_bytes(), after.as_deref(), q.limit, access, now)
            .await
        {
            Ok(mut page) => {
                // Registrations stay with their connection's node: this
                // node's are in its own store, the others' recorded in etcd.
                let keys: Vec<Vec<u8>> = page.keys.iter().map(|k| k.key.clone()).collect();
                let mut elsewhere = match cluster.watchers_of(&keys).await {
                    Ok(elsewhere) => elsewhere,
                    Err(e) => return unavailable(&e),
                };
                shared.store.with_store(|store| {
                    for key in &mut page.keys {
                        key.watchers = store.watchers(&key.key);
                        if let Some(more) = elsewhere.remove(&key.key) {
                            key.watchers.extend(more);
                            key.watchers.sort();
                            key.watchers.dedup();
                        }
                    }
                });
                keys_json(page.keys, page.next.map(hex::encode), now)
            }
            Err(e) => unavailable(&e),
        };
    }
    let start = match q.start.as_str() {
        "" => 0,
        start => match start.parse() {
            Ok(start) => start,
            Err(_) => return bad_start(),
        },
    };
    let access = rules.as_ref().map(|r| r as &dyn statestore::KeyAccess);
    let page = shared
        .store
        .with_store(|store| store.browse(q.pattern.as_bytes(), start, q.limit, access));
    keys_json(page.keys, page.next, crate::clock::now_ms())
}

/// etcd did not answer a cluster node's page.
#[cfg(feature = "cluster")]
fn unavailable(e: &str) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        format!("etcd, where this cluster node's keys are, did not answer: {e}\n"),
    )
        .into_response()
}

fn bad_start() -> Response {
    (
        StatusCode::BAD_REQUEST,
        "start: not the `next` of a page of keys\n",
    )
        .into_response()
}

/// A page of keys as `/api/keys` answers it.
fn keys_json(
    keys: Vec<statestore::browse::KeyView>,
    next: Option<impl Serialize>,
    now_ms: u64,
) -> Response {
    let keys: Vec<KeyJson> = keys
        .into_iter()
        .map(|k| {
            let (key, key_hex) = text(&k.key, false);
            let (value, value_hex) = text(&k.value, k.value.len() < k.value_len);
            KeyJson {
                key,
                key_hex,
                value,
                value_hex,
                value_len: k.value_len,
                version: k.version,
                expires_at_ms: k.expires_at_ms,
                fencing_token: k.fencing_token,
                persisted: k.persisted,
                watchers: k.watchers,
            }
        })
        .collect();
    Json(json!({ "keys": keys, "next": next, "now_ms": now_ms })).into_response()
}
