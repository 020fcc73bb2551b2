//! The state store's MQTT face: which PUBLISH is a request and whether it
//! may be served, and the exact properties of responses and notifications.
//!
//! # Requests
//!
//! A PUBLISH on [`topics::REQUEST_TOPIC`] (or, with the 2023 protocol on,
//! [`topics::LEGACY_REQUEST_TOPIC`]) is a request. [`admit`] decides, in this
//! order:
//!
//! 1. a Response Topic that is reserved (a request topic, or the store's
//!    notification namespace) is an attempt to make the store publish where
//!    only it may: the client is disconnected with 0x87 "not authorized";
//! 2. a Response Topic that is not a valid topic name: disconnected, 0x82;
//! 3. no Response Topic: nowhere to answer, so nothing is executed;
//! 4. QoS 0, or no Correlation Data: not executed, answered with an `-ERR`
//!    that says why;
//! 5. otherwise served, with `__ts`, `__ft` and `aio-persistence` taken from
//!    the user properties. The caller is always the connection's client id;
//!    `__srcId` and anything else in the payload are never trusted.
//!
//! # Responses and notifications
//!
//! Both are QoS 1 with content type `application/octet-stream` and user
//! properties `__ts` (a version) and `__protVer` = `1.0`. A response also
//! carries the request's Correlation Data and `__stat` = `200`, which the
//! official Rust client requires on every RESP3 answer, `-ERR` ones included.

use bytes::Bytes;
use router::protocol::{self, DisconnectReasonCode};
use statestore::hlc::Stamp;
use statestore::{Dialect, Notice, Request};

use crate::request_publish::RequestPublish;

use crate::sessions::{Answer, Correlation, Direct, DirectProperties, FixedProperties};
use crate::topics;

/// Content type of every state store payload.
pub const CONTENT_TYPE: &str = "application/octet-stream";

/// Where a response goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplyTo {
    /// The request's Response Topic (shared with the connection's answer
    /// route when it is that route's topic, see [`admit`]).
    pub topic: Bytes,
    /// The request's Correlation Data.
    pub correlation: Option<Correlation>,
    /// The client sent it again (MQTT DUP), as after a reconnection: a
    /// cluster node answers with the key's last write if that write was
    /// this request's, instead of running it twice.
    pub resent: bool,
    /// A cluster node's: the requesting connection's acknowledgement waits
    /// until this is dropped, once the outcome is out (see
    /// [`super::tickets`]).
    pub ticket: Option<super::tickets::Ticket>,
    /// The way answers on `topic` reached the requester last, kept by its
    /// connection (see [`crate::sessions::Route`]).
    pub route: Option<std::sync::Arc<crate::sessions::Route>>,
}

