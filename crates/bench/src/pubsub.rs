//! Publish/subscribe load: pairs, fan-in and fan-out at QoS 0, 1 or 2.
//!
//! Every message carries its publisher, its sequence number and when it was
//! sent, so the subscribers measure end-to-end latency and count exactly
//! what was lost and what was delivered twice.
//!
//! The load is closed-loop: a publisher keeps at most `--window` messages
//! per subscriber on their way (sent, not yet received by every subscriber
//! of its topic), and sends the next as soon as one arrives. That measures
//! the throughput a broker sustains with bounded queues, and latency at that
//! throughput, instead of how deep a broker lets a queue grow. A message
//! still missing after `--timeout-ms` is written off for flow control (and
//! counted as lost at the end, unless it turns up late).
//!
//! - `pairs`: N publishers, N subscribers; publisher i to subscriber i.
//! - `fan-in`: N publishers on their own topics, one subscriber to all (`+`).
//! - `fan-out`: one publisher, N subscribers of its topic.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::Packet;
use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};
use serde::Serialize;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::{Pattern, PubSubArgs};

/// Bytes of the header every message starts with: publisher (u32),
/// sequence (u64), nanoseconds since the run's epoch at sending (u64).
const HEADER: usize = 20;

/// The result of a run, as printed with `--json`.
#[derive(Debug, Serialize)]
pub struct Report {
    pub target: String,
    /// Where the subscribers connected (another node), if not to `target`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subscriber_target: Option<String>,
    pub pattern: String,
    pub qos: u8,
    pub publishers: usize,
    pub subscribers: usize,
    pub payload_bytes: usize,
    pub duration_s: f64,
    /// Messages published (the whole run, warm-up included).
    pub sent: u64,
    /// Deliveries expected: each message times the subscribers of its topic.
    pub expected: u64,
    /// Distinct deliveries received.
    pub received: u64,
    /// Deliveries of messages sent in the measured window, per second.
    pub messages_per_sec: f64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
    /// Expected deliveries that never arrived.
    pub lost: u64,
    /// Deliveries of a message a subscriber had received already.
    pub duplicated: u64,
    pub failed_connections: usize,
}

/// What publishers and subscribers share about one publisher.
struct Flow {
    /// Messages published.
    sent: AtomicU64,
    /// Distinct deliveries of its messages, over all its subscribers.
    received: AtomicU64,
    /// Woken on each delivery.
    progress: Notify,
}

/// What the run shares.
struct Run {
    epoch: Instant,
    warm_end: Instant,
    end: Instant,
    /// How long subscribers wait after `end` for what is still on its way.
    drain_end: Instant,
    flows: Vec<Flow>,
    /// Subscribers of each publisher's topic.
    fan: u64,
}

