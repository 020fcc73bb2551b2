//! Tests of statebroker's patches to the protocol module (see
//! PATCHES.md): packet size, strings, malformed packets.

/// Patch 31: a packet is no larger than a PUBLISH with its properties,
/// and a CONNECT and a CONNACK with every boxed part still go through
/// both codecs unchanged.
mod size_tests {
    use crate::protocol::*;

    #[test]
    fn a_packet_is_as_large_as_a_publish_with_its_properties() {
        let publish = std::mem::size_of::<(Publish, Option<PublishProperties>)>();
        let packet = std::mem::size_of::<Packet>();
        assert!(
            packet <= publish + 8,
            "Packet is {packet} bytes, a publish with its properties {publish}"
        );
    }

    /// Every move of a packet copies it: past 256 bytes glibc's memcpy
    /// takes its slower path (a 32-byte field on `Publish` made a packet
    /// 264 bytes and cost the broker ~390 instructions a state store
    /// request in copies, by callgrind, on 2026-11-29).
    #[test]
    fn a_packet_stays_within_256_bytes() {
        let packet = std::mem::size_of::<Packet>();
        assert!(packet <= 256, "Packet is {packet} bytes");
    }

    #[test]
    fn a_connect_and_a_connack_with_every_part_come_back_the_same() {
        let connect = Packet::Connect(
            Connect {
                keep_alive: 30,
                client_id: "c".into(),
                clean_session: false,
            },
            Some(Box::new(ConnectProperties {
                session_expiry_interval: Some(60),
                receive_maximum: Some(10),
                max_packet_size: Some(1000),
                topic_alias_max: Some(4),
                request_response_info: Some(1),
                request_problem_info: Some(0),
                user_properties: vec![("k".into(), "v".into())],
                authentication_method: None,
                authentication_data: None,
            })),
            Some(Box::new(LastWill {
                topic: Bytes::from_static(b"w"),
                message: Bytes::from_static(b"gone"),
                qos: QoS::AtLeastOnce,
                retain: true,
            })),
            Some(Box::new(LastWillProperties {
                delay_interval: Some(5),
                payload_format_indicator: Some(1),
                message_expiry_interval: Some(30),
                content_type: Some("text/plain".into()),
                response_topic: Some("r".into()),
                correlation_data: Some(Bytes::from_static(b"c")),
                user_properties: vec![("wk".into(), "wv".into())],
            })),
            Some(Login {
                username: "u".into(),
                password: "p".into(),
            }),
        );
        let connack = Packet::ConnAck(
            ConnAck {
                session_present: true,
                code: ConnectReturnCode::Success,
            },
            Some(Box::new(ConnAckProperties {
                session_expiry_interval: Some(60),
                ..ConnAckProperties::default()
            })),
        );
        for packet in [connect, connack] {
            let mut buffer = BytesMut::new();
            v5::V5.write(packet.clone(), &mut buffer).unwrap();
            let back = v5::V5.read_mut(&mut buffer, 1 << 20).unwrap();
            assert_eq!(back, packet);
        }
    }
}

/// Patch 30: [`mqtt_string`] against the checks it replaced.
mod string_tests {
    use crate::protocol::*;

    /// Patch 49: the NUL search finds a NUL at every position, and none
    /// where there is none.
    #[test]
    fn null_checks_find_a_nul_wherever_it_is() {
        for len in 0..=100 {
            let clean = vec![b'a'; len];
            assert!(check_no_null(&clean).is_ok(), "{len} bytes without NUL");
            for at in 0..len {
                let mut with = clean.clone();
                with[at] = 0;
                assert!(
                    matches!(check_no_null(&with), Err(Error::NullCharacter)),
                    "NUL at {at} of {len}"
                );
            }
        }
    }

