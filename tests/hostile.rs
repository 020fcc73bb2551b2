//! Hostile and careless clients against a broker process: whatever they do,
//! the broker's resident memory (read from `/proc`) stays bounded and it
//! keeps serving the others.

#[path = "http/client.rs"]
#[allow(dead_code)]
mod client;
mod common;

use std::time::Duration;

use bytes::Bytes;
use common::raw::{Raw, Recv, v5};
use common::spawn_broker;
use rumqttc::v5::mqttbytes::QoS;

/// Resident memory of a process, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb * 1024
}

/// One round of churn: `clients` clean sessions, each subscribing to a
/// filter of its own, publishing `payload` to it, receiving it, and leaving.
async fn churn_round(addr: std::net::SocketAddr, round: usize, clients: usize, payload: &Bytes) {
    for i in 0..clients {
        let id = format!("churn-{round}-{i}");
        let topic = format!("churn/{round}/{i}");
        let mut c = Raw::connect(addr, &id).await;
        c.subscribe(&topic, QoS::AtMostOnce).await;
        c.publish(&topic, payload.clone(), QoS::AtMostOnce, None)
            .await;
        let p = c.next_publish().await;
        assert_eq!(p.payload.len(), payload.len());
        c.send(v5::Packet::Disconnect(v5::Disconnect::new(
            v5::DisconnectReasonCode::NormalDisconnection,
        )))
        .await;
        assert!(matches!(c.recv().await, Recv::Closed));
    }
}

/// Clients that come, subscribe to a filter nobody else uses, publish, and
/// go: what they leave behind (the filter's message log, the router's
/// records of the client id) is freed, so the broker's memory stops
/// growing. Each round leaves 300 logs holding a 64 KiB message; unfreed,
/// six rounds grow the broker by well over 100 MiB.
#[tokio::test]
async fn churned_clients_and_filters_leave_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let broker = spawn_broker(dir.path(), &[]).await;
    let pid = broker.child.id().unwrap();
    let payload = Bytes::from(vec![b'x'; 64 * 1024]);
    for round in 0..2 {
        churn_round(broker.addr, round, 300, &payload).await;
    }
    let warm = rss(pid);
    for round in 2..8 {
        churn_round(broker.addr, round, 300, &payload).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after = rss(pid);
    let growth = after.saturating_sub(warm);
    eprintln!(
        "rss after 2 rounds {} MiB, after 8 rounds {} MiB",
        warm >> 20,
        after >> 20
    );
    assert!(
        growth < 40 << 20,
        "the broker grew by {} MiB over 6 rounds of churn",
        growth >> 20
    );
    // Still serving.
    let mut c = Raw::connect(broker.addr, "after-churn").await;
    let r = c.request(&[b"GET", b"k"]).await;
    assert_eq!(&r.payload[..], b"$-1\r\n");
}

/// A client that asks for large values and never acknowledges the answers
/// cannot make the broker hold them without bound: once its queue passes
/// `max_queued_bytes` it is disconnected with 0x97, and others are served.
#[tokio::test]
async fn a_client_that_never_acknowledges_is_bounded() {
    let broker = common::start_broker_with(|s| s.broker.max_queued_bytes = 1 << 20).await;
    let addr = broker.local_addr();
    let mut writer = Raw::connect(addr, "big-writer").await;
    let value = vec![b'v'; 256 * 1024];
    let set = writer.request(&[b"SET", b"big", &value]).await;
    assert_eq!(&set.payload[..], b"+OK\r\n");

    let mut greedy = Raw::connect(addr, "greedy").await;
    greedy.ensure_response_subscription().await;
    let ts = common::raw::now_hlc("greedy");
    for n in 0..20u64 {
        let properties = greedy.request_properties(&n.to_be_bytes(), &[("__ts", &ts)]);
        let payload = statestore::resp3::encode_request(&[&b"GET"[..], b"big"]);
        let mut publish = v5::Publish::new(
            common::raw::REQUEST_TOPIC,
            QoS::AtLeastOnce,
            payload,
            Some(properties),
        );
        publish.pkid = greedy.pkid();
        greedy.send(v5::Packet::Publish(publish)).await;
    }
    // Reads everything, acknowledges nothing.
    let mut answers = 0;
    let reason = loop {
        match greedy.recv().await {
            Recv::Packet(v5::Packet::Publish(_)) => answers += 1,
            Recv::Packet(v5::Packet::Disconnect(d)) => break d.reason_code,
            Recv::Packet(_) => {}
            other => panic!("expected a DISCONNECT, got {other:?} after {answers} answers"),
        }
    };
    assert_eq!(reason, v5::DisconnectReasonCode::QuotaExceeded);
    assert!(
        answers <= 4,
        "{answers} answers of 256 KiB within a 1 MiB bound"
    );
    let r = writer.request(&[b"GET", b"small"]).await;
    assert_eq!(&r.payload[..], b"$-1\r\n");
}

