//! One link to another node: opened as an MQTT 5 client of its listener
//! (logging in with the cluster's secret, kept in etcd), driven by a task
//! of its own that reconnects until the link is dropped; and what a
//! publish keeps on its way over it.

use std::sync::{Arc, Weak};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use metrics::Counter;
use router::protocol::{PublishProperties, QoS};
use rumqttc::Outgoing;
use rumqttc::v5::mqttbytes::QoS as LinkQoS;
use rumqttc::v5::mqttbytes::v5::{Packet as LinkPacket, PublishProperties as LinkProperties};
use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};
use tokio::sync::oneshot;

use super::{LINK_CLIENT_PREFIX, LINK_SESSION_EXPIRY, LINK_USERNAME, Peers};
use crate::cluster::Cluster;
use crate::cluster::confirmations::Confirmations;

/// One link, and the task that drives it (it ends when the link is dropped).
pub(super) struct Link {
    pub node_id: String,
    pub address: String,
    pub client: AsyncClient,
    pub forwarded: Counter,
    pub dropped: Counter,
    _stop: oneshot::Sender<()>,
}

impl Peers {
    /// A link to `node` at `address`, driven by a task of its own.
    pub(super) fn open(&self, node: &str, address: &str) -> Result<Link, String> {
        let (host, port) = address
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.trim_matches(['[', ']']), p.parse::<u16>().ok()?)))
            .ok_or_else(|| format!("`{address}` is not host:port"))?;
        let mut options =
            MqttOptions::new(format!("{LINK_CLIENT_PREFIX}{}", self.node_id), host, port);
        // Clean Start 1 at first: the other node may keep a session of an
        // earlier link of this node's (before a restart, or before the
        // link was closed), whose QoS 2 publishes waiting for a PUBREL this
        // link knows nothing of: it numbers its own from 1, and the router
        // would take a new publish on such an id for the old one (dropping
        // it, and delivering the old one at its PUBREL). Clean Start 0
        // once connected (see `drive`), so that what a broken connection
        // had in flight is sent again.
        options
            .set_credentials(LINK_USERNAME, self.secret.clone())
            .set_clean_start(true)
            .set_session_expiry_interval(Some(LINK_SESSION_EXPIRY))
            .set_keep_alive(Duration::from_secs(5))
            .set_max_packet_size(Some(u32::MAX >> 4))
            .set_request_channel_capacity(self.forward_queue);
        let (client, events) = AsyncClient::new(options, self.forward_queue);
        let (stop, stopped) = oneshot::channel();
        tokio::spawn(drive(
            events,
            node.to_owned(),
            address.to_owned(),
            Arc::clone(&self.confirmations),
            Arc::clone(&self.standing),
            self.me.clone(),
            stopped,
        ));
        let (forwarded, dropped) = crate::metrics::cluster_forward_counters(node);
        tracing::info!(peer = node, address, "clustering: linking to a node");
        Ok(Link {
            node_id: node.to_owned(),
            address: address.to_owned(),
            client,
            forwarded,
            dropped,
            _stop: stop,
        })
    }
}

/// The properties a publish keeps on its way to another node (the topic
/// alias was resolved on the way in; subscription identifiers are the
/// receiving subscriber's).
/// The link client's QoS for the router's.
pub(super) fn link_qos(qos: QoS) -> LinkQoS {
    match qos {
        QoS::AtMostOnce => LinkQoS::AtMostOnce,
        QoS::AtLeastOnce => LinkQoS::AtLeastOnce,
        QoS::ExactlyOnce => LinkQoS::ExactlyOnce,
    }
}

pub(super) fn link_properties(p: &PublishProperties) -> LinkProperties {
    LinkProperties {
        payload_format_indicator: p.payload_format_indicator,
        message_expiry_interval: p.message_expiry_interval,
        topic_alias: None,
        response_topic: p.response_topic.as_deref().map(str::to_owned),
        correlation_data: p.correlation_data.clone(),
        user_properties: p
            .user_properties
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        subscription_identifiers: Vec::new(),
        content_type: p.content_type.as_deref().map(str::to_owned),
    }
}

