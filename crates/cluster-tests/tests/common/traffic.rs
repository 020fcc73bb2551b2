//! MQTT traffic for fault runs (#29 item 5): numbered publishers and
//! recording subscribers, each with a persistent session, that move to the
//! next node when theirs fails them (closed, DISCONNECT, or silent with a
//! ping unanswered), as a client given the list of a cluster's servers
//! does. What they record is checked with
//! `statebroker_checker::delivery`.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rumqttc::v5::mqttbytes::QoS;
use statebroker_checker::delivery::{Published, Received};

use super::raw::{Raw, Recv, v5};
use super::{PATIENCE, addr};

/// Silence after which a client pings.
const PING_AFTER: Duration = Duration::from_secs(2);
/// Silence after which a client leaves for the next node. A node waits
/// at most 5 s for another's acknowledgement, and answers pings at once.
const DEAD_AFTER: Duration = Duration::from_secs(6);
/// How long a CONNACK may take.
const CONNACK_WAIT: Duration = Duration::from_secs(5);
/// Every client's Session Expiry Interval, seconds.
const EXPIRY: u32 = 300;

/// A connection to one node, with what its liveness check needs.
struct Conn {
    raw: Raw,
    node: usize,
    heard: Instant,
    pinged: bool,
}

#[allow(clippy::large_enum_variant)]
enum Next {
    Packet(v5::Packet),
    /// Nothing within the wait.
    Quiet,
    /// The connection is over (why).
    Gone(String),
}

