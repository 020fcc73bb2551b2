//! Restarts: what comes back, what does not, and versions that keep rising.

mod common;

use std::path::Path;
use std::time::Duration;

use azure_iot_operations_services::state_store::SetOptions;
use broker::RunningBroker;
use broker::config::{Mode, PersistenceSettings};
use common::raw::{Raw, now_hlc, user_property};
use common::{SdkClient, start_broker_with};

async fn start(dir: &Path, keys: &[&str]) -> RunningBroker {
    let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
    start_broker_with(|s| {
        s.persistence = Some(PersistenceSettings {
            data_dir: dir.to_owned(),
            mode: Mode::Fsync,
            accept_data_loss: false,
        });
        s.persist_policy = statestore::persist::PersistPolicy::parse(&keys).unwrap();
    })
    .await
}

/// A broker in fsync mode whose faults (`stall_disk`) tests may inject.
async fn start_with_faults(dir: &Path) -> RunningBroker {
    start_broker_with(|s| {
        s.persistence = Some(PersistenceSettings {
            data_dir: dir.to_owned(),
            mode: Mode::Fsync,
            accept_data_loss: false,
        });
        s.faults.enabled = true;
    })
    .await
}

async fn restart(broker: RunningBroker, dir: &Path, keys: &[&str]) -> RunningBroker {
    broker.shutdown(Duration::from_secs(2)).await;
    start(dir, keys).await
}

/// SET with `aio-persistence: true` and optional `__ts` / `__ft`.
async fn set(
    c: &mut Raw,
    args: &[&str],
    persist: bool,
    ts: Option<&str>,
    ft: Option<&str>,
) -> (Vec<u8>, String) {
    let ts = ts.map_or_else(|| now_hlc(&c.client_id), str::to_owned);
    let mut user = vec![("__ts", ts.as_str())];
    if persist {
        user.push(("aio-persistence", "true"));
    }
    if let Some(ft) = ft {
        user.push(("__ft", ft));
    }
    let r = c
        .request_raw(
            common::raw::REQUEST_TOPIC,
            &statestore::resp3::encode_request(args),
            &user,
        )
        .await;
    (
        r.payload.to_vec(),
        user_property(&r, "__ts").unwrap().to_owned(),
    )
}

async fn get(c: &mut Raw, key: &str) -> (Vec<u8>, String) {
    let r = c.request(&[b"GET", key.as_bytes()]).await;
    (
        r.payload.to_vec(),
        user_property(&r, "__ts").unwrap().to_owned(),
    )
}

