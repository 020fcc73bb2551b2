//! Which filters of a SUBSCRIBE the broker lets through to the router.
//!
//! Refused here, per filter (MQTT 5 with the reason code, 3.1.1 with 0x80):
//!
//! - invalid filters, and `$share/` without a Share Name (or one with `+`
//!   or `#`) and a filter: 0x8F ([MQTT-4.8.2-1], [MQTT-4.8.2-2]);
//! - `$`-topics other than the broker's `$SYS/...` statistics (rumqttd
//!   would disconnect the client for them), shared or not: 0x87;
//! - another client's part of the state store's notification namespace, by
//!   name: 0x87 (see [`crate::topics::may_subscribe`]).
//!
//! The rest go to the router, whose SUBACK lacks the refused ones: they are
//! put back in their places before the SUBACK reaches the client.

use std::collections::HashMap;

use router::protocol::{
    self, Filter, Packet, SubAck, SubscribeReasonCode, UnsubAck, UnsubAckReason, Unsubscribe,
};

use crate::authorization::{Policy, Principal};
use crate::codec::Protocol;
use crate::topics;

/// Why the broker refuses `filter` for the client whose id hex-encodes to
/// `own_hex`, if it does.
pub(crate) fn refusal(filter: &str, own_hex: &str) -> Option<SubscribeReasonCode> {
    // A shared subscription's Topic Filter follows `$share/{group}/`: the
    // `$` rule is its (`$share/g/$x/#` was let through while `$x/#` was
    // refused).
    let topic_filter = filter
        .strip_prefix("$share/")
        .and_then(|rest| rest.split_once('/'))
        .map_or(filter, |(_, f)| f);
    if !protocol::valid_filter(filter) || !valid_shared(filter) {
        Some(SubscribeReasonCode::TopicFilterInvalid)
    } else if topic_filter.starts_with('$') && !crate::topics::is_sys_topic(topic_filter)
        || !topics::may_subscribe(filter, own_hex)
    {
        Some(SubscribeReasonCode::NotAuthorized)
    } else {
        None
    }
}

/// Whether `filter`, if it is a shared subscription's, has a Share Name of
/// at least one character without `+` or `#` ([MQTT-4.8.2-1]; `/` cannot
/// be in it), then `/` and a Topic Filter ([MQTT-4.8.2-2]). The filter as a
/// whole passed [`protocol::valid_filter`].
fn valid_shared(filter: &str) -> bool {
    match filter.strip_prefix("$share/") {
        None => true,
        Some(rest) => rest.split_once('/').is_some_and(|(share_name, filter)| {
            !share_name.is_empty() && !share_name.contains(['+', '#']) && !filter.is_empty()
        }),
    }
}

/// The reason code a client of `protocol` is told for a refusal.
pub(crate) fn failure(protocol: Protocol, code: SubscribeReasonCode) -> SubscribeReasonCode {
    match protocol {
        Protocol::V4 => SubscribeReasonCode::Failure,
        Protocol::V5 => code,
    }
}

/// The filters of one SUBSCRIBE, sorted.
#[derive(Debug, Default)]
pub(crate) struct Checked {
    /// For the router.
    pub allowed: Vec<Filter>,
    /// `(position in the SUBSCRIBE, reason code)` of the refused ones.
    pub refused: Vec<(usize, SubscribeReasonCode)>,
}

/// Sorts `filters` into allowed and refused (logging each refusal).
/// With a policy, a filter must also be one the client may subscribe to
/// (its own notification topic needs no rule: the store's key rules
/// govern what it hears there).
pub(crate) fn check(
    filters: Vec<Filter>,
    own_hex: &str,
    protocol: Protocol,
    client_id: &str,
    policy: Option<(&Policy, &Principal)>,
) -> Checked {
    let mut checked = Checked::default();
    for (position, filter) in filters.into_iter().enumerate() {
        let denied = || {
            policy.is_some_and(|(policy, principal)| {
                !topics::in_notify_namespace(&filter.path)
                    && !policy.may_subscribe(principal, &filter.path)
            })
        };
        let code = refusal(&filter.path, own_hex)
            .or_else(|| denied().then_some(SubscribeReasonCode::NotAuthorized));
        match code {
            Some(code) => {
                tracing::info!(
                    client_id,
                    filter = filter.path,
                    ?code,
                    "subscription refused"
                );
                checked.refused.push((position, failure(protocol, code)));
            }
            None => checked.allowed.push(filter),
        }
    }
    checked
}

