//! Membership: each node registers itself in etcd, `<etcd_prefix>N/<node_id>`,
//! under a lease it keeps alive, and reads who else is there.
//!
//! The node serves MQTT clients while it holds the lease ([`Standing`]):
//! until the last renewal's send time plus the TTL etcd granted, less a
//! margin, so it stops before etcd lets the lease go. A node that cannot
//! renew (cut off from etcd, or paused past the TTL) disconnects its
//! clients with DISCONNECT 0x9C "use another server" and refuses CONNECT
//! (see `connection::accept`) until it has registered again under a new
//! lease. Two live nodes never hold one node id: registering compares the
//! key's creation revision with 0, and a node whose id another live node
//! holds does not start (one whose previous run was killed waits for that
//! run's lease to run out first).

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};

use super::Cluster;
use crate::standing::Standing;

/// How often a suspended node asks etcd about its lease (see `run`).
const SUSPENDED_RETRY: Duration = Duration::from_millis(250);

/// How long a suspended node waits for etcd to confirm its lease before
/// it counts it lost and sends its clients away, in TTLs past the
/// deadline. Holding them longer is safe (the node serves nothing, and a
/// lease etcd confirms never ran out), but a node cut off from etcd alone
/// should let its clients find another node soon.
const GIVE_UP_TTLS: u32 = 2;

/// How long a node id held under a lease that etcd says has run out (or
/// has less than a second left) may still be held: etcd revokes an
/// expired lease, and deletes its keys, up to its lessor's check interval
/// (500 ms) plus a raft round after it ran out, later on a loaded
/// machine. Counting it as 0 gave up after 1 s, and a node restarted
/// right after it was killed failed to start (seen in the MQTT fault
/// run).
const RUNNING_OUT: Duration = Duration::from_secs(3);

/// Why a registration did not happen.
enum Refused {
    /// etcd did not answer, or answered an error.
    Etcd(String),
    /// Another lease holds the node's key; it was granted for `granted`.
    Held { granted: Duration },
}

/// A registered node, as its record says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub node_id: String,
    /// Where the other nodes' links reach its MQTT listener (`host:port`),
    /// if it has a plain TCP one.
    pub peer_address: Option<String>,
    /// The lease its registration is under: a record put under another
    /// (an earlier run's) belongs to a node that is gone.
    pub lease: i64,
}

/// This node's registration, and the members it last saw.
pub struct Membership {
    cluster: Arc<Cluster>,
    /// `<etcd_prefix>N/`.
    prefix: Vec<u8>,
    /// `<etcd_prefix>N/<node_id>`.
    key: Vec<u8>,
    /// What the key holds: the node's MQTT listeners (JSON).
    value: Vec<u8>,
    ttl: Duration,
    standing: Arc<Standing>,
    /// The members as last read, this node included, sorted by id.
    members: tokio::sync::watch::Sender<Vec<Member>>,
    /// The node left the cluster ([`Membership::leave`]): its lease is
    /// neither renewed nor taken again.
    left: std::sync::atomic::AtomicBool,
}

