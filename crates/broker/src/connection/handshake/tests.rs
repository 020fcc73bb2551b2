use super::*;
use bytes::Bytes;
use router::protocol::QoS;

fn listener() -> Listener {
    Listener {
        name: "v5.1".into(),
        addr: "127.0.0.1:0".parse().unwrap(),
        transport: crate::config::Transport::Tcp,
        tls: None,
        allow_anonymous: true,
        connect_timeout_ms: 1000,
        max_packet_size: 1 << 20,
        receive_maximum: 1000,
    }
}

fn connect(client_id: &str, clean: bool, keep_alive: u16) -> Connect {
    Connect {
        keep_alive,
        client_id: client_id.into(),
        clean_session: clean,
    }
}

fn hello(connect: Connect, properties: Option<ConnectProperties>) -> Hello {
    Hello {
        connect,
        properties,
        will: None,
        will_properties: None,
        login: None,
    }
}

fn will(topic: &str) -> LastWill {
    LastWill {
        topic: Bytes::copy_from_slice(topic.as_bytes()),
        message: Bytes::from_static(b"bye"),
        qos: QoS::AtLeastOnce,
        retain: false,
    }
}

#[test]
fn client_ids() {
    let refused = |c: Connect| {
        check_connect(&c, None, None, Protocol::V5)
            .err()
            .map(|e| e.0)
    };
    assert_eq!(refused(connect("", true, 0)), None);
    assert_eq!(refused(connect("", false, 0)), Some(Refusal::BadClientId));
    for bad in ["a/b", "a+", "#", "$sys", "statebroker:publisher"] {
        assert_eq!(
            refused(connect(bad, true, 0)),
            Some(Refusal::BadClientId),
            "{bad}"
        );
    }
    assert_eq!(refused(connect("sensor-1", false, 0)), None);
}

#[test]
fn will_topics() {
    let c = connect("c", true, 0);
    let check = |topic: &str, p| {
        check_connect(&c, Some(&will(topic)), None, p)
            .err()
            .map(|e| e.0)
    };
    for p in [Protocol::V5, Protocol::V4] {
        assert_eq!(check("devices/c/status", p), None);
        assert_eq!(check(topics::REQUEST_TOPIC, p), Some(Refusal::BadWill));
        let notify = format!("{}/x", topics::NOTIFY_NAMESPACE);
        assert_eq!(check(&notify, p), Some(Refusal::BadWill));
        // The broker's own topics: a retained will there would pass
        // for the broker's word (a client's PUBLISH there is refused).
        assert_eq!(check("$SYS/broker/version", p), Some(Refusal::BadWill));
    }
    // Not a topic name: MQTT 5 says so (0x90), 3.1.1 closes.
    for bad in ["", "a/+"] {
        assert_eq!(check(bad, Protocol::V5), Some(Refusal::BadWill));
        assert_eq!(check(bad, Protocol::V4), Some(Refusal::Malformed));
    }
}

#[test]
fn authentication_methods_are_refused() {
    let c = connect("c", true, 0);
    let props = |method: Option<&str>, data: Option<&[u8]>| ConnectProperties {
        session_expiry_interval: None,
        receive_maximum: None,
        max_packet_size: None,
        topic_alias_max: None,
        request_response_info: None,
        request_problem_info: None,
        user_properties: Vec::new(),
        authentication_method: method.map(str::to_owned),
        authentication_data: data.map(Bytes::copy_from_slice),
    };
    let check = |p: ConnectProperties| {
        check_connect(&c, None, Some(&p), Protocol::V5)
            .err()
            .map(|e| e.0)
    };
    assert_eq!(check(props(None, None)), None);
    assert_eq!(
        check(props(Some("SCRAM-SHA-1"), None)),
        Some(Refusal::BadAuthenticationMethod)
    );
    assert_eq!(
        check(props(Some("SCRAM-SHA-1"), Some(b"x"))),
        Some(Refusal::BadAuthenticationMethod)
    );
    assert_eq!(check(props(None, Some(b"x"))), Some(Refusal::ProtocolError));
}