    /// The check before patch 30.
    fn before(bytes: &[u8]) -> Result<String, Error> {
        check_no_null(bytes)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| Error::TopicNotUtf8)
    }

    fn same(bytes: &[u8]) {
        let old = format!("{:?}", before(bytes));
        assert_eq!(format!("{:?}", mqtt_string(bytes)), old, "{bytes:?}");
        // Patch 32: a string sharing the packet's bytes, the same checks.
        let shared = mqtt_byte_string(Bytes::copy_from_slice(bytes)).map(String::from);
        assert_eq!(format!("{shared:?}"), old, "{bytes:?}");
        // Patch 33: the text without a copy, the same checks.
        let text = mqtt_str(bytes).map(str::to_owned).ok_or(());
        assert_eq!(text, before(bytes).map_err(drop), "{bytes:?}");
    }

    /// Patch 32: a publish's property strings, ASCII or not, come back
    /// as they were written; one that is not UTF-8 is refused.
    #[test]
    fn a_publishs_property_strings_come_back_the_same() {
        let publish = Packet::Publish(
            Publish::new("t", "p", false),
            Some(PublishProperties {
                response_topic: Some("réponse/1".into()),
                content_type: Some("application/octet-stream".into()),
                user_properties: vec![("__ts".into(), "1:0:c".into()), ("clé".into(), "".into())],
                correlation_data: Some(Bytes::from_static(b"c")),
                ..PublishProperties::default()
            }),
        );
        let mut buffer = BytesMut::new();
        v5::V5.write(publish.clone(), &mut buffer).unwrap();
        let written = buffer.clone();
        assert_eq!(v5::V5.read_mut(&mut buffer, 1 << 20).unwrap(), publish);
        // "clé" as Latin-1: not UTF-8.
        let at = written
            .windows(4)
            .position(|w| w == "clé".as_bytes())
            .unwrap();
        let mut broken = written.to_vec();
        broken.splice(at..at + 4, [b'c', b'l', 0xe9, b'!']);
        let mut broken = BytesMut::from(&broken[..]);
        assert!(v5::V5.read_mut(&mut broken, 1 << 20).is_err());
    }

    #[test]
    fn strings_are_taken_or_refused_as_before() {
        for case in [
            &b""[..],
            b"a/b/c",
            b"\x7f",
            b"\x01",
            b"nul\0inside",
            b"\0",
            b"caf\xc3\xa9",
            b"\xc3\xa9\0",
            b"\x80",
            b"\xff",
            b"half \xc3",
            b"\xed\xa0\x80",
        ] {
            same(case);
        }
        // Every byte alone, after ASCII, and at every place of strings
        // of a word and longer (in the words and in the rest, which patch
        // 50 reads as a last word overlapping the one before).
        for b in 0..=255u8 {
            same(&[b]);
            same(&[b'x', b'y', b]);
            for len in [8, 9, 15, 16, 21, 24] {
                for at in 0..len {
                    let mut long = vec![b'a'; len];
                    long[at] = b;
                    same(&long);
                }
            }
        }
        // Pseudo-random strings, mostly ASCII, some not.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 40) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|i| {
                    let r = x.rotate_left(i as u32 * 7) as u8;
                    if x.is_multiple_of(5) {
                        r
                    } else {
                        r & 0x7f
                    }
                })
                .collect();
            same(&bytes);
        }
    }
}

/// statebroker patch 18: what both decoders refuse as malformed.
mod malformed_tests {
    use crate::protocol::v4::V4;
    use crate::protocol::v5::V5;
    use crate::protocol::{Error, Protocol};
    use bytes::BytesMut;

    fn s(bytes: &[u8]) -> Vec<u8> {
        let mut out = (bytes.len() as u16).to_be_bytes().to_vec();
        out.extend_from_slice(bytes);
        out
    }

    fn packet(byte0: u8, body: &[u8]) -> Vec<u8> {
        assert!(body.len() < 128);
        let mut out = vec![byte0, body.len() as u8];
        out.extend_from_slice(body);
        out
    }

    /// A CONNECT of `level` with `flags` and `payload` (MQTT 5: no properties).
    fn connect(level: u8, flags: u8, payload: &[&[u8]]) -> Vec<u8> {
        let mut body = s(b"MQTT");
        body.extend([level, flags, 0, 30]);
        if level == 5 {
            body.push(0);
        }
        for field in payload {
            body.extend(s(field));
        }
        packet(0x10, &body)
    }

