//! Issue #31: what clients can leave behind in sessions is bounded.
//! `[broker] max_session_expiry_secs` caps how long a session outlives its
//! connection (MQTT 5 clients are told in CONNACK, 3.1.1 persistent
//! sessions get it too); `[broker] max_kept_sessions` caps how many
//! sessions are kept: beyond it a CONNECT that would keep one for a new
//! client id is refused (MQTT 5 0x97, 3.1.1 0x03), while resumes are
//! served, expiry frees room, and the bound holds across a restart. The
//! count is the router's (`statebroker_kept_sessions`).

#[path = "http/client.rs"]
#[allow(dead_code)]
mod client;
mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use broker::RunningBroker;
use broker::config::{Mode, PersistenceSettings, Settings};
use bytes::BytesMut;
use common::mqtt::{goodbye, session};
use common::raw::{Raw, v5};
use common::start_broker_with;
use rumqttc::mqttbytes::v4;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use v5::ConnectReturnCode;

/// Gauges are set from the scraped broker just before rendering, and the
/// recorder is process-wide: one scrape at a time in this test binary.
static SCRAPE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Every test here starts its broker with this lock held, so that the
/// process-wide counters it reads are its own.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The value of `series` at `/metrics`.
async fn metric(http: SocketAddr, series: &str) -> f64 {
    let _one = SCRAPE.lock().await;
    client::metric(http, series).await
}

const KEPT: &str = "statebroker_kept_sessions";
const REFUSED: &str = "statebroker_connections_refused_total{reason=\"sessions_quota_exceeded\"}";

/// A broker with its HTTP endpoint, `max_kept_sessions` and
/// `max_session_expiry_secs`, persisting into `dir` if given.
async fn start(max_kept: usize, max_expiry: u32, dir: Option<&Path>) -> RunningBroker {
    start_broker_with(|s: &mut Settings| {
        s.http = Some("127.0.0.1:0".parse().unwrap());
        s.broker.max_kept_sessions = max_kept;
        s.broker.max_session_expiry_secs = max_expiry;
        s.persistence = dir.map(|dir| PersistenceSettings {
            data_dir: dir.to_owned(),
            mode: Mode::Fsync,
            accept_data_loss: false,
        });
    })
    .await
}

/// Connects `id` with `clean_start` and Session Expiry Interval `expiry`.
async fn connect(
    addr: SocketAddr,
    id: &str,
    clean_start: bool,
    expiry: Option<u32>,
) -> (Raw, v5::ConnAck) {
    Raw::connect_with(addr, id, session(clean_start, expiry)).await
}

/// Connects `id` with a session kept `expiry` seconds and leaves; the
/// CONNACK's code.
async fn keep(addr: SocketAddr, id: &str, expiry: u32) -> ConnectReturnCode {
    let (c, ack) = connect(addr, id, true, Some(expiry)).await;
    if ack.code == ConnectReturnCode::Success {
        goodbye(c, None).await;
    }
    ack.code
}

/// An MQTT 3.1.1 CONNECT of `id` (clean session `clean`); the CONNACK's
/// return code and Session Present flag.
async fn connect_311(addr: SocketAddr, id: &str, clean: bool) -> (v4::ConnectReturnCode, bool) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut connect = v4::Connect::new(id);
    connect.keep_alive = 30;
    connect.clean_session = clean;
    let mut buf = BytesMut::new();
    v4::Packet::Connect(connect)
        .write(&mut buf, usize::MAX)
        .unwrap();
    stream.write_all(&buf).await.unwrap();
    let mut rbuf = BytesMut::new();
    loop {
        match v4::Packet::read(&mut rbuf, usize::MAX) {
            Ok(v4::Packet::ConnAck(ack)) => {
                let disconnect = v4::Packet::Disconnect;
                let mut out = BytesMut::new();
                disconnect.write(&mut out, usize::MAX).unwrap();
                let _ = stream.write_all(&out).await;
                return (ack.code, ack.session_present);
            }
            Ok(other) => panic!("expected CONNACK, got {other:?}"),
            Err(rumqttc::mqttbytes::Error::InsufficientBytes(_)) => {}
            Err(e) => panic!("{e:?}"),
        }
        let read = tokio::time::timeout(Duration::from_secs(10), stream.read_buf(&mut rbuf));
        assert!(read.await.unwrap().unwrap() > 0, "closed without CONNACK");
    }
}

