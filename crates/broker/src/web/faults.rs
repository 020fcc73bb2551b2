//! Faults over HTTP (what `statebroker-cli faults` speaks), on the web
//! view's endpoint and behind its guard. Every answer is JSON; a broker
//! without `[faults] enabled = true` answers 403 to all but the status.
//!
//! | request | body | does |
//! |---|---|---|
//! | `GET /api/faults` | | status: enabled, rules, clock offset, counts |
//! | `PUT /api/faults/rules` | `[rule, ...]` | replaces the rules |
//! | `POST /api/faults/rules` | `rule` | adds a rule after the others |
//! | `DELETE /api/faults/rules` | | removes every rule |
//! | `POST /api/faults/disconnect` | `{"client_id", "reason_code"?}` | disconnects a client now (404: not connected) |
//! | `POST /api/faults/refuse` | `{"ms"}` | refuses new connections for `ms` (0: stop) |
//! | `POST /api/faults/expire` | `{"key"}` | expires a key now (404: no such key) |
//! | `POST /api/faults/stall-disk` | `{"ms"}` | writes nothing to disk for `ms` (0: stop; 400 without a data directory) |
//! | `POST /api/faults/clock` | `{"offset_ms"}` | moves the store's clock |
//!
//! A rule is `[[faults.rules]]`'s table as JSON (see [`crate::faults`]).

use std::time::Duration;

use axum::extract::FromRequestParts;
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;

use super::{Broker, starting};
use crate::fault_control::FaultControl;
use crate::faults::{FaultError, RuleSpec};

/// The routes, under `/api/faults`.
pub(super) fn routes() -> Router<Broker> {
    Router::new()
        .route("/api/faults", get(status))
        .route(
            "/api/faults/rules",
            get(status)
                .put(set_rules)
                .post(add_rule)
                .delete(clear_rules),
        )
        .route("/api/faults/disconnect", post(disconnect))
        .route("/api/faults/refuse", post(refuse))
        .route("/api/faults/expire", post(expire))
        .route("/api/faults/stall-disk", post(stall_disk))
        .route("/api/faults/clock", post(clock))
}

/// The broker's [`FaultControl`], as an extractor: 503 "starting" until
/// the broker has started.
struct Control(FaultControl);

impl FromRequestParts<Broker> for Control {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, broker: &Broker) -> Result<Control, Response> {
        // Under a policy, for operators only (`viewer.rs`).
        super::viewer::Operator::from_request_parts(parts, broker).await?;
        match broker.get() {
            Some(shared) => Ok(Control(FaultControl::new(std::sync::Arc::clone(shared)))),
            None => Err(starting()),
        }
    }
}

fn answer<T: serde::Serialize>(result: Result<T, FaultError>) -> Response {
    match result {
        Ok(value) => Json(value).into_response(),
        Err(e) => {
            let status = match e {
                FaultError::Disabled => StatusCode::FORBIDDEN,
                FaultError::Invalid(_) => StatusCode::BAD_REQUEST,
            };
            (status, Json(json!({ "error": e.to_string() }))).into_response()
        }
    }
}

fn not_found(text: String) -> Response {
    (StatusCode::NOT_FOUND, Json(json!({ "error": text }))).into_response()
}

async fn status(Control(control): Control) -> Response {
    Json(control.status()).into_response()
}

async fn set_rules(Control(control): Control, Json(rules): Json<Vec<RuleSpec>>) -> Response {
    answer(control.set_rules(rules).map(|()| control.status()))
}

async fn add_rule(Control(control): Control, Json(rule): Json<RuleSpec>) -> Response {
    answer(control.add_rule(rule).map(|_| control.status()))
}

async fn clear_rules(Control(control): Control) -> Response {
    answer(control.clear_rules().map(|()| control.status()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DisconnectForm {
    client_id: String,
    /// Default 0x80 (unspecified error).
    #[serde(default = "unspecified")]
    reason_code: u8,
}

fn unspecified() -> u8 {
    0x80
}

async fn disconnect(Control(control): Control, Json(form): Json<DisconnectForm>) -> Response {
    match control.disconnect(&form.client_id, form.reason_code) {
        Ok(false) => not_found(format!("client {} is not connected", form.client_id)),
        other => answer(other.map(|_| json!({ "disconnected": form.client_id }))),
    }
}

/// `{"ms"}`: how long (refusing connections, stalling the disk).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MsForm {
    ms: u64,
}

async fn refuse(Control(control): Control, Json(form): Json<MsForm>) -> Response {
    answer(
        control
            .refuse_connections(Duration::from_millis(form.ms))
            .map(|()| json!({ "refusing_ms": form.ms })),
    )
}

async fn stall_disk(Control(control): Control, Json(form): Json<MsForm>) -> Response {
    answer(
        control
            .stall_disk(Duration::from_millis(form.ms))
            .map(|()| json!({ "stalling_ms": form.ms })),
    )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExpireForm {
    key: String,
}

async fn expire(Control(control): Control, Json(form): Json<ExpireForm>) -> Response {
    match control.expire_key(form.key.as_bytes()) {
        Ok(false) => not_found(format!("no key {}", form.key)),
        other => answer(other.map(|_| json!({ "expired": form.key }))),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClockForm {
    offset_ms: i64,
}

async fn clock(Control(control): Control, Json(form): Json<ClockForm>) -> Response {
    answer(
        control
            .set_clock_offset(form.offset_ms)
            .map(|()| json!({ "clock_offset_ms": form.offset_ms })),
    )
}
