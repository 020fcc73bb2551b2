use std::slice::Iter;

use super::*;
use bytes::{Buf, BufMut, Bytes, BytesMut};

mod connack;
mod connect;
mod disconnect;
mod ping;
mod puback;
mod pubcomp;
mod publish;
mod pubrec;
mod pubrel;
mod suback;
mod subscribe;
mod unsuback;
mod unsubscribe;

/// MQTT packet type
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PacketType {
    Connect = 1,
    ConnAck,
    Publish,
    PubAck,
    PubRec,
    PubRel,
    PubComp,
    Subscribe,
    SubAck,
    Unsubscribe,
    UnsubAck,
    PingReq,
    PingResp,
    Disconnect,
}

/// An MQTT 5 property identifier (2.2.2.2; public since statebroker patch
/// 41, for [`Error::DuplicateProperty`]).
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PropertyType {
    PayloadFormatIndicator = 1,
    MessageExpiryInterval = 2,
    ContentType = 3,
    ResponseTopic = 8,
    CorrelationData = 9,
    SubscriptionIdentifier = 11,
    SessionExpiryInterval = 17,
    AssignedClientIdentifier = 18,
    ServerKeepAlive = 19,
    AuthenticationMethod = 21,
    AuthenticationData = 22,
    RequestProblemInformation = 23,
    WillDelayInterval = 24,
    RequestResponseInformation = 25,
    ResponseInformation = 26,
    ServerReference = 28,
    ReasonString = 31,
    ReceiveMaximum = 33,
    TopicAliasMaximum = 34,
    TopicAlias = 35,
    MaximumQos = 36,
    RetainAvailable = 37,
    UserProperty = 38,
    MaximumPacketSize = 39,
    WildcardSubscriptionAvailable = 40,
    SubscriptionIdentifierAvailable = 41,
    SharedSubscriptionAvailable = 42,
}

impl PropertyType {
    /// The property's name in the specification (2.2.2.2).
    pub fn name(self) -> &'static str {
        match self {
            PropertyType::PayloadFormatIndicator => "Payload Format Indicator",
            PropertyType::MessageExpiryInterval => "Message Expiry Interval",
            PropertyType::ContentType => "Content Type",
            PropertyType::ResponseTopic => "Response Topic",
            PropertyType::CorrelationData => "Correlation Data",
            PropertyType::SubscriptionIdentifier => "Subscription Identifier",
            PropertyType::SessionExpiryInterval => "Session Expiry Interval",
            PropertyType::AssignedClientIdentifier => "Assigned Client Identifier",
            PropertyType::ServerKeepAlive => "Server Keep Alive",
            PropertyType::AuthenticationMethod => "Authentication Method",
            PropertyType::AuthenticationData => "Authentication Data",
            PropertyType::RequestProblemInformation => "Request Problem Information",
            PropertyType::WillDelayInterval => "Will Delay Interval",
            PropertyType::RequestResponseInformation => "Request Response Information",
            PropertyType::ResponseInformation => "Response Information",
            PropertyType::ServerReference => "Server Reference",
            PropertyType::ReasonString => "Reason String",
            PropertyType::ReceiveMaximum => "Receive Maximum",
            PropertyType::TopicAliasMaximum => "Topic Alias Maximum",
            PropertyType::TopicAlias => "Topic Alias",
            PropertyType::MaximumQos => "Maximum QoS",
            PropertyType::RetainAvailable => "Retain Available",
            PropertyType::UserProperty => "User Property",
            PropertyType::MaximumPacketSize => "Maximum Packet Size",
            PropertyType::WildcardSubscriptionAvailable => "Wildcard Subscription Available",
            PropertyType::SubscriptionIdentifierAvailable => "Subscription Identifier Available",
            PropertyType::SharedSubscriptionAvailable => "Shared Subscription Available",
        }
    }
}

impl std::fmt::Display for PropertyType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// statebroker patch 41: the properties of one packet read so far, one bit
/// per identifier (every identifier is below 64), so that a property that
/// may appear once and comes twice is refused: MQTT 5 calls each such
/// repetition a Protocol Error (3.1.2.11, 3.1.3.2, 3.3.2.3, 3.4.2.2, ...,
/// 3.14.2.2). User Property may repeat (2.2.2.2), and so may Subscription
/// Identifier in a PUBLISH (3.3.2.3.8): the PUBLISH decoder does not
/// record it. A mask and a branch per property, no allocation: PUBLISH's
/// properties are read for every message.
#[derive(Debug, Default, Clone, Copy)]
struct Seen(u64);

