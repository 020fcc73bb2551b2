//! The live web view, on the HTTP endpoint (see [`crate::http`]): a page
//! for a client developer testing against the broker.
//!
//! - `GET /`: the page (`index.html`, embedded): keys (paged, glob
//!   filter), live requests and notifications, clients and sessions;
//! - `GET /api/keys?pattern=*&start=0&limit=100`: a page of keys with
//!   the start of the value (text, or hex when not UTF-8) and its length,
//!   version, expiry, fencing token, persisted or not, watchers; `next`
//!   resumes (see `keys.rs`);
//! - `GET /api/clients`: clients connected or with a kept session, their
//!   subscriptions and queued deliveries;
//! - `GET /api/summary`: the numbers of `$SYS` in one object, and
//!   `allow_edit`;
//! - `GET /api/events`: Server-Sent Events, one JSON
//!   [`crate::activity::Event`] per request answered and notification sent,
//!   after the last ones kept ([`crate::activity::BACKLOG`]);
//! - `GET /api/rates`: requests and messages per second, the last minute
//!   ([`crate::activity::Rate`]);
//! - `POST /api/set`, `POST /api/del`: the edit forms, refused unless
//!   `[http] allow_edit = true` (see `edit.rs`);
//! - `/api/faults...`: faults on demand, refused unless `[faults] enabled
//!   = true` (see `faults.rs`).
//!
//! Read-only by default: nothing but the edit forms changes the store.
//!
//! Before anything else the guard refuses a request whose `Host` the
//! endpoint does not serve (421; see `hosts.rs`: DNS rebinding), and a
//! change (any method but GET and HEAD) whose `Origin` names another host
//! (403). The endpoint listens on
//! loopback by default, where anyone who can reach it sees every key. On
//! any other address the view asks for a user of the broker's password file
//! (HTTP Basic; failures slowed per address as for MQTT), and is refused
//! altogether without a password file, unless `[http] allow_anonymous`
//! opens its reads (GET, HEAD) to anyone; `/metrics`, `/healthz` and
//! `/readyz` stay open for scrapers and probes. Under an authorization
//! policy each request gets what the policy gives its user, and with a
//! password file the view asks for one on loopback too (`viewer.rs`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::shared::Shared;

mod edit;
mod faults;
mod hosts;
mod keys;
mod viewer;

use viewer::{Operator, Viewer};

pub(crate) use hosts::AllowedHosts;

/// The broker the endpoint (view, metrics) describes: set once it has
/// started (the endpoint itself starts first, so `/readyz` can say "not
/// ready").
pub(crate) type Broker = Arc<std::sync::OnceLock<Arc<Shared>>>;

/// The view's routes; `exposed`: the endpoint is on a non-loopback
/// address; `anonymous`: there, reads need no password (`[http]
/// allow_anonymous`); `hosts`: the names it is served under.
pub(crate) fn routes(
    broker: Broker,
    exposed: bool,
    anonymous: bool,
    hosts: AllowedHosts,
) -> Router {
    let guard = Guard {
        broker: Arc::clone(&broker),
        exposed,
        anonymous,
        hosts: Arc::new(hosts),
    };
    Router::new()
        .route("/", get(page))
        .route("/api/keys", get(keys::keys))
        .route("/api/clients", get(clients))
        .route("/api/summary", get(summary))
        .route("/api/events", get(events))
        .route("/api/rates", get(rates))
        .route("/api/set", post(edit::set))
        .route("/api/del", post(edit::del))
        .merge(faults::routes())
        .layer(axum::middleware::from_fn_with_state(guard, guard_view))
        .with_state(broker)
}

#[derive(Clone)]
struct Guard {
    broker: Broker,
    exposed: bool,
    anonymous: bool,
    hosts: Arc<AllowedHosts>,
}

/// What the guard decides before looking at the password.
#[derive(Debug, PartialEq, Eq)]
enum Gate {
    Open,
    /// Exposed, but there is no password file to check against.
    NoPasswordFile,
    /// Exposed: check these credentials (`None`: none were sent).
    Check(Option<(String, String)>),
    Starting,
}

/// `anonymous_read`: `[http] allow_anonymous` and the request only reads.
fn gate(
    exposed: bool,
    anonymous_read: bool,
    started: Option<bool>,
    authorization: Option<&str>,
) -> Gate {
    if !exposed || anonymous_read {
        return Gate::Open;
    }
    match started {
        None => Gate::Starting,
        Some(false) => Gate::NoPasswordFile,
        Some(true) => Gate::Check(authorization.and_then(basic_credentials)),
    }
}

/// `Basic base64(user:password)`.
fn basic_credentials(header: &str) -> Option<(String, String)> {
    use base64::Engine;
    let encoded = header.strip_prefix("Basic ")?.trim();
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let (user, password) = text.split_once(':')?;
    Some((user.to_owned(), password.to_owned()))
}

