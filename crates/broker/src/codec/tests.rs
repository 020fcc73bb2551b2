use super::*;

fn connect(level: u8) -> Vec<u8> {
    // CONNECT, "MQTT", level, flags (clean), keep alive 60, [props], client id "a"
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', level, 0x02, 0, 60];
    if level == 5 {
        body.push(0);
    }
    body.extend_from_slice(&[0, 1, b'a']);
    let mut packet = vec![0x10, body.len() as u8];
    packet.extend(body);
    packet
}

#[test]
fn a_plain_puback_reads_as_the_decoder_reads_it() {
    for protocol in [Protocol::V4, Protocol::V5] {
        for pkid in [0u16, 1, 0x00ff, 0x8000, u16::MAX] {
            let [high, low] = pkid.to_be_bytes();
            // Followed by the start of another packet.
            let bytes = [0x40, 0x02, high, low, 0x30];
            let read = Incoming::puback(puback_at(&bytes, 1 << 20).unwrap());
            let mut slow = BytesMut::from(&bytes[..]);
            let decoded = protocol.decode(&mut slow, 1 << 20).unwrap();
            assert_eq!(read.packet, decoded, "{protocol:?} {pkid}");
            assert_eq!((read.qos, read.pkid, read.dup), (0, 0, false));
            assert_eq!(&bytes[4..], &slow[..], "the same bytes left");
        }
        // Not whole yet, or with a reason code: the decoder's.
        let mut short = BytesMut::from(&[0x40, 0x02, 0x00][..]);
        assert_eq!(puback_at(&short, 1 << 20), None);
        assert!(protocol.read(&mut short, 1 << 20).unwrap().is_none());
        assert_eq!(short.len(), 3);
    }
    assert_eq!(puback_at(&[0x40, 0x03, 0x00, 0x07, 0x10], 1 << 20), None);
    let mut with_reason = BytesMut::from(&[0x40, 0x03, 0x00, 0x07, 0x10][..]);
    let read = Protocol::V5
        .read(&mut with_reason, 1 << 20)
        .unwrap()
        .unwrap();
    assert!(matches!(
        read.packet,
        Packet::PubAck(
            router::protocol::PubAck {
                pkid: 7,
                reason: router::protocol::PubAckReason::NoMatchingSubscribers
            },
            _
        )
    ));
}

#[test]
fn detects_protocol_level() {
    assert_eq!(detect(&connect(4), 1024), Ok(Some(Protocol::V4)));
    assert_eq!(detect(&connect(5), 1024), Ok(Some(Protocol::V5)));
    assert_eq!(
        detect(&connect(3), 1024),
        Err(CodecError::UnsupportedLevel(3))
    );
    assert_eq!(detect(&connect(5)[..5], 1024), Ok(None));
    assert!(detect(&[0x30, 0x00], 1024).is_err());
    assert!(matches!(
        detect(&[0x10, 0xFF, 0xFF, 0xFF, 0x7F], 1024),
        Err(CodecError::TooLarge(_))
    ));
    assert!(matches!(
        detect(&[0x10, 0xFF, 0xFF, 0xFF, 0xFF, 0x01], usize::MAX),
        Err(CodecError::Malformed(_))
    ));
}

#[test]
fn reads_connect() {
    for (level, protocol) in [(4, Protocol::V4), (5, Protocol::V5)] {
        let mut buf = BytesMut::from(&connect(level)[..]);
        let incoming = protocol.read(&mut buf, 1024).unwrap().unwrap();
        assert!(matches!(incoming.packet, Packet::Connect(..)));
        assert!(buf.is_empty());
    }
}

#[test]
fn refuses_server_only_packets_without_decoding() {
    // CONNACK, SUBACK, UNSUBACK, PINGRESP from a client; the v5 decoder
    // would reach `unreachable!()` on some of these.
    for bytes in [
        &[0x20u8, 0x03, 0, 0, 0][..],
        &[0x90, 3, 0, 1, 0],
        &[0xB0, 3, 0, 1, 0],
        &[0xD0, 0],
    ] {
        for protocol in [Protocol::V4, Protocol::V5] {
            let mut buf = BytesMut::from(bytes);
            assert!(
                matches!(protocol.read(&mut buf, 1024), Err(CodecError::Protocol(_))),
                "{bytes:?}"
            );
        }
    }
}

