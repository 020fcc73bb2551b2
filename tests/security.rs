//! Security end to end: hashed passwords and anonymous clients, TLS
//! (server-only and mutual, a wrong CA refused), WebSocket and secure
//! WebSocket, the authorization policy on topics and state store keys, the
//! official SDK over TLS with a password, and reload on SIGHUP.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use broker::config::{TlsFiles, Transport};
use bytes::Bytes;
use common::raw::{Raw, v5};
use common::tls::{self, Ca};
use common::{SdkClient, T, start_broker_with};
use rcgen::DnType;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{ConnectReturnCode, PubAckReason, SubscribeReasonCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A password file with `users`, in a directory kept for the test's life.
fn password_file(dir: &std::path::Path, users: &[(&str, &str)]) -> PathBuf {
    let mut text = String::new();
    for (user, password) in users {
        text = broker::passwords::set_user(&text, user, password.as_bytes()).unwrap();
    }
    tls::write(dir, "passwd", &text)
}

fn login(
    user: &str,
    password: &str,
) -> impl FnOnce(&mut (v5::Connect, Option<v5::LastWill>, Option<v5::Login>)) {
    let login = v5::Login::new(user, password);
    move |c| c.2 = Some(login)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_anonymous_clients_and_slowed_guessing() {
    let dir = tempfile::tempdir().unwrap();
    let file = password_file(dir.path(), &[("alice", "s3cret")]);
    let broker = start_broker_with(|s| {
        s.password_file = Some(file.clone());
        s.listeners[0].allow_anonymous = false;
    })
    .await;
    let addr = broker.local_addr();
    let (_c, ack) = Raw::connect_with(addr, "alice", login("alice", "s3cret")).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    let (_c, ack) = Raw::connect_with(addr, "anon", |_| {}).await;
    assert_eq!(ack.code, ConnectReturnCode::NotAuthorized, "0x87");
    let (_c, ack) = Raw::connect_with(addr, "guess", login("alice", "nope")).await;
    assert_eq!(ack.code, ConnectReturnCode::BadUserNamePassword, "0x86");
    // MQTT 3.1.1: 0x05 for anonymous, 0x04 for a wrong password.
    for (connect_flags, payload_extra, code) in [
        (0x02u8, Vec::new(), 0x05u8),
        (
            0xC2,
            [&[0, 5][..], b"alice", &[0, 4], b"nope"].concat(),
            0x04,
        ),
    ] {
        let mut body = vec![0, 4];
        body.extend(b"MQTT");
        body.extend([4, connect_flags, 0, 30, 0, 2]);
        body.extend(b"v4");
        body.extend(payload_extra);
        let mut packet = vec![0x10, body.len() as u8];
        packet.extend(body);
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(&packet).await.unwrap();
        let mut connack = [0u8; 4];
        tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut connack))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(connack, [0x20, 2, 0, code]);
    }
    // Three failures from this address so far: the next attempt waits its turn.
    let started = Instant::now();
    let (_c, ack) = Raw::connect_with(addr, "guess2", login("alice", "nope2")).await;
    assert_eq!(ack.code, ConnectReturnCode::BadUserNamePassword);
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "a guess after failures is slowed: {:?}",
        started.elapsed()
    );
}

/// A broker whose first listener is TLS (or WSS) with `ca` signing its
/// certificate; `clients_ca` requires client certificates.
async fn tls_broker(
    dir: &std::path::Path,
    ca: &Ca,
    clients_ca: Option<&Ca>,
    transport: Transport,
    tweak: impl FnOnce(&mut broker::Settings),
) -> broker::RunningBroker {
    let server = ca.server();
    let files = TlsFiles {
        cert: tls::write(dir, "server.pem", &server.cert_pem),
        key: tls::write(dir, "server.key", &server.key_pem),
        ca: clients_ca.map(|c| tls::write(dir, "clients-ca.pem", &c.pem())),
    };
    start_broker_with(|s| {
        s.listeners[0].tls = Some(files);
        s.listeners[0].transport = transport;
        tweak(s);
    })
    .await
}