impl Membership {
    /// Registers this node under a new lease; its MQTT `listeners` are
    /// recorded for the other nodes, and `peer_address`, where their links
    /// reach it. Refused if another live node holds the node id.
    pub async fn join(
        cluster: Arc<Cluster>,
        listeners: Vec<String>,
        peer_address: Option<String>,
    ) -> Result<Arc<Membership>, String> {
        let settings = &cluster.settings;
        let prefix = format!("{}N/", settings.etcd_prefix).into_bytes();
        let key = [prefix.as_slice(), settings.node_id.as_bytes()].concat();
        let value = serde_json::json!({
            "node_id": settings.node_id,
            "mqtt": listeners,
            "peer": peer_address,
            "started_ms": crate::clock::now_ms(),
        })
        .to_string()
        .into_bytes();
        let ttl = settings.lease_ttl;
        let mut membership = Membership {
            cluster,
            prefix,
            key,
            value,
            ttl,
            standing: Arc::new(Standing::until(Instant::now())),
            members: tokio::sync::watch::Sender::new(Vec::new()),
            left: std::sync::atomic::AtomicBool::new(false),
        };
        // The id may still be held by this node's previous run (killed
        // before its lease ran out): wait for that lease, once; a holder
        // still there after it is another live node.
        let since = Instant::now();
        let mut said = false;
        // The longest lease seen holding the id: a lease that ran out
        // between the read and the question says 0 (it must not shorten
        // the wait into "another live node").
        let mut longest = Duration::ZERO;
        let (lease, until) = loop {
            match membership.register().await {
                Ok(registered) => break registered,
                Err(Refused::Etcd(e)) => return Err(e),
                Err(Refused::Held { granted }) => {
                    longest = longest.max(granted);
                    let limit = longest + Duration::from_secs(1);
                    if since.elapsed() >= limit {
                        return Err(membership.held_by_another());
                    }
                    if !std::mem::replace(&mut said, true) {
                        tracing::info!(
                            node_id = membership.cluster.node_id(),
                            wait_ms = limit.as_millis() as u64,
                            "clustering: the node id is still registered (a previous run's lease?): waiting for it to run out"
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        };
        membership.standing = Arc::new(Standing::until(until));
        membership.cluster.lease.send_replace(lease);
        let membership = Arc::new(membership);
        membership.refresh_members().await;
        tracing::info!(
            node_id = membership.cluster.node_id(),
            lease_ttl_ms = ttl.as_millis() as u64,
            members = ?membership.members(),
            "clustering: joined the cluster"
        );
        tokio::spawn(run(
            Arc::downgrade(&membership),
            lease,
            membership.cluster.stop.subscribe(),
        ));
        Ok(membership)
    }

    /// Whether this node serves, as the lease says.
    pub fn standing(&self) -> Arc<Standing> {
        Arc::clone(&self.standing)
    }

    /// The lease the node is registered under now: what it records in
    /// etcd for as long as it serves goes under it, and goes with it.
    pub fn lease(&self) -> i64 {
        *self.cluster.lease.borrow()
    }

    /// The node stops normally (its clients, links and will records gone):
    /// revokes its lease, so that its registration and its claims on
    /// client ids go at once, and the other nodes adopt the sessions it
    /// kept (see `super::orphans`) and may start a node with its id.
    /// Before, they went when the lease ran out, a TTL later: what was
    /// published meanwhile for those sessions was lost. Waits at most
    /// etcd's request timeout.
    pub async fn leave(&self) {
        self.left.store(true, std::sync::atomic::Ordering::Release);
        let mut client = self.cluster.client.clone();
        let revoke = client.lease_revoke(self.lease());
        match tokio::time::timeout(self.cluster.settings.request_timeout, revoke).await {
            Ok(Ok(_)) => tracing::info!(
                node_id = self.cluster.node_id(),
                "clustering: stopping: left the cluster (membership lease revoked: the other nodes adopt the sessions kept here)"
            ),
            _ => tracing::warn!(
                node_id = self.cluster.node_id(),
                "clustering: stopping: etcd did not revoke the membership lease: this node's registration and claims go when it runs out"
            ),
        }
    }

    /// Whether the node left the cluster.
    pub fn left(&self) -> bool {
        self.left.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The node ids registered, this one's included, sorted.
    pub fn members(&self) -> Vec<String> {
        let members = self.members.borrow();
        members.iter().map(|m| m.node_id.clone()).collect()
    }

    /// The members registered, this one included, as they change (read
    /// after each renewal).
    pub fn watch(&self) -> tokio::sync::watch::Receiver<Vec<Member>> {
        self.members.subscribe()
    }

    /// A new lease and the node's key under it, if no other lease holds
    /// the key; the lease and until when the node may serve.
    async fn register(&self) -> Result<(i64, Instant), Refused> {
        let mut client = self.cluster.client.clone();
        let timeout = self.cluster.settings.request_timeout;
        let ttl_s = self.ttl.as_secs().max(1) as i64;
        let sent = Instant::now();
        let grant = tokio::time::timeout(timeout, client.lease_grant(ttl_s, None))
            .await
            .map_err(|_| Refused::Etcd("etcd did not answer in time".to_owned()))?
            .map_err(|e| Refused::Etcd(e.to_string()))?;
        let lease = grant.id();
        let txn = Txn::new()
            .when([Compare::create_revision(
                self.key.clone(),
                CompareOp::Equal,
                0,
            )])
            .and_then([TxnOp::put(
                self.key.clone(),
                self.value.clone(),
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(self.key.clone(), None)]);
        let done = tokio::time::timeout(timeout, client.txn(txn))
            .await
            .map_err(|_| "etcd did not answer in time".to_owned())
            .and_then(|r| r.map_err(|e| e.to_string()));
        let response = match done {
            Ok(response) if response.succeeded() => {
                return Ok((lease, sent + self.serving_for(grant.ttl())));
            }
            Ok(response) => response,
            Err(e) => {
                let _ = tokio::time::timeout(timeout, client.lease_revoke(lease)).await;
                return Err(Refused::Etcd(e));
            }
        };
        let _ = tokio::time::timeout(timeout, client.lease_revoke(lease)).await;
        // Held: by how long a lease, as far as etcd says.
        let holder = response.op_responses().into_iter().find_map(|op| match op {
            etcd_client::TxnOpResponse::Get(get) => get.kvs().first().map(|kv| kv.lease()),
            _ => None,
        });
        let granted = match holder {
            Some(holder) if holder != 0 => {
                let asked = client.lease_time_to_live(holder, None);
                match tokio::time::timeout(timeout, asked).await {
                    // Less than a second left (etcd says 0: whole
                    // seconds), or ran out meanwhile (-1): the key goes
                    // when etcd revokes the lease, which may be a while
                    // after.
                    Ok(Ok(ttl)) if ttl.ttl() <= 0 => RUNNING_OUT,
                    Ok(Ok(ttl)) => Duration::from_secs(ttl.granted_ttl().max(0) as u64),
                    _ => self.ttl,
                }
            }
            _ => self.ttl,
        };
        Err(Refused::Held { granted })
    }

    /// Why another node holds this node's id: said once the holder's
    /// lease had time to run out.
    fn held_by_another(&self) -> String {
        format!(
            "node id {:?} is registered by another live node (etcd key {}): each node needs its own [clustering] node_id",
            self.cluster.node_id(),
            String::from_utf8_lossy(&self.key)
        )
    }

    /// How long after a renewal's send the node may serve, for a lease of
    /// `ttl_s` seconds: less a margin, so it stops before etcd lets go.
    fn serving_for(&self, ttl_s: i64) -> Duration {
        let ttl = Duration::from_secs(ttl_s.max(0) as u64);
        let margin = (ttl / 5).clamp(Duration::from_millis(200), Duration::from_secs(1));
        ttl.saturating_sub(margin)
    }

    async fn refresh_members(&self) {
        let mut client = self.cluster.client.clone();
        let list = client.get(self.prefix.clone(), Some(GetOptions::new().with_prefix()));
        if let Ok(Ok(response)) =
            tokio::time::timeout(self.cluster.settings.request_timeout, list).await
        {
            let mut members: Vec<Member> = response
                .kvs()
                .iter()
                .map(|kv| Member {
                    node_id: String::from_utf8_lossy(&kv.key()[self.prefix.len()..]).into_owned(),
                    peer_address: serde_json::from_slice::<serde_json::Value>(kv.value())
                        .ok()
                        .and_then(|v| v.get("peer")?.as_str().map(str::to_owned)),
                    lease: kv.lease(),
                })
                .collect();
            members.sort_by(|a, b| a.node_id.cmp(&b.node_id));
            crate::metrics::cluster_members(members.len());
            self.members.send_if_modified(|current| {
                let changed = *current != members;
                *current = members;
                changed
            });
        }
    }
}

/// Keeps `lease` alive; when it is lost, says so and registers again.
/// Past the serving deadline without a renewal the node is suspended (see
/// `standing.rs`): it keeps asking etcd about the same lease, more often,
/// for up to [`GIVE_UP_TTLS`] TTLs; a renewal confirmed then resumes it.
/// Ends when the membership or the cluster is dropped.
async fn run(
    membership: Weak<Membership>,
    mut lease: i64,
    mut stop: tokio::sync::watch::Receiver<()>,
) {
    loop {
        let Some(m) = membership.upgrade() else {
            return;
        };
        let every = (m.ttl / 4).clamp(Duration::from_millis(250), Duration::from_secs(2));
        let timeout = m.cluster.settings.request_timeout.min(every * 2);
        let (ttl, standing) = (m.ttl, Arc::clone(&m.standing));
        let mut client = m.cluster.client.clone();
        drop(m);
        // Renew until the lease is lost: etcd says so, or it did not
        // answer for GIVE_UP_TTLS TTLs after the deadline.
        let mut renewing = None;
        let mut suspended = false;
        loop {
            let wait = if standing.serving() {
                every
            } else {
                SUSPENDED_RETRY
            };
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                _ = stop.changed() => return,
            }
            let Some(m) = membership.upgrade() else {
                return;
            };
            if m.left() {
                return;
            }
            if let Some(overdue) = standing.overdue() {
                if overdue >= ttl * GIVE_UP_TTLS {
                    break;
                }
                if !std::mem::replace(&mut suspended, true) {
                    crate::metrics::cluster_suspended();
                    tracing::warn!(
                        node_id = m.cluster.node_id(),
                        "clustering: the membership lease was not renewed in time (etcd electing a leader, or unreachable): clients wait until etcd confirms it"
                    );
                }
            }
            if renewing.is_none() {
                let opened = tokio::time::timeout(timeout, client.lease_keep_alive(lease)).await;
                let Ok(Ok(stream)) = opened else { continue };
                renewing = Some(stream);
            }
            let Some((keeper, acks)) = renewing.as_mut() else {
                continue;
            };
            let sent = Instant::now();
            let renewed = async {
                keeper.keep_alive().await.ok()?;
                acks.message().await.ok()?
            };
            match tokio::time::timeout(timeout, renewed).await {
                Ok(Some(ack)) if ack.ttl() > 0 => {
                    m.standing.serve_until(sent + m.serving_for(ack.ttl()));
                    if std::mem::replace(&mut suspended, false) {
                        tracing::info!(
                            node_id = m.cluster.node_id(),
                            "clustering: etcd confirmed the membership lease: clients go on"
                        );
                    }
                    m.refresh_members().await;
                }
                // etcd says the lease is gone.
                Ok(Some(_)) => break,
                // No answer: open the stream again next time; the deadline
                // decides.
                _ => renewing = None,
            }
        }
        let Some(m) = membership.upgrade() else {
            return;
        };
        // Revoked by the node itself, as it stops.
        if m.left() {
            return;
        }
        m.standing.lost();
        crate::metrics::cluster_lease_lost();
        tracing::warn!(
            node_id = m.cluster.node_id(),
            "clustering: lost the membership lease (cut off from etcd, or paused past its TTL): clients are sent to another node (DISCONNECT 0x9C) and CONNECT is refused until this node registers again"
        );
        drop(m);
        // The old lease goes now (if etcd has not let it go already), then
        // a new registration.
        let _ = tokio::time::timeout(timeout, client.lease_revoke(lease)).await;
        let mut held_said = false;
        lease = loop {
            let Some(m) = membership.upgrade() else {
                return;
            };
            match m.register().await {
                Ok((lease, until)) => {
                    m.cluster.lease.send_replace(lease);
                    m.standing.serve_until(until);
                    m.refresh_members().await;
                    tracing::info!(
                        node_id = m.cluster.node_id(),
                        members = ?m.members(),
                        "clustering: registered again: serving clients"
                    );
                    break lease;
                }
                Err(refused) => {
                    match refused {
                        // Said once per loss: another process registered
                        // this node's id meanwhile (two nodes given one
                        // id), and this node serves nothing until that one
                        // goes.
                        Refused::Held { .. } if !std::mem::replace(&mut held_said, true) => {
                            tracing::warn!(
                                error = m.held_by_another(),
                                "clustering: cannot register again: this node serves no client and links to no node until the other one's lease ends"
                            );
                        }
                        Refused::Held { .. } => {}
                        Refused::Etcd(why) => {
                            tracing::debug!(error = why, "clustering: cannot register yet");
                        }
                    }
                    drop(m);
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(500)) => {}
                        _ = stop.changed() => return,
                    }
                }
            }
        };
    }
}
