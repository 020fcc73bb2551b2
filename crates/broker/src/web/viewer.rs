//! Who a web view request acts as, under the authorization policy.
//!
//! Without a policy the view shows and (with `[http] allow_edit`) changes
//! everything, to whoever the guard lets in. With a policy loaded, every
//! request acts as the principal client id [`EDITOR`] with the username
//! the request logged in as (none for an anonymous read), and gets what
//! the policy gives that principal, as an MQTT client would:
//!
//! - keys: the pages list only the keys it may read; an edit of a key it
//!   may not write is answered `-ERR not authorized` by the store;
//! - the broker's own activity (clients and their subscriptions, the live
//!   requests and notifications, the statistics, faults): only for a
//!   principal the policy lets subscribe to `$SYS/#`, mosquitto's topics
//!   for an operator; others get 403.
//!
//! The guard puts a [`Viewer`] in each request it lets through; the
//! handlers take it (and [`Operator`]) as extractors.

use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};

use crate::authorization::{KeyRules, Principal};
use crate::shared::Shared;

use super::edit::EDITOR;

/// The topic filter a principal must be allowed to subscribe to for the
/// broker's activity.
pub const OPERATOR_FILTER: &str = "$SYS/#";

/// The principal a web view request acts as.
#[derive(Debug, Clone)]
pub struct Viewer {
    principal: Arc<Principal>,
}

impl Viewer {
    /// A request that logged in as `username` (`None`: anonymous).
    pub fn new(username: Option<String>) -> Viewer {
        Viewer {
            principal: Arc::new(Principal {
                client_id: EDITOR.to_owned(),
                username,
                attributes: Default::default(),
            }),
        }
    }

    /// The key rules of the policy in use for this viewer; `None` without
    /// a policy (every key).
    pub fn key_rules(&self, shared: &Shared) -> Option<KeyRules> {
        shared.authorizer.current().map(|policy| KeyRules {
            policy,
            principal: Arc::clone(&self.principal),
        })
    }

    /// Whether the viewer may see the broker's activity.
    pub fn is_operator(&self, shared: &Shared) -> bool {
        shared
            .authorizer
            .current()
            .is_none_or(|policy| policy.may_subscribe(&self.principal, OPERATOR_FILTER))
    }

    /// Who, for log lines.
    pub fn name(&self) -> &str {
        self.principal.username.as_deref().unwrap_or("anonymous")
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Viewer {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Viewer, Response> {
        // Every route is behind the guard, which puts one in; a route
        // outside it is a bug, refused rather than served to anyone.
        parts.extensions.get::<Viewer>().cloned().ok_or_else(|| {
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "no viewer for this request\n",
            )
                .into_response()
        })
    }
}

/// A viewer the policy lets see the broker's activity (an extractor:
/// others get 403 with the rule they lack).
pub struct Operator;

impl FromRequestParts<super::Broker> for Operator {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut Parts,
        broker: &super::Broker,
    ) -> Result<Operator, Response> {
        let viewer = Viewer::from_request_parts(parts, broker).await?;
        let Some(shared) = broker.get() else {
            return Err(super::starting());
        };
        if viewer.is_operator(shared) {
            return Ok(Operator);
        }
        tracing::info!(
            user = ?viewer.name(),
            path = %parts.uri.path(),
            "web view: the authorization policy does not let this user see the broker's activity"
        );
        Err((
            StatusCode::FORBIDDEN,
            format!(
                "the authorization policy does not let {:?} see the broker's activity: \
                 that takes a rule letting it subscribe to {OPERATOR_FILTER}\n",
                viewer.name()
            ),
        )
            .into_response())
    }
}
