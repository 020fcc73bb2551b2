use super::*;

const ALL: usize = 1 << 20;

fn pending() -> Pending {
    Pending::new(Keys {
        etcd_prefix: "/p/".into(),
        own: "n/r.".into(),
    })
}

fn v(s: &str) -> Arc<Vec<u8>> {
    Arc::new(s.as_bytes().to_vec())
}

/// The keys of a batch's operations, and whether each is a put.
fn written(batch: &(Vec<Change>, Vec<TxnOp>)) -> Vec<(String, bool)> {
    batch
        .0
        .iter()
        .map(|c| match c {
            Change::Put(put) => {
                let key = pending().keys.key(&put.client, put.number);
                (String::from_utf8(key).unwrap(), true)
            }
            Change::Now(write) => (
                String::from_utf8(write.key.clone()).unwrap(),
                write.value.is_some(),
            ),
        })
        .collect()
}

#[test]
fn keys_name_the_client_by_length_then_the_node_and_run() {
    assert_eq!(
        pending().keys.key("a/b", 26),
        b"/p/Q/3:a/b/n/r.000000000000001a"
    );
    assert!(
        !pending()
            .keys
            .key("a/b", 1)
            .starts_with(&Keys::session("/p/", "a"))
    );
}

#[test]
fn a_message_waits_before_it_is_written_and_goes_unwritten_if_delivered() {
    let t = Instant::now();
    let mut p = pending();
    p.put("c", 1, v("one"), t);
    p.put("c", 2, v("two"), t);
    assert!(p.take(ALL, t).0.is_empty(), "not due yet");
    assert_eq!(p.next_due(), Some(t + LINGER));
    assert!(!p.delivered("c", 1), "nothing to write for it");
    let batch = p.take(ALL, t + LINGER);
    assert_eq!(
        written(&batch),
        [("/p/Q/1:c/n/r.0000000000000002".into(), true)]
    );
    // Its put left: the removal is a write, at once.
    assert!(p.delivered("c", 2));
    let batch = p.take(ALL, t + LINGER);
    assert_eq!(
        written(&batch),
        [("/p/Q/1:c/n/r.0000000000000002".into(), false)]
    );
    assert!(p.take(ALL, t + LINGER * 2).0.is_empty());
    assert_eq!(p.next_due(), None);
    assert_eq!(p.count("c"), 0);
}

#[test]
fn a_message_never_kept_costs_nothing_when_delivered() {
    let mut p = pending();
    assert!(!p.delivered("c", 7));
    assert_eq!(p.len(), 0);
}

#[test]
fn a_failed_put_goes_again_unless_delivered_meanwhile() {
    let t = Instant::now();
    let later = t + LINGER;
    let mut p = pending();
    p.put("c", 1, v("one"), t);
    p.put("c", 2, v("two"), t);
    let (failed, _) = p.take(ALL, later);
    assert_eq!(failed.len(), 2);
    // Delivered while its put was on its way, which then failed.
    assert!(p.delivered("c", 1));
    p.put_back(failed, later);
    let batch = p.take(ALL, later);
    assert_eq!(
        written(&batch),
        [
            ("/p/Q/1:c/n/r.0000000000000001".into(), false),
            ("/p/Q/1:c/n/r.0000000000000002".into(), true),
        ]
    );
}

#[test]
fn a_removal_does_not_wait_behind_puts_not_due() {
    let t = Instant::now();
    let mut p = pending();
    p.put("c", 1, v("one"), t);
    p.take(ALL, t + LINGER);
    p.put("c", 2, v("two"), t + LINGER);
    assert!(p.delivered("c", 1));
    assert!(p.next_due().unwrap() <= Instant::now(), "due at once");
    assert_eq!(
        written(&p.take(ALL, t + LINGER)),
        [("/p/Q/1:c/n/r.0000000000000001".into(), false)],
        "the removal, not the put due later"
    );
}

#[test]
fn a_qos2_messages_copy_is_marked_before_it_is_sent() {
    let t = Instant::now();
    let mut p = pending();
    p.put("c", 1, v("one"), t);
    p.put("c", 2, v("two"), t);
    p.put("c", 3, v("three"), t);
    // Sent before its put left: nothing is written, nothing to mark.
    assert!(p.sending("c", 1).is_none());
    let batch = p.take(ALL, t + LINGER);
    assert_eq!(written(&batch).len(), 2, "2 and 3 written");
    // Sent after: its copy's key, for the caller to mark; the mark
    // goes first, and word once etcd has it.
    let key = p.sending("c", 2).expect("a copy to mark");
    assert_eq!(key, b"/p/Q/1:c/n/r.0000000000000002");
    let mut heard = p.mark_waited(key.clone(), b"marked".to_vec());
    assert!(heard.try_recv().is_err(), "not before etcd has it");
    let batch = p.take(ALL, t + LINGER);
    assert_eq!(
        written(&batch),
        [("/p/Q/1:c/n/r.0000000000000002".into(), true)],
        "the mark, a put"
    );
    batch.0.into_iter().for_each(Change::done);
    assert_eq!(heard.try_recv(), Ok(()));
    // Its PUBREC writes nothing (its PUBREL removes the copy, see
    // `Queue::releasing`); 3 is still kept.
    assert!(!p.delivered("c", 2));
    assert_eq!(p.count("c"), 1);
    let mut gone = p.remove_waited(key);
    let batch = p.take(ALL, t + LINGER);
    assert_eq!(
        written(&batch),
        [("/p/Q/1:c/n/r.0000000000000002".into(), false)]
    );
    batch.0.into_iter().for_each(Change::done);
    assert_eq!(gone.try_recv(), Ok(()));
    assert!(p.sending("c", 9).is_none(), "never kept here");
}

