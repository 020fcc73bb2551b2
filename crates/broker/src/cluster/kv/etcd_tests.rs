use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use statestore::command::{Command, Dialect, KeyCommand};
use statestore::hlc::HybridClock;

use super::*;
use crate::config::ClusteringSettings;

struct Clock(Mutex<HybridClock>);

impl NodeClock for Clock {
    fn observe(&self, seen: Version) {
        self.0.lock().observe(seen);
    }
    fn mint(&self, now_ms: u64, received: Option<&Hlc>) -> Version {
        self.0.lock().next(now_ms, received)
    }
    fn clock_now(&self, now_ms: u64) -> Version {
        self.0.lock().now(now_ms)
    }
    fn wall_ms(&self) -> u64 {
        crate::clock::now_ms()
    }
}

/// A cluster node `id` on etcd `endpoint` (its tasks not started).
pub(in crate::cluster) async fn node(id: &str, endpoint: &str) -> Arc<Cluster> {
    node_with(id, endpoint, 1_572_864).await
}

/// [`node`] with etcd's request limit `max_request_bytes`.
async fn node_with(id: &str, endpoint: &str, max_request_bytes: usize) -> Arc<Cluster> {
    Cluster::connect(ClusteringSettings {
        node_id: id.into(),
        etcd_endpoints: vec![endpoint.into()],
        etcd_prefix: "/kv-test/".into(),
        request_timeout: Duration::from_secs(5),
        tombstone_ttl: Duration::from_secs(70),
        max_request_bytes,
        cached_reads: false,
        cache_bytes: 1 << 20,
        requests_to_leader: true,
        lease_ttl: Duration::from_secs(5),
        peer_address: None,
        forward_queue: 100,
        session_reap_interval: Duration::from_secs(60),
        keep_queued_in_etcd: true,
        recent_publishes_bytes: 0,
    })
    .await
    .expect("etcd answers")
}

/// Serves `args` on `node` as request `request`; the answer's RESP3
/// and version.
async fn serve(node: &Cluster, args: &[&[u8]], request: u64) -> (String, String) {
    serve_sent(node, args, (request, false), &client_now()).await
}

/// The client's timestamp (`__ts`) now.
fn client_now() -> String {
    format!("{}:0:client", crate::clock::now_ms())
}

