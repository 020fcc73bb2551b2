//! Crash test: a broker process takes persisted writes as fast as clients
//! can send them and is killed with SIGKILL at a random moment, again and
//! again. After every restart, every acknowledged write must be there with
//! its version, and nothing that was never written may appear. The same
//! goes for retained messages (acknowledged by PUBACK), persistent
//! sessions (their subscriptions acknowledged by SUBACK) and the QoS 2
//! messages queued for an offline persistent session (acknowledged by
//! PUBREC): each arrives after the restart, exactly once.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::raw::{REQUEST_TOPIC, Raw, Recv, now_hlc, user_property, v5};
use common::{spawn_broker, write_sequentially};
use parking_lot::Mutex;
use rumqttc::v5::mqttbytes::QoS;
use statestore::command::Page;
use statestore::resp3::encode_request;

/// key -> (value, version) of acknowledged writes.
type Acked = Arc<Mutex<HashMap<String, (String, String)>>>;
/// key -> value of every write ever sent.
type Attempted = Arc<Mutex<HashMap<String, String>>>;
/// Topics of acknowledged retained publishes (the payload is the topic).
type Retained = Arc<Mutex<Vec<String>>>;
/// (client id, topic) of persistent sessions whose subscription was acknowledged.
type Sessions = Arc<Mutex<Vec<(String, String)>>>;

/// The offline persistent session that QoS 2 messages are queued for.
const MAILBOX: &str = "mailbox";

/// Topics of the QoS 2 messages queued for [`MAILBOX`]: acknowledged
/// (PUBREC) and received.
#[derive(Default)]
struct Mail {
    acked: Vec<String>,
    received: std::collections::HashSet<String>,
}

/// Publishes QoS 2 messages for the offline [`MAILBOX`] session until the
/// broker goes away; the payload of each is its topic.
async fn mailer(addr: std::net::SocketAddr, name: String, mail: Arc<Mutex<Mail>>) -> usize {
    let mut c = Raw::connect(addr, &name).await;
    let mut n = 0usize;
    loop {
        let topic = format!("mail/{name}/{n}");
        let mut publish = v5::Publish::new(
            topic.as_str(),
            QoS::ExactlyOnce,
            Bytes::from(topic.clone()),
            None,
        );
        publish.pkid = c.pkid();
        let pkid = publish.pkid;
        c.send(v5::Packet::Publish(publish)).await;
        loop {
            match c.recv_within(Duration::from_secs(5)).await {
                Recv::Packet(v5::Packet::PubRec(rec)) if rec.pkid == pkid => {
                    mail.lock().acked.push(topic.clone());
                    c.send(v5::Packet::PubRel(v5::PubRel::new(pkid, None)))
                        .await;
                }
                Recv::Packet(v5::Packet::PubComp(comp)) if comp.pkid == pkid => break,
                Recv::Packet(_) => continue,
                Recv::Closed | Recv::Timeout => return n,
            }
        }
        n += 1;
    }
}

/// Every message acknowledged for [`MAILBOX`] has arrived, each once.
async fn verify_mail(addr: std::net::SocketAddr, mail: &Mutex<Mail>) {
    let (mut c, connack) = Raw::connect_with(addr, MAILBOX, persistent(false)).await;
    assert!(connack.session_present, "the mailbox session was lost");
    loop {
        match c.recv_within(Duration::from_millis(500)).await {
            Recv::Packet(v5::Packet::Publish(p)) => {
                assert_eq!(p.qos, QoS::ExactlyOnce);
                assert_eq!(p.topic, p.payload);
                c.send(v5::Packet::PubRec(v5::PubRec::new(p.pkid, None)))
                    .await;
                let topic = String::from_utf8(p.topic.to_vec()).unwrap();
                assert!(
                    mail.lock().received.insert(topic.clone()),
                    "QoS 2 message {topic} delivered twice"
                );
            }
            Recv::Packet(v5::Packet::PubRel(rel)) => {
                c.send(v5::Packet::PubComp(v5::PubComp::new(rel.pkid, None)))
                    .await;
            }
            Recv::Packet(_) => {}
            _ => break,
        }
    }
    let mail = mail.lock();
    for topic in &mail.acked {
        assert!(mail.received.contains(topic), "acknowledged {topic} lost");
    }
}