async fn guard_view(
    State(guard): State<Guard>,
    axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<std::net::SocketAddr>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Err(refused) = served(&guard.hosts, &request) {
        tracing::info!(%peer, host = %refused.host, origin = %refused.origin, method = %request.method(), path = %request.uri().path(), "web view: {}", refused.why);
        crate::metrics::http_request_refused(refused.reason);
        return (refused.status, refused.text).into_response();
    }
    let shared = guard.broker.get().cloned();
    let header = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let started = shared.as_ref().map(|s| s.authenticator.has_password_file());
    let reads = matches!(
        *request.method(),
        axum::http::Method::GET | axum::http::Method::HEAD
    );
    // With a policy and users, the view is a user's on loopback too: the
    // policy decides what each sees (`viewer.rs`).
    let users_decide = shared
        .as_ref()
        .is_some_and(|s| s.authorizer.current().is_some() && s.authenticator.has_password_file());
    let mut request = request;
    match gate(
        guard.exposed || users_decide,
        guard.anonymous && reads,
        started,
        header.as_deref(),
    ) {
        Gate::Open => {
            request.extensions_mut().insert(Viewer::new(None));
            next.run(request).await
        }
        Gate::Starting => starting(),
        Gate::NoPasswordFile => (
            StatusCode::FORBIDDEN,
            "the web view on a non-loopback address needs users: set [broker] password_file \
             (or, for its reads, [http] allow_anonymous = true)\n",
        )
            .into_response(),
        Gate::Check(credentials) => {
            let sent = credentials.is_some();
            let ok = match (&shared, credentials) {
                (Some(shared), Some((user, password))) => shared
                    .authenticator
                    .verify(peer.ip(), &user, &password)
                    .await
                    .then_some(user),
                _ => None,
            };
            if let Some(user) = ok {
                request.extensions_mut().insert(Viewer::new(Some(user)));
                next.run(request).await
            } else {
                if sent {
                    tracing::info!(%peer, "web view: credentials refused");
                }
                (
                    StatusCode::UNAUTHORIZED,
                    [(header::WWW_AUTHENTICATE, "Basic realm=\"statebroker\"")],
                    "a user of the broker's password file, please\n",
                )
                    .into_response()
            }
        }
    }
}

/// Why the guard turned a request away before looking at it.
#[derive(Debug)]
struct Misdirected {
    status: StatusCode,
    /// For the metric: `host` or `origin`.
    reason: &'static str,
    why: &'static str,
    text: &'static str,
    /// What the request said (for the log line).
    host: String,
    origin: String,
}

/// Whether the request names a host the endpoint serves (its `Host`, and
/// the authority of an absolute-form target), and, for a change, comes
/// from no page or a page of such a host (`Origin`).
fn served(hosts: &AllowedHosts, request: &axum::extract::Request) -> Result<(), Misdirected> {
    let headers = request.headers();
    let authority = request.uri().authority().map(|a| a.as_str());
    // For the log line: every value (an absolute-form target's authority
    // too), each cut at 100 characters.
    let shown = |name: header::HeaderName| {
        let values: Vec<String> = headers
            .get_all(&name)
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .chain(
                authority
                    .filter(|_| name == header::HOST)
                    .map(str::to_owned),
            )
            .map(|v| v.chars().take(100).collect())
            .collect();
        if values.is_empty() {
            "-".to_owned()
        } else {
            values.join(", ")
        }
    };
    let refuse = |status, reason, why, text| Misdirected {
        status,
        reason,
        why,
        text,
        host: shown(header::HOST),
        origin: shown(header::ORIGIN),
    };
    let sent: Vec<_> = headers.get_all(header::HOST).iter().collect();
    if sent.is_empty() && authority.is_none() {
        return Err(refuse(
            StatusCode::MISDIRECTED_REQUEST,
            "host",
            "request without a Host header refused",
            "the web view needs a Host header (HTTP/1.1)\n",
        ));
    }
    let host_ok = sent.len() <= 1
        && sent
            .iter()
            .all(|v| v.to_str().is_ok_and(|h| hosts.allows_host(h)))
        && authority.is_none_or(|a| hosts.allows_host(a));
    if !host_ok {
        return Err(refuse(
            StatusCode::MISDIRECTED_REQUEST,
            "host",
            "request for a host not served refused (DNS rebinding?)",
            "this host name is not served here: to open the web view under it, add it to [http] allowed_hosts\n",
        ));
    }
    let reads = matches!(
        *request.method(),
        axum::http::Method::GET | axum::http::Method::HEAD
    );
    let mut origins = headers.get_all(header::ORIGIN).iter();
    let origin_ok = reads
        || origins.all(|origin| {
            origin
                .to_str()
                .is_ok_and(|origin| hosts.allows_origin(origin))
        });
    if !origin_ok {
        return Err(refuse(
            StatusCode::FORBIDDEN,
            "origin",
            "change from a page of another host refused",
            "a page of another site may not change anything here (Origin refused)\n",
        ));
    }
    Ok(())
}

async fn page() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        include_str!("index.html"),
    )
}