    fn read(level: u8, bytes: &[u8]) -> Result<crate::protocol::Packet, Error> {
        let mut buf = BytesMut::from(bytes);
        match level {
            5 => V5.read_mut(&mut buf, 1024),
            _ => V4.read_mut(&mut buf, 1024),
        }
    }

    /// `rest` after the packet id: MQTT 5 has an empty property length first.
    fn with_id(level: u8, pkid: u16, rest: &[u8]) -> Vec<u8> {
        let mut body = pkid.to_be_bytes().to_vec();
        if level == 5 {
            body.push(0);
        }
        body.extend_from_slice(rest);
        body
    }

    #[test]
    fn malformed_packets_are_refused() {
        for level in [5u8, 4] {
            let will_props: &[u8] = if level == 5 { &[0] } else { &[] };
            let mut will = s(b"c");
            will.extend_from_slice(will_props);
            will.extend(s(b"a\0b"));
            will.extend(s(b"bye"));
            let mut will_connect = s(b"MQTT");
            will_connect.extend([level, 0x06, 0, 30]);
            if level == 5 {
                will_connect.push(0);
            }
            will_connect.extend(will);
            let mut filter = s(b"a");
            filter.push(1);
            let mut null_filter = s(b"a\0");
            null_filter.push(0);
            let mut publish = s(b"a\0b");
            if level == 5 {
                publish.push(0);
            }
            let reserved_option = if level == 5 { 0x41 } else { 0x05 };
            let mut reserved = s(b"a");
            reserved.push(reserved_option);
            let cases: Vec<(Vec<u8>, Error, &str)> = vec![
                (
                    connect(level, 0x03, &[b"c"]),
                    Error::ReservedConnectFlag,
                    "reserved flag",
                ),
                (
                    connect(level, 0x02, &[b"c", b"user"]),
                    Error::UnannouncedConnectField,
                    "user name, flag 0",
                ),
                (
                    connect(level, 0x82, &[b"c", b"user", b"pw"]),
                    Error::UnannouncedConnectField,
                    "password, flag 0",
                ),
                (
                    connect(level, 0x02, &[b"c\0"]),
                    Error::NullCharacter,
                    "client id",
                ),
                (
                    connect(level, 0x82, &[b"c", b"u\0"]),
                    Error::NullCharacter,
                    "user name",
                ),
                (
                    packet(0x10, &will_connect),
                    Error::NullCharacter,
                    "will topic",
                ),
                (packet(0x30, &publish), Error::NullCharacter, "topic"),
                (
                    packet(0x82, &with_id(level, 1, &null_filter)),
                    Error::NullCharacter,
                    "filter",
                ),
                (
                    packet(0x82, &with_id(level, 0, &filter)),
                    Error::PacketIdZero,
                    "SUBSCRIBE id 0",
                ),
                (
                    packet(0xA2, &with_id(level, 0, &s(b"a"))),
                    Error::PacketIdZero,
                    "UNSUBSCRIBE id 0",
                ),
                (
                    packet(0xA2, &with_id(level, 1, &[])),
                    Error::EmptyUnsubscribe,
                    "UNSUBSCRIBE without filter",
                ),
                (
                    packet(0x80, &with_id(level, 1, &filter)),
                    Error::InvalidFixedHeaderFlags(0x80),
                    "SUBSCRIBE flags",
                ),
                (
                    packet(0xA3, &with_id(level, 1, &s(b"a"))),
                    Error::InvalidFixedHeaderFlags(0xA3),
                    "UNSUBSCRIBE flags",
                ),
                (
                    packet(0x60, &[0, 1]),
                    Error::InvalidFixedHeaderFlags(0x60),
                    "PUBREL flags",
                ),
                (
                    packet(0x41, &[0, 1]),
                    Error::InvalidFixedHeaderFlags(0x41),
                    "PUBACK flags",
                ),
                (
                    packet(0x82, &with_id(level, 1, &reserved)),
                    Error::ReservedSubscriptionOptions(reserved_option),
                    "options",
                ),
            ];
            for (bytes, error, what) in cases {
                assert_eq!(read(level, &bytes), Err(error), "{what}, level {level}");
            }
        }
        // 3.1.1 only: a Password without a User Name.
        assert_eq!(
            read(4, &connect(4, 0x42, &[b"c", b"pw"])),
            Err(Error::PasswordWithoutUserName)
        );
        // MQTT 5 only: a Password is Binary Data, U+0000 allowed.
        assert!(read(5, &connect(5, 0xC2, &[b"c", b"u", b"p\0w"])).is_ok());
    }