/// Publishes retained messages at QoS 1 on fresh topics until the broker
/// goes away; the payload of each is its topic.
async fn retainer(addr: std::net::SocketAddr, name: String, acked: Retained) -> usize {
    let mut c = Raw::connect(addr, &name).await;
    let mut n = 0usize;
    loop {
        let topic = format!("ret/{name}/{n}");
        let mut publish = v5::Publish::new(
            topic.as_str(),
            QoS::AtLeastOnce,
            Bytes::from(topic.clone()),
            None,
        );
        publish.retain = true;
        publish.pkid = c.pkid();
        let pkid = publish.pkid;
        c.send(v5::Packet::Publish(publish)).await;
        loop {
            match c.recv_within(Duration::from_secs(5)).await {
                Recv::Packet(v5::Packet::PubAck(ack)) if ack.pkid == pkid => {
                    acked.lock().push(topic.clone());
                    break;
                }
                Recv::Packet(_) => continue,
                Recv::Closed | Recv::Timeout => return n,
            }
        }
        n += 1;
    }
}

/// A persistent session subscribes to its own topic, and stays connected.
async fn subscriber(addr: std::net::SocketAddr, name: String, acked: Sessions) {
    let (mut c, _) = Raw::connect_with(addr, &name, persistent(true)).await;
    let topic = format!("sess/{name}");
    let codes = c.subscribe(&topic, QoS::AtLeastOnce).await;
    assert!(matches!(codes[0], v5::SubscribeReasonCode::Success(_)));
    acked.lock().push((name, topic));
    while let Recv::Packet(_) = c.recv_within(Duration::from_secs(30)).await {}
}

fn persistent(
    clean_start: bool,
) -> impl FnOnce(&mut (v5::Connect, Option<v5::LastWill>, Option<v5::Login>)) {
    move |c| {
        c.0.clean_start = clean_start;
        c.0.properties = Some(v5::ConnectProperties {
            session_expiry_interval: Some(3600),
            ..v5::ConnectProperties::new()
        });
    }
}

/// Every acknowledged retained message is retained, with its payload, and
/// nothing else is; every acknowledged session is there and receives.
async fn verify_mqtt(addr: std::net::SocketAddr, retained: &Retained, sessions: &Sessions) {
    let mut c = Raw::connect(addr, "mqtt-verifier").await;
    c.subscribe("ret/#", QoS::AtLeastOnce).await;
    let mut found = std::collections::HashSet::new();
    loop {
        match c.recv_within(Duration::from_millis(500)).await {
            Recv::Packet(v5::Packet::Publish(p)) => {
                c.send(v5::Packet::PubAck(v5::PubAck::new(p.pkid, None)))
                    .await;
                assert_eq!(p.topic, p.payload, "a retained message kept its payload");
                assert!(p.retain);
                assert!(
                    found.insert(String::from_utf8(p.topic.to_vec()).unwrap()),
                    "retained message delivered twice"
                );
            }
            Recv::Packet(_) => {}
            _ => break,
        }
    }
    for topic in retained.lock().iter() {
        assert!(found.contains(topic), "acknowledged retained {topic} lost");
    }
    let sessions = sessions.lock().clone();
    for (client, topic) in &sessions {
        let (mut s, connack) = Raw::connect_with(addr, client, persistent(false)).await;
        assert!(
            connack.session_present,
            "acknowledged session {client} lost"
        );
        c.publish(topic, "ping", QoS::AtLeastOnce, None).await;
        let p = s.next_publish().await;
        assert_eq!(&p.topic[..], topic.as_bytes(), "{client} still subscribed");
    }
}