fn starting() -> Response {
    (StatusCode::SERVICE_UNAVAILABLE, "the broker is starting\n").into_response()
}

async fn clients(_: Operator, State(broker): State<Broker>) -> Response {
    let Some(shared) = broker.get() else {
        return starting();
    };
    Json(shared.sessions.clients()).into_response()
}

async fn summary(_: Operator, State(broker): State<Broker>) -> Response {
    let Some(shared) = broker.get() else {
        return starting();
    };
    let now = crate::stats::sample(shared);
    let mut values: serde_json::Map<String, serde_json::Value> = crate::sys::messages(&now)
        .into_iter()
        .map(|(topic, value)| {
            let name = topic.trim_start_matches("$SYS/broker/").to_owned();
            (name, serde_json::Value::String(value))
        })
        .collect();
    // Whether the page shows its edit forms.
    values.insert(
        "allow_edit".into(),
        serde_json::Value::Bool(shared.settings.http_allow_edit),
    );
    Json(values).into_response()
}

/// Samples requests and messages per second into `shared.activity` until
/// the broker stops.
pub(crate) async fn sample_rates(shared: Arc<Shared>) {
    let mut shutdown = shared.shutdown.clone();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let totals = || {
        (
            shared.activity.requests(),
            crate::metrics::totals().messages_received,
        )
    };
    let mut last = totals();
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        let now = totals();
        shared.activity.push_rate(crate::activity::Rate {
            at_ms: crate::clock::now_ms(),
            requests: now.0.saturating_sub(last.0),
            messages: now.1.saturating_sub(last.1),
        });
        last = now;
    }
}

async fn rates(_: Operator, State(broker): State<Broker>) -> Response {
    let Some(shared) = broker.get() else {
        return starting();
    };
    Json(shared.activity.rates()).into_response()
}

async fn events(_: Operator, State(broker): State<Broker>) -> Response {
    let Some(shared) = broker.get() else {
        return starting();
    };
    // The backlog first, then what comes after it (each event once: the
    // backlog and the subscription are taken under one lock).
    let (backlog, receiver) = shared.activity.subscribe();
    let seen = backlog.last().map_or(0, |(n, _)| *n);
    let sse = |(number, event): crate::activity::Numbered| {
        let data = serde_json::to_string(&event).unwrap_or_default();
        Ok::<_, Infallible>(SseEvent::default().id(number.to_string()).data(data))
    };
    let earlier = futures_util::stream::iter(backlog.into_iter().map(sse));
    let state = (receiver, shared.shutdown.clone());
    let live =
        futures_util::stream::unfold(state, move |(mut receiver, mut shutdown)| async move {
            loop {
                tokio::select! {
                    event = receiver.recv() => match event {
                        Ok(event) if event.0 <= seen => continue,
                        Ok(event) => return Some((sse(event), (receiver, shutdown))),
                        // Fell behind: the oldest events are gone; go on.
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
                    },
                    _ = shutdown.changed() => return None,
                }
            }
        });
    let stream = futures_util::StreamExt::chain(earlier, live);
    let every = keep_alive_interval(shared.settings.http_options.idle_timeout);
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(every))
        .into_response()
}

/// How often the event stream sends a keep-alive comment: every 15 s, and
/// often enough that the connection never counts as idle (`[http]
/// idle_timeout_ms`).
fn keep_alive_interval(idle_timeout: Duration) -> Duration {
    (idle_timeout / 2).clamp(Duration::from_millis(10), Duration::from_secs(15))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_event_stream_is_never_idle() {
        let every = |ms| keep_alive_interval(Duration::from_millis(ms)).as_millis();
        assert_eq!(every(60_000), 15_000);
        assert_eq!(every(20_000), 10_000);
        assert_eq!(every(300), 150);
        assert_eq!(every(1), 10);
    }

    #[test]
    fn the_view_asks_for_a_password_only_when_exposed() {
        assert_eq!(gate(false, false, Some(false), None), Gate::Open);
        assert_eq!(gate(false, false, None, None), Gate::Open);
        assert_eq!(gate(true, false, None, None), Gate::Starting);
        assert_eq!(
            gate(true, false, Some(false), Some("Basic YTpi")),
            Gate::NoPasswordFile
        );
        assert_eq!(gate(true, false, Some(true), None), Gate::Check(None));
        // "alice:s3c:ret" (a password may hold ':').
        assert_eq!(
            gate(true, false, Some(true), Some("Basic YWxpY2U6czNjOnJldA==")),
            Gate::Check(Some(("alice".into(), "s3c:ret".into())))
        );
        assert_eq!(
            gate(true, false, Some(true), Some("Bearer x")),
            Gate::Check(None)
        );
        assert_eq!(
            gate(true, false, Some(true), Some("Basic !!")),
            Gate::Check(None)
        );
        // [http] allow_anonymous: reads need nothing, even before the start
        // or without a password file (changes: anonymous_read is false).
        assert_eq!(gate(true, true, None, None), Gate::Open);
        assert_eq!(gate(true, true, Some(false), None), Gate::Open);
    }
}