impl Seen {
    /// Records `property`; `Err` if it came before (User Property excepted).
    #[inline]
    fn once(&mut self, property: PropertyType) -> Result<(), Error> {
        let bit = 1u64 << (property as u8);
        if self.0 & bit != 0 && property != PropertyType::UserProperty {
            return Err(Error::DuplicateProperty(property));
        }
        self.0 |= bit;
        Ok(())
    }
}

/// Packet type from a byte
///
/// ```text
///          7                          3                          0
///          +--------------------------+--------------------------+
/// byte 1   | MQTT Control Packet Type | Flags for each type      |
///          +--------------------------+--------------------------+
///          |         Remaining Bytes Len  (1/2/3/4 bytes)        |
///          +-----------------------------------------------------+
///
/// <https://docs.oasis-open.org/mqtt/mqtt/v3.1.1/os/mqtt-v3.1.1-os.html#_Toc385349207>
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd)]
pub struct FixedHeader {
    /// First byte of the stream. Used to identify packet types and
    /// several flags
    byte1: u8,
    /// Length of fixed header. Byte 1 + (1..4) bytes. So fixed header
    /// len can vary from 2 bytes to 5 bytes
    /// 1..4 bytes are variable length encoded to represent remaining length
    fixed_header_len: usize,
    /// Remaining length of the packet. Doesn't include fixed header bytes
    /// Represents variable header + payload size
    remaining_len: usize,
}

impl FixedHeader {
    pub fn new(byte1: u8, remaining_len_len: usize, remaining_len: usize) -> FixedHeader {
        FixedHeader {
            byte1,
            fixed_header_len: remaining_len_len + 1,
            remaining_len,
        }
    }

    pub fn packet_type(&self) -> Result<PacketType, Error> {
        let num = self.byte1 >> 4;
        match num {
            1 => Ok(PacketType::Connect),
            2 => Ok(PacketType::ConnAck),
            3 => Ok(PacketType::Publish),
            4 => Ok(PacketType::PubAck),
            5 => Ok(PacketType::PubRec),
            6 => Ok(PacketType::PubRel),
            7 => Ok(PacketType::PubComp),
            8 => Ok(PacketType::Subscribe),
            9 => Ok(PacketType::SubAck),
            10 => Ok(PacketType::Unsubscribe),
            11 => Ok(PacketType::UnsubAck),
            12 => Ok(PacketType::PingReq),
            13 => Ok(PacketType::PingResp),
            14 => Ok(PacketType::Disconnect),
            _ => Err(Error::InvalidPacketType(num)),
        }
    }

    /// Returns the size of full packet (fixed header + variable header + payload)
    /// Fixed header is enough to get the size of a frame in the stream
    pub fn frame_length(&self) -> usize {
        self.fixed_header_len + self.remaining_len
    }
}

fn property(num: u8) -> Result<PropertyType, Error> {
    let property = match num {
        1 => PropertyType::PayloadFormatIndicator,
        2 => PropertyType::MessageExpiryInterval,
        3 => PropertyType::ContentType,
        8 => PropertyType::ResponseTopic,
        9 => PropertyType::CorrelationData,
        11 => PropertyType::SubscriptionIdentifier,
        17 => PropertyType::SessionExpiryInterval,
        18 => PropertyType::AssignedClientIdentifier,
        19 => PropertyType::ServerKeepAlive,
        21 => PropertyType::AuthenticationMethod,
        22 => PropertyType::AuthenticationData,
        23 => PropertyType::RequestProblemInformation,
        24 => PropertyType::WillDelayInterval,
        25 => PropertyType::RequestResponseInformation,
        26 => PropertyType::ResponseInformation,
        28 => PropertyType::ServerReference,
        31 => PropertyType::ReasonString,
        33 => PropertyType::ReceiveMaximum,
        34 => PropertyType::TopicAliasMaximum,
        35 => PropertyType::TopicAlias,
        36 => PropertyType::MaximumQos,
        37 => PropertyType::RetainAvailable,
        38 => PropertyType::UserProperty,
        39 => PropertyType::MaximumPacketSize,
        40 => PropertyType::WildcardSubscriptionAvailable,
        41 => PropertyType::SubscriptionIdentifierAvailable,
        42 => PropertyType::SharedSubscriptionAvailable,
        num => return Err(Error::InvalidPropertyType(num)),
    };

    Ok(property)
}