async fn round_trip(c: &mut Raw, topic: &str) {
    assert_eq!(
        c.subscribe(topic, QoS::AtLeastOnce).await,
        vec![SubscribeReasonCode::Success(QoS::AtLeastOnce)]
    );
    let ack = c
        .publish(topic, Bytes::from_static(b"hello"), QoS::AtLeastOnce, None)
        .await;
    assert_eq!(ack, Some(PubAckReason::Success));
    let p = c.next_publish().await;
    assert_eq!(&p.payload[..], b"hello");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_server_only_and_a_wrong_ca_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("statebroker test CA");
    let broker = tls_broker(dir.path(), &ca, None, Transport::Tcp, |_| {}).await;
    let addr = broker.local_addr();
    let stream = tls::tls_stream(addr, &tls::connector(&ca.pem(), None))
        .await
        .unwrap();
    let (mut c, ack) = Raw::connect_over(Box::new(stream), "tls-client", |_| {}).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    round_trip(&mut c, "tls/topic").await;
    // A client trusting another CA refuses the server.
    let other = Ca::new("someone else");
    assert!(
        tls::tls_stream(addr, &tls::connector(&other.pem(), None))
            .await
            .is_err()
    );
    // Plain MQTT on the TLS port gets no CONNACK.
    let mut plain = tokio::net::TcpStream::connect(addr).await.unwrap();
    plain
        .write_all(&[0x10, 12, 0, 4, b'M', b'Q', b'T', b'T', 4, 2, 0, 30, 0, 0])
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(10), plain.read(&mut buf))
        .await
        .unwrap()
        .unwrap_or(0);
    assert!(n == 0 || buf[0] != 0x20, "no CONNACK over plain TCP");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_names_the_client_for_the_policy() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("server CA");
    let clients = Ca::new("clients CA");
    let policy = tls::write(
        dir.path(),
        "policy.yaml",
        r##"
rules:
  - principals:
      attributes: [{ O: plant-7 }]
    brokerResources:
      - method: Connect
      - method: Publish
        topics: ["plants/{principal.attributes.O}/{principal.username}/#"]
      - method: Subscribe
        topics: ["plants/{principal.attributes.O}/#"]
"##,
    );
    let broker = tls_broker(dir.path(), &ca, Some(&clients), Transport::Tcp, |s| {
        s.authorization = Some(policy);
        s.listeners[0].allow_anonymous = false;
    })
    .await;
    let addr = broker.local_addr();
    let device = clients.client("device-1", &[(DnType::OrganizationName, "plant-7")]);
    let stream = tls::tls_stream(addr, &tls::connector(&ca.pem(), Some(&device)))
        .await
        .unwrap();
    let (mut c, ack) = Raw::connect_over(Box::new(stream), "any-id", |_| {}).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    round_trip(&mut c, "plants/plant-7/device-1/temp").await;
    // Another device's topic: PUBACK 0x87.
    let ack = c
        .publish(
            "plants/plant-7/device-2/temp",
            Bytes::from_static(b"x"),
            QoS::AtLeastOnce,
            None,
        )
        .await;
    assert_eq!(ack, Some(PubAckReason::NotAuthorized));
    // Another plant's certificate connects to nothing.
    let stranger = clients.client("device-9", &[(DnType::OrganizationName, "plant-8")]);
    let stream = tls::tls_stream(addr, &tls::connector(&ca.pem(), Some(&stranger)))
        .await
        .unwrap();
    let (_s, ack) = Raw::connect_over(Box::new(stream), "x", |_| {}).await;
    assert_eq!(ack.code, ConnectReturnCode::NotAuthorized);
    // No certificate, or one from the wrong CA: the handshake fails.
    for cert in [
        None,
        Some(ca.client("forged", &[(DnType::OrganizationName, "plant-7")])),
    ] {
        let refused = async {
            let mut s = tls::tls_stream(addr, &tls::connector(&ca.pem(), cert.as_ref())).await?;
            // TLS 1.3 reports the refusal at the first read.
            s.write_all(&[0xC0, 0]).await?;
            let mut b = [0u8; 1];
            match s.read(&mut b).await? {
                0 => Err(std::io::Error::other("closed")),
                _ => Ok(()),
            }
        }
        .await;
        assert!(refused.is_err(), "refused without a good certificate");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_and_secure_websocket() {
    let broker = start_broker_with(|s| s.listeners[0].transport = Transport::WebSocket).await;
    let addr = broker.local_addr();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let ws = tls::websocket(tcp, &format!("ws://{addr}/mqtt")).await;
    let (mut c, ack) = Raw::connect_over(ws, "ws-client", |_| {}).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    round_trip(&mut c, "ws/topic").await;
    // The state store over WebSocket too.
    let answer = c.request(&[b"SET", b"k", b"v"]).await;
    assert_eq!(&answer.payload[..], b"+OK\r\n");

    // A packet over the listener's limit in one WebSocket message: the
    // message is over the WebSocket's limit too, and the client is told
    // why (0x95) as on TCP; it was closed without a word before.
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let ws = tls::websocket(tcp, &format!("ws://{addr}/mqtt")).await;
    let (mut big, ack) = Raw::connect_over(ws, "ws-big", |_| {}).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    let huge = Bytes::from(vec![b'x'; 1_300_000]);
    let mut publish = v5::Publish::new("ws/big", QoS::AtLeastOnce, huge, None);
    publish.pkid = 1;
    big.send(v5::Packet::Publish(publish)).await;
    let d = big.expect_disconnect().await;
    assert_eq!(
        common::raw::disconnect_reason(&d),
        Some(v5::DisconnectReasonCode::PacketTooLarge)
    );

    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("wss CA");
    let broker = tls_broker(dir.path(), &ca, None, Transport::WebSocket, |_| {}).await;
    let addr = broker.local_addr();
    let stream = tls::tls_stream(addr, &tls::connector(&ca.pem(), None))
        .await
        .unwrap();
    let ws = tls::websocket(stream, &format!("wss://localhost:{}/mqtt", addr.port())).await;
    let (mut c, ack) = Raw::connect_over(ws, "wss-client", |_| {}).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    round_trip(&mut c, "wss/topic").await;
}

const STORE_POLICY: &str = r##"
authorizationPolicies:
  rules:
    - principals: { usernames: [alice] }
      brokerResources:
        - method: Connect
        - method: Subscribe
          topics: ["clients/{principal.clientId}/#"]
        - method: Publish
          topics: ["open/#"]
      stateStoreResources:
        - keyType: Pattern
          keys: ["alice/*"]
          method: ReadWrite
        - keyType: String
          keys: ["shared"]
          method: Read
"##;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_guards_topics_and_keys() {
    let dir = tempfile::tempdir().unwrap();
    let file = password_file(dir.path(), &[("alice", "pw"), ("bob", "pw")]);
    let policy = tls::write(dir.path(), "policy.yaml", STORE_POLICY);
    let broker = start_broker_with(|s| {
        s.password_file = Some(file);
        s.authorization = Some(policy);
    })
    .await;
    let addr = broker.local_addr();
    // bob has no Connect rule; anonymous neither.
    let (_b, ack) = Raw::connect_with(addr, "bob", login("bob", "pw")).await;
    assert_eq!(ack.code, ConnectReturnCode::NotAuthorized);
    let (_a, ack) = Raw::connect_with(addr, "anon", |_| {}).await;
    assert_eq!(ack.code, ConnectReturnCode::NotAuthorized);

    let (mut c, ack) = Raw::connect_with(addr, "alice-1", login("alice", "pw")).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    // Keys.
    assert_eq!(
        &c.request(&[b"SET", b"alice/a", b"1"]).await.payload[..],
        b"+OK\r\n"
    );
    let denied = b"-ERR not authorized\r\n";
    assert_eq!(
        &c.request(&[b"SET", b"bob/a", b"1"]).await.payload[..],
        denied
    );
    assert_eq!(
        &c.request(&[b"SET", b"shared", b"1"]).await.payload[..],
        denied
    );
    assert_eq!(&c.request(&[b"DEL", b"shared"]).await.payload[..], denied);
    assert_eq!(&c.request(&[b"GET", b"bob/a"]).await.payload[..], denied);
    assert_eq!(
        &c.request(&[b"KEYNOTIFY", b"bob/a"]).await.payload[..],
        denied
    );
    assert_eq!(
        &c.request(&[b"GET", b"shared"]).await.payload[..],
        b"$-1\r\n"
    );
    assert_eq!(
        &c.request(&[b"KEYNOTIFY", b"alice/a"]).await.payload[..],
        b"+OK\r\n"
    );
    // SCAN lists only what alice may read.
    broker.store().with_store(|store| {
        for key in ["bob/x", "shared", "zed"] {
            let set = statestore::resp3::encode_request(&["SET", key, "v"]);
            let ts = common::raw::now_hlc("t");
            let request = statestore::Request {
                payload: &set,
                timestamp: Some(&ts),
                ..Default::default()
            };
            let me = statestore::Caller {
                client_id: "admin",
                connection: 0,
                owner: "admin",
            };
            store.execute(&request, me, statebroker_now());
        }
    });
    let page = c.request(&[b"SCAN", b"*"]).await;
    let page = statestore::command::Page::decode(&page.payload).unwrap();
    let mut keys = page.keys;
    keys.sort();
    assert_eq!(keys, vec![b"alice/a".to_vec(), b"shared".to_vec()]);
    // Topics: publish denied 0x87, subscribe denied per filter.
    assert_eq!(
        c.subscribe_many(
            &["clients/alice-1/x", "clients/bob/x", "open/#"],
            QoS::AtLeastOnce
        )
        .await,
        vec![
            SubscribeReasonCode::Success(QoS::AtLeastOnce),
            SubscribeReasonCode::NotAuthorized,
            SubscribeReasonCode::NotAuthorized,
        ]
    );
    let ack = c
        .publish("closed/x", Bytes::from_static(b"x"), QoS::AtLeastOnce, None)
        .await;
    assert_eq!(ack, Some(PubAckReason::NotAuthorized));
    // A request whose answer would go where alice may not subscribe:
    // PUBACK 0x87 and no answer.
    let mut props = c.request_properties(b"1", &[]);
    props.response_topic = Some("clients/bob/inbox".into());
    let get = statestore::resp3::encode_request(&["GET", "alice/a"]);
    let ack = c
        .publish(
            common::raw::REQUEST_TOPIC,
            get,
            QoS::AtLeastOnce,
            Some(props),
        )
        .await;
    assert_eq!(ack, Some(PubAckReason::NotAuthorized));
    c.no_publish_within(Duration::from_millis(200)).await;
}

