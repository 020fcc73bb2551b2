//! A state store request from this connection: the Response Topic rules
//! (a reserved one disconnects), the authorization policy (answers go only
//! where the caller may subscribe; its key rules go with the request), the
//! acknowledgement, admission by the binding, the faults a test asked for
//! (see [`crate::faults`]), and the hand-off to the store.

use std::sync::Arc;
use std::time::Duration;

use statestore::{Caller, Dialect, Request};

use super::Machine;
use crate::authorization::{KeyRules, Policy, Principal};
use crate::connection::end::End;
use crate::faults::Action;
use crate::persistence::Batch;
use crate::request_publish::RequestPublish;
use crate::shared::Shared;
use crate::store::StateStoreService;
use crate::store::binding::{self, Admission, ReplyTo};

impl Machine {
    /// A state store request: checked by the binding, acknowledged here,
    /// executed by the store.
    pub(crate) fn on_request(
        &mut self,
        request: RequestPublish<'_>,
        dialect: Dialect,
    ) -> Result<(), End> {
        let RequestPublish { qos, pkid, dup, .. } = request;
        if let Err((code, why)) = binding::check_response_topic(request.response_topic) {
            tracing::warn!(
                client_id = self.client_id,
                reason = why,
                "bad response topic: disconnecting"
            );
            return Err(End::Violation(code, why));
        }
        // With a policy, answers go only where the caller may subscribe.
        let policy = self.shared.authorizer.current();
        if let Some(policy) = &policy
            && let Some(topic) = request.response_topic
            && !policy.may_subscribe(&self.principal, topic)
        {
            tracing::info!(
                client_id = self.client_id,
                response_topic = topic,
                "request refused: the authorization policy denies subscribing to its response topic"
            );
            self.ack(qos, pkid, false);
            return Ok(());
        }
        // A request this session ran already, sent again (see
        // `sessions/acknowledged.rs`): acknowledged again only, when its
        // answer may go out.
        let correlation = request.correlation_data;
        let again = self.inbound.ran_already(qos, pkid, dup, correlation);
        // A cluster node acknowledges a request once its outcome is out
        // (see `store::tickets`): the acknowledgement is queued after the
        // request is handed over, held until its ticket is dropped.
        let mut ticket = match (&self.outcomes, again) {
            (Some(tickets), None) if qos > 0 => Some(tickets.issue()),
            _ => None,
        };
        let outcome = ticket.as_ref().map(crate::store::tickets::Ticket::number);
        let before_ack = self.wbuf.len();
        if outcome.is_none() {
            self.ack(qos, pkid, true);
        }
        if let Some(wait) = again {
            tracing::debug!(
                client_id = self.client_id,
                pkid,
                "request sent again: acknowledged, not run again"
            );
            self.ack_hold
                .acknowledged(before_ack, self.wbuf.len(), wait, true);
            return Ok(());
        }
        let kept = self.session_expiry > 0;
        let known = self.answer_route.as_ref().map(|route| route.topic());
        match binding::admit(&request, dialect, known) {
            Admission::Serve(mut request, mut reply_to) => {
                reply_to.resent = dup;
                reply_to.ticket = ticket.take();
                reply_to.route = self.answer_route(&reply_to.topic);
                let caller = Caller {
                    client_id: &self.client_id,
                    connection: self.id,
                    owner: &self.owner,
                };
                let rules = policy.clone().map(|policy| {
                    Arc::new(KeyRules {
                        policy,
                        principal: Arc::clone(&self.principal),
                    })
                });
                request.access = rules.as_deref().map(|r| r as &dyn statestore::KeyAccess);
                // No fault rule matching: the default plan, execute now.
                let plan = self
                    .shared
                    .faults
                    .plan(&self.client_id, request.payload)
                    .unwrap_or_default();
                match plan.delay {
                    None => {
                        let mut answer = None;
                        let wait = run_planned(
                            &self.shared.store,
                            &request,
                            caller,
                            reply_to,
                            plan.action,
                            rules
                                .clone()
                                .map(|r| r as Arc<dyn statestore::KeyAccess + Send + Sync>),
                            Some(&mut answer),
                        );
                        self.inbound.ran(qos, pkid, correlation, wait, kept);
                        // The acknowledgement may wait for the answer, and
                        // reading stops while too many wait (see hold.rs).
                        self.ack_hold
                            .acknowledged(before_ack, self.wbuf.len(), wait, false);
                        // The answer, if it went out at once, after its
                        // acknowledgement.
                        if let Some(answer) = &mut answer {
                            self.out.answer(answer, kept, self.protocol, &mut self.wbuf);
                        }
                        if wait.is_some() || !self.awaited.is_empty() {
                            let position = self.position();
                            self.awaited.push(wait, position);
                        }
                    }
                    Some(delay) => {
                        self.inbound.ran(qos, pkid, correlation, None, kept);
                        self.later.push(Delayed {
                            delay,
                            request: OwnedRequest::of(&request),
                            reply_to,
                            action: plan.action,
                            policy: policy.clone(),
                            principal: Arc::clone(&self.principal),
                            client_id: self.client_id.clone(),
                            connection: self.id,
                            owner: Arc::clone(&self.owner),
                        });
                    }
                }
                if let Some(code) = plan.disconnect {
                    return Err(End::Fault(code));
                }
            }
            Admission::Refuse(mut reply_to, text) => {
                reply_to.ticket = ticket.take();
                tracing::info!(
                    client_id = self.client_id,
                    reason = text,
                    "request not executed"
                );
                self.shared.store.refuse(reply_to, &self.client_id, text);
            }
            Admission::Ignore => {
                tracing::info!(
                    client_id = self.client_id,
                    "request without response topic ignored"
                );
            }
        }
        drop(ticket);
        if outcome.is_some() {
            self.ack_when(qos, pkid, true, outcome);
        }
        Ok(())
    }