/// The value of `series` at the `/metrics` of the HTTP endpoint `http`.
async fn metric(http: std::net::SocketAddr, series: &str) -> f64 {
    client::metric(http, series).await
}

/// Issue #31: a client cycling client ids, each asking for a session kept
/// for ever with a subscription of its own, used to leave a kept session
/// behind each time (in the router, the broker's mirror and the journal),
/// without end. With `[broker] max_kept_sessions` the broker keeps that
/// many and refuses the rest (CONNACK 0x97) at no cost; the router's count
/// (`statebroker_kept_sessions`) stays at the bound; a client resuming its
/// session at the bound, and clean sessions, are still served.
#[tokio::test]
async fn a_client_cycling_client_ids_is_bounded_by_max_kept_sessions() {
    const BOUND: usize = 1_000;
    const TRIES: usize = 2_500;
    let dir = tempfile::tempdir().unwrap();
    let http = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap()
    };
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_statebroker"));
    command
        .args(["--listen", "127.0.0.1:0", "--http", &http.to_string()])
        .arg("--data-dir")
        .arg(dir.path())
        .env("STATEBROKER__BROKER__MAX_KEPT_SESSIONS", BOUND.to_string());
    let (child, addr, log) = common::spawn_command(command).await;
    let pid = child.id().unwrap();
    let start = rss(pid);
    let (mut accepted, mut refused) = (0, 0);
    let mut at_bound = start;
    for i in 0..TRIES {
        let id = format!("cycler-{i}");
        let (mut c, connack) = Raw::connect_with(addr, &id, |c| {
            c.0.properties = Some(v5::ConnectProperties {
                session_expiry_interval: Some(u32::MAX),
                ..v5::ConnectProperties::new()
            });
        })
        .await;
        match connack.code {
            v5::ConnectReturnCode::Success => {
                accepted += 1;
                c.subscribe(&format!("cycler/{i}/#"), QoS::AtLeastOnce)
                    .await;
                c.send(v5::Packet::Disconnect(v5::Disconnect::new(
                    v5::DisconnectReasonCode::NormalDisconnection,
                )))
                .await;
                assert!(matches!(c.recv().await, Recv::Closed));
                if accepted == BOUND {
                    at_bound = rss(pid);
                }
            }
            v5::ConnectReturnCode::QuotaExceeded => {
                refused += 1;
                assert!(matches!(c.recv().await, Recv::Closed), "closed after");
            }
            other => panic!("{id}: CONNACK {other:?}"),
        }
    }
    let end = rss(pid);
    let kept = metric(http, "statebroker_kept_sessions").await;
    let refusals = metric(
        http,
        "statebroker_connections_refused_total{reason=\"sessions_quota_exceeded\"}",
    )
    .await;
    eprintln!(
        "{TRIES} client ids each asking for a session kept for ever, bound {BOUND}: \
         {accepted} accepted, {refused} refused; kept sessions {kept}; rss at start {} KiB, \
         at the bound {} KiB (+{} KiB, {} bytes per kept session), after {} refusals {} KiB",
        start >> 10,
        at_bound >> 10,
        at_bound.saturating_sub(start) >> 10,
        at_bound.saturating_sub(start) / BOUND as u64,
        refused,
        end >> 10,
    );
    assert_eq!((accepted, refused), (BOUND, TRIES - BOUND));
    assert_eq!(kept, BOUND as f64, "the router's count");
    assert_eq!(refusals, (TRIES - BOUND) as f64, "every refusal counted");
    assert!(
        log.lock()
            .iter()
            .any(|l| l.contains("CONNECT refused: kept sessions at their bound")),
        "refusals are logged"
    );
    // At the bound: a session is resumed, a clean one is served.
    let (_c, connack) = Raw::connect_with(addr, "cycler-7", |c| {
        c.0.clean_start = false;
        c.0.properties = Some(v5::ConnectProperties {
            session_expiry_interval: Some(60),
            ..v5::ConnectProperties::new()
        });
    })
    .await;
    assert_eq!(connack.code, v5::ConnectReturnCode::Success);
    assert!(connack.session_present, "resumed at the bound");
    let mut clean = Raw::connect(addr, "clean-at-the-bound").await;
    let r = clean.request(&[b"GET", b"k"]).await;
    assert_eq!(&r.payload[..], b"$-1\r\n");
    drop(child);
}