/// Writes unique persisted keys until the broker goes away.
async fn writer(
    addr: std::net::SocketAddr,
    name: String,
    acked: Acked,
    attempted: Attempted,
) -> usize {
    let (mut c, _) = Raw::connect_with(addr, &name, |_| {}).await;
    let codes = c
        .subscribe(&c.response_topic.clone(), QoS::AtLeastOnce)
        .await;
    assert!(matches!(codes[0], v5::SubscribeReasonCode::Success(_)));
    let mut n = 0usize;
    loop {
        let key = format!("{name}-{n}");
        let value = format!("value-of-{key}");
        attempted.lock().insert(key.clone(), value.clone());
        let correlation = (n as u64).to_be_bytes();
        let ts = now_hlc(&name);
        let props =
            c.request_properties(&correlation, &[("__ts", &ts), ("aio-persistence", "true")]);
        let mut publish = v5::Publish::new(
            REQUEST_TOPIC,
            QoS::AtLeastOnce,
            Bytes::from(encode_request(&[
                b"SET".as_slice(),
                key.as_bytes(),
                value.as_bytes(),
            ])),
            Some(props),
        );
        publish.pkid = c.pkid();
        c.send(v5::Packet::Publish(publish)).await;
        loop {
            match c.recv_within(Duration::from_secs(5)).await {
                Recv::Packet(v5::Packet::Publish(p)) => {
                    c.send(v5::Packet::PubAck(v5::PubAck::new(p.pkid, None)))
                        .await;
                    let props = p.properties.as_ref().unwrap();
                    if props.correlation_data.as_deref() != Some(&correlation[..]) {
                        continue;
                    }
                    assert_eq!(&p.payload[..], b"+OK\r\n");
                    let version = user_property(&p, "__ts").unwrap().to_owned();
                    acked.lock().insert(key.clone(), (value.clone(), version));
                    break;
                }
                Recv::Packet(_) => continue,
                Recv::Closed | Recv::Timeout => return n,
            }
        }
        n += 1;
    }
}

/// Checks the restarted broker against what was acknowledged and attempted.
async fn verify(addr: std::net::SocketAddr, acked: &Acked, attempted: &Attempted) -> usize {
    let mut c = Raw::connect(addr, "verifier").await;
    let acked = acked.lock().clone();
    for (key, (value, version)) in &acked {
        let r = c.request(&[b"GET", key.as_bytes()]).await;
        let expected = format!("${}\r\n{value}\r\n", value.len());
        assert_eq!(
            String::from_utf8_lossy(&r.payload),
            expected,
            "acknowledged {key} lost"
        );
        assert_eq!(
            user_property(&r, "__ts"),
            Some(version.as_str()),
            "version of {key}"
        );
    }
    // Nothing appears that was never written.
    let mut found = 0;
    let mut token: Option<Vec<u8>> = None;
    loop {
        let mut args = vec![b"SCAN".to_vec(), b"*".to_vec()];
        args.extend(token.take());
        let page = c
            .request(&args.iter().map(Vec::as_slice).collect::<Vec<_>>())
            .await;
        let Page { keys, token: next } = Page::decode(&page.payload).unwrap();
        for key in keys {
            let key = String::from_utf8(key).unwrap();
            let value = attempted.lock().get(&key).cloned();
            let Some(value) = value else {
                panic!("{key} was never written")
            };
            let r = c.request(&[b"GET", key.as_bytes()]).await;
            assert_eq!(
                String::from_utf8_lossy(&r.payload),
                format!("${}\r\n{value}\r\n", value.len())
            );
            found += 1;
        }
        match next {
            Some(t) => token = Some(t),
            None => break,
        }
    }
    assert!(found >= acked.len());
    found
}

/// A random number from the clock (no test dependency for one number).
fn random_below(n: u64) -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(Instant::now()) % n
}