    /// The way answers on `topic` reach this client: the last one's while
    /// it holds, else a new one (none when this client is not the topic's
    /// only subscriber, or this connection not its live one).
    fn answer_route(&mut self, topic: &[u8]) -> Option<Arc<crate::sessions::Route>> {
        let sessions = &self.shared.sessions;
        if let Some(route) = &self.answer_route
            && route.topic() == topic
            && sessions.holds(route)
        {
            return Some(Arc::clone(route));
        }
        self.answer_route = sessions
            .route(&self.client_id, self.id, topic)
            .map(Arc::new);
        self.answer_route.clone()
    }
}

/// A request a fault delays: it runs `delay` from now, as if it had
/// arrived then, unless its connection ended meanwhile (the request is
/// lost with it, as it would be on the network).
pub(crate) struct Delayed {
    delay: Duration,
    request: OwnedRequest,
    reply_to: ReplyTo,
    action: Action,
    policy: Option<Arc<Policy>>,
    principal: Arc<Principal>,
    client_id: String,
    connection: u64,
    owner: Arc<str>,
}

impl Delayed {
    /// Waits, then runs the request (the driver spawns this).
    pub async fn run(self, shared: Arc<Shared>) {
        tokio::time::sleep(self.delay).await;
        if !shared.sessions.is_live(&self.client_id, self.connection) {
            tracing::info!(
                client_id = self.client_id,
                "a delayed request is lost: its connection ended meanwhile"
            );
            return;
        }
        let rules = self.policy.clone().map(|policy| {
            Arc::new(KeyRules {
                policy,
                principal: Arc::clone(&self.principal),
            })
        });
        let owned = &self.request;
        let request = Request {
            payload: &owned.payload,
            timestamp: owned.timestamp.as_deref(),
            fencing_token: owned.fencing_token.as_deref(),
            persist: owned.persist,
            dialect: owned.dialect,
            access: rules.as_deref().map(|r| r as &dyn statestore::KeyAccess),
        };
        let caller = Caller {
            client_id: &self.client_id,
            connection: self.connection,
            owner: &self.owner,
        };
        let owned_rules = rules
            .clone()
            .map(|r| r as Arc<dyn statestore::KeyAccess + Send + Sync>);
        run_planned(
            &shared.store,
            &request,
            caller,
            self.reply_to,
            self.action,
            owned_rules,
            None,
        );
    }
}

/// A request's parts, kept while a fault delays it.
struct OwnedRequest {
    payload: Vec<u8>,
    timestamp: Option<String>,
    fencing_token: Option<String>,
    persist: bool,
    dialect: Dialect,
}

impl OwnedRequest {
    fn of(request: &Request<'_>) -> OwnedRequest {
        OwnedRequest {
            payload: request.payload.to_vec(),
            timestamp: request.timestamp.map(str::to_owned),
            fencing_token: request.fencing_token.map(str::to_owned),
            persist: request.persist,
            dialect: request.dialect,
        }
    }
}

/// Runs a request as a fault's plan says: executed and answered, answered
/// with its `-ERR`, executed and not answered, or neither. Returns the
/// batch the answer waits for, if any. `here`: in the requester's own
/// connection task, where an answer that goes out at once is put (see
/// `StateStoreService::serve_here`).
fn run_planned(
    store: &Arc<StateStoreService>,
    request: &Request<'_>,
    caller: Caller<'_>,
    reply_to: ReplyTo,
    action: Action,
    access: Option<Arc<dyn statestore::KeyAccess + Send + Sync>>,
    here: Option<&mut Option<crate::sessions::Answer>>,
) -> Option<Batch> {
    match action {
        Action::Execute => match here {
            Some(here) => store.serve_here(request, caller, reply_to, access, here),
            None => store.serve(request, caller, Some(reply_to), access),
        },
        Action::Error(text) => {
            store.refuse(reply_to, caller.client_id, &text);
            None
        }
        Action::DropAfter => store.serve(request, caller, None, access),
        Action::DropBefore => None,
    }
}