    #[test]
    fn well_formed_packets_still_decode() {
        for level in [5u8, 4] {
            let mut filter = s(b"a/+");
            filter.push(if level == 5 { 0x2E } else { 0x02 });
            for bytes in [
                connect(level, 0xC2, &[b"c", b"user", b"pw"]),
                connect(level, 0x82, &[b"c", b"user"]),
                packet(0x82, &with_id(level, 1, &filter)),
                packet(0xA2, &with_id(level, 1, &s(b"a/+"))),
                packet(0x62, &[0, 1]),
                packet(0x40, &[0, 1]),
                packet(0x3B, &{
                    let mut p = s(b"a");
                    p.extend([0, 1]);
                    if level == 5 {
                        p.push(0);
                    }
                    p
                }),
            ] {
                assert!(read(level, &bytes).is_ok(), "{bytes:02x?}, level {level}");
            }
        }
    }

    #[test]
    fn a_topic_with_a_wildcard_anywhere_is_not_valid() {
        use crate::protocol::valid_topic;
        for topic in ["a/b", "", "/", "a b/ç/😀", "statestore/v1/x/command/invoke"] {
            assert!(valid_topic(topic), "{topic:?}");
        }
        for topic in [
            "+",
            "#",
            "a/+/b",
            "a/#",
            "a+b",
            "x#",
            "ç/+",
            &"a/".repeat(100),
        ]
        .iter()
        .map(|t| t.to_string())
        .chain([format!("{}+", "a/".repeat(100))])
        {
            if topic.contains(['+', '#']) {
                assert!(!valid_topic(&topic), "{topic:?}");
            } else {
                assert!(valid_topic(&topic), "{topic:?}");
            }
        }
    }
}

/// statebroker patch 41: what the MQTT 5 decoder refuses as a Protocol
/// Error (a property twice, values CONNECT may not hold, a Response Topic
/// with a wildcard, Subscription Identifier 0) or as malformed (QoS 0 with
/// DUP 1), and the same packets without the fault still decoding.
mod protocol_error_tests {
    use crate::protocol::v5::{PropertyType, V5};
    use crate::protocol::{Error, Packet, Protocol};
    use bytes::BytesMut;

    fn s(bytes: &[u8]) -> Vec<u8> {
        let mut out = (bytes.len() as u16).to_be_bytes().to_vec();
        out.extend_from_slice(bytes);
        out
    }

    fn packet(byte0: u8, body: &[u8]) -> Vec<u8> {
        assert!(body.len() < 128);
        let mut out = vec![byte0, body.len() as u8];
        out.extend_from_slice(body);
        out
    }

    /// Properties with their length in front (under 128 bytes).
    fn props(properties: &[u8]) -> Vec<u8> {
        assert!(properties.len() < 128);
        let mut out = vec![properties.len() as u8];
        out.extend_from_slice(properties);
        out
    }

    fn string_property(id: u8, value: &[u8]) -> Vec<u8> {
        let mut out = vec![id];
        out.extend(s(value));
        out
    }

    /// A CONNECT with `properties`, and a will with `will_properties` if
    /// given.
    fn connect(properties: &[u8], will_properties: Option<&[u8]>) -> Vec<u8> {
        let mut body = s(b"MQTT");
        let flags = if will_properties.is_some() {
            0x06
        } else {
            0x02
        };
        body.extend([5, flags, 0, 30]);
        body.extend(props(properties));
        body.extend(s(b"client"));
        if let Some(will) = will_properties {
            body.extend(props(will));
            body.extend(s(b"will/topic"));
            body.extend(s(b"bye"));
        }
        packet(0x10, &body)
    }