async fn crash_loop(mode: &str, budget: Duration, max_rounds: usize) {
    let dir = tempfile::tempdir().unwrap();
    let acked: Acked = Arc::default();
    let attempted: Attempted = Arc::default();
    let retained: Retained = Arc::default();
    let sessions: Sessions = Arc::default();
    let mail: Arc<Mutex<Mail>> = Arc::default();
    let config = dir.path().join("statebroker.toml");
    std::fs::write(
        &config,
        format!("[persistence]\nmode = \"{mode}\"\ninterval_ms = 200\n"),
    )
    .unwrap();
    let config = config.to_str().unwrap().to_owned();
    let data = dir.path().join("data");
    let started = Instant::now();
    let mut rounds = 0;
    let mut kill_points = Vec::new();
    while rounds < max_rounds && started.elapsed() < budget {
        let common::BrokerProcess {
            mut child, addr, ..
        } = spawn_broker(&data, &["--config", &config]).await;
        verify(addr, &acked, &attempted).await;
        verify_mqtt(addr, &retained, &sessions).await;
        if rounds == 0 {
            let (mut c, _) = Raw::connect_with(addr, MAILBOX, persistent(true)).await;
            c.subscribe("mail/#", QoS::ExactlyOnce).await;
        } else {
            verify_mail(addr, &mail).await;
        }
        let mailer = tokio::spawn(mailer(addr, format!("r{rounds}m"), Arc::clone(&mail)));
        let retainers: Vec<_> = (0..2)
            .map(|w| {
                tokio::spawn(retainer(
                    addr,
                    format!("r{rounds}p{w}"),
                    Arc::clone(&retained),
                ))
            })
            .collect();
        let listener = tokio::spawn(subscriber(
            addr,
            format!("r{rounds}s"),
            Arc::clone(&sessions),
        ));
        let writers: Vec<_> = (0..4)
            .map(|w| {
                tokio::spawn(writer(
                    addr,
                    format!("r{rounds}w{w}"),
                    Arc::clone(&acked),
                    Arc::clone(&attempted),
                ))
            })
            .collect();
        let kill_after = Duration::from_millis(100 + random_below(700));
        tokio::time::sleep(kill_after).await;
        child.start_kill().unwrap();
        child.wait().await.unwrap();
        let mut written = 0;
        for w in writers {
            written += w.await.unwrap();
        }
        let mut published = 0;
        for r in retainers {
            published += r.await.unwrap();
        }
        listener.abort();
        let mailed = mailer.await.unwrap();
        kill_points.push((kill_after.as_millis(), written, published, mailed));
        rounds += 1;
    }
    let common::BrokerProcess {
        mut child, addr, ..
    } = spawn_broker(&data, &["--config", &config]).await;
    let found = verify(addr, &acked, &attempted).await;
    verify_mqtt(addr, &retained, &sessions).await;
    verify_mail(addr, &mail).await;
    child.start_kill().unwrap();
    let acked = acked.lock().len();
    let (retained, sessions) = (retained.lock().len(), sessions.lock().len());
    let (mailed, received) = {
        let mail = mail.lock();
        (mail.acked.len(), mail.received.len())
    };
    println!(
        "{mode}: {rounds} SIGKILLs (after ms, writes acked, retained publishes, queued QoS 2 messages acked in the round): {kill_points:?}; {acked} acknowledged writes, {found} keys found; {retained} retained messages and {sessions} sessions acknowledged, all found; {mailed} QoS 2 messages queued for an offline session acknowledged, {received} received, each once"
    );
    assert!(rounds >= 3, "only {rounds} rounds");
    assert!(acked > 0 && retained > 0 && sessions > 0 && mailed > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_survive_sigkill_fsync_mode() {
    crash_loop("fsync", Duration::from_secs(20), 12).await;
}

/// In interval mode only a power loss may lose acknowledged writes; a killed
/// process loses none (they are in the journal, in the OS's hands).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_survive_sigkill_interval_mode() {
    crash_loop("interval", Duration::from_secs(15), 8).await;
}

/// The journal files and the end of the data in the newest one.
/// Versions across restarts, crashes (SIGKILL) and clean stops (SIGTERM)
/// in turn: each SET's version above the last one's, and never more than
/// about the clock's lease (1 s) ahead of the wall clock. Before, each
/// crash or stop put the clock up to 10 s further ahead: eight quick
/// restarts put versions 70 s ahead, and a lock's fencing token taken then
/// was refused as "too far in the future".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_stay_near_the_wall_clock_across_quick_restarts() {
    let data = tempfile::tempdir().unwrap();
    let mut last = String::new();
    for round in 0..8 {
        let mut broker = spawn_broker(data.path(), &[]).await;
        let mut c = Raw::connect(broker.addr, "clock").await;
        let answer = c.request(&[b"SET", b"k", b"v"]).await;
        let version = user_property(&answer, "__ts").expect("__ts").to_owned();
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let (ms, _) = version.split_once(':').unwrap();
        let ahead = ms.parse::<u64>().unwrap().saturating_sub(wall);
        assert!(version > last, "round {round}: {version} after {last}");
        assert!(
            ahead < 1_500,
            "round {round}: the version is {ahead} ms ahead of the wall clock"
        );
        last = version;
        if round % 2 == 0 {
            broker.child.start_kill().unwrap();
        } else {
            common::signal(&broker.child, "TERM");
        }
        broker.child.wait().await.unwrap();
    }
}

