use std::time::Duration;

use bytes::Bytes;
use etcd_client::GetOptions;
use router::protocol::Publish;

use super::backlog::Backlog as _;
use super::*;
use crate::cluster::kv::etcd_tests::node;

fn message(payload: &str) -> Message {
    let mut publish = Publish::new(
        Bytes::from_static(b"t"),
        Bytes::from(payload.to_owned()),
        false,
    );
    publish.qos = QoS::AtLeastOnce;
    Message {
        publish,
        properties: None,
    }
}

/// Another node that takes a session from this one while its lease
/// lives (no link: killed moments ago, or cut off) takes its fence
/// down before it reads the session's copies: a batch this node sent
/// and etcd had not committed cannot commit after that read (and
/// leave a copy the next reader would send again). This node puts
/// its fence up again and goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_in_doubt_cannot_commit_once_another_node_read_the_session() {
    let etcd = statebroker_cluster_harness::EtcdCluster::start(1).expect("etcd starts");
    let (x, y) = (
        node("x", &etcd.endpoint(0)).await,
        node("y", &etcd.endpoint(0)).await,
    );
    let mut client = x.client.clone();
    for cluster in [&x, &y] {
        let lease = client.lease_grant(30, None).await.unwrap().id();
        cluster.lease.send_replace(lease);
    }
    let (qx, qy) = (Queue::start(Arc::clone(&x), false), Queue::start(y, false));
    let read = |queue: Arc<Queue>| async move {
        let queued = queue.read("c").await.unwrap();
        queued
            .into_iter()
            .map(|q| String::from_utf8_lossy(&q.message.publish.payload).into_owned())
            .collect::<Vec<_>>()
    };
    let until = |queue: Arc<Queue>, want: Vec<&'static str>| async move {
        let start = Instant::now();
        while read(Arc::clone(&queue)).await != want {
            assert!(start.elapsed() < Duration::from_secs(30), "never {want:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    qx.keep(&["c"], MessageId(1), &message("one"));
    until(Arc::clone(&qy), vec!["one"]).await;
    // A batch of x's etcd has not committed (x had no answer).
    let first = qx.fence.at().expect("x's fence is up");
    let mut key = Keys::node("/kv-test/", "c", "x");
    key.extend_from_slice(b"late.0000000000000002");
    let value = encode_message(&message("two").publish, None, 0).unwrap();
    let late = qx.fence.behind(first, vec![TxnOp::put(key, value, None)]);
    // y takes the session: x's fence first, then the copies.
    qy.fence_off("x").await.unwrap();
    assert_eq!(read(Arc::clone(&qy)).await, ["one"]);
    let answer = client.txn(late).await.unwrap();
    assert!(!answer.succeeded(), "x's late batch commits after y's read");
    assert_eq!(read(Arc::clone(&qy)).await, ["one"]);
    // x goes on behind its fence put up again.
    qx.keep(&["c"], MessageId(3), &message("three"));
    until(qy, vec!["one", "three"]).await;
    assert!(qx.fence.at().is_some_and(|at| at > first));
}

/// A batch that failed may commit later (it waited at a paused
/// member): the queue puts its fence up again before it writes
/// anything more, so the late batch cannot leave a copy behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_failed_cannot_commit_after_the_writes_that_follow() {
    let etcd = statebroker_cluster_harness::EtcdCluster::start(1).expect("etcd starts");
    let cluster = node("q", &etcd.endpoint(0)).await;
    let mut client = cluster.client.clone();
    let lease = client.lease_grant(30, None).await.unwrap().id();
    cluster.lease.send_replace(lease);
    let queue = Queue::start(Arc::clone(&cluster), false);
    let copies = |client: etcd_client::Client| async move {
        let prefix = Keys::session("/kv-test/", "c");
        let mut client = client;
        client
            .get(
                prefix,
                Some(GetOptions::new().with_prefix().with_count_only()),
            )
            .await
            .unwrap()
            .count()
    };
    let written = |n: i64| {
        let client = cluster.client.clone();
        async move {
            let start = Instant::now();
            while copies(client.clone()).await != n {
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "{n} copies never in etcd"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    queue.keep(&["c"], MessageId(1), &message("one"));
    written(1).await;
    let first = queue.fence.at().expect("the fence is up");

    // A batch in doubt: taken, sent (it waits at a member), failed.
    queue.keep(&["c"], MessageId(2), &message("two"));
    let late = {
        let (changes, ops) = queue
            .pending
            .lock()
            .take(1 << 20, Instant::now() + LINGER * 2);
        assert_eq!(changes.len(), 1, "message 2's put");
        let late = queue.fence.behind(first, ops.clone());
        queue.put_back(Batch {
            changes,
            ops: Vec::new(),
        });
        late
    };
    // Message 2 is delivered meanwhile: its removal goes (it may be
    // in etcd), and the writer goes on with another message.
    queue.delivered("c", MessageId(2));
    queue.keep(&["c"], MessageId(3), &message("three"));
    // (The writer puts a batch back itself, awake; here it is woken.)
    queue.wake.notify_one();
    written(2).await;
    let now = queue.fence.at().expect("the fence is up again");
    assert!(now > first, "the fence went up again: {first} -> {now}");

    // The late batch reaches etcd now: it does not commit.
    let answer = client.txn(late).await.unwrap();
    assert!(!answer.succeeded(), "a batch from behind the old fence");
    assert_eq!(copies(client.clone()).await, 2, "messages 1 and 3 only");
}
