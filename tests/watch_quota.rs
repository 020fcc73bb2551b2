//! KEYNOTIFY limits per user, end to end: anonymous clients from one
//! address share one quota however many connections and client ids they
//! use, and cannot take the room of an authenticated user (or of another
//! address); the room comes back when their connections end.

mod common;

use common::raw::{NOTIFY_NAMESPACE, Raw, v5};
use common::{eventually, start_broker_with};
use rumqttc::v5::mqttbytes::QoS;

const OK: &[u8] = b"+OK\r\n";
const FULL: &[u8] = b"-ERR the quota has been exceeded\r\n";

/// Registers `client` for each of `keys`; returns how many were accepted
/// (the others must have been refused with the quota error).
async fn watch_all(client: &mut Raw, keys: &[String]) -> usize {
    let mut accepted = 0;
    for key in keys {
        let answer = client.request(&[b"KEYNOTIFY", key.as_bytes()]).await;
        match &answer.payload[..] {
            OK => accepted += 1,
            FULL => {}
            other => panic!("KEYNOTIFY {key}: {:?}", String::from_utf8_lossy(other)),
        }
    }
    accepted
}

fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}/{i}")).collect()
}

/// A client connecting from `source` (a loopback address of this machine).
async fn connect_from(source: &str, addr: std::net::SocketAddr, client_id: &str) -> Raw {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
    let stream = socket.connect(addr).await.expect("connect to broker");
    stream.set_nodelay(true).unwrap();
    let (raw, ack) = Raw::connect_over(Box::new(stream), client_id, |_| {}).await;
    assert_eq!(ack.code, v5::ConnectReturnCode::Success, "{ack:?}");
    raw
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_cannot_take_every_registration() {
    let dir = tempfile::tempdir().unwrap();
    let users = broker::passwords::set_user("", "alice", b"s3cret").unwrap();
    let password_file = dir.path().join("passwd");
    std::fs::write(&password_file, users).unwrap();
    let broker = start_broker_with(|s| {
        s.password_file = Some(password_file);
        s.statestore.max_watches = 100;
        s.statestore.max_watches_per_user = 10;
        s.statestore.max_watches_per_client = 5;
    })
    .await;
    let addr = broker.local_addr();
    let watches = || broker.store().with_store(|store| store.watch_count());

    // Anonymous clients on 127.0.0.1, each trying 5 (its own limit) under
    // a new client id: together they get the address's 10, no more.
    let mut anonymous = Vec::new();
    let mut accepted = 0;
    for i in 0..6 {
        let mut c = Raw::connect(addr, &format!("anon-{i}")).await;
        accepted += watch_all(&mut c, &keys(&format!("anon-{i}"), 5)).await;
        anonymous.push(c);
    }
    assert_eq!(accepted, 10, "the per-user limit of one address");
    assert_eq!(watches(), 10);

    // Another address has its own quota.
    let mut other = connect_from("127.0.0.2", addr, "elsewhere").await;
    assert_eq!(watch_all(&mut other, &keys("elsewhere", 5)).await, 5);

    // alice, authenticated from the same address, has hers: two clients of
    // 5 each, and a third refused.
    let login = |c: &mut (v5::Connect, Option<v5::LastWill>, Option<v5::Login>)| {
        c.2 = Some(v5::Login::new("alice", "s3cret"));
    };
    let mut alice = Vec::new();
    for (i, expected) in [5, 5, 0].into_iter().enumerate() {
        let id = format!("alice-{i}");
        let (mut c, ack) = Raw::connect_with(addr, &id, login).await;
        assert_eq!(ack.code, v5::ConnectReturnCode::Success);
        let own = format!("{NOTIFY_NAMESPACE}/{}/#", hex::encode_upper(&id));
        c.subscribe(&own, QoS::AtLeastOnce).await;
        assert_eq!(watch_all(&mut c, &keys(&id, 5)).await, expected, "{id}");
        alice.push(c);
    }
    assert_eq!(watches(), 25);

    // ... and is notified of changes to what she watches.
    let setter = &mut anonymous[5];
    assert_eq!(
        &setter.request(&[b"SET", b"alice-0/3", b"on"]).await.payload[..],
        OK
    );
    let notice = alice[0].next_publish().await;
    assert!(
        notice
            .topic
            .ends_with(hex::encode_upper("alice-0/3").as_bytes())
    );
    assert_eq!(
        &notice.payload[..],
        b"*4\r\n$6\r\nNOTIFY\r\n$3\r\nSET\r\n$5\r\nVALUE\r\n$2\r\non\r\n"
    );

    // The first anonymous client leaves: its 5 are the address's again.
    common::mqtt::goodbye(anonymous.remove(0), None).await;
    eventually("anon-0's registrations released", || watches() == 20).await;
    let mut late = Raw::connect(addr, "anon-late").await;
    assert_eq!(watch_all(&mut late, &keys("anon-late", 5)).await, 5);
    // Stopping a registration frees room too, once.
    let stop = late.request(&[b"KEYNOTIFY", b"anon-late/0", b"STOP"]).await;
    assert_eq!(&stop.payload[..], OK);
    let mut last = Raw::connect(addr, "anon-last").await;
    assert_eq!(watch_all(&mut last, &keys("anon-last", 2)).await, 1);
}

/// A key whose notification topic would be longer than MQTT allows
/// (65,535 bytes: the namespace, both hex-encoded, ~32,700 bytes of client
/// id and key together) cannot be watched: KEYNOTIFY says so, rather than
/// the watcher being disconnected at the key's first change (as before).
/// The longest key that fits is watched and notified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_too_long_for_a_notification_topic_is_refused_at_keynotify() {
    let broker = start_broker_with(|_| {}).await;
    let client_id = "long-keys";
    let mut watcher = Raw::connect(broker.local_addr(), client_id).await;
    let own = format!("{NOTIFY_NAMESPACE}/{}/#", hex::encode_upper(client_id));
    watcher.subscribe(&own, QoS::AtLeastOnce).await;
    let fixed = NOTIFY_NAMESPACE.len() + 1 + 2 * client_id.len() + "/command/notify/".len();
    let longest = (65_535 - fixed) / 2;
    let too_long = "k".repeat(longest + 1);
    let answer = watcher.request(&[b"KEYNOTIFY", too_long.as_bytes()]).await;
    assert_eq!(&answer.payload[..], FULL);
    let fits = "k".repeat(longest);
    let answer = watcher.request(&[b"KEYNOTIFY", fits.as_bytes()]).await;
    assert_eq!(&answer.payload[..], OK);
    let mut writer = Raw::connect(broker.local_addr(), "writer").await;
    for key in [&too_long, &fits] {
        let answer = writer.request(&[b"SET", key.as_bytes(), b"v"]).await;
        assert_eq!(&answer.payload[..], OK);
    }
    // The one registered is notified, on a topic of 65,534 or 65,535 bytes.
    let note = watcher.next_publish().await;
    assert!(note.topic.len() <= 65_535 && note.topic.len() >= 65_534);
    assert!(note.topic.ends_with(hex::encode_upper(&fits).as_bytes()));
    assert!(note.payload.starts_with(b"*4\r\n$6\r\nNOTIFY\r\n$3\r\nSET"));
}