/// Waits until the router's count is `n` (it applies a DISCONNECT on its
/// own thread).
async fn kept_becomes(http: SocketAddr, n: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now = metric(http, KEPT).await;
        if now == n as f64 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "kept sessions: {now}, expected {n}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// 3.2.2.3.2: a client asking for a longer Session Expiry Interval than
/// the broker's maximum (or for "never") is told the maximum in CONNACK;
/// one asking for less is told nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connack_caps_the_session_expiry_interval() {
    let _one = ONE_AT_A_TIME.lock().await;
    let broker = start(0, 3_600, None).await;
    let addr = broker.local_addr();
    for asked in [u32::MAX, 3_601] {
        let (_c, ack) = connect(addr, "long", true, Some(asked)).await;
        assert_eq!(ack.code, ConnectReturnCode::Success);
        let told = ack.properties.and_then(|p| p.session_expiry_interval);
        assert_eq!(told, Some(3_600), "asked {asked}");
    }
    for asked in [Some(3_600), Some(60), None] {
        let (_c, ack) = connect(addr, "short", true, asked).await;
        let told = ack.properties.and_then(|p| p.session_expiry_interval);
        assert_eq!(told, None, "asked {asked:?}: the client's own stands");
    }
}

/// At `max_kept_sessions`, a new client id asking for a kept session is
/// refused with 0x97 (logged, counted); a session at the bound resumes,
/// a clean session connects, and a session discarded by a clean start
/// frees room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_sessions_beyond_the_bound_are_refused_and_resumes_are_not() {
    let _one = ONE_AT_A_TIME.lock().await;
    let broker = start(3, 0, None).await;
    let (addr, http) = (broker.local_addr(), broker.http_addr().unwrap());
    let refused_before = metric(http, REFUSED).await;
    for i in 0..3 {
        assert_eq!(
            keep(addr, &format!("s{i}"), 600).await,
            ConnectReturnCode::Success
        );
    }
    kept_becomes(http, 3).await;
    assert_eq!(
        keep(addr, "s3", 600).await,
        ConnectReturnCode::QuotaExceeded
    );
    assert_eq!(
        keep(addr, "s4", u32::MAX).await,
        ConnectReturnCode::QuotaExceeded
    );
    assert_eq!(metric(http, REFUSED).await - refused_before, 2.0);
    assert_eq!(metric(http, KEPT).await, 3.0, "nothing of the refused kept");
    // Resumed at the bound.
    let (c, ack) = connect(addr, "s1", false, Some(600)).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    assert!(ack.session_present);
    goodbye(c, None).await;
    // A clean session is not counted.
    let (c, ack) = connect(addr, "clean", true, None).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    goodbye(c, None).await;
    // s0 starts clean and keeps nothing: room for s3.
    let (c, ack) = connect(addr, "s0", true, Some(0)).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    goodbye(c, None).await;
    kept_becomes(http, 2).await;
    assert_eq!(keep(addr, "s3", 600).await, ConnectReturnCode::Success);
    kept_becomes(http, 3).await;
}

/// MQTT 3.1.1: a persistent session (clean session 0) counts, and beyond
/// the bound a new one is refused with 0x03 "server unavailable"; one that
/// exists resumes. It is kept no longer than `max_session_expiry_secs`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt311_persistent_sessions_are_bounded() {
    let _one = ONE_AT_A_TIME.lock().await;
    let broker = start(2, 2, None).await;
    let (addr, http) = (broker.local_addr(), broker.http_addr().unwrap());
    let accepted = v4::ConnectReturnCode::Success;
    assert_eq!(connect_311(addr, "four-a", false).await, (accepted, false));
    assert_eq!(connect_311(addr, "four-b", false).await, (accepted, false));
    kept_becomes(http, 2).await;
    assert_eq!(
        connect_311(addr, "four-c", false).await,
        (v4::ConnectReturnCode::ServiceUnavailable, false)
    );
    assert_eq!(
        connect_311(addr, "four-clean", true).await,
        (accepted, false)
    );
    assert_eq!(
        connect_311(addr, "four-a", false).await,
        (accepted, true),
        "resumed"
    );
    // "For ever" in 3.1.1, 2 s here: both expire, and make room.
    kept_becomes(http, 0).await;
    assert_eq!(connect_311(addr, "four-c", false).await, (accepted, false));
}

/// Sessions that expire free room for new ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_sessions_free_room() {
    let _one = ONE_AT_A_TIME.lock().await;
    let broker = start(2, 0, None).await;
    let (addr, http) = (broker.local_addr(), broker.http_addr().unwrap());
    assert_eq!(keep(addr, "e0", 1).await, ConnectReturnCode::Success);
    assert_eq!(keep(addr, "e1", 1).await, ConnectReturnCode::Success);
    assert_eq!(
        keep(addr, "e2", 600).await,
        ConnectReturnCode::QuotaExceeded
    );
    kept_becomes(http, 0).await;
    assert_eq!(keep(addr, "e2", 600).await, ConnectReturnCode::Success);
}