#[test]
fn publish_qos_and_packet_id_from_the_raw_header() {
    // QoS 1 PUBLISH "t" pkid 7, v5 with empty properties, payload "x"
    let mut buf = BytesMut::from(&[0x32, 7, 0, 1, b't', 0, 7, 0, b'x'][..]);
    let incoming = Protocol::V5.read(&mut buf, 1024).unwrap().unwrap();
    assert_eq!((incoming.qos, incoming.pkid), (1, 7));
    let mut buf = BytesMut::from(&[0x36, 7, 0, 1, b't', 0, 7, 0, b'x'][..]);
    assert!(Protocol::V5.read(&mut buf, 1024).is_err(), "QoS 3");
    let mut buf = BytesMut::from(&[0x32, 3, 0, 1, b't'][..]);
    assert!(Protocol::V5.read(&mut buf, 1024).is_err(), "no packet id");
}

#[test]
fn publish_with_qos_and_packet_id() {
    let p = publish(b"topic", b"payload", 1, 4242, false);
    let mut buf = BytesMut::new();
    Protocol::V5
        .write(Packet::Publish(p, None), &mut buf)
        .unwrap();
    assert_eq!(encoded_publish_id(&buf), Some((1, 4242)));
    let incoming = Protocol::V5.read(&mut buf, 1024).unwrap().unwrap();
    match incoming.packet {
        Packet::Publish(p, _) => assert_eq!(
            (&p.topic[..], &p.payload[..]),
            (&b"topic"[..], &b"payload"[..])
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn own_publish_encoding_matches_rumqttds_decoder() {
    use bytes::Bytes;
    use router::protocol::PublishProperties;
    let properties = PublishProperties {
        payload_format_indicator: Some(1),
        message_expiry_interval: Some(60),
        content_type: Some("application/octet-stream".into()),
        response_topic: Some("reply/here".into()),
        correlation_data: Some(Bytes::from_static(b"\x00\x01corr")),
        subscription_identifiers: vec![7, 300, 70_000],
        user_properties: vec![
            ("__stat".into(), "200".into()),
            ("__ts".into(), "1:2:n".into()),
        ],
        ..PublishProperties::default()
    };
    let big = vec![b'x'; 20_000];
    for (qos, pkid, payload) in [
        (0u8, 0u16, &b"p"[..]),
        (1, 4242, &b""[..]),
        (1, 65535, &big[..]),
    ] {
        let mut buf = BytesMut::new();
        encode_publish(
            Protocol::V5,
            b"a/topic",
            payload,
            qos,
            pkid,
            &properties,
            &mut buf,
        );
        assert_eq!(encoded_publish_id(&buf), Some((qos, pkid)));
        match Protocol::V5
            .read(&mut buf, 1 << 20)
            .unwrap()
            .unwrap()
            .packet
        {
            Packet::Publish(p, Some(props)) => {
                assert_eq!((&p.topic[..], &p.payload[..]), (&b"a/topic"[..], payload));
                assert_eq!(props, properties);
            }
            other => panic!("{other:?}"),
        }
        assert!(buf.is_empty(), "exactly one packet");
        let mut buf = BytesMut::new();
        encode_publish(
            Protocol::V4,
            b"a/topic",
            payload,
            qos,
            pkid,
            &properties,
            &mut buf,
        );
        match Protocol::V4
            .read(&mut buf, 1 << 20)
            .unwrap()
            .unwrap()
            .packet
        {
            Packet::Publish(p, None) => assert_eq!(&p.payload[..], payload),
            other => panic!("{other:?}"),
        }
    }
}

/// What the decoder reads but MQTT 5 does not allow is a Protocol
/// Error (DISCONNECT or CONNACK 0x82), what it cannot read malformed
/// (0x81); a client's PUBLISH may not carry a Subscription Identifier,
/// the broker's may.
/// The Message Expiry Interval of an encoded PUBLISH is found where the
/// encoder puts it, after a Payload Format Indicator or without one.
#[test]
fn an_encoded_publishs_message_expiry_is_found() {
    use router::protocol::PublishProperties;
    let encode = |properties: Option<PublishProperties>| {
        let publish = publish(b"t/x", b"payload", 1, 9, false);
        let mut out = BytesMut::new();
        Protocol::V5
            .write(Packet::Publish(publish, properties), &mut out)
            .unwrap();
        out
    };
    let with = |pfi: Option<u8>, expiry: Option<u32>| PublishProperties {
        payload_format_indicator: pfi,
        message_expiry_interval: expiry,
        content_type: Some("text/plain".into()),
        ..PublishProperties::default()
    };
    for pfi in [None, Some(1)] {
        let out = encode(Some(with(pfi, Some(0x0102_0304))));
        let (at, secs) = encoded_message_expiry(&out).unwrap();
        assert_eq!(secs, 0x0102_0304);
        assert_eq!(&out[at..at + 4], &[1, 2, 3, 4]);
        assert_eq!(encoded_message_expiry(&encode(Some(with(pfi, None)))), None);
    }
    assert_eq!(encoded_message_expiry(&encode(None)), None);
}

#[test]
fn protocol_errors_and_malformed_packets() {
    // PUBLISH QoS 1 "t" id 1 with `props` and payload "x".
    let publish = |props: &[u8]| {
        let mut p = vec![0x32, (6 + props.len()) as u8, 0, 1, b't', 0, 1];
        p.push(props.len() as u8);
        p.extend_from_slice(props);
        p.push(b'x');
        BytesMut::from(&p[..])
    };
    let twice = publish(&[0x01, 1, 0x01, 1]);
    assert!(matches!(
        Protocol::V5.read(&mut twice.clone(), 1024),
        Err(CodecError::Protocol(e)) if e.contains("Payload Format Indicator")
    ));
    // Read (stored messages must stay readable), refused from clients.
    for protocol in [Protocol::V5, Protocol::V4] {
        let body: &[u8] = match protocol {
            Protocol::V5 => &[0x38, 5, 0, 1, b't', 0, b'x'],
            Protocol::V4 => &[0x38, 4, 0, 1, b't', b'x'],
        };
        let dup = protocol
            .read(&mut BytesMut::from(body), 1024)
            .unwrap()
            .unwrap();
        assert!(matches!(
            check_from_client(&dup.packet),
            Err(CodecError::Malformed(e)) if e.contains("MQTT-3.3.1-2")
        ));
    }
    let wildcard = Protocol::V5
        .read(&mut publish(&[0x08, 0, 3, b'a', b'/', b'#']), 1024)
        .unwrap()
        .unwrap();
    assert!(matches!(
        check_from_client(&wildcard.packet),
        Err(CodecError::Protocol(e)) if e.contains("MQTT-3.3.2-14")
    ));
    let with_id = Protocol::V5
        .read(&mut publish(&[0x0B, 3]), 1024)
        .unwrap()
        .unwrap();
    assert!(matches!(
        check_from_client(&with_id.packet),
        Err(CodecError::Protocol(e)) if e.contains("MQTT-3.3.4-6")
    ));
    let without = Protocol::V5.read(&mut publish(&[]), 1024).unwrap().unwrap();
    assert_eq!(check_from_client(&without.packet), Ok(()));
}

#[test]
fn too_large_and_partial() {
    let mut buf = BytesMut::from(&[0x30, 0x80, 0x01][..]);
    assert!(matches!(
        Protocol::V4.read(&mut buf, 100),
        Err(CodecError::TooLarge(128))
    ));
    let mut buf = BytesMut::from(&[0x30, 0x05, 0, 1][..]);
    assert!(Protocol::V4.read(&mut buf, 100).unwrap().is_none());
    assert_eq!(buf.len(), 4, "partial frames are left in the buffer");
}
