#![allow(dead_code, unused)]

pub mod v4;
pub mod v5;

use std::{io, str::Utf8Error, string::FromUtf8Error};

/// This module is the place where all the protocol specifics gets abstracted
/// out and creates a structures which are common across protocols. Since,
/// MQTT is the core protocol that this broker supports, a lot of structs closely
/// map to what MQTT specifies in its protocol
use bytes::{Buf, BufMut, Bytes, BytesMut};
pub use bytestring::ByteString;

use crate::Notification;

// TODO: Handle the cases when there are no properties using Inner struct, so
// handling of properties can be made simplier internally

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Packet {
    // statebroker patch 31: the large parts of CONNECT and CONNACK are
    // boxed, so that a `Packet` is as large as a PUBLISH with its
    // properties (216 bytes), not a CONNECT's 392: every packet is moved
    // several times between the socket and the router.
    Connect(
        Connect,
        Option<Box<ConnectProperties>>,
        Option<Box<LastWill>>,
        Option<Box<LastWillProperties>>,
        Option<Login>,
    ),
    ConnAck(ConnAck, Option<Box<ConnAckProperties>>),
    Publish(Publish, Option<PublishProperties>),
    PubAck(PubAck, Option<PubAckProperties>),
    PingReq(PingReq),
    PingResp(PingResp),
    Subscribe(Subscribe, Option<SubscribeProperties>),
    SubAck(SubAck, Option<SubAckProperties>),
    PubRec(PubRec, Option<PubRecProperties>),
    PubRel(PubRel, Option<PubRelProperties>),
    PubComp(PubComp, Option<PubCompProperties>),
    Unsubscribe(Unsubscribe, Option<UnsubscribeProperties>),
    UnsubAck(UnsubAck, Option<UnsubAckProperties>),
    Disconnect(Disconnect, Option<DisconnectProperties>),
}

//--------------------------- Connect packet -------------------------------
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PingReq;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PingResp;