/// Kept sessions come back from the journal and count: after a restart
/// the bound holds (a new client id is refused, a saved session resumes),
/// and sessions saved without a maximum expiry are held to the one
/// configured now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bounds_hold_across_a_restart() {
    let _one = ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let broker = start(2, 0, Some(dir.path())).await;
    let addr = broker.local_addr();
    assert_eq!(keep(addr, "r0", u32::MAX).await, ConnectReturnCode::Success);
    assert_eq!(keep(addr, "r1", u32::MAX).await, ConnectReturnCode::Success);
    broker.shutdown(Duration::from_secs(2)).await;

    let broker = start(2, 0, Some(dir.path())).await;
    let (addr, http) = (broker.local_addr(), broker.http_addr().unwrap());
    assert_eq!(metric(http, KEPT).await, 2.0, "restored and counted");
    assert_eq!(
        keep(addr, "r2", 600).await,
        ConnectReturnCode::QuotaExceeded
    );
    let (c, ack) = connect(addr, "r0", false, Some(u32::MAX)).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    assert!(ack.session_present, "resumed after the restart");
    goodbye(c, None).await;
    broker.shutdown(Duration::from_secs(2)).await;

    // Saved "for ever"; restarted with a 1 s maximum: gone a second later.
    let broker = start(2, 1, Some(dir.path())).await;
    let (addr, http) = (broker.local_addr(), broker.http_addr().unwrap());
    kept_becomes(http, 0).await;
    let (_c, ack) = connect(addr, "r1", false, Some(600)).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    assert!(!ack.session_present, "expired under the new maximum");
}

/// A retained publish at QoS 1 or 2: its PUBACK's or PUBREC's reason
/// (`Success`, `QuotaExceeded`, ...).
async fn retain(
    client: &mut Raw,
    topic: &str,
    payload: &[u8],
    qos: rumqttc::v5::mqttbytes::QoS,
) -> String {
    acknowledged(client, topic, payload, qos, true).await
}

/// A publish at QoS 1 or 2: its PUBACK's or PUBREC's reason (no PUBREL).
async fn acknowledged(
    client: &mut Raw,
    topic: &str,
    payload: &[u8],
    qos: rumqttc::v5::mqttbytes::QoS,
    retain: bool,
) -> String {
    use common::raw::Recv;
    use rumqttc::v5::mqttbytes::v5::{Packet, Publish};
    let mut publish = Publish::new(topic, qos, bytes::Bytes::copy_from_slice(payload), None);
    publish.retain = retain;
    publish.pkid = client.pkid();
    let pkid = publish.pkid;
    client.send(Packet::Publish(publish)).await;
    loop {
        match client.recv().await {
            Recv::Packet(Packet::PubAck(ack)) if ack.pkid == pkid => {
                return format!("{:?}", ack.reason);
            }
            Recv::Packet(Packet::PubRec(rec)) if rec.pkid == pkid => {
                return format!("{:?}", rec.reason);
            }
            Recv::Packet(_) => continue,
            other => panic!("no acknowledgement: {other:?}"),
        }
    }
}

/// The retained messages are bounded in number and bytes (`[broker]
/// max_retained_messages`, `max_retained_bytes`): a retained publish on a
/// new topic beyond them gets PUBACK / PUBREC 0x97 and is not kept;
/// replacing and clearing always work. Before, one client kept 3,000
/// retained messages of 1 MB (4.4 GB of RSS, and as much after a restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retained_messages_are_bounded() {
    use rumqttc::v5::mqttbytes::QoS;
    const OK: &str = "Success";
    const QUOTA: &str = "QuotaExceeded";
    let _one = ONE_AT_A_TIME.lock().await;
    let broker = start_broker_with(|s| {
        s.broker.max_retained_messages = 2;
        s.broker.max_retained_bytes = 100;
        // The broker's own retained $SYS statistics would count too.
        s.broker.sys_interval = 0;
    })
    .await;
    let mut client = Raw::connect(broker.local_addr(), "retainer").await;
    assert_eq!(
        retain(&mut client, "r/1", b"one", QoS::AtLeastOnce).await,
        OK
    );
    assert_eq!(
        retain(&mut client, "r/2", b"two", QoS::AtLeastOnce).await,
        OK
    );
    // A third topic: the count.
    assert_eq!(
        retain(&mut client, "r/3", b"three", QoS::AtLeastOnce).await,
        QUOTA
    );
    assert_eq!(
        retain(&mut client, "r/3", b"three", QoS::ExactlyOnce).await,
        QUOTA
    );
    // Replaced, and cleared (an empty retained publish): room for r/3.
    assert_eq!(
        retain(&mut client, "r/1", b"uno", QoS::AtLeastOnce).await,
        OK
    );
    assert_eq!(retain(&mut client, "r/2", b"", QoS::AtLeastOnce).await, OK);
    assert_eq!(
        retain(&mut client, "r/3", b"three", QoS::AtLeastOnce).await,
        OK
    );
    // The bytes: r/1 may not grow past 100 bytes of topics and payloads.
    let large = [b'x'; 90];
    assert_eq!(
        retain(&mut client, "r/1", &large, QoS::AtLeastOnce).await,
        QUOTA
    );
    assert_eq!(retain(&mut client, "r/1", b"1", QoS::AtLeastOnce).await, OK);
    // What a new subscriber gets: the messages kept, not the refused.
    let mut reader = Raw::connect(broker.local_addr(), "reader").await;
    reader.subscribe("r/#", QoS::AtLeastOnce).await;
    let mut got = Vec::new();
    for _ in 0..2 {
        let p = reader.next_publish().await;
        got.push((
            String::from_utf8_lossy(&p.topic).into_owned(),
            p.payload.to_vec(),
        ));
    }
    got.sort();
    assert_eq!(
        got,
        [
            ("r/1".to_owned(), b"1".to_vec()),
            ("r/3".to_owned(), b"three".to_vec())
        ]
    );
    let extra = reader.recv_within(Duration::from_millis(300)).await;
    assert!(matches!(extra, common::raw::Recv::Timeout), "{extra:?}");
}