/// Checks if the stream has enough bytes to frame a packet and returns fixed header
/// only if a packet can be framed with existing bytes in the `stream`.
/// The passed stream doesn't modify parent stream's cursor. If this function
/// returned an error, next `check` on the same parent stream is forced start
/// with cursor at 0 again (Iter is owned. Only Iter's cursor is changed internally)
pub fn check(stream: Iter<u8>, max_packet_size: usize) -> Result<FixedHeader, Error> {
    // Create fixed header if there are enough bytes in the stream
    // to frame full packet
    let stream_len = stream.len();
    let fixed_header = parse_fixed_header(stream)?;

    // Don't let rogue connections attack with huge payloads.
    // Disconnect them before reading all that data
    if fixed_header.remaining_len > max_packet_size {
        return Err(Error::PayloadSizeLimitExceeded(fixed_header.remaining_len));
    }

    // If the current call fails due to insufficient bytes in the stream,
    // after calculating remaining length, we extend the stream
    let frame_length = fixed_header.frame_length();
    if stream_len < frame_length {
        return Err(Error::InsufficientBytes(frame_length - stream_len));
    }

    Ok(fixed_header)
}

/// Parses fixed header
fn parse_fixed_header(mut stream: Iter<u8>) -> Result<FixedHeader, Error> {
    // At least 2 bytes are necessary to frame a packet
    let stream_len = stream.len();
    if stream_len < 2 {
        return Err(Error::InsufficientBytes(2 - stream_len));
    }

    let byte1 = stream.next().unwrap();
    let (len_len, len) = length(stream)?;

    Ok(FixedHeader::new(*byte1, len_len, len))
}

/// Parses variable byte integer in the stream and returns the length
/// and number of bytes that make it. Used for remaining length calculation
/// as well as for calculating property lengths
fn length(stream: Iter<u8>) -> Result<(usize, usize), Error> {
    let mut len: usize = 0;
    let mut len_len = 0;
    let mut done = false;
    let mut shift = 0;

    // Use continuation bit at position 7 to continue reading next
    // byte to frame 'length'.
    // Stream 0b1xxx_xxxx 0b1yyy_yyyy 0b1zzz_zzzz 0b0www_wwww will
    // be framed as number 0bwww_wwww_zzz_zzzz_yyy_yyyy_xxx_xxxx
    for byte in stream {
        len_len += 1;
        let byte = *byte as usize;
        len += (byte & 0x7F) << shift;

        // stop when continue bit is 0
        done = (byte & 0x80) == 0;
        if done {
            break;
        }

        shift += 7;

        // Only a max of 4 bytes allowed for remaining length
        // more than 4 shifts (0, 7, 14, 21) implies bad length
        if shift > 21 {
            return Err(Error::MalformedRemainingLength);
        }
    }

    // Not enough bytes to frame remaining length. wait for
    // one more byte
    if !done {
        return Err(Error::InsufficientBytes(1));
    }

    Ok((len_len, len))
}

/// Reads a series of bytes with a length from a byte stream
fn read_mqtt_bytes(stream: &mut Bytes) -> Result<Bytes, Error> {
    let len = read_u16(stream)? as usize;

    // Prevent attacks with wrong remaining length. This method is used in
    // `packet.assembly()` with (enough) bytes to frame packet. Ensures that
    // reading variable len string or bytes doesn't cross promised boundary
    // with `read_fixed_header()`
    if len > stream.len() {
        return Err(Error::BoundaryCrossed(len));
    }

    Ok(stream.split_to(len))
}

/// Reads a string from bytes stream
fn read_mqtt_string(stream: &mut Bytes) -> Result<String, Error> {
    let s = read_mqtt_bytes(stream)?;
    super::mqtt_string(&s)
}

/// statebroker patch 32: a string that shares the packet's bytes.
fn read_mqtt_byte_string(stream: &mut Bytes) -> Result<super::ByteString, Error> {
    super::mqtt_byte_string(read_mqtt_bytes(stream)?)
}

