use super::*;

fn peers() -> Peers {
    Peers {
        node_id: "sb1".into(),
        secret: String::new(),
        forward_queue: 1,
        links: RwLock::new(Vec::new()),
        inbound: parking_lot::Mutex::new(HashMap::new()),
        linked: Arc::new(tokio::sync::Notify::new()),
        joined: std::sync::atomic::AtomicBool::new(false),
        confirmations: Arc::new(Confirmations::default()),
        standing: Arc::new(crate::standing::Standing::always()),
        stamps: Arc::new(Stamps::new("sb1", 1)),
        recent: Arc::new(Recent::new(0, Duration::from_secs(1))),
        me: Weak::new(),
    }
}

fn member(node_id: &str) -> Member {
    Member {
        node_id: node_id.into(),
        peer_address: Some("127.0.0.1:1883".into()),
        lease: 1,
    }
}

/// A link accepted before the node's last stop was sent away with it:
/// it does not count as linked again; one accepted since does, and a
/// link that ends is no longer counted.
#[test]
fn only_links_accepted_since_the_last_stop_count() {
    let p = peers();
    let members = [member("sb1"), member("sb2"), member("sb3")];
    assert_eq!(p.not_linked(&members, 0), ["sb2", "sb3"]);
    p.inbound_link("sb2", 10, 0, true);
    p.inbound_link("sb3", 11, 0, true);
    assert!(p.not_linked(&members, 0).is_empty());
    // The node stopped serving (epoch 1): the old links do not count.
    assert_eq!(p.not_linked(&members, 1), ["sb2", "sb3"]);
    p.inbound_link("sb2", 12, 1, true);
    assert_eq!(p.not_linked(&members, 1), ["sb3"]);
    // The old link of sb2 ends after its new one came: still linked.
    p.inbound_link("sb2", 10, 0, false);
    assert_eq!(p.not_linked(&members, 1), ["sb3"]);
    p.inbound_link("sb2", 12, 1, false);
    assert_eq!(p.not_linked(&members, 1), ["sb2", "sb3"]);
}