/// Connection packet initiated by the client
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connect {
    /// Mqtt keep alive time
    pub keep_alive: u16,
    /// Client Id
    pub client_id: String,
    /// Clean session. Asks the broker to clear previous state
    pub clean_session: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectProperties {
    /// Expiry interval property after loosing connection
    pub session_expiry_interval: Option<u32>,
    /// Maximum simultaneous packets
    pub receive_maximum: Option<u16>,
    /// Maximum packet size
    pub max_packet_size: Option<u32>,
    /// Maximum mapping integer for a topic
    pub topic_alias_max: Option<u16>,
    pub request_response_info: Option<u8>,
    pub request_problem_info: Option<u8>,
    /// List of user properties
    pub user_properties: Vec<(String, String)>,
    /// Method of authentication
    pub authentication_method: Option<String>,
    /// Authentication data
    pub authentication_data: Option<Bytes>,
}

/// LastWill that broker forwards on behalf of the client
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastWill {
    pub topic: Bytes,
    pub message: Bytes,
    pub qos: QoS,
    pub retain: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastWillProperties {
    pub delay_interval: Option<u32>,
    pub payload_format_indicator: Option<u8>,
    pub message_expiry_interval: Option<u32>,
    pub content_type: Option<String>,
    pub response_topic: Option<String>,
    pub correlation_data: Option<Bytes>,
    pub user_properties: Vec<(String, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Login {
    pub username: String,
    pub password: String,
}

//--------------------------- ConnectAck packet -------------------------------

/// Return code in connack
// This contains return codes for both MQTT v311 and v5
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectReturnCode {
    Success,
    RefusedProtocolVersion,
    ServiceUnavailable,
    UnspecifiedError,
    MalformedPacket,
    ProtocolError,
    ImplementationSpecificError,
    UnsupportedProtocolVersion,
    ClientIdentifierNotValid,
    BadUserNamePassword,
    NotAuthorized,
    ServerUnavailable,
    ServerBusy,
    Banned,
    BadAuthenticationMethod,
    TopicNameInvalid,
    PacketTooLarge,
    QuotaExceeded,
    PayloadFormatInvalid,
    RetainNotSupported,
    QoSNotSupported,
    UseAnotherServer,
    ServerMoved,
    ConnectionRateExceeded,
}

/// Acknowledgement to connect packet
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnAck {
    pub session_present: bool,
    pub code: ConnectReturnCode,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConnAckProperties {
    pub session_expiry_interval: Option<u32>,
    pub receive_max: Option<u16>,
    pub max_qos: Option<u8>,
    pub retain_available: Option<u8>,
    pub max_packet_size: Option<u32>,
    pub assigned_client_identifier: Option<String>,
    pub topic_alias_max: Option<u16>,
    pub reason_string: Option<String>,
    pub user_properties: Vec<(String, String)>,
    pub wildcard_subscription_available: Option<u8>,
    pub subscription_identifiers_available: Option<u8>,
    pub shared_subscription_available: Option<u8>,
    pub server_keep_alive: Option<u16>,
    pub response_information: Option<String>,
    pub server_reference: Option<String>,
    pub authentication_method: Option<String>,
    pub authentication_data: Option<Bytes>,
}

//--------------------------- Publish packet -------------------------------

/// Publish packet
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Publish {
    pub dup: bool,
    pub qos: QoS,
    pub pkid: u16,
    pub retain: bool,
    pub topic: Bytes,
    pub payload: Bytes,
}

impl Publish {
    // Constructor for publish. Used in local links as local links shouldn't
    // send qos 1 or 2 packets
    pub fn new<T: Into<Bytes>>(topic: T, payload: T, retain: bool) -> Publish {
        Publish {
            dup: false,
            qos: QoS::AtMostOnce,
            pkid: 0,
            retain,
            topic: topic.into(),
            payload: payload.into(),
        }
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// Approximate length for meter
    pub fn len(&self) -> usize {
        let len = 2 + self.topic.len() + self.payload.len();
        match self.qos == QoS::AtMostOnce {
            true => len,
            false => len + 2,
        }
    }

    /// Serialization which is independent of MQTT
    pub fn serialize(&self) -> Bytes {
        let mut o = BytesMut::with_capacity(self.len() + 5);
        let dup = self.dup as u8;
        let qos = self.qos as u8;
        let retain = self.retain as u8;
        o.put_u8(0b0011_0000 | retain | (qos << 1) | (dup << 3));
        o.put_u16(self.pkid);
        o.put_u16(self.topic.len() as u16);
        o.extend_from_slice(&self.topic[..]);

        // TODO: Change segments to take Buf to prevent this copying
        o.extend_from_slice(&self.payload[..]);
        o.freeze()
    }

    /// Serialization which is independent of MQTT
    pub fn deserialize(mut o: Bytes) -> Publish {
        let header = o.get_u8();
        let qos_num = (header & 0b0110) >> 1;
        let qos = qos(qos_num).unwrap_or(QoS::AtMostOnce);
        let dup = (header & 0b1000) != 0;
        let retain = (header & 0b0001) != 0;

        let pkid = o.get_u16();
        let topic_len = o.get_u16();
        let topic = o.split_to(topic_len as usize);
        let payload = o;
        Publish {
            dup,
            qos,
            retain,
            topic,
            pkid,
            payload,
        }
    }
}

/// statebroker patch 32: the strings are [`ByteString`]s, which share the
/// packet's bytes (a state store request has six: taken without a copy or
/// an allocation each).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PublishProperties {
    pub payload_format_indicator: Option<u8>,
    pub message_expiry_interval: Option<u32>,
    pub topic_alias: Option<u16>,
    pub response_topic: Option<ByteString>,
    pub correlation_data: Option<Bytes>,
    pub user_properties: Vec<(ByteString, ByteString)>,
    pub subscription_identifiers: Vec<usize>,
    pub content_type: Option<ByteString>,
}

/// A will's properties as its publish carries them (the router's wills and
/// the broker's, statebroker patch 32: the strings become `ByteString`s).
impl From<LastWillProperties> for PublishProperties {
    fn from(props: LastWillProperties) -> PublishProperties {
        PublishProperties {
            payload_format_indicator: props.payload_format_indicator,
            message_expiry_interval: props.message_expiry_interval,
            response_topic: props.response_topic.map(Into::into),
            correlation_data: props.correlation_data,
            user_properties: props
                .user_properties
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
            content_type: props.content_type.map(Into::into),
            ..PublishProperties::default()
        }
    }
}

//--------------------------- PublishAck packet -------------------------------

/// Return code in puback
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PubAckReason {
    Success,
    NoMatchingSubscribers,
    UnspecifiedError,
    ImplementationSpecificError,
    NotAuthorized,
    TopicNameInvalid,
    PacketIdentifierInUse,
    QuotaExceeded,
    PayloadFormatInvalid,
}

/// Acknowledgement to QoS1 publish
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PubAck {
    pub pkid: u16,
    pub reason: PubAckReason,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PubAckProperties {
    pub reason_string: Option<String>,
    pub user_properties: Vec<(String, String)>,
}

//--------------------------- Subscribe packet -------------------------------

/// Subscription packet
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subscribe {
    pub pkid: u16,
    pub filters: Vec<Filter>,
}

///  Subscription filter
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    pub path: String,
    pub qos: QoS,
    pub nolocal: bool,
    pub preserve_retain: bool,
    pub retain_forward_rule: RetainForwardRule,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RetainForwardRule {
    OnEverySubscribe,
    OnNewSubscribe,
    Never,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscribeProperties {
    pub id: Option<usize>,
    pub user_properties: Vec<(String, String)>,
}

//--------------------------- SubscribeAck packet -------------------------------

/// Acknowledgement to subscribe
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubAck {
    pub pkid: u16,
    pub return_codes: Vec<SubscribeReasonCode>,
}

impl SubAck {
    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn len(&self) -> usize {
        2 + self.return_codes.len()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubscribeReasonCode {
    QoS0,
    QoS1,
    QoS2,
    Success(QoS),
    Failure,
    Unspecified,
    ImplementationSpecific,
    NotAuthorized,
    TopicFilterInvalid,
    PkidInUse,
    QuotaExceeded,
    SharedSubscriptionsNotSupported,
    SubscriptionIdNotSupported,
    WildcardSubscriptionsNotSupported,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubAckProperties {
    pub reason_string: Option<String>,
    pub user_properties: Vec<(String, String)>,
}

//--------------------------- Unsubscribe packet -------------------------------

/// Unsubscribe packet
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsubscribe {
    pub pkid: u16,
    pub filters: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnsubscribeProperties {
    pub user_properties: Vec<(String, String)>,
}
//--------------------------- UnsubscribeAck packet -------------------------------

/// Acknowledgement to unsubscribe
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnsubAck {
    pub pkid: u16,
    pub reasons: Vec<UnsubAckReason>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum UnsubAckReason {
    Success,
    NoSubscriptionExisted,
    UnspecifiedError,
    ImplementationSpecificError,
    NotAuthorized,
    TopicFilterInvalid,
    PacketIdentifierInUse,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnsubAckProperties {
    pub reason_string: Option<String>,
    pub user_properties: Vec<(String, String)>,
}

//--------------------------- Ping packet -------------------------------

struct Ping;
struct PingResponse;

//------------------------------------------------------------------------

//--------------------------- PubRec packet -------------------------------

/// Return code in connack
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum PubRecReason {
    Success,
    NoMatchingSubscribers,
    UnspecifiedError,
    ImplementationSpecificError,
    NotAuthorized,
    TopicNameInvalid,
    PacketIdentifierInUse,
    QuotaExceeded,
    PayloadFormatInvalid,
}

/// Acknowledgement to QoS1 publish
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PubRec {
    pub pkid: u16,
    pub reason: PubRecReason,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PubRecProperties {
    pub reason_string: Option<String>,
    pub user_properties: Vec<(String, String)>,
}

//------------------------------------------------------------------------

//--------------------------- PubComp packet -------------------------------

/// Return code in connack
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum PubCompReason {
    Success,
    PacketIdentifierNotFound,
}

/// QoS2 Assured publish complete, in response to PUBREL packet
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PubComp {
    pub pkid: u16,
    pub reason: PubCompReason,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PubCompProperties {
    pub reason_string: Option<String>,
    pub user_properties: Vec<(String, String)>,
}

//------------------------------------------------------------------------

//--------------------------- PubRel packet -------------------------------

/// Return code in connack
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum PubRelReason {
    Success,
    PacketIdentifierNotFound,
}

/// QoS2 Publish release, in response to PUBREC packet
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PubRel {
    pub pkid: u16,
    pub reason: PubRelReason,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PubRelProperties {
    pub reason_string: Option<String>,
    pub user_properties: Vec<(String, String)>,
}

//------------------------------------------------------------------------

//--------------------------- Disconnect packet -------------------------------
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Disconnect {
    /// Disconnect Reason Code
    pub reason_code: DisconnectReasonCode,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum DisconnectReasonCode {
    /// Close the connection normally. Do not send the Will Message.
    NormalDisconnection,
    /// The Client wishes to disconnect but requires that the Server also publishes its Will Message.
    DisconnectWithWillMessage,
    /// The Connection is closed but the sender either does not wish to reveal the reason, or none of the other Reason Codes apply.
    UnspecifiedError,
    /// The received packet does not conform to this specification.
    MalformedPacket,
    /// An unexpected or out of order packet was received.
    ProtocolError,
    /// The packet received is valid but cannot be processed by this implementation.
    ImplementationSpecificError,
    /// The request is not authorized.
    NotAuthorized,
    /// The Server is busy and cannot continue processing requests from this Client.
    ServerBusy,
    /// The Server is shutting down.
    ServerShuttingDown,
    /// The Connection is closed because no packet has been received for 1.5 times the Keepalive time.
    KeepAliveTimeout,
    /// Another Connection using the same ClientID has connected causing this Connection to be closed.
    SessionTakenOver,
    /// The Topic Filter is correctly formed, but is not accepted by this Sever.
    TopicFilterInvalid,
    /// The Topic Name is correctly formed, but is not accepted by this Client or Server.
    TopicNameInvalid,
    /// The Client or Server has received more than Receive Maximum publication for which it has not sent PUBACK or PUBCOMP.
    ReceiveMaximumExceeded,
    /// The Client or Server has received a PUBLISH packet containing a Topic Alias which is greater than the Maximum Topic Alias it sent in the CONNECT or CONNACK packet.
    TopicAliasInvalid,
    /// The packet size is greater than Maximum Packet Size for this Client or Server.
    PacketTooLarge,
    /// The received data rate is too high.
    MessageRateTooHigh,
    /// An implementation or administrative imposed limit has been exceeded.
    QuotaExceeded,
    /// The Connection is closed due to an administrative action.
    AdministrativeAction,
    /// The payload format does not match the one specified by the Payload Format Indicator.
    PayloadFormatInvalid,
    /// The Server has does not support retained messages.
    RetainNotSupported,
    /// The Client specified a QoS greater than the QoS specified in a Maximum QoS in the CONNACK.
    QoSNotSupported,
    /// The Client should temporarily change its Server.
    UseAnotherServer,
    /// The Server is moved and the Client should permanently change its server location.
    ServerMoved,
    /// The Server does not support Shared Subscriptions.
    SharedSubscriptionNotSupported,
    /// This connection is closed because the connection rate is too high.
    ConnectionRateExceeded,
    /// The maximum connection time authorized for this connection has been exceeded.
    MaximumConnectTime,
    /// The Server does not support Subscription Identifiers; the subscription is not accepted.
    SubscriptionIdentifiersNotSupported,
    /// The Server does not support Wildcard subscription; the subscription is not accepted.
    WildcardSubscriptionsNotSupported,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DisconnectProperties {
    /// Session Expiry Interval in seconds
    pub session_expiry_interval: Option<u32>,

    /// Human readable reason for the disconnect
    pub reason_string: Option<String>,

    /// List of user properties
    pub user_properties: Vec<(String, String)>,

    /// String which can be used by the Client to identify another Server to use.
    pub server_reference: Option<String>,
}
//------------------------------------------------------------------------

/// Quality of service
#[repr(u8)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, PartialOrd)]
#[allow(clippy::enum_variant_names)]
pub enum QoS {
    #[default]
    AtMostOnce = 0,
    AtLeastOnce = 1,
    ExactlyOnce = 2,
}

/// Maps a number to QoS
pub fn qos(num: u8) -> Option<QoS> {
    match num {
        0 => Some(QoS::AtMostOnce),
        1 => Some(QoS::AtLeastOnce),
        2 => Some(QoS::ExactlyOnce),
        qos => None,
    }
}

/// Checks if a topic or topic filter has wildcards
pub fn has_wildcards(s: &str) -> bool {
    s.contains('+') || s.contains('#')
}

/// Checks if a topic is valid
pub fn valid_topic(topic: &str) -> bool {
    // One pass for both wildcards (statebroker patch 29): every publish's
    // topic comes here, a state store request's twice.
    memchr::memchr2(b'+', b'#', topic.as_bytes()).is_none()
}

/// Checks if the filter is valid
///
/// <https://docs.oasis-open.org/mqtt/mqtt/v3.1.1/os/mqtt-v3.1.1-os.html#_Toc398718106>
pub fn valid_filter(filter: &str) -> bool {
    if filter.is_empty() {
        return false;
    }

    let hirerarchy = filter.split('/').collect::<Vec<&str>>();
    if let Some((last, remaining)) = hirerarchy.split_last() {
        for entry in remaining.iter() {
            // # is not allowed in filter except as a last entry
            // invalid: sport/tennis#/player
            // invalid: sport/tennis/#/ranking
            if entry.contains('#') {
                return false;
            }

            // + must occupy an entire level of the filter
            // invalid: sport+
            if entry.len() > 1 && entry.contains('+') {
                return false;
            }
        }

        // only single '#" or '+' is allowed in last entry
        // invalid: sport/tennis#
        // invalid: sport/++
        if last.len() != 1 && (last.contains('#') || last.contains('+')) {
            return false;
        }
    }

    true
}

/// Checks if topic matches a filter. topic and filter validation isn't done here.
///
/// **NOTE**: 'topic' is a misnomer in the arg. this can also be used to match 2 wild subscriptions
/// **NOTE**: make sure a topic is validated during a publish and filter is validated
/// during a subscribe
pub fn matches(topic: &str, filter: &str) -> bool {
    // MQTT 5 4.7.2: a filter starting with a wildcard does not match a topic
    // starting with `$`; a filter naming the `$` level does (statebroker
    // patch 13: `$SYS/#` used to match nothing).
    if topic.starts_with('$') && (filter.starts_with('+') || filter.starts_with('#')) {
        return false;
    }

    let mut topics = topic.split('/');
    let mut filters = filter.split('/');

    for f in filters.by_ref() {
        // "#" being the last element is validated by the broker with 'valid_filter'
        if f == "#" {
            return true;
        }

        // filter still has remaining elements
        // filter = a/b/c/# should match topci = a/b/c
        // filter = a/b/c/d should not match topic = a/b/c
        let top = topics.next();
        match top {
            Some("#") => return false,
            Some(_) if f == "+" => continue,
            Some(t) if f != t => return false,
            Some(_) => continue,
            None => return false,
        }
    }

    // topic has remaining elements and filter's last element isn't "#"
    if topics.next().is_some() {
        return false;
    }

    true
}

/// Error during serialization and deserialization
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("Invalid return code received as response for connect = {0}")]
    InvalidConnectReturnCode(u8),
    #[error("Invalid reason = {0}")]
    InvalidReason(u8),
    #[error("Invalid reason = {0}")]
    InvalidRemainingLength(usize),
    #[error("Invalid protocol used")]
    InvalidProtocol,
    #[error("Invalid protocol level {0}. Make sure right port is being used.")]
    InvalidProtocolLevel(u8),
    #[error("Invalid packet format")]
    IncorrectPacketFormat,
    #[error("Invalid packet type = {0}")]
    InvalidPacketType(u8),
    #[error("Invalid retain forward rule = {0}")]
    InvalidRetainForwardRule(u8),
    #[error("Invalid QoS level = {0}")]
    InvalidQoS(u8),
    #[error("Invalid subscribe reason code = {0}")]
    InvalidSubscribeReasonCode(u8),
    #[error("Packet received has id Zero")]
    PacketIdZero,
    #[error("Empty Subscription")]
    EmptySubscription,
    /// statebroker patch 41: SUBSCRIBE's decoder refuses it.
    #[error("Subscription Identifier 0 (MQTT 5 3.8.2.1.2: a Protocol Error)")]
    SubscriptionIdZero,
    #[error("Payload size is incorrect")]
    PayloadSizeIncorrect,
    #[error("Payload is too long")]
    PayloadTooLong,
    #[error("Payload size has been exceeded by {0} bytes")]
    PayloadSizeLimitExceeded(usize),
    #[error("Payload is required")]
    PayloadRequired,
    #[error("Payload is required = {0}")]
    PayloadNotUtf8(#[from] Utf8Error),
    #[error("Topic not utf-8")]
    TopicNotUtf8,
    #[error("Promised boundary crossed, contains {0} bytes")]
    BoundaryCrossed(usize),
    #[error("Packet is malformed")]
    MalformedPacket,
    #[error("Remaining length is malformed")]
    MalformedRemainingLength,
    #[error("Invalid property type = {0}")]
    InvalidPropertyType(u8),
    // statebroker patch 18: malformed packets the decoders used to accept,
    // each named by the rule it breaks (MQTT 5, and 3.1.1 where it differs).
    /// The reserved bit of the Connect Flags is 1.
    #[error("CONNECT reserved flag set [MQTT-3.1.2-3]")]
    ReservedConnectFlag,
    /// A User Name or Password whose flag is 0 (bytes after the last field
    /// the Connect Flags announce).
    #[error(
        "CONNECT holds a User Name or Password its flag does not announce [MQTT-3.1.2-16, MQTT-3.1.2-18] (3.1.1: [MQTT-3.1.2-18, MQTT-3.1.2-20])"
    )]
    UnannouncedConnectField,
    /// 3.1.1: a Password without a User Name.
    #[error("3.1.1 CONNECT with a Password but no User Name [MQTT-3.1.2-22]")]
    PasswordWithoutUserName,
    /// U+0000 in a UTF-8 string (a topic, a filter, a client id, ...).
    #[error("U+0000 in a UTF-8 string [MQTT-1.5.4-2] (3.1.1: [MQTT-1.5.3-2])")]
    NullCharacter,
    /// Fixed-header flags other than those the packet type has (the first
    /// byte of the packet).
    #[error(
        "fixed header flags {0:#04x} not those of the packet type (2.1.3: [MQTT-3.6.1-1], [MQTT-3.8.1-1], [MQTT-3.10.1-1]; 3.1.1: [MQTT-2.2.2-1])"
    )]
    InvalidFixedHeaderFlags(u8),
    /// Reserved bits of the Subscription Options set.
    #[error(
        "reserved subscription option bits set in {0:#04x} [MQTT-3.8.3-5] (3.1.1: [MQTT-3-8.3-4])"
    )]
    ReservedSubscriptionOptions(u8),
    /// An UNSUBSCRIBE without a topic filter.
    #[error("UNSUBSCRIBE without a topic filter [MQTT-3.10.3-2]")]
    EmptyUnsubscribe,
    // statebroker patch 41: what MQTT 5 calls a Protocol Error in a packet
    // the decoders can read (see `Error::is_protocol_error`), and a
    // malformed PUBLISH; each named by the rule it breaks.
    /// A property that may appear once, twice in a packet.
    #[error("{0} included more than once (MQTT 5: a Protocol Error)")]
    DuplicateProperty(v5::PropertyType),
    /// CONNECT's Receive Maximum is 0.
    #[error("Receive Maximum 0 in CONNECT (MQTT 5 3.1.2.11.3: a Protocol Error)")]
    ReceiveMaximumZero,
    /// CONNECT's Maximum Packet Size is 0.
    #[error("Maximum Packet Size 0 in CONNECT (MQTT 5 3.1.2.11.4: a Protocol Error)")]
    MaximumPacketSizeZero,
    /// CONNECT's Request Response Information is neither 0 nor 1.
    #[error("Request Response Information {0}, not 0 or 1 (MQTT 5 3.1.2.11.6: a Protocol Error)")]
    InvalidRequestResponseInformation(u8),
    /// CONNECT's Request Problem Information is neither 0 nor 1.
    #[error("Request Problem Information {0}, not 0 or 1 (MQTT 5 3.1.2.11.7: a Protocol Error)")]
    InvalidRequestProblemInformation(u8),
    /// A Response Topic with `+` or `#`: a PUBLISH's, or a will's (which
    /// becomes a PUBLISH's).
    #[error("Response Topic with a wildcard [MQTT-3.3.2-14]")]
    ResponseTopicWildcard,
    /// More bytes required to frame packet. Argument
    /// implies minimum additional bytes required to
    /// proceed further
    #[error("Insufficient number of bytes to frame packet, {0} more bytes required")]
    InsufficientBytes(usize),
}

impl Error {
    /// statebroker patch 41: whether MQTT 5 calls this a Protocol Error
    /// (reason code 0x82: the packet was read, and holds what the protocol
    /// does not allow, 1.2) rather than a Malformed Packet (0x81: it could
    /// not be read as the specification says, 2.2.2.2, 4.13).
    pub fn is_protocol_error(&self) -> bool {
        matches!(
            self,
            Error::DuplicateProperty(_)
                | Error::ReceiveMaximumZero
                | Error::MaximumPacketSizeZero
                | Error::InvalidRequestResponseInformation(_)
                | Error::InvalidRequestProblemInformation(_)
                | Error::ResponseTopicWildcard
                | Error::SubscriptionIdZero
        )
    }
}

/// statebroker patch 18: the fixed header's flags (the low 4 bits of its
/// first byte) are those MQTT sets for the packet type (MQTT 5 2.1.3, 3.1.1
/// 2.2.2): 0010 for PUBREL, SUBSCRIBE and UNSUBSCRIBE, 0000 for the others;
/// PUBLISH's carry DUP, QoS and RETAIN.
pub(crate) fn check_fixed_header_flags(byte1: u8) -> Result<(), Error> {
    let expected = match byte1 >> 4 {
        3 => return Ok(()),
        6 | 8 | 10 => 0b0010,
        _ => 0,
    };
    if byte1 & 0x0F == expected {
        Ok(())
    } else {
        Err(Error::InvalidFixedHeaderFlags(byte1))
    }
}

/// Whether `bytes` are an MQTT UTF-8 string: valid UTF-8 ([MQTT-1.5.4-1])
/// without U+0000 ([MQTT-1.5.4-2], patch 18). Nearly every topic and
/// property is ASCII: one pass over its bytes tells that it is ASCII with
/// no NUL, which needs no UTF-8 validation (the ASCII check is the
/// validation); other strings are checked as before (statebroker patch
/// 30: a NUL search, then the UTF-8 validation, was ~170 instructions per
/// string, six strings per state store request).
fn check_mqtt_string(bytes: &[u8]) -> Result<(), Error> {
    if !ascii_without_nul(bytes) {
        check_no_null(bytes)?;
        std::str::from_utf8(bytes).map_err(|_| Error::TopicNotUtf8)?;
    }
    Ok(())
}

/// An MQTT UTF-8 string as a `String` (see [`check_mqtt_string`]).
pub(crate) fn mqtt_string(bytes: &[u8]) -> Result<String, Error> {
    check_mqtt_string(bytes)?;
    // SAFETY: checked to be UTF-8 just above.
    Ok(unsafe { String::from_utf8_unchecked(bytes.to_vec()) })
}

/// statebroker patch 32: an MQTT UTF-8 string sharing `bytes` rather than
/// copied, with [`mqtt_string`]'s checks.
pub(crate) fn mqtt_byte_string(bytes: Bytes) -> Result<ByteString, Error> {
    check_mqtt_string(&bytes)?;
    // SAFETY: checked to be UTF-8 just above.
    Ok(unsafe { ByteString::from_bytes_unchecked(bytes) })
}

/// statebroker patch 33: `bytes` as text if they are an MQTT UTF-8 string
/// (valid UTF-8 without U+0000; ASCII checked in one pass, as every
/// string the decoders read), without a copy: for the broker's own
/// looks at a topic the codec read (`std::str::from_utf8` took about 180
/// instructions for a state store request's topic, twice per request).
pub fn mqtt_str(bytes: &[u8]) -> Option<&str> {
    check_mqtt_string(bytes).ok()?;
    // SAFETY: checked to be UTF-8 just above.
    Some(unsafe { std::str::from_utf8_unchecked(bytes) })
}

/// Whether every byte is in 1..=0x7f: eight bytes at a time (a word with
/// a byte of 0x80 or more has a top bit set; one with a zero byte has a top
/// bit set in `(w - 0x01..) & !w`, the classic zero-byte test, exact as a
/// whole), the bytes after the last whole word as the last eight bytes
/// (patch 50: a word that overlaps the one before is as exact; they went
/// one by one, ~25 instructions a string), and a string shorter than a
/// word one byte at a time (a byte in 1..=0x7f has its top bit clear, and
/// so has the byte below it; 0, whose predecessor wraps to 0xff, and
/// 0x80.. do not).
fn ascii_without_nul(bytes: &[u8]) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const TOPS: u64 = 0x8080_8080_8080_8080;
    let flags_of = |word: &[u8]| {
        let w = u64::from_le_bytes(word.try_into().unwrap_or_default());
        w | (w.wrapping_sub(ONES) & !w)
    };
    if bytes.len() < 8 {
        let flags = bytes
            .iter()
            .fold(0u8, |flags, &b| flags | b | b.wrapping_sub(1));
        return flags & 0x80 == 0;
    }
    let mut words = bytes.chunks_exact(8);
    let mut flags = 0u64;
    for word in &mut words {
        flags |= flags_of(word);
    }
    if !words.remainder().is_empty() {
        flags |= flags_of(&bytes[bytes.len() - 8..]);
    }
    flags & TOPS == 0
}

/// statebroker patch 18: no U+0000 in a UTF-8 string ([MQTT-1.5.4-2]).
/// Searched with `memchr` (patch 49): `<[u8]>::contains` went a byte at a
/// time, ~135 instructions for a state store request's topic.
pub(crate) fn check_no_null(s: &[u8]) -> Result<(), Error> {
    if memchr::memchr(0, s).is_some() {
        Err(Error::NullCharacter)
    } else {
        Ok(())
    }
}

pub trait Protocol {
    fn read_mut(&mut self, stream: &mut BytesMut, max_size: usize) -> Result<Packet, Error>;
    fn write(&self, packet: Packet, write: &mut BytesMut) -> Result<usize, Error>;
}

#[cfg(test)]
mod tests;