impl Conn {
    /// Connects `client_id` to node `from`, or the next one that takes
    /// it, round the list; Clean Start `clean`. With Session Present.
    async fn open(ports: &[u16], from: usize, client_id: &str, clean: bool) -> (Conn, bool) {
        let started = Instant::now();
        let mut node = from % ports.len();
        let mut tried = Vec::new();
        loop {
            let tweak = |c: &mut (v5::Connect, Option<v5::LastWill>, Option<v5::Login>)| {
                c.0.clean_start = clean;
                c.0.properties = Some(v5::ConnectProperties {
                    session_expiry_interval: Some(EXPIRY),
                    ..v5::ConnectProperties::new()
                });
            };
            match Raw::try_connect(addr(ports[node]), client_id, CONNACK_WAIT, tweak).await {
                Ok((raw, connack)) if connack.code == v5::ConnectReturnCode::Success => {
                    let conn = Conn {
                        raw,
                        node,
                        heard: Instant::now(),
                        pinged: false,
                    };
                    return (conn, connack.session_present);
                }
                Ok((_, connack)) => tried.push(format!("node {node}: {:?}", connack.code)),
                Err(e) => tried.push(format!("node {node}: {e}")),
            }
            assert!(
                started.elapsed() < 2 * PATIENCE,
                "{client_id}: no node took it: {tried:?}"
            );
            node = (node + 1) % ports.len();
            if node == from % ports.len() {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }

    async fn send(&mut self, packet: v5::Packet) {
        self.raw.send(packet).await;
    }

    /// The next packet within `wait`, pinging after [`PING_AFTER`] of
    /// silence; gone after [`DEAD_AFTER`].
    async fn next(&mut self, wait: Duration) -> Next {
        match self.raw.recv_within(wait).await {
            Recv::Packet(v5::Packet::Disconnect(d)) => {
                Next::Gone(format!("DISCONNECT {:?}", d.reason_code))
            }
            Recv::Packet(packet) => {
                self.heard = Instant::now();
                self.pinged = false;
                match packet {
                    v5::Packet::PingResp(_) => Next::Quiet,
                    packet => Next::Packet(packet),
                }
            }
            Recv::Closed => Next::Gone("closed".into()),
            Recv::Timeout => {
                let silent = self.heard.elapsed();
                if silent >= DEAD_AFTER {
                    return Next::Gone(format!("silent for {silent:?}"));
                }
                if silent >= PING_AFTER && !self.pinged {
                    self.pinged = true;
                    self.send(v5::Packet::PingReq(v5::PingReq)).await;
                }
                Next::Quiet
            }
        }
    }
}

/// One publisher of a fault run.
#[derive(Clone, Debug)]
pub struct PublisherSpec {
    /// Client id, and the name its messages carry (topic `{prefix}{name}`).
    pub name: String,
    /// The node it connects to first.
    pub home: usize,
    pub prefix: String,
    /// 1 or 2.
    pub qos: u8,
    /// Publishes in flight at most.
    pub window: usize,
    pub retain: bool,
    /// Time between two new publishes.
    pub pause: Duration,
}

/// What a publisher did: for the checker, and when it first sent each
/// number.
#[derive(Debug)]
pub struct PublisherLog {
    pub published: Published,
    pub first_sent: Vec<Instant>,
    /// Acknowledgements with a failure reason code (not in `acknowledged`).
    pub refused: u32,
}

/// Publishes numbers 0, 1, ... on `{prefix}{name}` until `stop`, then
/// waits for what is in flight (at most [`PATIENCE`]). Unacknowledged
/// publishes are sent again (DUP, same packet id) after a reconnection;
/// PUBRELs too, if the session was there.
pub async fn publisher(
    ports: Arc<Vec<u16>>,
    spec: PublisherSpec,
    stop: Arc<AtomicBool>,
) -> PublisherLog {
    let qos = if spec.qos == 2 {
        QoS::ExactlyOnce
    } else {
        QoS::AtLeastOnce
    };
    let topic = format!("{}{}", spec.prefix, spec.name);
    let mut log = PublisherLog {
        published: Published {
            publisher: spec.name.clone(),
            qos: spec.qos,
            ..Published::default()
        },
        first_sent: Vec::new(),
        refused: 0,
    };
    let publish = |n: u64, pkid: u16, dup: bool| {
        let mut p = v5::Publish::new(&topic, qos, Bytes::from(n.to_string()), None);
        p.pkid = pkid;
        p.dup = dup;
        p.retain = spec.retain;
        v5::Packet::Publish(p)
    };
    // Number -> (packet id, released: PUBREC came and PUBREL went). At
    // most `window` entries: a packet id's number is found by looking.
    let mut in_flight: BTreeMap<u64, (u16, bool)> = BTreeMap::new();
    let number_of = |in_flight: &BTreeMap<u64, (u16, bool)>, pkid: u16| {
        in_flight
            .iter()
            .find(|(_, (p, _))| *p == pkid)
            .map(|(&n, _)| n)
    };
    let (mut conn, _) = Conn::open(&ports, spec.home, &spec.name, true).await;
    let mut next_send = Instant::now();
    let mut stopped_at: Option<Instant> = None;
    loop {
        let stopping = stop.load(Ordering::Acquire);
        if stopping && stopped_at.is_none() {
            stopped_at = Some(Instant::now());
        }
        while !stopping && in_flight.len() < spec.window && Instant::now() >= next_send {
            let n = log.published.sent;
            let pkid = (n % 60_000) as u16 + 1;
            conn.send(publish(n, pkid, false)).await;
            log.first_sent.push(Instant::now());
            log.published.sent += 1;
            in_flight.insert(n, (pkid, false));
            next_send = Instant::now() + spec.pause;
        }
        if stopping && (in_flight.is_empty() || stopped_at.unwrap().elapsed() > PATIENCE) {
            if !in_flight.is_empty() {
                eprintln!("{}: {} never acknowledged", spec.name, in_flight.len());
            }
            return log;
        }
        let wait = if !stopping && in_flight.len() < spec.window {
            next_send
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        } else {
            Duration::from_millis(500)
        };
        match conn.next(wait).await {
            Next::Packet(v5::Packet::PubAck(ack)) => {
                if let Some(n) = number_of(&in_flight, ack.pkid) {
                    in_flight.remove(&n);
                    if matches!(
                        ack.reason,
                        v5::PubAckReason::Success | v5::PubAckReason::NoMatchingSubscribers
                    ) {
                        log.published.acknowledged.push(n);
                    } else {
                        log.refused += 1;
                        eprintln!("{}: {n} refused: {:?}", spec.name, ack.reason);
                    }
                }
            }
            Next::Packet(v5::Packet::PubRec(rec)) => {
                let Some(n) = number_of(&in_flight, rec.pkid) else {
                    continue;
                };
                let ok = matches!(
                    rec.reason,
                    v5::PubRecReason::Success | v5::PubRecReason::NoMatchingSubscribers
                );
                if !ok {
                    in_flight.remove(&n);
                    log.refused += 1;
                    eprintln!("{}: {n} refused: {:?}", spec.name, rec.reason);
                    continue;
                }
                let entry = in_flight.get_mut(&n).expect("in flight");
                if !entry.1 {
                    entry.1 = true;
                    log.published.acknowledged.push(n);
                }
                conn.send(v5::Packet::PubRel(v5::PubRel::new(rec.pkid, None)))
                    .await;
            }
            Next::Packet(v5::Packet::PubComp(comp)) => {
                if let Some(n) = number_of(&in_flight, comp.pkid)
                    && in_flight[&n].1
                {
                    in_flight.remove(&n);
                }
            }
            Next::Packet(_) | Next::Quiet => {}
            Next::Gone(why) => {
                let from = conn.node;
                let (again, present) = Conn::open(&ports, from + 1, &spec.name, false).await;
                conn = again;
                log.published.reconnects += 1;
                eprintln!(
                    "{}: left node {from} ({why}), now on node {} (session present: {present}), {} in flight",
                    spec.name,
                    conn.node,
                    in_flight.len()
                );
                // Received by the broker, its session gone: done.
                if !present {
                    in_flight.retain(|_, (_, released)| !*released);
                }
                for (&n, &(pkid, released)) in &in_flight {
                    if released {
                        conn.send(v5::Packet::PubRel(v5::PubRel::new(pkid, None)))
                            .await;
                    } else {
                        log.published.resent.push(n);
                        conn.send(publish(n, pkid, true)).await;
                    }
                }
            }
        }
    }
}

/// What a subscriber did.
#[derive(Debug)]
pub struct SubscriberLog {
    pub received: Received,
    /// When each connection after the first was accepted.
    pub reconnected_at: Vec<Instant>,
    /// QoS 2 publishes without DUP on a packet id not yet released (a
    /// broker reusing it; taken as new).
    pub reused_pkids: u32,
}

/// A subscriber of `filter` at QoS 2, connected and subscribed (SUBACK
/// received) on node `home`; its task records messages (topic
/// `{prefix}{publisher}`, payload the number) until `done` and then 3 s
/// without a message.
pub async fn subscriber(
    ports: Arc<Vec<u16>>,
    name: &str,
    home: usize,
    filter: &str,
    done: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<SubscriberLog> {
    let (mut conn, _) = Conn::open(&ports, home, name, true).await;
    let codes = conn.raw.subscribe(filter, QoS::ExactlyOnce).await;
    assert_eq!(
        codes,
        vec![v5::SubscribeReasonCode::Success(QoS::ExactlyOnce)]
    );
    let (name, filter) = (name.to_owned(), filter.to_owned());
    tokio::spawn(async move {
        let mut log = SubscriberLog {
            received: Received {
                subscriber: name.clone(),
                ..Received::default()
            },
            reconnected_at: Vec::new(),
            reused_pkids: 0,
        };
        let mut unreleased: HashSet<u16> = HashSet::new();
        let mut last = Instant::now();
        let started = Instant::now();
        // Where each QoS 2 message came first: (packet id, DUP, node,
        // time), to tell in the test's output how a second one came.
        let mut first_qos2: HashMap<(String, u64), (u16, bool, usize, Duration)> = HashMap::new();
        loop {
            match conn.next(Duration::from_millis(500)).await {
                Next::Packet(v5::Packet::Publish(p)) => {
                    last = Instant::now();
                    let (publisher, n) = numbered(&p);
                    let new = match p.qos {
                        QoS::AtMostOnce => true,
                        QoS::AtLeastOnce => {
                            conn.send(v5::Packet::PubAck(v5::PubAck::new(p.pkid, None)))
                                .await;
                            true
                        }
                        QoS::ExactlyOnce => {
                            let new = unreleased.insert(p.pkid);
                            if !new && !p.dup {
                                log.reused_pkids += 1;
                            }
                            conn.send(v5::Packet::PubRec(v5::PubRec::new(p.pkid, None)))
                                .await;
                            new || !p.dup
                        }
                    };
                    if new && p.qos == QoS::ExactlyOnce {
                        let here = (p.pkid, p.dup, conn.node, started.elapsed());
                        match first_qos2.entry((publisher.clone(), n)) {
                            Entry::Vacant(first) => {
                                first.insert(here);
                            }
                            Entry::Occupied(first) => eprintln!(
                                "{name}: QoS 2 {publisher} {n} again: first (pkid, dup, node, at) {:?}, now {here:?}",
                                first.get()
                            ),
                        }
                    }
                    if new {
                        log.received.messages.push((publisher, n, p.qos as u8));
                    }
                }
                Next::Packet(v5::Packet::PubRel(rel)) => {
                    unreleased.remove(&rel.pkid);
                    conn.send(v5::Packet::PubComp(v5::PubComp::new(rel.pkid, None)))
                        .await;
                }
                Next::Packet(_) => {}
                Next::Quiet => {
                    if done.load(Ordering::Acquire) && last.elapsed() >= Duration::from_secs(3) {
                        return log;
                    }
                }
                Next::Gone(why) => {
                    let from = conn.node;
                    let (again, present) = Conn::open(&ports, from + 1, &name, false).await;
                    conn = again;
                    log.received.reconnects += 1;
                    log.reconnected_at.push(Instant::now());
                    eprintln!(
                        "{name}: left node {from} ({why}), now on node {} (session present: {present})",
                        conn.node
                    );
                    if !present {
                        unreleased.clear();
                        conn.raw.subscribe(&filter, QoS::ExactlyOnce).await;
                    }
                }
            }
        }
    })
}

/// A numbered message's publisher (the topic's last level) and number
/// (the payload; `u64::MAX` if it is none, which the checker counts as
/// never sent).
fn numbered(p: &v5::Publish) -> (String, u64) {
    let topic = String::from_utf8_lossy(&p.topic);
    let publisher = topic.rsplit('/').next().unwrap_or_default().to_owned();
    let n = std::str::from_utf8(&p.payload)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(u64::MAX);
    (publisher, n)
}

/// The retained messages under `filter` node `port` serves, as
/// (publisher, number): what a new subscriber receives until 1 s passes
/// without one.
pub async fn retained(port: u16, client_id: &str, filter: &str) -> BTreeMap<String, u64> {
    let mut raw = Raw::connect(addr(port), client_id).await;
    raw.subscribe(filter, QoS::AtLeastOnce).await;
    let mut got = BTreeMap::new();
    loop {
        match raw.recv_within(Duration::from_secs(1)).await {
            Recv::Packet(v5::Packet::Publish(p)) => {
                if p.qos != QoS::AtMostOnce {
                    raw.send(v5::Packet::PubAck(v5::PubAck::new(p.pkid, None)))
                        .await;
                }
                let (publisher, n) = numbered(&p);
                got.insert(publisher, n);
            }
            Recv::Packet(_) => {}
            Recv::Timeout | Recv::Closed => return got,
        }
    }
}