#[tokio::test]
async fn persisted_keys_come_back_with_value_version_and_token() {
    let dir = tempfile::tempdir().unwrap();
    let broker = start(dir.path(), &[]).await;
    let mut c = Raw::connect(broker.local_addr(), "writer").await;
    let (ok, v_kept) = set(&mut c, &["SET", "kept", "value"], true, None, None).await;
    assert_eq!(ok, b"+OK\r\n");
    let base = now_ms() - 1000;
    let token = format!("{base}:3:lockd");
    let (_, v_fenced) = set(&mut c, &["SET", "fenced", "f"], true, None, Some(&token)).await;
    // Persisted once, persisted for good: this SET has no property.
    let (_, v_sticky) = set(&mut c, &["SET", "kept-2", "a"], true, None, None).await;
    let (_, v_sticky2) = set(&mut c, &["SET", "kept-2", "b"], false, None, None).await;
    assert!(v_sticky2 > v_sticky);
    set(&mut c, &["SET", "memory-only", "m"], false, None, None).await;
    set(&mut c, &["SET", "deleted", "d"], true, None, None).await;
    assert_eq!(
        &c.request(&[b"DEL", b"deleted"]).await.payload[..],
        b":1\r\n"
    );
    drop(c);

    let broker = restart(broker, dir.path(), &[]).await;
    let mut c = Raw::connect(broker.local_addr(), "reader").await;
    assert_eq!(
        get(&mut c, "kept").await,
        (b"$5\r\nvalue\r\n".to_vec(), v_kept)
    );
    assert_eq!(
        get(&mut c, "kept-2").await,
        (b"$1\r\nb\r\n".to_vec(), v_sticky2)
    );
    assert_eq!(
        get(&mut c, "fenced").await,
        (b"$1\r\nf\r\n".to_vec(), v_fenced)
    );
    assert_eq!(get(&mut c, "memory-only").await.0, b"$-1\r\n");
    assert_eq!(get(&mut c, "deleted").await.0, b"$-1\r\n");
    // The fencing token came back with its key.
    let older = format!("{base}:2:lockd");
    let (answer, _) = set(&mut c, &["SET", "fenced", "x"], false, None, Some(&older)).await;
    assert!(
        answer.starts_with(b"-ERR the request fencing token is a lower version"),
        "{answer:?}"
    );
    assert_eq!(
        set(&mut c, &["SET", "fenced", "x"], false, None, Some(&token))
            .await
            .0,
        b"+OK\r\n"
    );
    broker.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn expiry_is_absolute_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let broker = start(dir.path(), &[]).await;
    let mut c = Raw::connect(broker.local_addr(), "ttl").await;
    for (key, px) in [("short", "800"), ("soon", "2500"), ("long", "60000")] {
        set(&mut c, &["SET", key, "v", "PX", px], true, None, None).await;
    }
    drop(c);
    broker.shutdown(Duration::from_secs(2)).await;
    // Down while "short" expires.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let broker = start(dir.path(), &[]).await;
    let mut c = Raw::connect(broker.local_addr(), "ttl").await;
    assert_eq!(
        get(&mut c, "short").await.0,
        b"$-1\r\n",
        "expired while down"
    );
    assert_eq!(get(&mut c, "soon").await.0, b"$1\r\nv\r\n");
    assert_eq!(get(&mut c, "long").await.0, b"$1\r\nv\r\n");
    // "soon" keeps its original deadline (set ~1 s ago with 2.5 s to live).
    tokio::time::sleep(Duration::from_millis(1800)).await;
    assert_eq!(get(&mut c, "soon").await.0, b"$-1\r\n");
    drop(c);
    // What expired is gone from disk too.
    let broker = restart(broker, dir.path(), &[]).await;
    assert_eq!(broker.store().with_store(|s| s.len()), 1);
    broker.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn versions_keep_rising_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let broker = start(dir.path(), &[]).await;
    let mut c = Raw::connect(broker.local_addr(), "clock").await;
    // A client 50 s ahead pushes the clock far beyond the wall clock, on a
    // key that is not even persisted.
    let ahead = format!("{}:7:clock", now_ms() + 50_000);
    let (_, high) = set(&mut c, &["SET", "volatile", "v"], false, Some(&ahead), None).await;
    drop(c);
    let broker = restart(broker, dir.path(), &[]).await;
    let mut c = Raw::connect(broker.local_addr(), "clock").await;
    let (_, after) = set(&mut c, &["SET", "k", "v"], false, None, None).await;
    assert!(after > high, "{after} must be above {high}");
    broker.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn configured_keys_persist_without_asking() {
    let dir = tempfile::tempdir().unwrap();
    let rules = ["glob:cfg/*", "exact:lock", "hex:00FF"];
    let broker = start(dir.path(), &rules).await;
    let mut c = Raw::connect(broker.local_addr(), "cfg").await;
    for key in ["cfg/a", "lock", "\u{0}\u{ff}", "other"] {
        let r = c
            .request_raw(
                common::raw::REQUEST_TOPIC,
                &statestore::resp3::encode_request(&[b"SET".as_slice(), key.as_bytes(), b"v"]),
                &[("__ts", &now_hlc("cfg"))],
            )
            .await;
        assert_eq!(&r.payload[..], b"+OK\r\n");
    }
    // The hex rule names the bytes 00 FF; "\u{0}\u{ff}" is not those bytes (UTF-8).
    let binary = c
        .request_raw(
            common::raw::REQUEST_TOPIC,
            &statestore::resp3::encode_request(&[&b"SET"[..], b"\x00\xff", b"v"]),
            &[("__ts", &now_hlc("cfg"))],
        )
        .await;
    assert_eq!(&binary.payload[..], b"+OK\r\n");
    drop(c);
    let broker = restart(broker, dir.path(), &rules).await;
    let mut c = Raw::connect(broker.local_addr(), "cfg").await;
    assert_eq!(get(&mut c, "cfg/a").await.0, b"$1\r\nv\r\n");
    assert_eq!(get(&mut c, "lock").await.0, b"$1\r\nv\r\n");
    assert_eq!(get(&mut c, "other").await.0, b"$-1\r\n");
    assert_eq!(
        &c.request(&[b"GET", b"\x00\xff"]).await.payload[..],
        b"$1\r\nv\r\n"
    );
    assert_eq!(broker.store().with_store(|s| s.len()), 3);
    broker.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_persist_option_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let broker = start(dir.path(), &[]).await;
    let c = SdkClient::connect(broker.local_addr(), "sdk-persist").await;
    let t = Duration::from_secs(5);
    let options = SetOptions {
        persist: true,
        ..SetOptions::default()
    };
    let set = c
        .client
        .set(b"durable".to_vec(), b"yes".to_vec(), t, None, options)
        .await
        .unwrap();
    c.client
        .set(
            b"volatile".to_vec(),
            b"no".to_vec(),
            t,
            None,
            SetOptions::default(),
        )
        .await
        .unwrap();
    c.close().await;
    let broker = restart(broker, dir.path(), &[]).await;
    let c = SdkClient::connect(broker.local_addr(), "sdk-persist").await;
    let get = c.client.get(b"durable".to_vec(), t).await.unwrap();
    assert_eq!(get.response, Some(b"yes".to_vec()));
    assert_eq!(get.version, set.version);
    assert_eq!(
        c.client
            .get(b"volatile".to_vec(), t)
            .await
            .unwrap()
            .response,
        None
    );
    c.close().await;
    broker.shutdown(Duration::from_secs(2)).await;
}

/// A QoS 1 PUBLISH of `SET key value` with `aio-persistence: true`, its
/// packet id taken, as the SDK sends it (not sent).
fn persisted_set(
    c: &mut Raw,
    key: &[u8],
    value: &[u8],
    correlation: &[u8],
) -> common::raw::v5::Publish {
    request_packet(c, &[&b"SET"[..], key, value], true, correlation)
}

/// A request as a PUBLISH to send without waiting for its PUBACK.
fn request_packet(
    c: &mut Raw,
    args: &[&[u8]],
    persist: bool,
    correlation: &[u8],
) -> common::raw::v5::Publish {
    let ts = now_hlc(&c.client_id);
    let mut user = vec![("__ts", ts.as_str())];
    if persist {
        user.push(("aio-persistence", "true"));
    }
    let properties = c.request_properties(correlation, &user);
    let payload = statestore::resp3::encode_request(args);
    let mut publish = common::raw::v5::Publish::new(
        common::raw::REQUEST_TOPIC,
        rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
        payload,
        Some(properties),
    );
    publish.pkid = c.pkid();
    publish
}

/// A persisted SET is answered once it is on disk; its PUBACK waits with it
/// and both leave in one write, so the client reads them at once
/// (`connection/hold.rs`). A PUBACK whose answer does not go straight to
/// its client (another client's topic, no subscriber at all, or a topic
/// another client shares, through the router) is not kept waiting for
/// an answer that will not come that way: the store tells the connection
/// once the answer is out (`ToConnection::AnswersOut`).
#[tokio::test]
async fn a_persisted_set_is_acknowledged_with_its_answer() {
    use common::raw::v5::Packet;
    use rumqttc::v5::mqttbytes::QoS;

    #[derive(Debug, Clone, Copy, PartialEq)]
    enum To {
        Requester,
        Other,
        Nobody,
        Shared,
    }

    let dir = tempfile::tempdir().unwrap();
    let broker = start(dir.path(), &[]).await;
    let mut c = Raw::connect(broker.local_addr(), "held").await;
    c.ensure_response_subscription().await;
    let mut other = Raw::connect(broker.local_addr(), "listener").await;
    other.subscribe("answers/elsewhere", QoS::AtLeastOnce).await;
    let shared = "answers/shared";
    c.subscribe(shared, QoS::AtLeastOnce).await;
    other.subscribe(shared, QoS::AtLeastOnce).await;

    let rounds = [
        To::Requester,
        To::Other,
        To::Requester,
        To::Nobody,
        To::Shared,
        To::Requester,
    ];
    for (round, to) in rounds.into_iter().enumerate() {
        let round = round as u8;
        let mut publish = persisted_set(&mut c, b"held-key", &[round], &[round]);
        let topic = match to {
            To::Requester => None,
            To::Other => Some("answers/elsewhere"),
            To::Nobody => Some("answers/nobody"),
            To::Shared => Some(shared),
        };
        if let Some(topic) = topic {
            let properties = publish.properties.as_mut().unwrap();
            properties.response_topic = Some(topic.into());
        }
        let pkid = publish.pkid;
        c.send(Packet::Publish(publish)).await;

        let packets = read_once(&mut c, Duration::from_secs(10)).await;
        match packets.first() {
            Some(Packet::PubAck(ack)) => assert_eq!(ack.pkid, pkid, "round {round}"),
            other => panic!("round {round} ({to:?}): expected the PUBACK first, got {other:?}"),
        }
        match to {
            To::Requester => {
                // Read at once: PUBACK and answer were written together.
                assert_eq!(packets.len(), 2, "round {round}: {packets:?}");
                match &packets[1] {
                    Packet::Publish(answer) => assert_eq!(&answer.payload[..], b"+OK\r\n"),
                    other => panic!("round {round}: expected the answer, got {other:?}"),
                }
            }
            To::Other | To::Nobody => {
                assert_eq!(packets.len(), 1, "round {round} ({to:?}): {packets:?}");
            }
            To::Shared => {
                // Through the router, to both: not necessarily in the
                // PUBACK's write.
                let mut answers = packets[1..].to_vec();
                if answers.is_empty() {
                    answers = read_once(&mut c, Duration::from_secs(10)).await;
                }
                match answers.as_slice() {
                    [Packet::Publish(answer)] => assert_eq!(&answer.payload[..], b"+OK\r\n"),
                    other => panic!("round {round}: expected the answer, got {other:?}"),
                }
            }
        }
        if matches!(to, To::Other | To::Shared) {
            let answer = other.next_publish().await;
            assert_eq!(&answer.payload[..], b"+OK\r\n", "round {round}");
        }
    }
    broker.shutdown(Duration::from_secs(2)).await;
}

/// The whole packets of one read (within `limit`).
async fn read_once(c: &mut Raw, limit: Duration) -> Vec<common::raw::v5::Packet> {
    use tokio::io::AsyncReadExt;
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(limit, c.stream.read(&mut buf))
        .await
        .expect("a packet in time")
        .unwrap();
    let mut bytes = bytes::BytesMut::from(&buf[..n]);
    let mut packets = Vec::new();
    while let Ok(packet) = common::raw::v5::Packet::read(&mut bytes, None) {
        packets.push(packet);
    }
    assert!(bytes.is_empty(), "whole packets only");
    packets
}

/// While the disk stalls (the `stall_disk` fault), a client sending
/// persisted SETs faster than they can be written is read only until 256
/// of its answers wait: what waits for the disk stays bounded. When the
/// disk is back, every SET is written and answered.
#[tokio::test]
async fn a_stalled_disk_stops_reading_at_a_bound() {
    use common::raw::v5::Packet;

    let dir = tempfile::tempdir().unwrap();
    let broker = start_with_faults(dir.path()).await;
    let faults = broker.faults();
    faults.stall_disk(Duration::from_secs(60)).unwrap();
    let mut c = Raw::connect(broker.local_addr(), "flood").await;
    c.ensure_response_subscription().await;

    // 1,000 requests in one write, not waiting for acknowledgements.
    const SENT: usize = 1000;
    let mut bytes = bytes::BytesMut::new();
    for i in 0..SENT {
        let key = format!("flood-{i}");
        let publish = persisted_set(&mut c, key.as_bytes(), b"v", &(i as u32).to_be_bytes());
        Packet::Publish(publish).write(&mut bytes, None).unwrap();
    }
    c.send_bytes(&bytes).await;

    let store = broker.store();
    common::eventually("256 answers wait for the disk", || {
        store.answers_waiting() == 256
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.answers_waiting(), 256, "no more is read meanwhile");
    c.no_publish_within(Duration::from_millis(10)).await;

    faults.stall_disk(Duration::ZERO).unwrap();
    for i in 0..SENT {
        let answer = c.next_publish().await;
        assert_eq!(&answer.payload[..], b"+OK\r\n", "answer {i}");
    }
    assert_eq!(store.answers_waiting(), 0);
    // What the service tracks of changes not on disk is forgotten as
    // they are published: the next request finds about one batch's worth.
    let (ok, _) = set(&mut c, &["SET", "after", "v"], true, None, None).await;
    assert_eq!(ok, b"+OK\r\n");
    assert!(
        store.changes_tracked() <= 2,
        "{} tracked",
        store.changes_tracked()
    );
    assert_eq!(faults.status().injected.get("disk_stall"), Some(&1));
    broker.shutdown(Duration::from_secs(2)).await;
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// While the disk stalls, only the answers that could show a change not on
/// disk yet wait (`store/pending.rs`): the persisted SET of `held`, a GET
/// of `held` and a SCAN. A GET and an in-memory SET of another key are
/// answered at once. When the disk is back, the waiting ones are answered,
/// the GET showing the value the SET made.
#[tokio::test]
async fn a_stalled_disk_holds_only_the_answers_that_could_show_its_changes() {
    use common::raw::v5::Packet;

    let dir = tempfile::tempdir().unwrap();
    let broker = start_with_faults(dir.path()).await;
    let mut writer = Raw::connect(broker.local_addr(), "writer").await;
    let mut reader = Raw::connect(broker.local_addr(), "reader").await;
    writer.ensure_response_subscription().await;
    reader.ensure_response_subscription().await;
    let (set_other, _) = set(&mut reader, &["SET", "other", "1"], false, None, None).await;
    assert_eq!(set_other, b"+OK\r\n");
    broker.faults().stall_disk(Duration::from_secs(60)).unwrap();

    let held = persisted_set(&mut writer, b"held", b"new", b"w1");
    writer.send(Packet::Publish(held)).await;
    let store = broker.store();
    common::eventually("the persisted SET waits", || store.answers_waiting() == 1).await;

    let at_once = Duration::from_secs(5);
    let got = tokio::time::timeout(at_once, get(&mut reader, "other"))
        .await
        .expect("a GET of another key is answered during the stall");
    assert_eq!(got.0, b"$1\r\n1\r\n");
    let in_memory = set(&mut reader, &["SET", "other", "2"], false, None, None);
    let in_memory = tokio::time::timeout(at_once, in_memory)
        .await
        .expect("an in-memory SET of another key is answered during the stall");
    assert_eq!(in_memory.0, b"+OK\r\n");

    let get_held = request_packet(&mut reader, &[b"GET", b"held"], false, b"r1");
    reader.send(Packet::Publish(get_held)).await;
    let scan = request_packet(&mut reader, &[b"SCAN", b"*"], false, b"r2");
    reader.send(Packet::Publish(scan)).await;
    common::eventually("the GET and the SCAN wait too", || {
        store.answers_waiting() == 3
    })
    .await;
    reader.no_publish_within(Duration::from_millis(300)).await;
    writer.no_publish_within(Duration::from_millis(10)).await;

    broker.faults().stall_disk(Duration::ZERO).unwrap();
    let answer = writer.next_publish().await;
    assert_eq!(&answer.payload[..], b"+OK\r\n");
    let mut answers = Vec::new();
    for _ in 0..2 {
        let answer = reader.next_publish().await;
        let correlation = answer.properties.as_ref().unwrap().correlation_data.clone();
        answers.push((correlation.unwrap().to_vec(), answer.payload.to_vec()));
    }
    answers.sort();
    assert_eq!(answers[0], (b"r1".to_vec(), b"$3\r\nnew\r\n".to_vec()));
    assert_eq!(answers[1].0, b"r2");
    let page = String::from_utf8_lossy(&answers[1].1);
    assert!(page.contains("held") && page.contains("other"), "{page}");
    assert_eq!(store.answers_waiting(), 0);
    broker.shutdown(Duration::from_secs(2)).await;
}

/// A GET that waits for a persisted change (the disk stalls) and whose
/// answer is too large for its client's Maximum Packet Size: the answer is
/// discarded where it reaches the client's connection, and the GET's
/// PUBACK, held to leave with it, goes anyway once the change is on disk
/// (`connection/hold.rs`; the connection that sees the discarded answer
/// before the store's answered position moves is the machine's test
/// `a_delivery_that_writes_nothing_ends_the_acknowledgements_hold`).
#[tokio::test]
async fn an_answer_too_large_for_its_client_leaves_its_acknowledgement_free() {
    use common::raw::{Recv, v5::Packet};

    let dir = tempfile::tempdir().unwrap();
    let broker = start_with_faults(dir.path()).await;
    let mut writer = Raw::connect(broker.local_addr(), "big-writer").await;
    writer.ensure_response_subscription().await;
    let (mut reader, connack) = Raw::connect_with(broker.local_addr(), "small-reader", |c| {
        c.0.properties = Some(rumqttc::v5::mqttbytes::v5::ConnectProperties {
            max_packet_size: Some(512),
            ..rumqttc::v5::mqttbytes::v5::ConnectProperties::new()
        });
    })
    .await;
    assert_eq!(connack.code, common::raw::v5::ConnectReturnCode::Success);
    reader.ensure_response_subscription().await;
    broker.faults().stall_disk(Duration::from_secs(60)).unwrap();

    let big = vec![b'x'; 2000];
    let set_big = persisted_set(&mut writer, b"big", &big, b"w1");
    writer.send(Packet::Publish(set_big)).await;
    let get_big = request_packet(&mut reader, &[b"GET", b"big"], false, b"r1");
    let pkid = get_big.pkid;
    reader.send(Packet::Publish(get_big)).await;
    let store = broker.store();
    common::eventually("the SET and the GET wait", || store.answers_waiting() == 2).await;
    assert!(
        matches!(
            reader.recv_within(Duration::from_millis(200)).await,
            Recv::Timeout
        ),
        "the GET's PUBACK waits with its answer"
    );

    broker.faults().stall_disk(Duration::ZERO).unwrap();
    let answer = writer.next_publish().await;
    assert_eq!(&answer.payload[..], b"+OK\r\n");
    match reader.recv_within(Duration::from_secs(10)).await {
        Recv::Packet(Packet::PubAck(ack)) => assert_eq!(ack.pkid, pkid),
        other => panic!("expected the GET's PUBACK, got {other:?}"),
    }
    assert!(
        matches!(
            reader.recv_within(Duration::from_millis(200)).await,
            Recv::Timeout
        ),
        "the answer, too large, is not sent"
    );
    broker.shutdown(Duration::from_secs(2)).await;
}

/// A persisted SET whose acknowledgement waits for a stalled disk, and
/// whose client reconnects to its session and sends it again (DUP 1): the
/// resent request is not run again, and its PUBACK (PUBREC at QoS 2), like
/// the original's, waits until the change is on disk. One answer, `+OK`; a
/// second run of `SET NX` would answer `:-1` (`sessions/acknowledged.rs`).
#[tokio::test]
async fn a_persisted_request_resent_while_the_disk_stalls_runs_once() {
    use common::raw::{Recv, v5::Packet};
    use rumqttc::v5::mqttbytes::QoS;

    let dir = tempfile::tempdir().unwrap();
    let broker = start_with_faults(dir.path()).await;
    let faults = broker.faults();
    let addr = broker.local_addr();
    let store = broker.store();
    for (qos, id) in [
        (QoS::AtLeastOnce, "resend-disk-1"),
        (QoS::ExactlyOnce, "resend-disk-2"),
    ] {
        let persistent = common::mqtt::session(false, Some(600));
        let (mut c, _) = Raw::connect_with(addr, id, persistent).await;
        c.ensure_response_subscription().await;
        faults.stall_disk(Duration::from_secs(60)).unwrap();
        let args = [b"SET", id.as_bytes(), b"v", b"NX"];
        let mut publish = request_packet(&mut c, &args, true, b"one");
        publish.qos = qos;
        c.send(Packet::Publish(publish.clone())).await;
        common::eventually("the SET waits for the disk", || {
            store.answers_waiting() == 1
        })
        .await;
        c.no_publish_within(Duration::from_millis(50)).await;
        drop(c); // its acknowledgement never came

        let persistent = common::mqtt::session(false, Some(600));
        let (mut c, connack) = Raw::connect_with(addr, id, persistent).await;
        assert!(connack.session_present);
        publish.dup = true;
        let pkid = publish.pkid;
        c.send(Packet::Publish(publish)).await;
        assert!(
            matches!(
                c.recv_within(Duration::from_millis(300)).await,
                Recv::Timeout
            ),
            "{id}: no acknowledgement while the change is not on disk"
        );
        assert_eq!(store.answers_waiting(), 1, "{id}: not run again");

        faults.stall_disk(Duration::ZERO).unwrap();
        let (acknowledged, answers) = common::mqtt::acknowledgement_and_answers(&mut c, pkid).await;
        assert!(acknowledged, "{id}: acknowledged once on disk");
        assert_eq!(answers, [bytes::Bytes::from_static(b"+OK\r\n")], "{id}");
    }
    broker.shutdown(Duration::from_secs(2)).await;
}
