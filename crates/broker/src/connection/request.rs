//! A state store request from this connection: the Response Topic rules
//! (a reserved one disconnects), the authorization policy (answers go only
//! where the caller may subscribe; its key rules go with the request), the
//! acknowledgement, admission by the binding, and the hand-off to the store.

use rumqttd::protocol::{Publish, PublishProperties};
use statestore::{Caller, Dialect};

use super::end::End;
use super::socket::Stream;
use super::task::Connection;
use crate::authorization::KeyRules;
use crate::store::binding::{self, Admission};

impl<S: Stream> Connection<S> {
    /// A state store request: checked by the binding, acknowledged here,
    /// executed by the store.
    pub(super) fn on_request(
        &mut self,
        publish: Publish,
        properties: Option<PublishProperties>,
        qos: u8,
        pkid: u16,
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
        // A QoS 2 duplicate of a request already executed: acknowledge again only.
        let duplicate = self.inbound.is_duplicate(qos, pkid);
        self.ack(qos, pkid, true);
        if duplicate {
            return Ok(());
        }
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
                self.store.serve(&request, caller, reply_to);
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
}