const WILL_POLICY: &str = r##"
authorizationPolicies:
  rules:
    - principals: { usernames: [alice] }
      brokerResources:
        - method: Connect
        - method: Subscribe
          topics: ["#"]
        - method: Publish
          topics: ["status/{principal.clientId}"]
"##;

/// `login` with a will on `topic` (payload "gone", QoS 1).
fn with_will(
    topic: &'static str,
) -> impl FnOnce(&mut (v5::Connect, Option<v5::LastWill>, Option<v5::Login>)) {
    move |c| {
        login("alice", "pw")(c);
        c.1 = Some(v5::LastWill::new(
            topic,
            "gone",
            QoS::AtLeastOnce,
            false,
            None,
        ));
    }
}

/// A will is a publish the broker makes for the client: one on a topic
/// the policy does not let the client publish to refuses the CONNECT
/// (0x87), and one a policy reloaded since no longer allows is not
/// published. Before, any client allowed to connect could publish (and
/// retain) anything anywhere through its will.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_will_is_a_publish_the_policy_must_allow() {
    let dir = tempfile::tempdir().unwrap();
    let file = password_file(dir.path(), &[("alice", "pw")]);
    let policy = tls::write(dir.path(), "policy.yaml", WILL_POLICY);
    let broker = start_broker_with(|s| {
        s.password_file = Some(file);
        s.authorization = Some(policy);
    })
    .await;
    let addr = broker.local_addr();
    let (_c, ack) = Raw::connect_with(addr, "alice-1", with_will("commands/victim/reboot")).await;
    assert_eq!(ack.code, ConnectReturnCode::NotAuthorized);

    let (mut watcher, ack) = Raw::connect_with(addr, "alice-w", login("alice", "pw")).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    watcher.subscribe("#", QoS::AtLeastOnce).await;
    // Its own status topic: allowed, and published when it drops.
    let (dev, ack) = Raw::connect_with(addr, "alice-2", with_will("status/alice-2")).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    drop(dev);
    let will = watcher.next_publish().await;
    assert_eq!(&will.topic[..], b"status/alice-2");

    // Allowed at its CONNECT, denied by the policy in force when it drops.
    let (dev, ack) = Raw::connect_with(addr, "alice-3", with_will("status/alice-3")).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    let later = WILL_POLICY.replace("status/{principal.clientId}", "later/{principal.clientId}");
    tls::write(dir.path(), "policy.yaml", &later);
    assert!(broker.reload());
    drop(dev);
    let (dev, ack) = Raw::connect_with(addr, "alice-4", with_will("later/alice-4")).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    drop(dev);
    // alice-4's will comes; alice-3's, dropped first, does not.
    let will = watcher.next_publish().await;
    assert_eq!(&will.topic[..], b"later/alice-4");
    watcher.no_publish_within(Duration::from_millis(500)).await;
}

