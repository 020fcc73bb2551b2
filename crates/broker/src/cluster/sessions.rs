//! Persistent sessions kept in etcd: a client finds its session on
//! whichever node it connects to next.
//!
//! `<etcd_prefix>S/<client id>` = `[node id length u8][node id][the
//! session as the data directory keeps it (see `durable`: Session Expiry
//! Interval, when its connection ended, its subscriptions)]`. The node that
//! owns the client writes it at each change the router journals (CONNECT,
//! SUBSCRIBE, UNSUBSCRIBE, the connection's end) and removes it when the
//! session ends, each time in a transaction that compares the owner record
//! with its claim ([`super::ownership`]): a node that lost the client can
//! no longer write it. A CONNECT with Clean Start 1 removes it with the
//! claim.
//!
//! At a CONNECT with Clean Start 0 ([`resume`]) the node reads the owner
//! record and the session record in one transaction. The session its
//! router keeps is the current one when this node owns the client, or
//! when the record is this node's own (its lease ended and came back) or
//! not written yet. Otherwise the record replaces it (the client has been
//! on another node since: CONNACK Session Present 1, with the
//! subscriptions it had there), and without a record the router's stale
//! copy goes. The node then claims the client; the node that had it ends
//! its connection (0x8E) and discards its copy.
//!
//! What moves is the subscriptions and the expiry, and, from a node that
//! is alive, the messages queued there for the session (see
//! [`super::handover`]).
//!
//! A record nobody owns (no owner record: its node died or lost its
//! lease, and the client did not come back) is removed by [`reap`] once
//! its session would have expired: counted from when its connection
//! ended, or from when a node first found it without an owner.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock, Weak};

use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp, TxnOpResponse};
use router::{Journal, Message, MessageId, Receipt, RestoredSession, RouterHandle, SessionRecord};
use tokio::time::Instant;

use super::ownership::owner_of;
use super::{Cluster, Ownership};
use crate::clock::now_ms;
use crate::durable::format::{decode_session, encode_session};

/// The router's journal on a cluster node: sessions go to etcd (through
/// the node's [`Ownership`]) besides the data directory's journal, if any.
pub struct SessionJournal {
    data_dir: Option<Arc<dyn Journal>>,
    ownership: OnceLock<Weak<Ownership>>,
    node_id: String,
}

impl SessionJournal {
    /// Around the data directory's journal (`data_dir`), for node
    /// `node_id`.
    pub fn new(data_dir: Option<Arc<dyn Journal>>, node_id: &str) -> Arc<SessionJournal> {
        Arc::new(SessionJournal {
            data_dir,
            ownership: OnceLock::new(),
            node_id: node_id.to_owned(),
        })
    }

    /// Sessions journaled from now on go to etcd through `ownership`.
    pub fn attach(&self, ownership: &Arc<Ownership>) {
        let _ = self.ownership.set(Arc::downgrade(ownership));
    }
}

impl Journal for SessionJournal {
    fn session(&self, client: &str, session: Option<&SessionRecord>) -> Option<Receipt> {
        if let Some(ownership) = self.ownership.get().and_then(Weak::upgrade) {
            ownership.session_changed(client, session.map(|s| encode(&self.node_id, s)));
        }
        self.data_dir.as_ref()?.session(client, session)
    }

    fn retained(&self, topic: &str, message: Option<&Message>) -> Option<Receipt> {
        self.data_dir.as_ref()?.retained(topic, message)
    }

    fn queued(&self, clients: &[&str], message: &Message) -> Option<(MessageId, Receipt)> {
        self.data_dir.as_ref()?.queued(clients, message)
    }

    fn delivered(&self, client: &str, message: MessageId) {
        if let Some(journal) = &self.data_dir {
            journal.delivered(client, message);
        }
    }

    fn keeps_messages(&self) -> bool {
        self.data_dir.is_some()
    }
}

/// A session record's value.
fn encode(node_id: &str, session: &SessionRecord) -> Vec<u8> {
    // Node ids are checked at start: short, no `/` or `:`.
    let id = &node_id.as_bytes()[..node_id.len().min(255)];
    let mut value = Vec::with_capacity(1 + id.len() + 64);
    value.push(id.len() as u8);
    value.extend_from_slice(id);
    value.extend_from_slice(&encode_session(session));
    value
}

