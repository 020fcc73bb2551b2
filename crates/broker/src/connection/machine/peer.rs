//! What a connection does with the publishes of another cluster node's
//! link, and with the marks only links may set: a message the other node
//! hands over for one client's session (see `crate::cluster::handover`),
//! a QoS 2 publish it sends again (its origin, see
//! `crate::cluster::origins`), and a client's publish that carries such a
//! mark (removed).

use router::protocol::{Publish, PublishProperties};

use super::Machine;

impl Machine {
    /// A publish from another node's link that this node handles itself:
    /// a message handed over for one client (delivered to it alone), or a
    /// QoS 2 copy sent again of one it had; `None` once it is handled
    /// (acknowledged). Otherwise the publish, its origin taken off and
    /// kept until its PUBREL (see `cluster::origins`).
    pub(super) fn on_peer_publish(
        &mut self,
        publish: Publish,
        mut properties: Option<PublishProperties>,
        qos: u8,
        pkid: u16,
    ) -> Option<(Publish, Option<PublishProperties>)> {
        // Another node says how far a node whose link broke had its
        // publishes (see `cluster::recent`).
        if let Some(said) = take(properties.as_mut(), crate::publisher::HAD) {
            self.shared.heard_had(&self.client_id, &said);
            self.ack(qos, pkid, true);
            return None;
        }
        // Another node has handed over all it had queued for a session
        // that moved here.
        if let Some(client) = take(properties.as_mut(), crate::publisher::HANDOVER_DONE) {
            if self.shared.handover_welcome(&self.client_id, &client) {
                self.shared.sessions.handover_done(&client);
            }
            self.ack(qos, pkid, true);
            return None;
        }
        // Another node hands over what it had queued for a session that
        // moved here: for that client alone.
        if let Some((client, kept_pkid, retain)) = handed_over(properties.as_mut()) {
            // The stamp stays on the message (never written to the
            // client), should the session move on before the client has it.
            let stamp = crate::publisher::stamp_of(properties.as_ref()).map(str::to_owned);
            if self.shared.handover_welcome(&self.client_id, &client) {
                let publish = Publish { retain, ..publish };
                let message = crate::sessions::Direct::handed_over(publish, properties, kept_pkid);
                // One in flight to the client goes under the id it saw
                // (the client takes it for the one it had); the others,
                // unless this node's router gave the session its own copy
                // (see `cluster::stamps`).
                let message = match stamp.filter(|_| kept_pkid.is_none()) {
                    Some(stamp) => self.shared.stamped_handover(&client, &stamp, message),
                    None => Some(message),
                };
                if let Some(mut message) = message {
                    // Kept in etcd here too until the client has it: the
                    // node it came from removes its own copy now.
                    self.shared.keep_handed_over(&client, &mut message);
                    self.shared.sessions.deliver_handed_over(&client, message);
                }
            } else {
                tracing::debug!(
                    client_id = client,
                    link = self.client_id,
                    "a handed-over message dropped: etcd gave the session's messages when that node left"
                );
            }
            self.ack(qos, pkid, true);
            return None;
        }
        // A QoS 2 publish another node forwarded: sent again there after
        // its first copy came here and was released, had (see
        // `cluster::origins`); otherwise had once its PUBREL releases it.
        if let Some(origin) = take(properties.as_mut(), crate::publisher::ORIGIN) {
            if self.shared.had_copy_from_another_node(&origin) {
                tracing::debug!(
                    origin,
                    "a QoS 2 publish sent again, had from its first node"
                );
                self.ack(qos, pkid, true);
                return None;
            }
            self.shared.hold_qos2(&self.client_id, pkid, Some(origin));
        }
        // Noted before the router has it (a QoS 2 one: its PUBREL, see
        // `cluster::stamps`); the stamp stays on the router's copy, for a
        // handover from here.
        if let Some(stamp) = crate::publisher::stamp_of(properties.as_ref()) {
            self.shared.stamp_arrived(
                &self.client_id,
                qos,
                pkid,
                stamp,
                &publish,
                properties.as_ref(),
            );
        }
        Some((publish, properties))
    }
}

/// Removes from a client's publish the marks only links may set: a
/// client cannot keep its message from a shared subscription
/// (`router::NOT_FOR_GROUP`), nor have other nodes deliver it to one
/// client alone as if handed over (`crate::publisher::HANDOVER`,
/// `HANDOVER_PKID`, `HANDOVER_DONE`), nor pass its publish for another's sent again
/// (`crate::publisher::ORIGIN`), nor speak for a node (`crate::publisher::HAD`).
pub(super) fn unmarked(properties: &mut Option<PublishProperties>, client_id: &str) {
    const MARKS: [&str; 8] = [
        router::NOT_FOR_GROUP,
        crate::publisher::HAD,
        crate::publisher::HANDOVER,
        crate::publisher::HANDOVER_DONE,
        crate::publisher::HANDOVER_PKID,
        crate::publisher::HANDOVER_RETAIN,
        crate::publisher::ORIGIN,
        crate::publisher::STAMP,
    ];
    if let Some(p) = properties
        && p.user_properties
            .iter()
            .any(|(k, _)| MARKS.contains(&k.as_ref()))
    {
        p.user_properties
            .retain(|(k, _)| !MARKS.contains(&k.as_ref()));
        tracing::debug!(
            client_id,
            "publish: the broker's own User Properties (statebroker:not-for-group, statebroker:had, statebroker:handover, statebroker:handover-done, statebroker:handover-pkid, statebroker:handover-retain, statebroker:origin, statebroker:stamp) removed"
        );
    }
}

/// The value of the broker's own User Property `key` on a publish from
/// another node's link (`crate::publisher::ORIGIN`), removed.
fn take(properties: Option<&mut PublishProperties>, key: &str) -> Option<String> {
    let user = &mut properties?.user_properties;
    let at = user.iter().position(|(k, _)| k == key)?;
    Some(user.remove(at).1.into())
}

/// The client a publish from another node's link is handed over to (see
/// `crate::publisher::HANDOVER`), for a QoS 2 message that node had
/// in flight the packet id the client saw (`HANDOVER_PKID`), and whether
/// it goes with RETAIN 1 (`HANDOVER_RETAIN`); their User Properties
/// removed.
fn handed_over(properties: Option<&mut PublishProperties>) -> Option<(String, Option<u16>, bool)> {
    let properties = properties?;
    let user = &mut properties.user_properties;
    let at = user
        .iter()
        .position(|(k, _)| k == crate::publisher::HANDOVER)?;
    let client = user.remove(at).1.into();
    let kept_pkid = user
        .iter()
        .position(|(k, _)| k == crate::publisher::HANDOVER_PKID)
        .and_then(|at| user.remove(at).1.parse::<u16>().ok())
        .filter(|&pkid| pkid > 0);
    let retain = user
        .iter()
        .position(|(k, _)| k == crate::publisher::HANDOVER_RETAIN)
        .map(|at| user.remove(at))
        .is_some();
    Some((client, kept_pkid, retain))
}
