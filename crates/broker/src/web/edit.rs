//! The web view's edit forms (`[http] allow_edit = true`; off by default):
//!
//! - `POST /api/set` `{"key": "...", "value": "...", "px_ms": 5000?}`
//! - `POST /api/del` `{"key": "..."}`
//!
//! Each runs as a state store request of the client id [`EDITOR`] (so
//! watchers are notified, `[persistence] keys` apply, the live list and the
//! metrics show it), under a policy with the keys its viewer may write
//! (`viewer.rs`), and answers `{"ok": bool, "answer": "<RESP3 reply>"}`.
//! Without `allow_edit` both answer 403 and change nothing.
//!
//! Only `application/json` bodies are accepted: a page of another site
//! cannot send one to the endpoint without the browser asking first
//! (CORS preflight, which the endpoint never grants).

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use statestore::resp3::{Reply, encode_request, parse_reply};
use statestore::{Caller, Request};

use super::viewer::Viewer;
use super::{Broker, starting};

/// The client id the web view's edits run as (in the live list, and to
/// watchers' eyes).
pub const EDITOR: &str = "statebroker-web";

/// `POST /api/set`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SetForm {
    key: String,
    value: String,
    /// Expiry in milliseconds (`PX`); absent or 0: none.
    #[serde(default)]
    px_ms: u64,
}

/// `POST /api/del`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DelForm {
    key: String,
}

pub(super) async fn set(
    viewer: Viewer,
    State(broker): State<Broker>,
    Json(form): Json<SetForm>,
) -> Response {
    let mut args: Vec<Vec<u8>> = vec![b"SET".to_vec(), form.key.into(), form.value.into()];
    if form.px_ms > 0 {
        args.push(b"PX".to_vec());
        args.push(form.px_ms.to_string().into_bytes());
    }
    run(&viewer, &broker, &args).await
}

pub(super) async fn del(
    viewer: Viewer,
    State(broker): State<Broker>,
    Json(form): Json<DelForm>,
) -> Response {
    run(&viewer, &broker, &[b"DEL".to_vec(), form.key.into()]).await
}

async fn run(viewer: &Viewer, broker: &Broker, args: &[Vec<u8>]) -> Response {
    let Some(shared) = broker.get() else {
        return starting();
    };
    if !shared.settings.http_allow_edit {
        return (
            StatusCode::FORBIDDEN,
            "the web view is read-only: set [http] allow_edit = true to edit keys\n",
        )
            .into_response();
    }
    let payload = encode_request(args);
    // A SET must carry a timestamp: the broker's own clock, as a client
    // on this machine would send it.
    let timestamp = statestore::hlc::Version {
        wall_ms: crate::clock::now_ms(),
        counter: 0,
    }
    .format(EDITOR);
    // Under a policy, the keys the viewer may write (`viewer.rs`).
    let rules = viewer.key_rules(shared);
    let request = Request {
        payload: &payload,
        timestamp: Some(&timestamp),
        access: rules.as_ref().map(|r| r as &dyn statestore::KeyAccess),
        ..Request::default()
    };
    let caller = Caller {
        client_id: EDITOR,
        connection: u64::MAX,
        owner: EDITOR,
    };
    let answer = shared.store.execute(&request, caller).await;
    // Debug form: a key with a line break cannot forge a log line.
    tracing::info!(user = ?viewer.name(), command = %String::from_utf8_lossy(&args[0]), key = ?String::from_utf8_lossy(&args[1]), answer = ?String::from_utf8_lossy(&answer).trim_end(), "web view edit");
    let (ok, text) = match parse_reply(&answer) {
        Ok(Reply::Error(e)) => (false, format!("-{e}")),
        Ok(Reply::Simple(s)) => (true, format!("+{s}")),
        Ok(Reply::Integer(n)) => (true, format!(":{n}")),
        _ => (true, String::from_utf8_lossy(&answer).trim_end().to_owned()),
    };
    Json(json!({ "ok": ok, "answer": text })).into_response()
}