impl Run {
    fn nanos(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Whether every delivery of every message sent so far has arrived.
    fn all_received(&self) -> bool {
        self.flows.iter().all(|f| {
            f.received.load(Ordering::Acquire) >= f.sent.load(Ordering::Acquire) * self.fan
        })
    }
}

fn qos(level: u8) -> QoS {
    match level {
        0 => QoS::AtMostOnce,
        1 => QoS::AtLeastOnce,
        _ => QoS::ExactlyOnce,
    }
}

fn options(target: SocketAddr, client_id: &str, expiry: Option<u32>) -> MqttOptions {
    let mut options = MqttOptions::new(client_id, target.ip().to_string(), target.port());
    options.set_session_expiry_interval(expiry);
    options.set_keep_alive(Duration::from_secs(60));
    options.set_clean_start(true);
    options.set_connection_timeout(30);
    options.set_max_packet_size(Some(1 << 20));
    let mut network = rumqttc::NetworkOptions::new();
    network.set_tcp_nodelay(true);
    options.set_network_options(network);
    options
}

/// Polls until CONNACK (and SUBACK, when `subscribe` is given).
async fn connect(
    target: SocketAddr,
    client_id: String,
    subscribe: Option<(String, QoS)>,
    expiry: Option<u32>,
) -> Result<(AsyncClient, EventLoop), String> {
    let (client, mut eventloop) = AsyncClient::new(options(target, &client_id, expiry), 1024);
    let mut waiting_for_suback = false;
    if let Some((filter, qos)) = subscribe {
        client
            .try_subscribe(filter, qos)
            .map_err(|e| e.to_string())?;
        waiting_for_suback = true;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut connected = false;
    while !connected || waiting_for_suback {
        match tokio::time::timeout_at(deadline, eventloop.poll()).await {
            Ok(Ok(Event::Incoming(Packet::ConnAck(_)))) => connected = true,
            Ok(Ok(Event::Incoming(Packet::SubAck(ack)))) => {
                if ack.return_codes.iter().any(|c| {
                    !matches!(
                        c,
                        rumqttc::v5::mqttbytes::v5::SubscribeReasonCode::Success(_)
                    )
                }) {
                    return Err(format!("{client_id}: subscription refused: {ack:?}"));
                }
                waiting_for_suback = false;
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(format!("{client_id}: {e}")),
            Err(_) => return Err(format!("{client_id}: no CONNACK/SUBACK in 30 s")),
        }
    }
    Ok((client, eventloop))
}

/// What one subscriber measured.
#[derive(Default)]
struct SubStats {
    histogram: Option<Histogram<u64>>,
    measured: u64,
    duplicated: u64,
    failure: Option<String>,
}

/// Which sequence numbers of one publisher a subscriber has seen.
#[derive(Default)]
struct Seen(Vec<u64>);

impl Seen {
    /// Marks `seq`; `false` if it was marked already.
    fn mark(&mut self, seq: u64) -> bool {
        let (word, bit) = ((seq / 64) as usize, seq % 64);
        if word >= self.0.len() {
            self.0.resize(word + 1, 0);
        }
        let fresh = self.0[word] & (1 << bit) == 0;
        self.0[word] |= 1 << bit;
        fresh
    }
}

async fn subscriber(mut eventloop: EventLoop, run: Arc<Run>) -> SubStats {
    let mut stats = SubStats {
        histogram: Some(Histogram::new_with_bounds(1, 600_000_000, 3).expect("histogram bounds")),
        ..SubStats::default()
    };
    let mut seen: Vec<Seen> = (0..run.flows.len()).map(|_| Seen::default()).collect();
    let warm_from = run.warm_end.duration_since(run.epoch).as_nanos() as u64;
    let end_at = run.end.duration_since(run.epoch).as_nanos() as u64;
    loop {
        // After the run, keep draining (checking every 50 ms) until nothing
        // more is expected or the drain deadline passes.
        let now = Instant::now();
        if now >= run.end && (run.all_received() || now >= run.drain_end) {
            break;
        }
        let wake = if now < run.end {
            run.end
        } else {
            now + Duration::from_millis(50)
        };
        let publish = match tokio::time::timeout_at(wake, eventloop.poll()).await {
            Ok(Ok(Event::Incoming(Packet::Publish(p)))) => p,
            Ok(Ok(_)) | Err(_) => continue,
            Ok(Err(e)) => {
                stats.failure = Some(e.to_string());
                break;
            }
        };
        let Some((publisher, seq, sent_at)) = header(&publish.payload) else {
            stats.failure = Some("a message without the benchmark header".into());
            continue;
        };
        let Some(flow) = run.flows.get(publisher) else {
            continue;
        };
        if !seen[publisher].mark(seq) {
            stats.duplicated += 1;
            continue;
        }
        flow.received.fetch_add(1, Ordering::AcqRel);
        flow.progress.notify_one();
        if (warm_from..end_at).contains(&sent_at) {
            stats.measured += 1;
            let us = (run.nanos().saturating_sub(sent_at) / 1000).max(1);
            if let Some(h) = &mut stats.histogram {
                let _ = h.record(us);
            }
        }
    }
    stats
}

fn header(payload: &Bytes) -> Option<(usize, u64, u64)> {
    let h = payload.get(..HEADER)?;
    let publisher = u32::from_be_bytes(h[0..4].try_into().ok()?) as usize;
    let seq = u64::from_be_bytes(h[4..12].try_into().ok()?);
    let sent_at = u64::from_be_bytes(h[12..20].try_into().ok()?);
    Some((publisher, seq, sent_at))
}

/// Publishes as fast as the window allows until the run ends.
async fn publisher(
    index: usize,
    client: AsyncClient,
    mut eventloop: EventLoop,
    topic: String,
    args: PubSubArgs,
    run: Arc<Run>,
) -> Option<String> {
    let flow = &run.flows[index];
    let window = args.window.max(1) as u64 * run.fan;
    let timeout = Duration::from_millis(args.timeout_ms);
    let mut written_off = 0u64;
    let mut payload = vec![b'p'; args.payload.max(HEADER)];
    payload[..4].copy_from_slice(&(index as u32).to_be_bytes());
    let mut last_progress = Instant::now();
    let mut last_received = 0;
    // Publishes the broker has completed (PUBACK at QoS 1, PUBCOMP at QoS 2).
    let mut completed = 0u64;
    let done = |event: &Event| {
        u64::from(matches!(
            event,
            Event::Incoming(Packet::PubAck(_) | Packet::PubComp(_))
        ))
    };
    while Instant::now() < run.end {
        let sent = flow.sent.load(Ordering::Acquire);
        let received = flow.received.load(Ordering::Acquire);
        if received != last_received {
            last_received = received;
            last_progress = Instant::now();
        }
        let outstanding = (sent * run.fan).saturating_sub(received + written_off);
        if outstanding < window {
            payload[4..12].copy_from_slice(&sent.to_be_bytes());
            payload[12..20].copy_from_slice(&run.nanos().to_be_bytes());
            if let Err(e) = client.try_publish(&topic, qos(args.qos), args.retain, payload.clone())
            {
                return Some(e.to_string());
            }
            flow.sent.store(sent + 1, Ordering::Release);
        } else if last_progress.elapsed() >= timeout {
            // Nothing arrived for a while: write the window off and go on.
            written_off = (sent * run.fan).saturating_sub(received);
            last_progress = Instant::now();
        }
        let full = outstanding + 1 >= window;
        tokio::select! {
            event = eventloop.poll() => match event {
                Ok(event) => completed += done(&event),
                Err(e) => return Some(e.to_string()),
            },
            () = flow.progress.notified(), if full => {}
            () = tokio::time::sleep(timeout), if full => {}
        }
    }
    // Finish the exchanges under way (a QoS 2 message is released to
    // subscribers only at PUBREL) before leaving.
    let sent = flow.sent.load(Ordering::Acquire);
    let finish = Instant::now() + timeout;
    while args.qos > 0 && completed < sent {
        match tokio::time::timeout_at(finish, eventloop.poll()).await {
            Ok(Ok(event)) => completed += done(&event),
            Ok(Err(e)) => return Some(e.to_string()),
            Err(_) => {
                return Some(format!(
                    "{} of {sent} publishes not acknowledged",
                    sent - completed
                ));
            }
        }
    }
    let _ = client.try_disconnect();
    let _ = tokio::time::timeout(Duration::from_millis(100), eventloop.poll()).await;
    None
}

/// The `pubsub` mode.
pub async fn run(args: PubSubArgs) -> Result<(), String> {
    if args.clients == 0 {
        return Err("--clients must be at least 1".into());
    }
    if args.qos > 2 {
        return Err("--qos must be 0, 1 or 2".into());
    }
    let n = args.clients;
    let (publishers, subscribers, fan) = match args.pattern {
        Pattern::Pairs => (n, n, 1),
        Pattern::FanIn => (n, 1, 1),
        Pattern::FanOut => (1, n, n as u64),
    };
    let id = format!("{}-{}", std::process::id(), fastrand::u32(..));
    let topic_of = |p: usize| format!("bench/pubsub/{id}/{p}");
    let mut subs = Vec::with_capacity(subscribers);
    let mut connecting = tokio::task::JoinSet::new();
    for s in 0..subscribers {
        let filter = match args.pattern {
            Pattern::Pairs => topic_of(s),
            Pattern::FanIn => format!("bench/pubsub/{id}/+"),
            Pattern::FanOut => topic_of(0),
        };
        let client_id = format!("bench-sub-{id}-{s}");
        connecting.spawn(connect(
            args.subscriber_target.unwrap_or(args.target),
            client_id,
            Some((filter, qos(args.qos))),
            args.persistent.then_some(300),
        ));
        if connecting.len() >= 64 || s + 1 == subscribers {
            while let Some(joined) = connecting.join_next().await {
                subs.push(joined.map_err(|e| e.to_string())??);
            }
        }
    }
    let mut pubs = Vec::with_capacity(publishers);
    let mut connecting = tokio::task::JoinSet::new();
    for p in 0..publishers {
        let client_id = format!("bench-pub-{id}-{p}");
        connecting.spawn(async move { (p, connect(args.target, client_id, None, None).await) });
        if connecting.len() >= 64 || p + 1 == publishers {
            while let Some(joined) = connecting.join_next().await {
                let (p, conn) = joined.map_err(|e| e.to_string())?;
                pubs.push((p, conn?));
            }
        }
    }
    let epoch = Instant::now();
    let warm_end = epoch + Duration::from_secs_f64(args.warmup);
    let end = warm_end + Duration::from_secs_f64(args.duration);
    let run = Arc::new(Run {
        epoch,
        warm_end,
        end,
        drain_end: end + Duration::from_millis(args.drain_ms),
        flows: (0..publishers)
            .map(|_| Flow {
                sent: AtomicU64::new(0),
                received: AtomicU64::new(0),
                progress: Notify::new(),
            })
            .collect(),
        fan,
    });
    let sub_tasks: Vec<_> = subs
        .into_iter()
        .map(|(client, eventloop)| {
            let task = tokio::spawn(subscriber(eventloop, Arc::clone(&run)));
            (client, task)
        })
        .collect();
    let pub_tasks: Vec<_> = pubs
        .into_iter()
        .map(|(p, (client, eventloop))| {
            tokio::spawn(publisher(
                p,
                client,
                eventloop,
                topic_of(p),
                args.clone(),
                Arc::clone(&run),
            ))
        })
        .collect();
    let mut failures = Vec::new();
    for task in pub_tasks {
        if let Some(f) = task.await.map_err(|e| e.to_string())? {
            failures.push(f);
        }
    }
    let mut histogram = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).expect("bounds");
    let (mut measured, mut duplicated) = (0, 0);
    for (client, task) in sub_tasks {
        let stats = task.await.map_err(|e| e.to_string())?;
        let _ = client.try_disconnect();
        if let Some(h) = &stats.histogram {
            histogram.add(h).map_err(|e| e.to_string())?;
        }
        measured += stats.measured;
        duplicated += stats.duplicated;
        if let Some(f) = stats.failure {
            failures.push(f);
        }
    }
    let sent: u64 = run
        .flows
        .iter()
        .map(|f| f.sent.load(Ordering::Acquire))
        .sum();
    let received: u64 = run
        .flows
        .iter()
        .map(|f| f.received.load(Ordering::Acquire))
        .sum();
    let expected = sent * fan;
    let report = Report {
        target: args.target.to_string(),
        subscriber_target: args.subscriber_target.map(|t| t.to_string()),
        pattern: format!("{:?}", args.pattern).to_lowercase(),
        qos: args.qos,
        publishers,
        subscribers,
        payload_bytes: args.payload.max(HEADER),
        duration_s: args.duration,
        sent,
        expected,
        received,
        messages_per_sec: measured as f64 / args.duration,
        p50_us: histogram.value_at_quantile(0.50),
        p90_us: histogram.value_at_quantile(0.90),
        p99_us: histogram.value_at_quantile(0.99),
        max_us: histogram.max(),
        lost: expected.saturating_sub(received),
        duplicated,
        failed_connections: failures.len(),
    };
    crate::emit(&report, args.json, &failures, || {
        format!(
            "target {}{}  {} at QoS {}  publishers {}  subscribers {}  payload {} B  measured {:.1} s\n\
             messages/s {:.0}  sent {}  expected {}  received {}  lost {}  duplicated {}  failed connections {}\n\
             latency µs: p50 {}  p90 {}  p99 {}  max {}",
            report.target,
            report
                .subscriber_target
                .as_ref()
                .map(|t| format!(" (subscribers on {t})"))
                .unwrap_or_default(),
            report.pattern,
            report.qos,
            report.publishers,
            report.subscribers,
            report.payload_bytes,
            report.duration_s,
            report.messages_per_sec,
            report.sent,
            report.expected,
            report.received,
            report.lost,
            report.duplicated,
            report.failed_connections,
            report.p50_us,
            report.p90_us,
            report.p99_us,
            report.max_us
        )
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seen_marks_each_sequence_once() {
        let mut seen = Seen::default();
        assert!(seen.mark(0));
        assert!(seen.mark(130));
        assert!(!seen.mark(130));
        assert!(!seen.mark(0));
        assert!(seen.mark(64));
    }

    #[test]
    fn header_round_trip() {
        let mut payload = vec![0; 32];
        payload[..4].copy_from_slice(&7u32.to_be_bytes());
        payload[4..12].copy_from_slice(&42u64.to_be_bytes());
        payload[12..20].copy_from_slice(&99u64.to_be_bytes());
        assert_eq!(header(&Bytes::from(payload)), Some((7, 42, 99)));
        assert_eq!(header(&Bytes::from_static(b"short")), None);
    }
}