#[test]
fn refusal_codes_per_protocol() {
    let code = |p, r| match refusal(p, r) {
        Some(Packet::ConnAck(ack, None)) => {
            assert!(!ack.session_present);
            ack.code
        }
        other => panic!("{other:?}"),
    };
    use ConnectReturnCode as C;
    assert_eq!(code(Protocol::V4, Refusal::Busy), C::ServiceUnavailable);
    assert_eq!(code(Protocol::V5, Refusal::Busy), C::ServerBusy);
    assert_eq!(code(Protocol::V4, Refusal::BadWill), C::NotAuthorized);
    assert_eq!(code(Protocol::V5, Refusal::BadWill), C::TopicNameInvalid);
    assert_eq!(code(Protocol::V5, Refusal::Malformed), C::MalformedPacket);
    assert_eq!(code(Protocol::V5, Refusal::ProtocolError), C::ProtocolError);
    assert_eq!(
        code(Protocol::V5, Refusal::ConnAckTooLarge),
        C::ImplementationSpecificError
    );
    assert_eq!(code(Protocol::V5, Refusal::SessionsQuota), C::QuotaExceeded);
    assert_eq!(
        code(Protocol::V4, Refusal::SessionsQuota),
        C::ServiceUnavailable
    );
    for r in [Refusal::Malformed, Refusal::ProtocolError] {
        assert_eq!(refusal(Protocol::V4, r), None, "{r:?}: 3.1.1 closes");
    }
    for r in [Refusal::Joining, Refusal::SessionUnavailable] {
        assert_eq!(code(Protocol::V5, r), C::ServerUnavailable, "{r:?}");
        assert_eq!(code(Protocol::V4, r), C::ServiceUnavailable, "{r:?}");
    }
    for p in [Protocol::V4, Protocol::V5] {
        assert_eq!(code(p, Refusal::BadClientId), C::ClientIdentifierNotValid);
        assert_eq!(code(p, Refusal::BadCredentials), C::BadUserNamePassword);
        assert_eq!(code(p, Refusal::NotAuthorized), C::NotAuthorized);
    }
}

#[test]
fn keep_alive_and_limits() {
    let props = ConnectProperties {
        session_expiry_interval: Some(3600),
        receive_maximum: Some(10),
        max_packet_size: Some(512),
        topic_alias_max: None,
        request_response_info: None,
        request_problem_info: None,
        user_properties: Vec::new(),
        authentication_method: None,
        authentication_data: None,
    };
    let h = hello(connect("c", false, 0), Some(props));
    let t = Terms::negotiate(&h, Protocol::V5, 60, || unreachable!());
    assert_eq!(
        (t.keep_alive, t.server_keep_alive, t.idle_limit()),
        (60, Some(60), Some(Duration::from_secs(90))),
        "no keep-alive asked: the broker's maximum, announced"
    );
    assert_eq!((t.receive_maximum, t.session_expiry), (10, 3600));
    assert_eq!(t.max_packet_size, 512);
    assert!(!t.clean_start && !t.assigned);

    let h = hello(connect("c", true, 30), None);
    let t = Terms::negotiate(&h, Protocol::V5, 60, || unreachable!());
    assert_eq!((t.keep_alive, t.server_keep_alive), (30, None));
    assert_eq!((t.receive_maximum, t.session_expiry), (u16::MAX, 0));
    assert_eq!(t.max_packet_size, usize::MAX);
    let t = Terms::negotiate(
        &hello(connect("c", true, 600), None),
        Protocol::V5,
        60,
        || unreachable!(),
    );
    assert_eq!((t.keep_alive, t.server_keep_alive), (60, Some(60)));
    // MQTT 3.1.1: a persistent session never expires.
    let t = Terms::negotiate(
        &hello(connect("c", false, 0), None),
        Protocol::V4,
        60,
        || unreachable!(),
    );
    assert_eq!(t.session_expiry, u32::MAX);
    // MQTT 3.1.1 has no way to be told: its keep-alive stands.
    let t = Terms::negotiate(
        &hello(connect("c", true, 0), None),
        Protocol::V4,
        60,
        || unreachable!(),
    );
    assert_eq!(
        (t.keep_alive, t.server_keep_alive, t.idle_limit()),
        (0, None, None)
    );
    // No maximum configured.
    let t = Terms::negotiate(
        &hello(connect("c", true, 0), None),
        Protocol::V5,
        0,
        || unreachable!(),
    );
    assert_eq!((t.keep_alive, t.server_keep_alive), (0, None));
}