    /// A PUBLISH "t" with `byte0`'s flags and `properties`, packet id 1 at
    /// QoS 1 and 2.
    fn publish(byte0: u8, properties: &[u8]) -> Vec<u8> {
        let mut body = s(b"t");
        if byte0 & 0b0110 != 0 {
            body.extend([0, 1]);
        }
        body.extend(props(properties));
        body.push(b'x');
        packet(byte0, &body)
    }

    fn subscribe(properties: &[u8]) -> Vec<u8> {
        let mut body = vec![0, 1];
        body.extend(props(properties));
        body.extend(s(b"a/b"));
        body.push(1);
        packet(0x82, &body)
    }

    /// A packet of the PUBACK family or DISCONNECT: `head` (packet id and
    /// reason code, or the reason code), then `properties`.
    fn acknowledgement(byte0: u8, head: &[u8], properties: &[u8]) -> Vec<u8> {
        let mut body = head.to_vec();
        body.extend(props(properties));
        packet(byte0, &body)
    }

    fn read(bytes: &[u8]) -> Result<Packet, Error> {
        V5.read_mut(&mut BytesMut::from(bytes), 1024)
    }

    fn u8_property(id: u8, v: u8) -> Vec<u8> {
        vec![id, v]
    }
    fn u16_property(id: u8, v: u16) -> Vec<u8> {
        let mut out = vec![id];
        out.extend(v.to_be_bytes());
        out
    }
    fn u32_property(id: u8, v: u32) -> Vec<u8> {
        let mut out = vec![id];
        out.extend(v.to_be_bytes());
        out
    }
    fn twice(property: &[u8]) -> Vec<u8> {
        [property, property].concat()
    }

    /// Makes a packet around the properties given.
    type Make = Box<dyn Fn(&[u8]) -> Vec<u8>>;

    #[test]
    fn a_property_twice_is_a_protocol_error() {
        use PropertyType as P;
        let user = {
            let mut u = string_property(0x26, b"k");
            u.extend(s(b"v"));
            u
        };
        // (packet with the property once, the same with it twice, property)
        let mut cases: Vec<(Make, Vec<u8>, P)> = Vec::new();
        let connect_props = |p: &[u8]| connect(p, None);
        for (property, kind) in [
            (u32_property(0x11, 10), P::SessionExpiryInterval),
            (u16_property(0x21, 10), P::ReceiveMaximum),
            (u32_property(0x27, 1000), P::MaximumPacketSize),
            (u16_property(0x22, 10), P::TopicAliasMaximum),
            (u8_property(0x19, 1), P::RequestResponseInformation),
            (u8_property(0x17, 0), P::RequestProblemInformation),
            (string_property(0x15, b"m"), P::AuthenticationMethod),
            (string_property(0x16, b"d"), P::AuthenticationData),
        ] {
            cases.push((Box::new(connect_props), property, kind));
        }
        let will_props = |p: &[u8]| connect(&[], Some(p));
        for (property, kind) in [
            (u32_property(0x18, 5), P::WillDelayInterval),
            (u8_property(0x01, 1), P::PayloadFormatIndicator),
            (u32_property(0x02, 60), P::MessageExpiryInterval),
            (string_property(0x03, b"text/plain"), P::ContentType),
            (string_property(0x08, b"r/t"), P::ResponseTopic),
            (string_property(0x09, b"c"), P::CorrelationData),
        ] {
            cases.push((Box::new(will_props), property, kind));
        }
        for (property, kind) in [
            (u8_property(0x01, 1), P::PayloadFormatIndicator),
            (u32_property(0x02, 60), P::MessageExpiryInterval),
            (u16_property(0x23, 1), P::TopicAlias),
            (string_property(0x08, b"r/t"), P::ResponseTopic),
            (string_property(0x09, b"c"), P::CorrelationData),
            (string_property(0x03, b"text/plain"), P::ContentType),
        ] {
            cases.push((Box::new(|p: &[u8]| publish(0x32, p)), property, kind));
        }
        cases.push((
            Box::new(subscribe),
            vec![0x0B, 7],
            P::SubscriptionIdentifier,
        ));
        let reason = string_property(0x1F, b"why");
        for byte0 in [0x40, 0x50, 0x62, 0x70] {
            cases.push((
                Box::new(move |p: &[u8]| acknowledgement(byte0, &[0, 1, 0], p)),
                reason.clone(),
                P::ReasonString,
            ));
        }
        let disconnect = |p: &[u8]| acknowledgement(0xE0, &[0], p);
        for (property, kind) in [
            (u32_property(0x11, 10), P::SessionExpiryInterval),
            (reason.clone(), P::ReasonString),
            (string_property(0x1C, b"elsewhere"), P::ServerReference),
        ] {
            cases.push((Box::new(disconnect), property, kind));
        }
        for (make, property, kind) in &cases {
            let once = make(&[property.as_slice(), &user].concat());
            assert!(read(&once).is_ok(), "{kind:?} once: {:?}", read(&once));
            let two = make(&[property.as_slice(), &user, property].concat());
            let error = read(&two).unwrap_err();
            assert_eq!(error, Error::DuplicateProperty(*kind), "{kind:?} twice");
            assert!(error.is_protocol_error());
            assert!(error.to_string().contains(kind.name()), "{error}");
        }
        // User Property repeats anywhere; Subscription Identifier in a
        // PUBLISH (to a client, 3.3.2.3.8).
        assert!(read(&connect(&twice(&user), Some(&twice(&user)))).is_ok());
        assert!(read(&publish(
            0x30,
            &[twice(&user), vec![0x0B, 1, 0x0B, 2]].concat()
        ))
        .is_ok());
        assert!(read(&subscribe(&twice(&user))).is_ok());
    }