fn statebroker_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// The official SDK over TLS with a username and password file, and its
/// round trip time over TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_sdk_over_tls_with_a_password() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("sdk CA");
    let file = password_file(dir.path(), &[("sdk-user", "sdk-pass")]);
    let broker = tls_broker(dir.path(), &ca, None, Transport::Tcp, |s| {
        s.password_file = Some(file);
        s.listeners[0].allow_anonymous = false;
    })
    .await;
    let ca_file = tls::write(dir.path(), "ca.pem", &ca.pem());
    let pass_file = tls::write(dir.path(), "sdk-pass", "sdk-pass");
    let c = SdkClient::connect_tls(
        broker.local_addr(),
        "sdk-tls",
        &ca_file,
        "sdk-user",
        &pass_file,
    )
    .await;
    assert!(c.set(b"over-tls", b"yes").await.response);
    let started = Instant::now();
    let rounds = 50u32;
    for _ in 0..rounds {
        let got = c.client.get(b"over-tls".to_vec(), T).await.unwrap();
        assert_eq!(got.response.as_deref(), Some(&b"yes"[..]));
    }
    eprintln!(
        "SDK GET round trip over TLS: {:?} on average",
        started.elapsed() / rounds
    );
    c.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_swaps_passwords_policy_and_certificates_keeping_connections() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("first CA");
    let file = password_file(dir.path(), &[("alice", "old")]);
    let broker = tls_broker(dir.path(), &ca, None, Transport::Tcp, |s| {
        s.password_file = Some(file.clone());
    })
    .await;
    let addr = broker.local_addr();
    let ids = std::sync::atomic::AtomicU32::new(0);
    let connect = |ca_pem: String, password: &'static str| {
        let id = format!(
            "alice-{}",
            ids.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        async move {
            let stream = tls::tls_stream(addr, &tls::connector(&ca_pem, None)).await?;
            let (c, ack) = Raw::connect_over(Box::new(stream), &id, login("alice", password)).await;
            Ok::<_, std::io::Error>((c, ack.code))
        }
    };
    let (mut kept, code) = connect(ca.pem(), "old").await.unwrap();
    assert_eq!(code, ConnectReturnCode::Success);
    // New password and a new certificate from another CA.
    password_file(dir.path(), &[("alice", "new")]);
    let second = Ca::new("second CA");
    let server = second.server();
    tls::write(dir.path(), "server.pem", &server.cert_pem);
    tls::write(dir.path(), "server.key", &server.key_pem);
    assert!(broker.reload());
    let (_c, code) = connect(second.pem(), "new").await.unwrap();
    assert_eq!(code, ConnectReturnCode::Success);
    assert!(
        connect(ca.pem(), "new").await.is_err(),
        "the old certificate is gone"
    );
    // The connection made before the reload still works.
    round_trip(&mut kept, "kept/topic").await;
    // A broken file keeps what was loaded.
    std::fs::write(&file, "alice:plaintext\n").unwrap();
    assert!(!broker.reload());
    let (_c, code) = connect(second.pem(), "new").await.unwrap();
    assert_eq!(code, ConnectReturnCode::Success);
}