/// The node that wrote a session record, and the session.
fn decode(value: &[u8]) -> Result<(&str, SessionRecord), String> {
    let (&len, rest) = value.split_first().ok_or("empty session record")?;
    let len = usize::from(len);
    if rest.len() < len {
        return Err("session record shorter than its node id".into());
    }
    let node = std::str::from_utf8(&rest[..len]).map_err(|_| "node id not UTF-8")?;
    Ok((node, decode_session(&rest[len..])?))
}

/// Makes the router's session of `client_id` the current one before a
/// CONNECT with Clean Start 0 links (see the module's documentation);
/// `max_expiry`: `[broker] max_session_expiry_secs`. `Err`: etcd did not
/// answer (the CONNECT is refused: accepting it could lose the session).
pub async fn resume(
    ownership: &Ownership,
    router: &RouterHandle,
    client_id: &str,
    max_expiry: u32,
    timeout: std::time::Duration,
    mut client: etcd_client::Client,
) -> Result<(), String> {
    let txn = Txn::new().and_then([
        TxnOp::get(ownership.key(client_id), None),
        TxnOp::get(ownership.session_key(client_id), None),
    ]);
    let response = tokio::time::timeout(timeout, client.txn(txn))
        .await
        .map_err(|_| "etcd did not answer in time".to_owned())?
        .map_err(|e| e.to_string())?;
    let mut found = response.op_responses().into_iter().map(|op| match op {
        TxnOpResponse::Get(get) => get
            .kvs()
            .first()
            .map(|kv| (kv.mod_revision(), kv.value().to_vec())),
        _ => None,
    });
    let owner = found.next().flatten();
    let record = found.next().flatten();
    let node = ownership.node_id();
    if owner
        .as_ref()
        .is_some_and(|(revision, _)| ownership.holds(client_id, *revision))
    {
        return Ok(());
    }
    let kept_here = router.subscriptions().has_kept_session(client_id);
    let session = match record {
        None if ownership.writing(client_id) => return Ok(()),
        None => None,
        Some((_, value)) => match decode(&value) {
            Ok((writer, _)) if writer == node && owner.is_none() && kept_here => {
                return Ok(());
            }
            Ok((_, session)) => Some(session),
            Err(why) => {
                tracing::error!(
                    client_id,
                    why,
                    "clustering: a session record in etcd cannot be read: the session starts afresh"
                );
                None
            }
        },
    };
    let from = owner
        .as_ref()
        .and_then(|(_, value)| owner_of(value))
        .unwrap_or("none")
        .to_owned();
    let restored = session.and_then(|session| {
        let expires_in = crate::durable::remaining(&session, now_ms(), max_expiry)?;
        Some(RestoredSession {
            client_id: client_id.to_owned(),
            filters: session.filters,
            expires_in,
            queue_full: session.queue_full,
            waiting: Vec::new(),
        })
    });
    if restored.is_none() && !kept_here {
        return Ok(());
    }
    let from_etcd = restored.is_some();
    let replaced = router
        .replace_session(client_id, restored)
        .await
        .map_err(|e| e.to_string())?;
    tracing::info!(
        client_id,
        owner = from,
        from_etcd,
        replaced,
        "clustering: the client's session was on another node since: this node's copy replaced from etcd (or, without a record, discarded)"
    );
    Ok(())
}

/// Removes session records nobody owns once their session would have
/// expired (`max_expiry`: `[broker] max_session_expiry_secs`, 0: none),
/// every `[clustering] session_reap_interval_s`, until the cluster is
/// dropped. Every node does it; each
/// removal compares the record's revision and that no owner record
/// exists, so a client that came back keeps its session.
pub async fn reap(cluster: Weak<Cluster>, max_expiry: u32) {
    let Some((mut stop, every)) = cluster
        .upgrade()
        .map(|c| (c.stop.subscribe(), c.settings.session_reap_interval))
    else {
        return;
    };
    // Records without an owner: their revision and when they are due.
    let mut orphans: HashMap<Vec<u8>, (i64, Option<Instant>)> = HashMap::new();
    loop {
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
        let Some(cluster) = cluster.upgrade() else {
            return;
        };
        if let Err(e) = reap_once(&cluster, max_expiry, &mut orphans).await {
            tracing::debug!(
                error = e,
                "clustering: cannot look for ownerless sessions now"
            );
        }
    }
}