/// Serializes bytes to stream (including length)
fn write_mqtt_bytes(stream: &mut BytesMut, bytes: &[u8]) {
    stream.put_u16(bytes.len() as u16);
    stream.extend_from_slice(bytes);
}

/// Serializes a string to stream
fn write_mqtt_string(stream: &mut BytesMut, string: &str) {
    write_mqtt_bytes(stream, string.as_bytes());
}

/// Writes remaining length to stream and returns number of bytes for remaining length
fn write_remaining_length(stream: &mut BytesMut, len: usize) -> Result<usize, Error> {
    if len > 268_435_455 {
        return Err(Error::PayloadTooLong);
    }

    let mut done = false;
    let mut x = len;
    let mut count = 0;

    while !done {
        let mut byte = (x % 128) as u8;
        x /= 128;
        if x > 0 {
            byte |= 128;
        }

        stream.put_u8(byte);
        count += 1;
        done = x == 0;
    }

    Ok(count)
}

/// Return number of remaining length bytes required for encoding length
fn len_len(len: usize) -> usize {
    if len >= 2_097_152 {
        4
    } else if len >= 16_384 {
        3
    } else if len >= 128 {
        2
    } else {
        1
    }
}

/// After collecting enough bytes to frame a packet (packet's frame())
/// , It's possible that content itself in the stream is wrong. Like expected
/// packet id or qos not being present. In cases where `read_mqtt_string` or
/// `read_mqtt_bytes` exhausted remaining length but packet framing expects to
/// parse qos next, these pre checks will prevent `bytes` crashes
fn read_u16(stream: &mut Bytes) -> Result<u16, Error> {
    if stream.len() < 2 {
        return Err(Error::MalformedPacket);
    }

    Ok(stream.get_u16())
}

fn read_u8(stream: &mut Bytes) -> Result<u8, Error> {
    if stream.is_empty() {
        return Err(Error::MalformedPacket);
    }

    Ok(stream.get_u8())
}

fn read_u32(stream: &mut Bytes) -> Result<u32, Error> {
    if stream.len() < 4 {
        return Err(Error::MalformedPacket);
    }

    Ok(stream.get_u32())
}

#[derive(Debug, Clone)]
pub struct V5;

impl Protocol for V5 {
    /// Reads a stream of bytes and extracts next MQTT packet out of it
    fn read_mut(&mut self, stream: &mut BytesMut, max_size: usize) -> Result<Packet, Error> {
        let fixed_header = check(stream.iter(), max_size)?;

        // Test with a stream with exactly the size to check border panics
        let packet = stream.split_to(fixed_header.frame_length());
        let packet_type = fixed_header.packet_type()?;
        check_fixed_header_flags(fixed_header.byte1)?;

        if fixed_header.remaining_len == 0 {
            // no payload packets
            return match packet_type {
                PacketType::PingReq => Ok(Packet::PingReq(PingReq)),
                PacketType::PingResp => Ok(Packet::PingResp(PingResp)),
                PacketType::Disconnect => Ok(Packet::Disconnect(
                    Disconnect {
                        reason_code: DisconnectReasonCode::NormalDisconnection,
                    },
                    None,
                )),
                _ => Err(Error::PayloadRequired),
            };
        }

        let packet = packet.freeze();
        let packet = match packet_type {
            PacketType::Connect => {
                let (connect, properties, will, willproperties, login) =
                    connect::read(fixed_header, packet)?;
                Packet::Connect(
                    connect,
                    properties.map(Box::new),
                    will.map(Box::new),
                    willproperties.map(Box::new),
                    login,
                )
            }
            PacketType::Publish => {
                let (publish, properties) = publish::read(fixed_header, packet)?;
                Packet::Publish(publish, properties)
            }
            PacketType::PubAck => {
                let (puback, properties) = puback::read(fixed_header, packet)?;
                Packet::PubAck(puback, properties)
            }
            PacketType::Subscribe => {
                let (subscribe, properties) = subscribe::read(fixed_header, packet)?;
                Packet::Subscribe(subscribe, properties)
            }
            PacketType::SubAck => {
                let (suback, properties) = suback::read(fixed_header, packet)?;
                Packet::SubAck(suback, properties)
            }
            PacketType::Unsubscribe => {
                let (unsubscribe, properties) = unsubscribe::read(fixed_header, packet)?;
                Packet::Unsubscribe(unsubscribe, properties)
            }
            PacketType::PingReq => Packet::PingReq(PingReq),
            PacketType::PingResp => Packet::PingResp(PingResp),
            PacketType::Disconnect => {
                let (disconnect, properties) = disconnect::read(fixed_header, packet)?;
                Packet::Disconnect(disconnect, properties)
            }
            PacketType::PubRec => {
                let (pubrec, properties) = pubrec::read(fixed_header, packet)?;
                Packet::PubRec(pubrec, properties)
            }
            PacketType::PubRel => {
                let (pubrel, properties) = pubrel::read(fixed_header, packet)?;
                Packet::PubRel(pubrel, properties)
            }
            PacketType::PubComp => {
                let (pubcomp, properties) = pubcomp::read(fixed_header, packet)?;
                Packet::PubComp(pubcomp, properties)
            }
            // statebroker patch 17: every packet this codec writes, it
            // reads (these two were an `unreachable!()` panic).
            PacketType::ConnAck => {
                let (connack, properties) = connack::read(fixed_header, packet)?;
                Packet::ConnAck(connack, properties.map(Box::new))
            }
            PacketType::UnsubAck => {
                let (unsuback, properties) = unsuback::read(fixed_header, packet)?;
                Packet::UnsubAck(unsuback, properties)
            }
        };

        Ok(packet)
    }