/// What to do with a request that passed the connection-ending checks.
#[derive(Debug)]
pub enum Admission<'a> {
    /// Execute it and answer to `ReplyTo`.
    Serve(Request<'a>, ReplyTo),
    /// Answer `-ERR <text>` without executing it.
    Refuse(ReplyTo, &'static str),
    /// No Response Topic: nothing to execute, nowhere to answer.
    Ignore,
}

/// A request that ends the connection: the reason code and why.
pub type Violation = (DisconnectReasonCode, String);

/// Which protocol generation a PUBLISH on `topic` speaks, if it is a request.
pub fn dialect(topic: &str, legacy_2023: bool) -> Option<Dialect> {
    if topic == topics::REQUEST_TOPIC {
        Some(Dialect::V1)
    } else if legacy_2023 && topic == topics::LEGACY_REQUEST_TOPIC {
        Some(Dialect::Legacy2023)
    } else {
        None
    }
}

/// Checks a request's Response Topic (the rules that disconnect). Call
/// before acknowledging the PUBLISH: a client that is disconnected for it
/// gets no PUBACK.
pub fn check_response_topic(response_topic: Option<&str>) -> Result<(), Violation> {
    let Some(topic) = response_topic else {
        return Ok(());
    };
    if topics::is_reserved_response_topic(topic) {
        return Err((
            DisconnectReasonCode::NotAuthorized,
            format!("response topic {topic} is reserved"),
        ));
    }
    if topic.is_empty() || !protocol::valid_topic(topic) {
        return Err((
            DisconnectReasonCode::ProtocolError,
            "response topic is not a valid topic name".into(),
        ));
    }
    Ok(())
}

/// Decides what to do with a request whose Response Topic passed
/// [`check_response_topic`] (see the module docs for the order). `known`:
/// the topic of the requester's answer route (see
/// [`crate::sessions::Route`]), taken for the Response Topic when it is
/// the same.
pub fn admit<'a>(
    request: &RequestPublish<'a>,
    dialect: Dialect,
    known: Option<&Bytes>,
) -> Admission<'a> {
    let Some(topic) = request.response_topic else {
        return Admission::Ignore;
    };
    let reply_to = ReplyTo {
        // The route's, or a copy, as the correlation data's below.
        topic: match known {
            Some(known) if known == topic.as_bytes() => known.clone(),
            _ => Bytes::copy_from_slice(topic.as_bytes()),
        },
        // A copy (inline up to its size): a slice would keep the whole
        // read buffer alive for as long as the router keeps the response.
        correlation: request.correlation_data.map(Correlation::from_slice),
        resent: false,
        ticket: None,
        route: None,
    };
    if request.qos == 0 {
        return Admission::Refuse(reply_to, "requests must be published with QoS 1");
    }
    if reply_to.correlation.is_none() {
        return Admission::Refuse(reply_to, "requests must carry correlation data");
    }
    // The first of each name, in one look at them.
    let (mut timestamp, mut fencing_token, mut persist) = (None, None, None);
    for (name, value) in request.user_properties() {
        let slot = match name {
            "__ts" => &mut timestamp,
            "__ft" => &mut fencing_token,
            "aio-persistence" => &mut persist,
            _ => continue,
        };
        slot.get_or_insert(value);
    }
    let request = Request {
        payload: request.payload,
        timestamp,
        fencing_token,
        persist: persist.is_some_and(|v: &str| v.eq_ignore_ascii_case("true")),
        dialect,
        access: None,
    };
    Admission::Serve(request, reply_to)
}

/// The response to a request: `payload` on the Response Topic, with the
/// request's Correlation Data, `__stat` = `200` and `__ts` = `timestamp`.
pub fn response(reply_to: ReplyTo, payload: Vec<u8>, timestamp: Stamp) -> Direct {
    answer(reply_to, payload, timestamp).into_direct()
}

/// [`response`]'s parts, for the requester's connection to encode (see
/// [`Answer`]).
pub fn answer(reply_to: ReplyTo, payload: Vec<u8>, timestamp: Stamp) -> Answer {
    Answer {
        topic: reply_to.topic,
        payload,
        fixed: &ANSWER,
        correlation_data: reply_to.correlation,
        varying: ("__ts", timestamp),
        qos: 1,
        subscription_identifiers: Vec::new(),
    }
}

/// What every answer carries besides its Correlation Data and `__ts`.
static ANSWER: FixedProperties =
    FixedProperties::new(CONTENT_TYPE, &[("__stat", "200"), ("__protVer", "1.0")]);

/// What every notification carries besides its `__ts`.
static NOTIFICATION: FixedProperties = FixedProperties::new(CONTENT_TYPE, &[("__protVer", "1.0")]);