#[test]
fn a_session_handed_over_gives_its_copies_and_makes_no_more() {
    let t = Instant::now();
    let mut p = pending();
    p.put("c", 1, v("one"), t);
    p.put("c", 2, v("two"), t);
    p.take(ALL, t + LINGER);
    p.put("c", 3, v("three"), t + LINGER);
    p.put("d", 4, v("four"), t);
    let copies = p.hand_over("c");
    assert_eq!(
        copies,
        [
            (1, b"/p/Q/1:c/n/r.0000000000000001".to_vec()),
            (2, b"/p/Q/1:c/n/r.0000000000000002".to_vec()),
        ],
        "the copies written"
    );
    assert_eq!(p.count("c"), 0);
    assert_eq!(
        written(&p.take(ALL, t + LINGER * 2)),
        [("/p/Q/1:d/n/r.0000000000000004".into(), true)],
        "3's put is not made; d's is"
    );
}

/// A put whose batch failed may still commit: a message sent after
/// that waits for its removal, and a delivered one gets one, whether
/// or not the put went again.
#[test]
fn a_failed_put_still_counts_as_written() {
    let t = Instant::now();
    let mut p = pending();
    for n in 1..=3 {
        p.put("c", n, v("m"), t);
    }
    let (failed, _) = p.take(ALL, t + LINGER);
    p.put_back(failed, t + LINGER);
    // QoS 2, before its put went again: a copy to mark (removed here).
    let key = p.sending("c", 1).expect("1 may be in etcd");
    p.remove(key);
    // QoS 1, delivered: a removal.
    assert!(p.delivered("c", 2), "2 may be in etcd");
    let (batch, _) = p.take(ALL, t + LINGER);
    assert_eq!(
        written(&(batch, Vec::new())),
        [
            ("/p/Q/1:c/n/r.0000000000000001".into(), false),
            ("/p/Q/1:c/n/r.0000000000000002".into(), false),
            ("/p/Q/1:c/n/r.0000000000000003".into(), true),
        ],
        "1 and 2 removed, 3 written again"
    );
    // 3 went again: delivered, it is removed as any written message.
    assert!(p.delivered("c", 3));
    assert_eq!(p.count("c"), 0);
}

#[test]
fn a_failed_removal_goes_again_and_is_still_waited_for() {
    let mut p = pending();
    let mut heard = p.remove_waited(b"k".to_vec());
    let now = Instant::now();
    let (failed, _) = p.take(ALL, now);
    p.put_back(failed, now);
    assert!(heard.try_recv().is_err());
    let (batch, _) = p.take(ALL, now);
    assert_eq!(batch.len(), 1);
    batch.into_iter().for_each(Change::done);
    assert_eq!(heard.try_recv(), Ok(()));
}

#[test]
fn a_batch_writes_no_key_twice() {
    let mut p = pending();
    p.remove(b"k".to_vec());
    p.remove(b"k".to_vec());
    let now = Instant::now();
    assert_eq!(p.take(ALL, now).0.len(), 1);
    assert_eq!(p.take(ALL, now).0.len(), 1);
}

#[test]
fn a_batch_is_bounded_in_operations_and_bytes() {
    let t = Instant::now();
    let mut p = pending();
    for n in 0..200 {
        p.put("c", n, v("0123456789"), t);
    }
    let due = t + LINGER;
    assert_eq!(p.take(ALL, due).0.len(), BATCH_OPS);
    assert_eq!(p.take(300, due).0.len(), 2, "(10 + 128) bytes each");
    assert_eq!(p.take(1, due).0.len(), 1, "one at least");
    assert_eq!(p.count("c"), 200);
}

#[test]
fn a_refusal_is_told_once_until_a_message_is_kept_again() {
    let mut p = pending();
    p.put("c", 1, v("1"), Instant::now());
    assert!(p.refused("c"));
    assert!(!p.refused("c"), "not again");
    assert!(!p.refused("c"));
    p.put("c", 2, v("2"), Instant::now());
    assert!(p.refused("c"), "again after one was kept");
    assert!(p.refused("new") && !p.refused("new") && !p.refused("other"));
}

#[test]
fn an_ended_sessions_puts_do_not_leave() {
    let t = Instant::now();
    let mut p = pending();
    p.put("a", 1, v("1"), t);
    p.put("ab", 2, v("2"), t);
    p.forget("a");
    assert_eq!(
        written(&p.take(ALL, t + LINGER)),
        [("/p/Q/2:ab/n/r.0000000000000002".into(), true)]
    );
}