/// 3.2.2.3.2: the broker's maximum Session Expiry Interval, told in
/// CONNACK to an MQTT 5 client that asked for more; applied to 3.1.1
/// persistent sessions without a word.
#[test]
fn session_expiry_is_capped() {
    let asking = |expiry: Option<u32>| ConnectProperties {
        session_expiry_interval: expiry,
        receive_maximum: None,
        max_packet_size: None,
        topic_alias_max: None,
        request_response_info: None,
        request_problem_info: None,
        user_properties: Vec::new(),
        authentication_method: None,
        authentication_data: None,
    };
    let l = listener();
    let capped = |expiry: Option<u32>, max: u32| {
        let h = hello(connect("c", false, 0), Some(asking(expiry)));
        let mut t = Terms::negotiate(&h, Protocol::V5, 0, || unreachable!());
        t.cap_session_expiry(max, Protocol::V5);
        let told = connack_properties(&t, &l, 0)
            .unwrap()
            .session_expiry_interval;
        (t.session_expiry, told)
    };
    assert_eq!(capped(Some(u32::MAX), 604_800), (604_800, Some(604_800)));
    assert_eq!(capped(Some(604_801), 604_800), (604_800, Some(604_800)));
    assert_eq!(capped(Some(604_800), 604_800), (604_800, None), "not more");
    assert_eq!(capped(Some(60), 604_800), (60, None));
    assert_eq!(capped(None, 604_800), (0, None), "nothing kept");
    assert_eq!(capped(Some(u32::MAX), 0), (u32::MAX, None), "no maximum");
    let h = hello(connect("c", false, 0), None);
    let mut t = Terms::negotiate(&h, Protocol::V4, 0, || unreachable!());
    t.cap_session_expiry(604_800, Protocol::V4);
    assert_eq!((t.session_expiry, t.server_session_expiry), (604_800, None));
    let h = hello(connect("c", true, 0), None);
    let mut t = Terms::negotiate(&h, Protocol::V4, 0, || unreachable!());
    t.cap_session_expiry(604_800, Protocol::V4);
    assert_eq!(t.session_expiry, 0, "a clean 3.1.1 session keeps nothing");
}

#[test]
fn assigned_client_id_is_announced() {
    let h = hello(connect("", true, 0), None);
    let t = Terms::negotiate(&h, Protocol::V5, 0, || "statebroker-1-7".into());
    assert_eq!(
        (t.client_id.as_str(), t.assigned),
        ("statebroker-1-7", true)
    );
    let l = listener();
    match connack(false, connack_properties(&t, &l, 1024).unwrap()) {
        Packet::ConnAck(ack, Some(p)) => {
            assert_eq!(ack.code, ConnectReturnCode::Success);
            assert_eq!(
                p.assigned_client_identifier.as_deref(),
                Some("statebroker-1-7")
            );
            assert_eq!(p.receive_max, Some(1000));
            assert_eq!(p.topic_alias_max, Some(1024));
            assert_eq!(p.max_packet_size, Some(1 << 20));
            assert_eq!(p.server_keep_alive, None);
        }
        other => panic!("{other:?}"),
    }
    let named = Terms::negotiate(
        &hello(connect("me", false, 0), None),
        Protocol::V5,
        0,
        || unreachable!(),
    );
    match connack(true, connack_properties(&named, &l, 0).unwrap()) {
        Packet::ConnAck(ack, Some(p)) => {
            assert!(ack.session_present);
            assert_eq!(p.assigned_client_identifier, None);
        }
        other => panic!("{other:?}"),
    }
}

/// [MQTT-3.1.2-24]: the CONNACK fits the client's Maximum Packet Size,
/// leaving out what matters least first.
#[test]
fn connack_within_the_clients_maximum_packet_size() {
    let l = listener();
    let size = |t: &Terms| {
        let mut out = bytes::BytesMut::new();
        let p = connack_properties(t, &l, 1024).unwrap();
        Protocol::V5
            .write(connack(false, p.clone()), &mut out)
            .unwrap();
        (out.len(), p)
    };
    let terms = |max: u32, id: &str| {
        let props = ConnectProperties {
            session_expiry_interval: None,
            receive_maximum: None,
            max_packet_size: Some(max),
            topic_alias_max: None,
            request_response_info: None,
            request_problem_info: None,
            user_properties: Vec::new(),
            authentication_method: None,
            authentication_data: None,
        };
        let h = hello(connect(id, true, 0), Some(props));
        Terms::negotiate(&h, Protocol::V5, 0, || "statebroker-1-7".into())
    };
    let (full, p) = size(&terms(1 << 20, "c"));
    assert_eq!(full, 24);
    assert_eq!(p.retain_available, Some(1));
    let (len, p) = size(&terms(20, "c"));
    assert_eq!(len, 20, "two 'available' flags left out");
    assert_eq!(
        (
            p.shared_subscription_available,
            p.wildcard_subscription_available
        ),
        (None, None)
    );
    assert_eq!(p.retain_available, Some(1));
    let (len, p) = size(&terms(16, "c"));
    assert_eq!(len, 16, "the four 'available' flags left out");
    assert_eq!(
        (p.retain_available, p.subscription_identifiers_available),
        (None, None)
    );
    assert_eq!(p.topic_alias_max, Some(1024));
    let (len, p) = size(&terms(22, "c"));
    assert_eq!(len, 22, "only as much left out as needed");
    assert_eq!(p.retain_available, Some(1));
    assert_eq!(p.shared_subscription_available, None);
    let (len, p) = size(&terms(13, "c"));
    assert_eq!(len, 13);
    assert_eq!(p.topic_alias_max, None);
    assert_eq!(
        (p.receive_max, p.max_packet_size),
        (Some(1000), Some(1 << 20))
    );
    // Receive Maximum and Maximum Packet Size never left out.
    assert!(connack_properties(&terms(12, "c"), &l, 1024).is_none());
    // Nor an assigned client id.
    assert!(connack_properties(&terms(20, ""), &l, 1024).is_none());
    let (len, p) = size(&terms(31, ""));
    assert_eq!(len, 31);
    assert_eq!(
        p.assigned_client_identifier.as_deref(),
        Some("statebroker-1-7")
    );
}