/// [`serve`] of a request `(id, resent)` the client sent at `sent`.
async fn serve_sent(
    node: &Cluster,
    args: &[&[u8]],
    request: (u64, bool),
    sent: &str,
) -> (String, String) {
    let command = Command::parse(args, Dialect::V1).unwrap();
    let keyed = Keyed {
        command: KeyCommand::of(command).unwrap(),
        timestamp: sent.parse().ok(),
        fencing_token: None,
        persist: false,
    };
    let clock = Clock(Mutex::new(HybridClock::starting_after(Version::default())));
    let answer = node
        .serve_key(&keyed, request, &Quota::default(), &clock)
        .await
        .expect("answered");
    let mut resp = Vec::new();
    answer.frame.encode(&mut resp);
    (
        String::from_utf8_lossy(&resp).into_owned(),
        answer.version.into(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_committed_elsewhere_first_is_not_committed_again() {
    let etcd = statebroker_cluster_harness::EtcdCluster::start(1).expect("etcd starts");
    let endpoint = etcd.endpoint(0);
    let (a, b) = (node("a", &endpoint).await, node("b", &endpoint).await);
    // Node a writes the key: its cache has that record.
    assert_eq!(serve(&a, &[b"SET", b"k", b"v0"], 1).await.0, "+OK\r\n");
    // Request 7 reaches node b first (sent again by its client) and
    // commits there.
    let (answer, version) = serve(&b, &[b"SET", b"k", b"v1"], 7).await;
    assert_eq!(answer, "+OK\r\n");
    let revision = |etcd: &statebroker_cluster_harness::EtcdCluster| {
        let out = etcd
            .etcdctl()
            .args(["get", "/kv-test/K/k", "-w", "json"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.split("\"mod_revision\":")
            .nth(1)
            .and_then(|r| r.split([',', '}']).next())
            .and_then(|r| r.parse::<i64>().ok())
            .unwrap_or_else(|| panic!("no mod_revision in {text}"))
    };
    let committed = revision(&etcd);
    // Node a still runs its first copy, planned on its older record:
    // its transaction fails, finds request 7's record, and answers
    // with that write instead of committing again.
    let (again, again_version) = serve(&a, &[b"SET", b"k", b"v1"], 7).await;
    assert_eq!(again, "+OK\r\n");
    assert_eq!(
        again_version, version,
        "the answer of the write that was made"
    );
    assert_eq!(revision(&etcd), committed, "not written again");
    // Another request on the same key is written, as ever.
    serve(&a, &[b"SET", b"k", b"v2"], 8).await;
    assert!(revision(&etcd) > committed);
}

/// A request sent again (its node died after etcd's commit, before
/// the answer) after another client wrote the key: its write is in
/// the key's history, and it is answered as done, not run again.
/// Before, the key's last record only was looked at, and the request
/// wrote its value over the other client's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_sent_again_finds_its_write_in_the_keys_history() {
    let etcd = statebroker_cluster_harness::EtcdCluster::start(1).expect("etcd starts");
    let endpoint = etcd.endpoint(0);
    let (a, b) = (node("a", &endpoint).await, node("b", &endpoint).await);
    let value = |node: Arc<Cluster>| async move { serve(&node, &[b"GET", b"k"], 99).await.0 };
    let sent = client_now();
    let (answer, version) = serve_sent(&a, &[b"SET", b"k", b"v1"], (7, false), &sent).await;
    assert_eq!(answer, "+OK\r\n");
    serve(&b, &[b"SET", b"k", b"other"], 8).await;
    serve(&b, &[b"SET", b"k", b"another"], 9).await;
    let again = serve_sent(&b, &[b"SET", b"k", b"v1"], (7, true), &sent).await;
    assert_eq!(
        again,
        ("+OK\r\n".to_owned(), version),
        "the first write's answer"
    );
    assert_eq!(
        value(Arc::clone(&b)).await,
        "$7\r\nanother\r\n",
        "not run again"
    );
    // A DEL sent again, after another SET: its tombstone is in the
    // history.
    let sent = client_now();
    assert_eq!(
        serve_sent(&a, &[b"DEL", b"k"], (10, false), &sent).await.0,
        ":1\r\n"
    );
    serve(&b, &[b"SET", b"k", b"back"], 11).await;
    let again = serve_sent(&b, &[b"DEL", b"k"], (10, true), &sent).await;
    assert_eq!(again.0, ":1\r\n");
    assert_eq!(
        value(Arc::clone(&b)).await,
        "$4\r\nback\r\n",
        "not deleted again"
    );
    // A request sent again that never ran runs: the key's history
    // holds no write of it.
    let sent = client_now();
    let (answer, _) = serve_sent(&b, &[b"SET", b"k", b"new"], (12, true), &sent).await;
    assert_eq!(answer, "+OK\r\n");
    assert_eq!(value(b).await, "$3\r\nnew\r\n");
}

/// With the quotas raised past etcd's request limit (the harness's
/// members take 2 MiB, and the node is told so), a SET whose write
/// would pass it gets `-ERR the quota has been exceeded`, and the
/// largest one that fits commits. Before, the node counted the key
/// twice and 512 bytes: a 60 KB key's SET of 1,950,000 bytes passed
/// that, etcd refused the request, and the refusal read as an outcome
/// not known: no answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_past_etcds_request_limit_is_refused_and_the_largest_that_fits_commits() {
    const LIMIT: usize = 2_097_152;
    let etcd = statebroker_cluster_harness::EtcdCluster::start(1).expect("etcd starts");
    let a = node_with("a", &etcd.endpoint(0), LIMIT).await;
    let quota = Quota {
        max_value_size: 4 << 20,
        max_bytes: 64 << 20,
        ..Quota::default()
    };
    let key = vec![b'k'; 60_000];
    let set = |value: usize| {
        let (a, key, quota) = (Arc::clone(&a), key.clone(), quota.clone());
        async move {
            let value = vec![b'v'; value];
            let args: [&[u8]; 3] = [b"SET", &key, &value];
            let keyed = Keyed {
                command: KeyCommand::of(Command::parse(&args, Dialect::V1).unwrap()).unwrap(),
                timestamp: client_now().parse().ok(),
                fencing_token: None,
                persist: false,
            };
            let clock = Clock(Mutex::new(HybridClock::starting_after(Version::default())));
            let answer = tokio::time::timeout(
                Duration::from_secs(30),
                a.serve_key(&keyed, (fastrand::u64(..), false), &quota, &clock),
            )
            .await
            .expect("an answer within 30 s")
            .expect("answered");
            let mut resp = Vec::new();
            answer.frame.encode(&mut resp);
            String::from_utf8_lossy(&resp).into_owned()
        }
    };
    const REFUSED: &str = "-ERR the quota has been exceeded\r\n";
    assert_eq!(set(1_950_000).await, REFUSED);
    // The largest value the node's count lets through, and one more.
    let fits = |value| {
        let record = Record::encoded_len(1, 0, value);
        super::super::writes::fits_a_request("/kv-test/K/".len() + key.len(), record, LIMIT)
    };
    let largest = (1_000_000..LIMIT).rev().find(|&v| fits(v)).unwrap();
    assert_eq!(set(largest + 1).await, REFUSED);
    assert_eq!(
        set(largest).await,
        "+OK\r\n",
        "etcd takes what the node counts as fitting"
    );
}