/// A client that sends without pause (its socket never empty when the
/// broker looks: PINGREQs, which the connection answers itself and which
/// never fill the router's side) still gets what it subscribed to while
/// it sends: the connection's loop asks its sources in a random order
/// (`connection/driver.rs`). A loop that asked the socket first on every
/// turn and nothing else until it was empty passed only through tokio's
/// cooperative budget (0.8-3.3 s against 0.2 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_pauses_still_gets_its_deliveries() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const MESSAGES: usize = 200;
    let broker = common::start_broker().await;
    let mut flooder = Raw::connect(broker.local_addr(), "flooder").await;
    flooder.subscribe("flood/t", QoS::AtMostOnce).await;
    let mut burst = bytes::BytesMut::new();
    for _ in 0..10_000 {
        v5::Packet::PingReq(v5::PingReq)
            .write(&mut burst, None)
            .unwrap();
    }
    let (mut rd, mut wr) = tokio::io::split(flooder.stream);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let stop = std::sync::Arc::clone(&stop);
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            let mut bursts = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if tokio::time::Instant::now() > deadline {
                    return (false, bursts);
                }
                wr.write_all(&burst)
                    .await
                    .expect("the broker keeps reading");
                bursts += 1;
            }
            (true, bursts)
        })
    };
    // Counts deliveries while the writer writes, then stops it.
    let reader = tokio::spawn(async move {
        let mut rbuf = bytes::BytesMut::new();
        let mut delivered = 0;
        while delivered < MESSAGES {
            match v5::Packet::read(&mut rbuf, None) {
                Ok(v5::Packet::Publish(_)) => delivered += 1,
                Ok(_) => {}
                Err(rumqttc::v5::mqttbytes::Error::InsufficientBytes(_)) => {
                    let n = tokio::time::timeout(Duration::from_secs(40), rd.read_buf(&mut rbuf))
                        .await
                        .expect("nothing from the broker for 40 s")
                        .expect("read");
                    assert!(n > 0, "the broker closed the connection");
                }
                Err(e) => panic!("malformed packet: {e:?}"),
            }
        }
    });
    // Another client publishes while the flood runs.
    let mut publisher = Raw::connect(broker.local_addr(), "publisher").await;
    for n in 0..MESSAGES {
        publisher
            .publish(
                "flood/t",
                Bytes::from(n.to_string()),
                QoS::AtLeastOnce,
                None,
            )
            .await;
    }
    reader.await.unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (stopped, bursts) = writer.await.unwrap();
    assert!(
        stopped,
        "{MESSAGES} deliveries came only once the client paused ({bursts} bursts of 10,000 PINGREQs sent)"
    );
}