/// The notifications of `notice`, one per watcher, each on the watcher's
/// own notification topic, with `__ts` = the key's version.
pub fn notifications(notice: &Notice) -> impl Iterator<Item = (&str, Direct)> {
    let payload = Bytes::from(notice.payload());
    notice.watchers.iter().map(move |watcher| {
        let message = Direct {
            topic: Bytes::from(topics::notification_topic(watcher, &notice.key)),
            payload: payload.clone(),
            properties: DirectProperties::Fixed {
                fixed: &NOTIFICATION,
                correlation_data: None,
                varying: ("__ts", notice.version.clone()),
                subscription_identifiers: Vec::new(),
            },
            qos: 1,
            handed_over: false,
            retain: false,
            kept_pkid: None,
            on_done: None,
        };
        (&**watcher, message)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use router::protocol::{Publish, PublishProperties};
    use statestore::Event;

    /// The request of `publish` with `properties` at `qos`.
    fn request<'a>(
        publish: &'a Publish,
        properties: &'a PublishProperties,
        qos: u8,
    ) -> RequestPublish<'a> {
        RequestPublish::decoded(publish, Some(properties), (qos, 1, false))
    }

    const RESPONSE: &str = "clients/c1/services/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke/response";

    fn props(response_topic: Option<&str>, correlation: Option<&[u8]>) -> PublishProperties {
        PublishProperties {
            response_topic: response_topic.map(Into::into),
            correlation_data: correlation.map(Bytes::copy_from_slice),
            user_properties: vec![
                ("__ts".into(), "1:0:c1".into()),
                ("__ft".into(), "2:0:c1".into()),
                ("aio-persistence".into(), "TRUE".into()),
                ("__srcId".into(), "someone-else".into()),
            ],
            ..PublishProperties::default()
        }
    }

    #[test]
    fn request_topics() {
        assert_eq!(dialect(topics::REQUEST_TOPIC, false), Some(Dialect::V1));
        assert_eq!(
            dialect(topics::LEGACY_REQUEST_TOPIC, true),
            Some(Dialect::Legacy2023)
        );
        assert_eq!(dialect(topics::LEGACY_REQUEST_TOPIC, false), None);
        assert_eq!(dialect("sensors/temp", true), None);
    }

    #[test]
    fn response_topics_that_disconnect() {
        for reserved in [
            topics::REQUEST_TOPIC.to_owned(),
            topics::LEGACY_REQUEST_TOPIC.to_owned(),
            format!("{}/x", topics::NOTIFY_NAMESPACE),
        ] {
            let code = check_response_topic(Some(&reserved)).unwrap_err().0;
            assert_eq!(code, DisconnectReasonCode::NotAuthorized, "{reserved}");
        }
        for invalid in ["", "a/+/b", "a/#"] {
            let code = check_response_topic(Some(invalid)).unwrap_err().0;
            assert_eq!(code, DisconnectReasonCode::ProtocolError, "{invalid:?}");
        }
        assert!(check_response_topic(Some(RESPONSE)).is_ok());
        assert!(check_response_topic(None).is_ok());
    }

    #[test]
    fn admission() {
        let x = Publish::new("t", "x", false);
        let payload = Publish::new("t", "payload", false);
        let no_topic = props(None, Some(b"c"));
        assert!(matches!(
            admit(&request(&x, &no_topic, 1), Dialect::V1, None),
            Admission::Ignore
        ));
        let p = props(Some(RESPONSE), Some(b"c"));
        match admit(&request(&x, &p, 0), Dialect::V1, None) {
            Admission::Refuse(to, text) => {
                assert_eq!(to.topic, RESPONSE);
                assert_eq!(text, "requests must be published with QoS 1");
            }
            other => panic!("{other:?}"),
        }
        let uncorrelated = props(Some(RESPONSE), None);
        assert!(matches!(
            admit(&request(&x, &uncorrelated, 1), Dialect::V1, None),
            Admission::Refuse(_, "requests must carry correlation data")
        ));
        match admit(&request(&payload, &p, 1), Dialect::Legacy2023, None) {
            Admission::Serve(request, to) => {
                assert_eq!(request.payload, b"payload");
                assert_eq!(request.timestamp, Some("1:0:c1"));
                assert_eq!(request.fencing_token, Some("2:0:c1"));
                assert!(request.persist);
                assert_eq!(request.dialect, Dialect::Legacy2023);
                assert_eq!(to.correlation.as_deref(), Some(&b"c"[..]));
            }
            other => panic!("{other:?}"),
        }
        // The answer route's topic is taken when it is the Response Topic
        // (shared, not copied); another is not.
        let known = Bytes::copy_from_slice(RESPONSE.as_bytes());
        match admit(&request(&payload, &p, 1), Dialect::V1, Some(&known)) {
            Admission::Serve(_, to) => assert_eq!(to.topic.as_ptr(), known.as_ptr()),
            other => panic!("{other:?}"),
        }
        let elsewhere = Bytes::from_static(b"clients/other/response");
        match admit(&request(&payload, &p, 1), Dialect::V1, Some(&elsewhere)) {
            Admission::Serve(_, to) => assert_eq!(to.topic, RESPONSE),
            other => panic!("{other:?}"),
        }
    }

    fn user(message: &Direct, name: &str) -> Option<String> {
        published(message)
            .user_properties
            .into_iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.into())
    }

    /// The message's properties as a publish has them.
    fn published(message: &Direct) -> PublishProperties {
        message.properties.clone().into_publish()
    }

    #[test]
    fn response_properties() {
        let to = ReplyTo {
            topic: Bytes::from_static(RESPONSE.as_bytes()),
            correlation: Some(Correlation::from_slice(b"corr")),
            resent: false,
            ticket: None,
            route: None,
        };
        let r = response(to, b"-ERR syntax error\r\n".to_vec(), "1:2:n".into());
        assert_eq!((&r.topic[..], r.qos), (RESPONSE.as_bytes(), 1));
        assert_eq!(published(&r).content_type.as_deref(), Some(CONTENT_TYPE));
        assert_eq!(
            published(&r).correlation_data.as_deref(),
            Some(&b"corr"[..])
        );
        assert_eq!(user(&r, "__stat").as_deref(), Some("200"));
        assert_eq!(user(&r, "__ts").as_deref(), Some("1:2:n"));
        assert_eq!(user(&r, "__protVer").as_deref(), Some("1.0"));
    }

    #[test]
    fn notification_per_watcher() {
        let notice = Notice {
            key: b"k".to_vec(),
            event: Event::Delete,
            version: "5:0:n".into(),
            watchers: vec!["a".into(), "b".into()],
        };
        let all: Vec<_> = notifications(&notice).collect();
        assert_eq!(all.len(), 2);
        for (watcher, n) in all {
            assert_eq!(n.topic, topics::notification_topic(watcher, b"k"));
            assert_eq!(&n.payload[..], b"*2\r\n$6\r\nNOTIFY\r\n$6\r\nDELETE\r\n");
            assert_eq!(user(&n, "__ts").as_deref(), Some("5:0:n"));
            assert_eq!(user(&n, "__stat"), None);
            assert_eq!(published(&n).content_type.as_deref(), Some(CONTENT_TYPE));
        }
    }

    /// An answer's properties, written from their fixed parts, encode to
    /// the same bytes as the publish properties they stand for, and decode
    /// back to them (Subscription Identifiers added on delivery included).
    #[test]
    fn an_answer_encodes_as_its_publish_properties_do() {
        use crate::codec::{EncodeProperties, Protocol, encode_publish};
        fn encode(m: &Direct, properties: &impl EncodeProperties) -> bytes::BytesMut {
            let mut out = bytes::BytesMut::new();
            encode_publish(
                Protocol::V5,
                &m.topic,
                &m.payload,
                1,
                9,
                properties,
                &mut out,
            );
            out
        }
        let to = ReplyTo {
            topic: Bytes::from_static(RESPONSE.as_bytes()),
            correlation: Some(Correlation::from_slice(b"corr")),
            resent: false,
            ticket: None,
            route: None,
        };
        let mut r = response(to, b"+OK\r\n".to_vec(), "1:2:n".into());
        r.properties.set_subscription_identifiers(vec![7, 300]);
        let properties = published(&r);
        let mut fixed = encode(&r, &r.properties);
        assert_eq!(fixed, encode(&r, &properties));
        match Protocol::V5.decode(&mut fixed, 1 << 20) {
            Ok(router::protocol::Packet::Publish(p, Some(decoded))) => {
                assert_eq!(&p.payload[..], b"+OK\r\n");
                assert_eq!(decoded, properties);
            }
            other => panic!("{other:?}"),
        }
        // A notification, the same.
        let notice = Notice {
            key: b"k".to_vec(),
            event: Event::Delete,
            version: "5:0:n".into(),
            watchers: vec!["a".into()],
        };
        let (_, n) = notifications(&notice).next().unwrap();
        assert_eq!(encode(&n, &n.properties), encode(&n, &published(&n)));
    }
}