async fn reap_once(
    cluster: &Cluster,
    max_expiry: u32,
    orphans: &mut HashMap<Vec<u8>, (i64, Option<Instant>)>,
) -> Result<(), String> {
    let prefix = &cluster.settings.etcd_prefix;
    let (owners, records) = (format!("{prefix}C/"), format!("{prefix}S/"));
    let timeout = cluster.settings.request_timeout;
    let mut client = cluster.client.clone();
    let keys = || Some(GetOptions::new().with_prefix().with_keys_only());
    let read = async {
        let owned = client.get(owners.as_bytes(), keys()).await?;
        let kept = client.get(records.as_bytes(), keys()).await?;
        Ok::<_, etcd_client::Error>((owned, kept))
    };
    let (owned, kept) = tokio::time::timeout(timeout, read)
        .await
        .map_err(|_| "etcd did not answer in time".to_owned())?
        .map_err(|e| e.to_string())?;
    let owned: HashSet<&[u8]> = owned
        .kvs()
        .iter()
        .map(|kv| &kv.key()[owners.len()..])
        .collect();
    let now = Instant::now();
    let mut ownerless = HashMap::new();
    for kv in kept.kvs() {
        let client_id = &kv.key()[records.len()..];
        if !owned.contains(client_id) {
            ownerless.insert(client_id.to_vec(), kv.mod_revision());
        }
    }
    orphans.retain(|client, (revision, _)| ownerless.get(client) == Some(revision));
    for (client_id, revision) in ownerless {
        let due = match orphans.get(&client_id) {
            Some((_, due)) => *due,
            None => {
                // When its session expires, as its record says.
                let key = [records.as_bytes(), &client_id].concat();
                let read = client.get(key, None);
                let response = tokio::time::timeout(timeout, read)
                    .await
                    .map_err(|_| "etcd did not answer in time".to_owned())?
                    .map_err(|e| e.to_string())?;
                let Some(kv) = response.kvs().first() else {
                    continue;
                };
                let due = match decode(kv.value()) {
                    Ok((_, mut session)) => {
                        // Connected when its node went: from now.
                        let at = session.disconnected_at_ms.unwrap_or_else(now_ms);
                        session.disconnected_at_ms = Some(at);
                        crate::durable::remaining(&session, now_ms(), max_expiry)
                            .map(|left| left.map(|left| now + left))
                            .unwrap_or(Some(now))
                    }
                    Err(_) => Some(now),
                };
                orphans.insert(client_id.clone(), (kv.mod_revision(), due));
                due
            }
        };
        if due.is_none_or(|due| due > now) {
            continue;
        }
        let key = [records.as_bytes(), &client_id].concat();
        let owner = [owners.as_bytes(), &client_id].concat();
        let txn = Txn::new()
            .when([
                Compare::mod_revision(key.clone(), CompareOp::Equal, revision),
                Compare::create_revision(owner, CompareOp::Equal, 0),
            ])
            .and_then([TxnOp::delete(key, None)]);
        let done = tokio::time::timeout(timeout, client.txn(txn)).await;
        if let Ok(Ok(response)) = done
            && response.succeeded()
        {
            tracing::info!(
                client_id = %String::from_utf8_lossy(&client_id),
                "clustering: removed the session record nobody owns: its session expired"
            );
        }
        orphans.remove(&client_id);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_record_names_its_node_and_garbage_is_refused() {
        let session = SessionRecord {
            expiry: 300,
            disconnected_at_ms: Some(1_000),
            filters: vec![("a/#".into(), router::SubOptions::default())],
            queue_full: None,
        };
        let value = encode("sb2", &session);
        let (node, back) = decode(&value).unwrap();
        assert_eq!(node, "sb2");
        assert_eq!(back.expiry, 300);
        assert_eq!(back.disconnected_at_ms, Some(1_000));
        assert_eq!(back.filters.len(), 1);
        assert!(decode(&[]).is_err());
        assert!(decode(&[9, b's']).is_err());
        assert!(decode(&value[..value.len() - 1]).is_err());
    }
}