fn journal_tail(data: &std::path::Path) -> (std::path::PathBuf, usize) {
    let mut journals: Vec<_> = std::fs::read_dir(data)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "jnl"))
        .collect();
    journals.sort();
    let newest = journals.pop().expect("a journal file");
    let bytes = std::fs::read(&newest).unwrap();
    let end = bytes
        .iter()
        .rposition(|&b| b != 0)
        .expect("journal holds data")
        + 1;
    (newest, end)
}

async fn damage_and_restart(damage: impl Fn(&mut Vec<u8>, usize)) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = spawn_broker(dir.path(), &[]).await;
    write_sequentially(broker.addr, "k", 30).await;
    broker.child.start_kill().unwrap();
    broker.child.wait().await.unwrap();

    let (journal, end) = journal_tail(dir.path());
    let mut bytes = std::fs::read(&journal).unwrap();
    damage(&mut bytes, end);
    std::fs::write(&journal, &bytes).unwrap();

    // Starts (no panic), keeps every batch before the damage, serves again.
    for _ in 0..2 {
        let mut broker = spawn_broker(dir.path(), &[]).await;
        let mut c = Raw::connect(broker.addr, "checker").await;
        for i in 0..29 {
            let key = format!("k{i:03}");
            assert_eq!(
                &c.request(&[b"GET", key.as_bytes()]).await.payload[..],
                b"$1\r\nv\r\n",
                "{key}"
            );
        }
        write_sequentially(broker.addr, "after", 3).await;
        let log = broker.log.lock().clone();
        broker.child.start_kill().unwrap();
        broker.child.wait().await.unwrap();
        if log
            .iter()
            .any(|l| l.contains("journal") || l.contains("Invalid batch"))
        {
            return log;
        }
    }
    panic!("no log line about the damaged journal");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_journal_tail_is_cut_off_with_a_log_line() {
    // The last batch never fully reached the disk.
    let log = damage_and_restart(|bytes, end| bytes[end - 6..end].fill(0)).await;
    println!("{}", log.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_journal_tail_is_cut_off_with_a_log_line() {
    // A bit flip inside the last batch: its checksum fails.
    let log = damage_and_restart(|bytes, end| bytes[end - 12] ^= 0x5A).await;
    println!("{}", log.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corruption_before_the_tail_stops_the_start_and_leaves_the_journal_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut broker = spawn_broker(dir.path(), &[]).await;
    write_sequentially(broker.addr, "k", 10).await;
    broker.child.start_kill().unwrap();
    broker.child.wait().await.unwrap();
    let (journal, _) = journal_tail(dir.path());
    let mut bytes = std::fs::read(&journal).unwrap();
    // Inside the value of the first key's batch: not the tail.
    let at = bytes.windows(4).position(|w| w == b"k000").unwrap() + 4;
    bytes[at] ^= 0x5A;
    std::fs::write(&journal, &bytes).unwrap();

    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_statebroker"))
        .args(["--listen", "127.0.0.1:0", "--no-http", "--data-dir"])
        .arg(dir.path())
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("not in the last batch"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(
        std::fs::read(&journal).unwrap(),
        bytes,
        "the journal is left as it was"
    );
}