/// QoS 2 publishes held until their PUBREL are bounded in bytes, per
/// client (connected or in its kept session) and all clients together
/// (`[broker] max_unreleased_qos2_bytes`, `..._total`): beyond either,
/// PUBREC 0x97 and nothing held or delivered; a PUBREL, or the end of a
/// session, frees room. Before, one client id held 1,000 publishes of
/// 1 MB without PUBREL (1.46 GB), and kept them after disconnecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qos2_publishes_waiting_for_pubrel_are_bounded() {
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::mqttbytes::v5::{Packet, PubRel};
    const OK: &str = "Success";
    const QUOTA: &str = "QuotaExceeded";
    let _one = ONE_AT_A_TIME.lock().await;
    let broker = start_broker_with(|s| {
        s.broker.max_unreleased_qos2_bytes = 1000;
        s.broker.max_unreleased_qos2_bytes_total = 1500;
    })
    .await;
    let addr = broker.local_addr();
    let held = [b'h'; 400];
    let (mut a, _) = Raw::connect_with(addr, "holder-a", session(true, Some(600))).await;
    assert_eq!(
        acknowledged(&mut a, "q2/t", &held, QoS::ExactlyOnce, false).await,
        OK
    );
    assert_eq!(
        acknowledged(&mut a, "q2/t", &held, QoS::ExactlyOnce, false).await,
        OK
    );
    // Its own bound: 3 x 404 bytes > 1000.
    assert_eq!(
        acknowledged(&mut a, "q2/t", &held, QoS::ExactlyOnce, false).await,
        QUOTA
    );
    // Everyone's: 808 + 404 fit 1500, 808 + 808 do not; a's kept session
    // still counts once a is gone.
    let mut b = Raw::connect(addr, "holder-b").await;
    assert_eq!(
        acknowledged(&mut b, "q2/t", &held, QoS::ExactlyOnce, false).await,
        OK
    );
    drop(a);
    assert_eq!(
        acknowledged(&mut b, "q2/t", &held, QoS::ExactlyOnce, false).await,
        QUOTA
    );
    // a comes back to its session and releases one: room for b.
    let (mut a, connack) = Raw::connect_with(addr, "holder-a", session(false, Some(600))).await;
    assert!(connack.session_present);
    a.send(Packet::PubRel(PubRel::new(1, None))).await;
    loop {
        match a.recv().await {
            common::raw::Recv::Packet(Packet::PubComp(c)) => {
                assert_eq!(c.pkid, 1);
                break;
            }
            common::raw::Recv::Packet(_) => continue,
            other => panic!("no PUBCOMP: {other:?}"),
        }
    }
    assert_eq!(
        acknowledged(&mut b, "q2/t", &held, QoS::ExactlyOnce, false).await,
        OK
    );
    // 404 (a) + 808 (b): no room for a third client's; a clean start
    // ends a's session and frees its part.
    let mut c = Raw::connect(addr, "holder-c").await;
    assert_eq!(
        acknowledged(&mut c, "q2/t", &held, QoS::ExactlyOnce, false).await,
        QUOTA
    );
    drop(a);
    let (_a, _) = Raw::connect_with(addr, "holder-a", session(true, None)).await;
    assert_eq!(
        acknowledged(&mut c, "q2/t", &held, QoS::ExactlyOnce, false).await,
        OK
    );
}