    fn write(&self, packet: Packet, buffer: &mut BytesMut) -> Result<usize, Error> {
        let size = match packet {
            Packet::Connect(
                connect,
                connect_properties,
                last_will,
                last_will_properties,
                login,
            ) => connect::write(
                &connect,
                &connect_properties.map(|p| *p),
                &last_will.map(|w| *w),
                &last_will_properties.map(|p| *p),
                &login,
                buffer,
            )?,
            Packet::ConnAck(connack, properties) => {
                connack::write(&connack, &properties.map(|p| *p), buffer)?
            }
            Packet::Publish(publish, properties) => publish::write(&publish, &properties, buffer)?,
            Packet::PubAck(puback, properties) => puback::write(&puback, &properties, buffer)?,
            Packet::Subscribe(subscribe, properties) => {
                subscribe::write(&subscribe, &properties, buffer)?
            }
            Packet::SubAck(suback, properties) => suback::write(&suback, &properties, buffer)?,
            Packet::PubRec(pubrec, properties) => pubrec::write(&pubrec, &properties, buffer)?,
            Packet::PubRel(pubrel, properties) => pubrel::write(&pubrel, &properties, buffer)?,
            Packet::PubComp(pubcomp, properties) => pubcomp::write(&pubcomp, &properties, buffer)?,
            Packet::Unsubscribe(unsubscribe, properties) => {
                unsubscribe::write(&unsubscribe, &properties, buffer)?
            }
            Packet::UnsubAck(unsuback, properties) => {
                unsuback::write(&unsuback, &properties, buffer)?
            }
            Packet::Disconnect(disconnect, properties) => {
                disconnect::write(&disconnect, &properties, buffer)?
            }
            Packet::PingReq(pingreq) => ping::pingreq::write(buffer)?,
            Packet::PingResp(pingresp) => ping::pingresp::write(buffer)?,
            _ => unreachable!(),
        };
        Ok(size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{ConnAck, ConnectReturnCode, UnsubAck, UnsubAckReason};

    /// statebroker patch 17: a CONNACK and an UNSUBACK (what a client
    /// reads) decode; they were an `unreachable!()` panic.
    #[test]
    fn what_a_client_reads_decodes() {
        let packets = [
            Packet::ConnAck(
                ConnAck {
                    session_present: true,
                    code: ConnectReturnCode::Success,
                },
                None,
            ),
            Packet::UnsubAck(
                UnsubAck {
                    pkid: 3,
                    reasons: vec![
                        UnsubAckReason::Success,
                        UnsubAckReason::NoSubscriptionExisted,
                    ],
                },
                None,
            ),
        ];
        for packet in packets {
            let mut buf = BytesMut::new();
            V5.write(packet.clone(), &mut buf).unwrap();
            assert_eq!(V5.read_mut(&mut buf, 1024).unwrap(), packet);
        }
    }
}
