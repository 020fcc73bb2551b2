//! The wills of clients whose node died.
//!
//! A node publishes the wills of its own clients (see `crate::will`), and
//! they reach every node (see [`super::peers`]). When the node dies, its
//! clients' wills are in etcd: `<etcd_prefix>W/<client id>` = `[the lease
//! of the node's membership, i64 BE][delay: min(Will Delay Interval,
//! Session Expiry Interval), seconds, u32 BE][the will as the PUBLISH it
//! becomes, in the data directory's message format]`. The claim that
//! records a CONNECT's node ([`super::ownership`]) puts it in the same
//! transaction (and removes an older one when the CONNECT has no will),
//! and the node removes it when the connection ends: from then on its own
//! will module has the will.
//!
//! A record whose lease is no member's is a dead node's (killed, or cut
//! off past its lease). Every node looks for such records when a member
//! leaves or comes back under a new lease, and every [`SCAN`]. After the
//! will's delay, counted from when it was found, a node removes the
//! record in a transaction that compares its revision, and publishes the
//! will only if it removed it: a client that connected again meanwhile
//! (its claim changed the record) gets no will, and of several nodes that
//! found the record one publishes it. At most once: a node that dies
//! between removing and publishing loses the will.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp};
use router::protocol::{LastWill, LastWillProperties};
use tokio::time::Instant;

use super::Cluster;
use super::membership::Member;
use crate::clock::now_ms;
use crate::durable::format::{decode_message, encode_message};
use crate::publisher::Publisher;

/// How often a node looks for dead nodes' wills besides membership
/// changes (a node that comes back quickly under the same id may not show
/// as a change).
const SCAN: Duration = Duration::from_secs(10);

/// A will record's value, but for the lease (put by the claim), of a
/// connection with `will` and Session Expiry Interval `session_expiry`.
pub fn encode(
    will: &LastWill,
    properties: Option<&LastWillProperties>,
    session_expiry: u32,
) -> Option<Vec<u8>> {
    let delay = crate::will::delay(properties, session_expiry);
    // Packet id 1: the encoder refuses 0 at QoS 1/2 (the node that
    // publishes it gives it its own).
    let (publish, properties) = crate::publisher::will_publish(will, properties.cloned(), 1);
    let message = encode_message(&publish, properties.as_ref(), now_ms())?;
    let delay = u32::try_from(delay.as_secs()).unwrap_or(u32::MAX);
    let mut value = Vec::with_capacity(4 + message.len());
    value.extend_from_slice(&delay.to_be_bytes());
    value.extend_from_slice(&message);
    Some(value)
}

/// A will record under `lease`.
pub fn with_lease(lease: i64, encoded: &[u8]) -> Vec<u8> {
    [&lease.to_be_bytes()[..], encoded].concat()
}

/// A will record's lease, delay and message (`None`: unreadable).
fn decode(value: &[u8]) -> Option<(i64, Duration, &[u8])> {
    let lease = i64::from_be_bytes(value.get(..8)?.try_into().ok()?);
    let delay = u32::from_be_bytes(value.get(8..12)?.try_into().ok()?);
    Some((lease, Duration::from_secs(u64::from(delay)), &value[12..]))
}

/// A dead node's will found, to publish at `due`.
struct Found {
    revision: i64,
    due: Instant,
}

/// Looks for dead nodes' wills and publishes them (see the module's
/// documentation), until the cluster is dropped.
pub async fn run(
    cluster: Weak<Cluster>,
    mut members: tokio::sync::watch::Receiver<Vec<Member>>,
    publisher: Arc<Publisher>,
) {
    let Some(mut stop) = cluster.upgrade().map(|c| c.stop.subscribe()) else {
        return;
    };
    let mut found: HashMap<String, Found> = HashMap::new();
    let mut next_scan = Instant::now();
    loop {
        let next_due = found.values().map(|f| f.due).min();
        let wake = next_due.map_or(next_scan, |due| due.min(next_scan));
        tokio::select! {
            () = tokio::time::sleep_until(wake) => {}
            changed = members.changed() => {
                if changed.is_err() {
                    return;
                }
                next_scan = Instant::now();
            }
            _ = stop.changed() => return,
        }
        let Some(cluster) = cluster.upgrade() else {
            return;
        };
        if Instant::now() >= next_scan {
            let leases: Vec<i64> = members.borrow().iter().map(|m| m.lease).collect();
            if scan(&cluster, &leases, &mut found).await {
                next_scan = Instant::now() + SCAN;
            } else {
                next_scan = Instant::now() + Duration::from_secs(1);
            }
        }
        let now = Instant::now();
        let due: Vec<(String, i64)> = found
            .iter()
            .filter(|(_, f)| f.due <= now)
            .map(|(client, f)| (client.clone(), f.revision))
            .collect();
        for (client_id, revision) in due {
            found.remove(&client_id);
            publish(&cluster, &publisher, &client_id, revision).await;
        }
    }
}

