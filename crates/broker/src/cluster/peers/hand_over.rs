//! Handing a moved session's queued messages to the node it moved to,
//! over the link to that node (see `crate::cluster::handover` for the
//! session's side).

use std::time::Duration;

use router::protocol::{Publish, PublishProperties};
use rumqttc::v5::AsyncClient;
use rumqttc::v5::mqttbytes::QoS as LinkQoS;
use rumqttc::v5::mqttbytes::v5::PublishProperties as LinkProperties;

use super::Peers;
use super::link::{link_properties, link_qos};

/// How long a hand-over waits for room on a link before it gives up.
const HANDOVER_PATIENCE: Duration = Duration::from_secs(5);

impl Peers {
    /// Sends `node` the messages queued here for `client_id`'s session,
    /// which moved there: each with the User Property
    /// [`crate::publisher::HANDOVER`] naming the client, which the other
    /// node delivers to that client alone; then, with none or all of them
    /// sent, a publish marked [`crate::publisher::HANDOVER_DONE`], which
    /// tells the client's connection there that what its router gives may
    /// follow. Waits for room on the link; returns how many messages it
    /// took (none without a link to `node`).
    pub async fn hand_over(
        &self,
        node: &str,
        client_id: &str,
        messages: Vec<(Publish, Option<PublishProperties>)>,
    ) -> usize {
        let Some(client) = self
            .links
            .read()
            .iter()
            .find(|l| l.node_id == node)
            .map(|l| l.client.clone())
        else {
            return 0;
        };
        let mut sent = 0;
        let mut whole = true;
        for (publish, properties) in messages {
            let Ok(topic) = std::str::from_utf8(&publish.topic) else {
                continue;
            };
            let mut properties = properties.as_ref().map(link_properties).unwrap_or_default();
            properties
                .user_properties
                .push((crate::publisher::HANDOVER.to_owned(), client_id.to_owned()));
            if publish.retain {
                properties
                    .user_properties
                    .push((crate::publisher::HANDOVER_RETAIN.to_owned(), "1".to_owned()));
            }
            let qos = link_qos(publish.qos);
            if !self
                .hand_one(&client, node, topic, qos, publish.payload, properties)
                .await
            {
                whole = false;
                break;
            }
            sent += 1;
        }
        if whole {
            let mut properties = LinkProperties::default();
            properties.user_properties.push((
                crate::publisher::HANDOVER_DONE.to_owned(),
                client_id.to_owned(),
            ));
            let topic = crate::publisher::HANDOVER_DONE_TOPIC;
            let payload = bytes::Bytes::new();
            self.hand_one(
                &client,
                node,
                topic,
                LinkQoS::AtLeastOnce,
                payload,
                properties,
            )
            .await;
        }
        sent
    }

    /// Publishes one message of a handover on the link to `node`, in the
    /// confirmations' order (nobody waits for them); a full queue is
    /// waited for, [`HANDOVER_PATIENCE`] at most. `false`: not taken.
    async fn hand_one(
        &self,
        client: &AsyncClient,
        node: &str,
        topic: &str,
        qos: LinkQoS,
        payload: bytes::Bytes,
        properties: LinkProperties,
    ) -> bool {
        let mut full_since = None;
        loop {
            let taken = self.confirmations.with(|state| {
                let published = client.try_publish_with_properties(
                    topic,
                    qos,
                    false,
                    payload.clone(),
                    properties.clone(),
                );
                published
                    .is_ok()
                    .then(|| state.handed(node, None))
                    .is_some()
            });
            if taken {
                return true;
            }
            let since = *full_since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() > HANDOVER_PATIENCE {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