    #[test]
    fn values_connect_may_not_hold_are_protocol_errors() {
        for (property, error) in [
            (u16_property(0x21, 0), Error::ReceiveMaximumZero),
            (u32_property(0x27, 0), Error::MaximumPacketSizeZero),
            (
                u8_property(0x19, 2),
                Error::InvalidRequestResponseInformation(2),
            ),
            (
                u8_property(0x17, 2),
                Error::InvalidRequestProblemInformation(2),
            ),
            (
                u8_property(0x17, 0xFF),
                Error::InvalidRequestProblemInformation(0xFF),
            ),
        ] {
            assert_eq!(read(&connect(&property, None)), Err(error));
            assert!(error.is_protocol_error(), "{error:?}");
        }
        for property in [
            u16_property(0x21, 1),
            u16_property(0x21, u16::MAX),
            u32_property(0x27, 1),
            u8_property(0x19, 0),
            u8_property(0x19, 1),
            u8_property(0x17, 0),
            u8_property(0x17, 1),
        ] {
            assert!(read(&connect(&property, None)).is_ok(), "{property:02x?}");
        }
    }

    /// A will's (the decoder reads only clients' CONNECTs); a PUBLISH's
    /// is the front end's to refuse (`codec::check_from_client`): the
    /// decoder also reads stored messages, and what older binaries stored
    /// must stay readable.
    #[test]
    fn a_wills_response_topic_with_a_wildcard_is_a_protocol_error() {
        for topic in [&b"a/#"[..], b"+", b"a/+/b", b"x#"] {
            let property = string_property(0x08, topic);
            assert!(read(&publish(0x32, &property)).is_ok());
            assert_eq!(
                read(&connect(&[], Some(&property))),
                Err(Error::ResponseTopicWildcard),
                "will"
            );
        }
        assert!(Error::ResponseTopicWildcard.is_protocol_error());
        let fine = string_property(0x08, b"reply/to/me");
        assert!(read(&connect(&[], Some(&fine))).is_ok());
    }

    #[test]
    fn subscription_identifier_0_is_a_protocol_error() {
        assert_eq!(read(&subscribe(&[0x0B, 0])), Err(Error::SubscriptionIdZero));
        assert!(Error::SubscriptionIdZero.is_protocol_error());
        assert!(read(&subscribe(&[0x0B, 1])).is_ok());
        assert!(read(&subscribe(&[0x0B, 0xFF, 0xFF, 0xFF, 0x7F])).is_ok());
    }
}