/// A session's `queue_full` (CONNECT User Property): read, checked,
/// settled against the broker's, told in CONNACK (left out first when
/// the CONNACK would not fit).
#[test]
fn queue_full_asked_settled_and_told() {
    use router::QueueFull::{DropOldest, Refuse};
    let asking = |value: &str, max_packet_size: Option<u32>| ConnectProperties {
        session_expiry_interval: None,
        receive_maximum: None,
        max_packet_size,
        topic_alias_max: None,
        request_response_info: None,
        request_problem_info: None,
        user_properties: vec![("queue_full".into(), value.into())],
        authentication_method: None,
        authentication_data: None,
    };
    let v5 = Protocol::V5;
    let checked = |p: &ConnectProperties| check_connect(&connect("c", true, 0), None, Some(p), v5);
    assert_eq!(
        checked(&asking("later", None)).unwrap_err().0,
        Refusal::BadUserProperty
    );
    assert!(checked(&asking("refuse", None)).is_ok());
    let Some(Packet::ConnAck(ack, Some(p))) = refusal(v5, Refusal::BadUserProperty) else {
        panic!("a CONNACK with properties");
    };
    assert_eq!(ack.code, ConnectReturnCode::ImplementationSpecificError);
    assert!(
        p.reason_string
            .unwrap()
            .contains("\"drop_oldest\" or \"refuse\"")
    );

    let terms = |value: &str, max: Option<u32>| {
        let h = hello(connect("c", false, 0), Some(asking(value, max)));
        Terms::negotiate(&h, v5, 0, || unreachable!())
    };
    // (broker's, allow_session_refuse, asked) -> in force, denied
    let cases = [
        (DropOldest, false, "refuse", None, Some(Refuse)),
        (DropOldest, true, "refuse", Some(Refuse), None),
        (Refuse, false, "refuse", Some(Refuse), None),
        (Refuse, false, "drop_oldest", Some(DropOldest), None),
        (DropOldest, false, "drop_oldest", Some(DropOldest), None),
    ];
    for (default, allow, asked, in_force, denied) in cases {
        let mut t = terms(asked, None);
        assert_eq!(t.settle_queue_full(default, allow), denied, "{asked}");
        assert_eq!(t.queue_full, in_force, "{asked}");
        let told = in_force.unwrap_or(default);
        assert_eq!(t.told_queue_full, Some(told));
        let p = connack_properties(&t, &listener(), 0).unwrap();
        assert_eq!(
            p.user_properties,
            vec![("queue_full".to_owned(), queue_full_name(told).to_owned())]
        );
    }
    // Nothing asked, nothing told.
    let mut t = Terms::negotiate(
        &hello(connect("c", false, 0), None),
        v5,
        0,
        || unreachable!(),
    );
    assert_eq!(t.settle_queue_full(Refuse, false), None);
    assert_eq!((t.queue_full, t.told_queue_full), (None, None));
    // A CONNACK that fits only without it.
    let mut t = terms("refuse", Some(30));
    t.settle_queue_full(Refuse, false);
    let p = connack_properties(&t, &listener(), 0).unwrap();
    assert!(p.user_properties.is_empty());
    assert_eq!(p.retain_available, Some(1), "left out first");
}