/// The UNSUBACK of a connection that has not joined the router: it has no
/// subscription, so none existed (MQTT 5 0x11; 3.1.1 clients see a plain
/// UNSUBACK).
pub(crate) fn unsuback_without_subscriptions(unsubscribe: &Unsubscribe) -> Packet {
    Packet::UnsubAck(
        UnsubAck {
            pkid: unsubscribe.pkid,
            reasons: vec![UnsubAckReason::NoSubscriptionExisted; unsubscribe.filters.len()],
        },
        None,
    )
}

/// Refusals waiting for the router's SUBACK, by SUBSCRIBE packet id.
#[derive(Debug, Default)]
pub(crate) struct PendingRefusals {
    by_pkid: HashMap<u16, Vec<(usize, SubscribeReasonCode)>>,
}

impl PendingRefusals {
    /// Keeps the refusals of SUBSCRIBE `pkid` until its SUBACK.
    pub fn hold(&mut self, pkid: u16, refused: Vec<(usize, SubscribeReasonCode)>) {
        if !refused.is_empty() {
            self.by_pkid.insert(pkid, refused);
        }
    }

    /// Puts the refusals back into the router's SUBACK, in their places.
    pub fn complete(&mut self, suback: &mut SubAck) {
        if let Some(refused) = self.by_pkid.remove(&suback.pkid) {
            for (position, code) in refused {
                let at = position.min(suback.return_codes.len());
                suback.return_codes.insert(at, code);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use router::protocol::{QoS, RetainForwardRule};

    const OWN: &str = "6331"; // "c1"

    fn filter(path: &str) -> Filter {
        Filter {
            path: path.into(),
            qos: QoS::AtLeastOnce,
            nolocal: false,
            preserve_retain: false,
            retain_forward_rule: RetainForwardRule::OnEverySubscribe,
        }
    }

    #[test]
    fn refusals() {
        use SubscribeReasonCode as R;
        let ns = topics::NOTIFY_NAMESPACE;
        for (path, expected) in [
            ("sensors/+/temp", None),
            ("#", None),
            ("$share/g/jobs/#", None),
            ("a/#/b", Some(R::TopicFilterInvalid)),
            ("$share/g", Some(R::TopicFilterInvalid)),
            ("$share/g/a", None),
            ("$share/g/+", None),
            ("$share/g//", None),
            ("$share//a", Some(R::TopicFilterInvalid)),
            ("$share/g/", Some(R::TopicFilterInvalid)),
            ("$share/+/a", Some(R::TopicFilterInvalid)),
            ("$share/g+/a", Some(R::TopicFilterInvalid)),
            ("$share/#/a", Some(R::TopicFilterInvalid)),
            ("$share/", Some(R::TopicFilterInvalid)),
            ("$SYS/#", None),
            ("$SYS/broker/uptime", None),
            ("$SYSTEM/#", Some(R::NotAuthorized)),
            ("$other/x", Some(R::NotAuthorized)),
            ("$share/g/$other/#", Some(R::NotAuthorized)),
            ("$share/g/$SYS/#", None),
            (&format!("{ns}/{OWN}/command/notify/+"), None),
            (
                &format!("{ns}/6332/command/notify/+"),
                Some(R::NotAuthorized),
            ),
            (&format!("{ns}/+/command/notify/+"), None),
        ] {
            assert_eq!(refusal(path, OWN), expected, "{path}");
        }
    }

    #[test]
    fn refused_filters_return_to_their_places() {
        let filters = vec![
            filter("$other/x"),
            filter("ok/1"),
            filter("a/#/b"),
            filter("ok/2"),
        ];
        let checked = check(filters, OWN, Protocol::V5, "c1", None);
        let allowed: Vec<_> = checked.allowed.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(allowed, ["ok/1", "ok/2"]);
        let mut pending = PendingRefusals::default();
        pending.hold(9, checked.refused);
        let granted = SubscribeReasonCode::Success(QoS::AtLeastOnce);
        let mut other = SubAck {
            pkid: 8,
            return_codes: vec![granted],
        };
        pending.complete(&mut other);
        assert_eq!(other.return_codes, vec![granted], "another SUBSCRIBE");
        let mut suback = SubAck {
            pkid: 9,
            return_codes: vec![granted, granted],
        };
        pending.complete(&mut suback);
        assert_eq!(
            suback.return_codes,
            vec![
                SubscribeReasonCode::NotAuthorized,
                granted,
                SubscribeReasonCode::TopicFilterInvalid,
                granted
            ]
        );
    }

    #[test]
    fn mqtt_3_1_1_hears_failure() {
        let checked = check(vec![filter("$other/x")], OWN, Protocol::V4, "c1", None);
        assert_eq!(checked.refused, vec![(0, SubscribeReasonCode::Failure)]);
    }
}