/// Drives one link: connects, sends, reconnects (backing off) until
/// `stop` fires or its sender is dropped. A link that breaks while the
/// node does not serve (its lease lost) connects again only once it
/// serves: a node whose id another process registered meanwhile (two
/// nodes given one `node_id`) would otherwise take that process's links
/// over, and be taken over by them, again and again.
async fn drive(
    mut events: EventLoop,
    peer: String,
    address: String,
    confirmations: Arc<Confirmations>,
    standing: Arc<crate::standing::Standing>,
    peers: Weak<Peers>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut connected = false;
    let mut backoff = Duration::from_millis(100);
    let set = |connected: &mut bool, now: bool| {
        if std::mem::replace(connected, now) != now {
            crate::metrics::cluster_peer_link(now);
        }
    };
    loop {
        // (Nothing else here may interrupt `poll`: it can be cut between
        // taking a publish and writing it, which then never goes.)
        let event = tokio::select! {
            _ = &mut stop => break,
            event = events.poll() => event,
        };
        match event {
            Ok(Event::Outgoing(Outgoing::Publish(pkid))) => confirmations.went_out(&peer, pkid),
            Ok(Event::Outgoing(Outgoing::AwaitAck(_))) => confirmations.held_back(&peer),
            Ok(Event::Incoming(LinkPacket::PubAck(ack))) => {
                confirmations.acknowledged(&peer, ack.pkid);
            }
            Ok(Event::Incoming(LinkPacket::PubRec(rec))) => {
                confirmations.acknowledged(&peer, rec.pkid);
            }
            Ok(Event::Incoming(LinkPacket::ConnAck(ack))) => {
                events.options.set_clean_start(false);
                confirmations.link_up(&peer, ack.session_present);
                if let Some(peers) = peers.upgrade() {
                    peers.recent.link_up(&peer);
                }
                tracing::info!(
                    peer,
                    address,
                    session_present = ack.session_present,
                    "clustering: link to a node up"
                );
                backoff = Duration::from_millis(100);
                set(&mut connected, true);
            }
            Ok(Event::Incoming(LinkPacket::Disconnect(d))) => {
                tracing::warn!(peer, address, reason = ?d.reason_code, "clustering: a node ended its link");
            }
            Ok(_) => {}
            Err(e) => {
                if connected {
                    tracing::warn!(peer, address, error = %e, "clustering: link to a node broken: reconnecting");
                    if let Some(peers) = peers.upgrade() {
                        peers.link_broke(&peer);
                    }
                } else {
                    tracing::debug!(peer, address, error = %e, "clustering: cannot link to a node yet");
                }
                set(&mut connected, false);
                confirmations.link_down(&peer);
                tokio::select! {
                    _ = &mut stop => break,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
                if !standing.serving() {
                    tracing::debug!(
                        peer,
                        "clustering: not serving: the link waits until this node serves again"
                    );
                    tokio::select! {
                        _ = &mut stop => break,
                        () = standing.serves() => {}
                    }
                }
            }
        }
    }
    set(&mut connected, false);
}

/// The cluster's secret: the one in etcd, or a new one put there if there
/// is none yet (only one of several nodes starting at once succeeds).
pub(super) async fn secret(cluster: &Cluster) -> Result<String, String> {
    let key = format!("{}secret", cluster.settings.etcd_prefix);
    let mut fresh = [0u8; 32];
    getrandom::fill(&mut fresh).map_err(|e| e.to_string())?;
    let fresh = hex::encode(fresh);
    let txn = Txn::new()
        .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
        .and_then([TxnOp::put(key.clone(), fresh.clone(), None)])
        .or_else([TxnOp::get(key, None)]);
    let mut client = cluster.client.clone();
    let response = tokio::time::timeout(cluster.settings.request_timeout, client.txn(txn))
        .await
        .map_err(|_| "etcd did not answer in time".to_owned())?
        .map_err(|e| e.to_string())?;
    if response.succeeded() {
        return Ok(fresh);
    }
    response
        .op_responses()
        .into_iter()
        .find_map(|op| match op {
            TxnOpResponse::Get(get) => get
                .kvs()
                .first()
                .and_then(|kv| kv.value_str().ok().map(str::to_owned)),
            _ => None,
        })
        .filter(|s| !s.is_empty())
        .ok_or_else(|| "the secret's key is there but empty".to_owned())
}