/// Reads the will records and notes those of dead nodes (`leases`: the
/// members' leases); `false` where etcd did not answer.
async fn scan(cluster: &Cluster, leases: &[i64], found: &mut HashMap<String, Found>) -> bool {
    let prefix = format!("{}W/", cluster.settings.etcd_prefix);
    let mut client = cluster.client.clone();
    let read = client.get(prefix.as_bytes(), Some(GetOptions::new().with_prefix()));
    let Ok(Ok(response)) = tokio::time::timeout(cluster.settings.request_timeout, read).await
    else {
        return false;
    };
    let now = Instant::now();
    let mut seen = Vec::new();
    for kv in response.kvs() {
        let Ok(client_id) = std::str::from_utf8(&kv.key()[prefix.len()..]) else {
            continue;
        };
        let Some((lease, delay, _)) = decode(kv.value()) else {
            continue;
        };
        if leases.contains(&lease) {
            continue;
        }
        seen.push(client_id.to_owned());
        let known = found
            .get(client_id)
            .is_some_and(|f| f.revision == kv.mod_revision());
        if !known {
            tracing::info!(
                client_id,
                delay_s = delay.as_secs(),
                "clustering: the node of a client with a will is gone: its will goes out after its delay"
            );
            found.insert(
                client_id.to_owned(),
                Found {
                    revision: kv.mod_revision(),
                    due: now + delay,
                },
            );
        }
    }
    // Records gone (published by another node, or the client is back).
    found.retain(|client, _| seen.contains(client));
    true
}

/// Removes `client_id`'s will record if it is still the one at `revision`
/// and, if this node removed it, publishes the will.
async fn publish(cluster: &Cluster, publisher: &Publisher, client_id: &str, revision: i64) {
    let key = format!("{}W/{client_id}", cluster.settings.etcd_prefix);
    let txn = Txn::new()
        .when([Compare::mod_revision(
            key.clone(),
            CompareOp::Equal,
            revision,
        )])
        .and_then([TxnOp::get(key.clone(), None), TxnOp::delete(key, None)]);
    let mut client = cluster.client.clone();
    let Ok(Ok(response)) =
        tokio::time::timeout(cluster.settings.request_timeout, client.txn(txn)).await
    else {
        // Not removed here: the next scan finds it again.
        return;
    };
    if !response.succeeded() {
        return;
    }
    let value = response.op_responses().into_iter().find_map(|op| match op {
        etcd_client::TxnOpResponse::Get(get) => get.kvs().first().map(|kv| kv.value().to_vec()),
        _ => None,
    });
    let Some(message) = value.as_deref().and_then(decode).map(|(_, _, m)| m) else {
        return;
    };
    match decode_message(message, now_ms()) {
        Ok(Some(message)) => {
            tracing::info!(
                client_id,
                "clustering: published the will of a client whose node is gone"
            );
            crate::metrics::dead_node_will_published();
            publisher.publish_as_client(message.publish, message.properties);
        }
        Ok(None) => tracing::info!(client_id, "clustering: a dead node's will expired"),
        Err(why) => tracing::error!(client_id, why, "clustering: a will record cannot be read"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_will_record_keeps_its_lease_delay_and_message() {
        let will = LastWill {
            topic: "w/t".into(),
            message: "gone".into(),
            qos: router::protocol::QoS::AtLeastOnce,
            retain: false,
        };
        let properties = LastWillProperties {
            delay_interval: Some(7),
            payload_format_indicator: None,
            message_expiry_interval: None,
            content_type: None,
            response_topic: None,
            correlation_data: None,
            user_properties: Vec::new(),
        };
        let encoded = encode(&will, Some(&properties), 60).unwrap();
        let value = with_lease(42, &encoded);
        let (lease, delay, message) = decode(&value).unwrap();
        assert_eq!((lease, delay), (42, Duration::from_secs(7)));
        let message = decode_message(message, now_ms()).unwrap().unwrap();
        assert_eq!(&message.publish.topic[..], b"w/t");
        assert_eq!(&message.publish.payload[..], b"gone");
        assert!(decode(&value[..11]).is_none());
    }
}
