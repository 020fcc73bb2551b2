//! A state store request from this connection: the Response Topic rules
//! (a reserved one disconnects), the authorization policy (answers go only
//! where the caller may subscribe; its key rules go with the request), the
//! acknowledgement, admission by the binding, the faults a test asked for
//! (see [`crate::faults`]), and the hand-off to the store.

use std::sync::Arc;
use std::time::Duration;

use router::protocol::{Publish, PublishProperties};
use statestore::{Caller, Dialect, Request};

use super::end::End;
use super::socket::Stream;
use super::task::Connection;
use crate::authorization::{KeyRules, Policy};
use crate::faults::Action;
use crate::store::StateStoreService;
use crate::store::binding::{self, Admission, ReplyTo};

impl<S: Stream> Connection<S> {
    /// A state store request: checked by the binding, acknowledged here,
    /// executed by the store. `(qos, pkid, dup)`: from its fixed header.
    pub(super) fn on_request(
        &mut self,
        publish: Publish,
        properties: Option<PublishProperties>,
        (qos, pkid, dup): (u8, u16, bool),
        dialect: Dialect,
    ) -> Result<(), End> {
        let properties = properties.unwrap_or_default();
        if let Err((code, why)) = binding::check_response_topic(&properties) {
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
            && let Some(topic) = &properties.response_topic
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
        let correlation = properties.correlation_data.as_deref();
        let again = self.inbound.ran_already(qos, pkid, dup, correlation);
        let before_ack = self.socket.wbuf.len();
        self.ack(qos, pkid, true);
        if let Some(wait) = again {
            tracing::debug!(
                client_id = self.client_id,
                pkid,
                "request sent again: acknowledged, not run again"
            );
            self.ack_hold
                .acknowledged(before_ack, self.socket.wbuf.len(), wait);
            return Ok(());
        }
        let kept = self.session_expiry > 0;
        match binding::admit(&publish.payload, &properties, qos, dialect) {
            Admission::Serve(mut request, reply_to) => {
                let caller = Caller {
                    client_id: &self.client_id,
                    connection: self.id,
                };
                let rules = policy.as_deref().map(|policy| KeyRules {
                    policy,
                    principal: &self.principal,
                });
                request.access = rules.as_ref().map(|r| r as &dyn statestore::KeyAccess);
                // No fault rule matching: the default plan, execute now.
                let plan = self
                    .shared
                    .faults
                    .plan(&self.client_id, request.payload)
                    .unwrap_or_default();
                match plan.delay {
                    None => {
                        let wait =
                            run_planned(&self.store, &request, caller, reply_to, plan.action);
                        self.inbound.ran(qos, pkid, correlation, wait, kept);
                        // The acknowledgement may wait for the answer, and
                        // reading stops while too many wait (see hold.rs).
                        self.ack_hold
                            .acknowledged(before_ack, self.socket.wbuf.len(), wait);
                        let store = &self.store;
                        self.awaited.push(wait, |seq| store.is_answered(seq));
                    }
                    Some(delay) => {
                        self.inbound.ran(qos, pkid, correlation, 0, kept);
                        let policy = policy.clone();
                        self.run_later(delay, &request, reply_to, plan.action, policy);
                    }
                }
                if let Some(code) = plan.disconnect {
                    return Err(End::Fault(code));
                }
            }
            Admission::Refuse(reply_to, text) => {
                tracing::info!(
                    client_id = self.client_id,
                    reason = text,
                    "request not executed"
                );
                self.store.refuse(reply_to, &self.client_id, text);
            }
            Admission::Ignore => {
                tracing::info!(
                    client_id = self.client_id,
                    "request without response topic ignored"
                );
            }
        }
        Ok(())
    }

    /// A request a fault delays: it runs `delay` from now, as if it had
    /// arrived then, unless this connection ended meanwhile (the request is
    /// lost with it, as it would be on the network).
    fn run_later(
        &self,
        delay: Duration,
        request: &Request<'_>,
        reply_to: ReplyTo,
        action: Action,
        policy: Option<Arc<Policy>>,
    ) {
        let owned = OwnedRequest {
            payload: request.payload.to_vec(),
            timestamp: request.timestamp.map(str::to_owned),
            fencing_token: request.fencing_token.map(str::to_owned),
            persist: request.persist,
            dialect: request.dialect,
        };
        let (store, sessions) = (Arc::clone(&self.store), Arc::clone(&self.sessions));
        let (client_id, connection) = (self.client_id.clone(), self.id);
        let principal = Arc::clone(&self.principal);
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            if !sessions.is_live(&client_id, connection) {
                tracing::info!(
                    client_id,
                    "a delayed request is lost: its connection ended meanwhile"
                );
                return;
            }
            let rules = policy.as_deref().map(|policy| KeyRules {
                policy,
                principal: &principal,
            });
            let request = Request {
                payload: &owned.payload,
                timestamp: owned.timestamp.as_deref(),
                fencing_token: owned.fencing_token.as_deref(),
                persist: owned.persist,
                dialect: owned.dialect,
                access: rules.as_ref().map(|r| r as &dyn statestore::KeyAccess),
            };
            let caller = Caller {
                client_id: &client_id,
                connection,
            };
            run_planned(&store, &request, caller, reply_to, action);
        });
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

/// Runs a request as a fault's plan says: executed and answered, answered
/// with its `-ERR`, executed and not answered, or neither. Returns the
/// persistence batch the answer waits for (0: none).
fn run_planned(
    store: &Arc<StateStoreService>,
    request: &Request<'_>,
    caller: Caller<'_>,
    reply_to: ReplyTo,
    action: Action,
) -> u64 {
    match action {
        Action::Execute => store.serve(request, caller, Some(reply_to)),
        Action::Error(text) => {
            store.refuse(reply_to, caller.client_id, &text);
            0
        }
        Action::DropAfter => store.serve(request, caller, None),
        Action::DropBefore => 0,
    }
}
