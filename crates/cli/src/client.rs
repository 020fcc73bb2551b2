//! A state store client over MQTT 5 (rumqttc), speaking only the public
//! protocol (see `../shared/PROTOCOL.md`): requests on the v1 request topic
//! with a Response Topic, Correlation Data and `__ts`; answers matched by
//! correlation; KEYNOTIFY notifications on the client's own topic.
//!
//! Nothing here is statebroker-specific, so the CLI works against a real
//! Azure IoT Operations broker too.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{ConnectReturnCode, Packet, Publish, PublishProperties};
use rumqttc::v5::{AsyncClient, ConnectionError, Event, EventLoop, MqttOptions};
use statestore::resp3::{Reply, encode_request, parse_reply};
use tokio::sync::{mpsc, oneshot};

/// The v1 request topic.
pub const REQUEST_TOPIC: &str = "statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke";
const NOTIFY_PREFIX: &str = "clients/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8";

/// Why a command did not get an answer.
#[derive(Debug)]
pub enum Failure {
    /// Nothing within the timeout.
    Timeout(&'static str),
    /// The connection could not be made or was lost.
    Connection(String),
    /// The answer was not RESP3.
    Protocol(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Timeout(what) => write!(f, "no answer within the timeout ({what})"),
            Failure::Connection(why) => write!(f, "{why}"),
            Failure::Protocol(why) => write!(f, "unreadable answer: {why}"),
        }
    }
}

/// How to reach the broker.
#[derive(Debug, Clone)]
pub struct Target {
    /// Host name or address.
    pub host: String,
    /// Port.
    pub port: u16,
    /// MQTT client id (also the caller the store sees).
    pub client_id: String,
    /// Username and password.
    pub login: Option<(String, String)>,
    /// How long to wait for the connection and for each answer.
    pub timeout: Duration,
    /// TLS, if asked for.
    pub tls: Option<crate::tls::TlsOptions>,
}

/// One answer: the RESP3 reply, the version (`__ts`) and every user property.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The reply.
    pub reply: Reply,
    /// `__ts`, the key's version or the store's clock.
    pub version: Option<String>,
    /// All user properties, in order.
    pub properties: Vec<(String, String)>,
}

/// A key-change notification.
#[derive(Debug, Clone)]
pub struct Notification {
    /// The key that changed.
    pub key: Vec<u8>,
    /// `Some(value)` for a SET, `None` for a delete or expiry.
    pub value: Option<Vec<u8>>,
    /// The key's version.
    pub version: Option<String>,
}

type Waiting = HashMap<Bytes, oneshot::Sender<Publish>>;

/// A connected state store client.
pub struct Client {
    mqtt: AsyncClient,
    client_id: String,
    response_topic: String,
    timeout: Duration,
    next_correlation: u64,
    register: mpsc::UnboundedSender<(Bytes, oneshot::Sender<Publish>)>,
    notifications: Option<mpsc::UnboundedReceiver<Notification>>,
    lost: mpsc::UnboundedReceiver<String>,
}

/// The current time as an HLC, as the official clients write it.
pub fn now_hlc(node: &str) -> String {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    format!("{ms:015}:{:05}:{node}", 0)
}

/// The largest packet the client takes in (its CONNECT's Maximum Packet
/// Size): an answer carries a value, whose size the broker's
/// `[state_store] max_value_size` bounds.
pub const MAX_INCOMING_PACKET: u32 = 64 << 20;

impl Client {
    /// Connects (clean start) and subscribes to its response topic.
    pub async fn connect(target: &Target) -> Result<Client, Failure> {
        let mut options =
            MqttOptions::new(target.client_id.clone(), target.host.clone(), target.port);
        options.set_keep_alive(Duration::from_secs(30));
        options.set_clean_start(true);
        // rumqttc takes in packets up to 10 KiB unless told: a value up to
        // the store's limit (1 MiB by default, configurable) must fit.
        options.set_max_packet_size(Some(MAX_INCOMING_PACKET));
        if let Some((user, password)) = &target.login {
            options.set_credentials(user.clone(), password.clone());
        }
        if let Some(tls) = &target.tls {
            let config = crate::tls::client_config(tls).map_err(Failure::Connection)?;
            options.set_transport(rumqttc::Transport::tls_with_config(
                rumqttc::TlsConfiguration::Rustls(std::sync::Arc::new(config)),
            ));
        }
        let (mqtt, mut eventloop) = AsyncClient::new(options, 64);
        tokio::time::timeout(target.timeout, wait_connack(&mut eventloop))
            .await
            .map_err(|_| Failure::Timeout("CONNACK"))??;
        let response_topic = format!(
            "clients/{}/services/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke/response",
            target.client_id
        );
        let notify_filter = format!(
            "{NOTIFY_PREFIX}/{}/command/notify/+",
            hex::encode_upper(&target.client_id)
        );
        let (register, registrations) = mpsc::unbounded_channel();
        let (notify_tx, notifications) = mpsc::unbounded_channel();
        let (lost_tx, lost) = mpsc::unbounded_channel();
        let (subacked_tx, subacked) = oneshot::channel();
        tokio::spawn(pump(
            eventloop,
            registrations,
            notify_tx,
            lost_tx,
            subacked_tx,
        ));
        mqtt.subscribe_many([
            rumqttc::v5::mqttbytes::v5::Filter::new(response_topic.clone(), QoS::AtLeastOnce),
            rumqttc::v5::mqttbytes::v5::Filter::new(notify_filter, QoS::AtLeastOnce),
        ])
        .await
        .map_err(|e| Failure::Connection(e.to_string()))?;
        tokio::time::timeout(target.timeout, subacked)
            .await
            .map_err(|_| Failure::Timeout("SUBACK"))?
            .map_err(|_| Failure::Connection("the connection closed".into()))?;
        Ok(Client {
            mqtt,
            client_id: target.client_id.clone(),
            response_topic,
            timeout: target.timeout,
            next_correlation: fastrand::u64(..),
            register,
            notifications: Some(notifications),
            lost,
        })
    }

    /// The client id.
    pub fn client_id(&self) -> &str {
        &self.client_id
    }

    /// The notifications of KEYNOTIFY registrations (once).
    pub fn notifications(&mut self) -> Option<mpsc::UnboundedReceiver<Notification>> {
        self.notifications.take()
    }

    /// Sends `args` as one request with `extra` user properties; waits for
    /// its answer.
    pub async fn request(
        &mut self,
        args: &[&[u8]],
        extra: &[(&str, String)],
    ) -> Result<Answer, Failure> {
        self.next_correlation = self.next_correlation.wrapping_add(1);
        let correlation = Bytes::copy_from_slice(&self.next_correlation.to_be_bytes());
        let (tx, rx) = oneshot::channel();
        let _ = self.register.send((correlation.clone(), tx));
        let mut user_properties = vec![
            ("__ts".to_owned(), now_hlc(&self.client_id)),
            ("__protVer".to_owned(), "1.0".to_owned()),
            ("__srcId".to_owned(), self.client_id.clone()),
        ];
        user_properties.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
        let properties = PublishProperties {
            response_topic: Some(self.response_topic.clone()),
            correlation_data: Some(correlation),
            user_properties,
            content_type: Some("application/octet-stream".into()),
            message_expiry_interval: Some(
                self.timeout.as_secs().clamp(1, u64::from(u32::MAX)) as u32
            ),
            ..PublishProperties::default()
        };
        self.mqtt
            .publish_with_properties(
                REQUEST_TOPIC,
                QoS::AtLeastOnce,
                false,
                encode_request(args),
                properties,
            )
            .await
            .map_err(|e| Failure::Connection(e.to_string()))?;
        let publish = tokio::select! {
            answer = tokio::time::timeout(self.timeout, rx) => answer
                .map_err(|_| Failure::Timeout("the state store's response"))?
                .map_err(|_| Failure::Connection("the connection closed".into()))?,
            Some(why) = self.lost.recv() => return Err(Failure::Connection(why)),
        };
        let reply = parse_reply(&publish.payload).map_err(|_| {
            Failure::Protocol(String::from_utf8_lossy(&publish.payload).into_owned())
        })?;
        let properties = publish
            .properties
            .map(|p| p.user_properties)
            .unwrap_or_default();
        let version = property(&properties, "__ts");
        Ok(Answer {
            reply,
            version,
            properties,
        })
    }

    /// Waits until the connection is lost; returns why.
    pub async fn lost(&mut self) -> String {
        self.lost
            .recv()
            .await
            .unwrap_or_else(|| "the connection closed".into())
    }

    /// Disconnects cleanly.
    pub async fn disconnect(self) {
        let _ = self.mqtt.disconnect().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn property(properties: &[(String, String)], name: &str) -> Option<String> {
    properties
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.clone())
}

async fn wait_connack(eventloop: &mut EventLoop) -> Result<(), Failure> {
    loop {
        match eventloop.poll().await {
            Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                return match ack.code {
                    ConnectReturnCode::Success => Ok(()),
                    code => Err(Failure::Connection(format!("connection refused: {code:?}"))),
                };
            }
            Ok(_) => {}
            Err(ConnectionError::ConnectionRefused(code)) => {
                return Err(Failure::Connection(format!("connection refused: {code:?}")));
            }
            Err(e) => return Err(Failure::Connection(format!("cannot connect: {e}"))),
        }
    }
}

/// Drives the connection: hands answers to their waiters and
/// notifications to the channel.
async fn pump(
    mut eventloop: EventLoop,
    mut registrations: mpsc::UnboundedReceiver<(Bytes, oneshot::Sender<Publish>)>,
    notifications: mpsc::UnboundedSender<Notification>,
    lost: mpsc::UnboundedSender<String>,
    subacked: oneshot::Sender<()>,
) {
    let mut subacked = Some(subacked);
    let mut waiting = Waiting::new();
    loop {
        let event = tokio::select! {
            event = eventloop.poll() => event,
            Some((correlation, tx)) = registrations.recv() => {
                waiting.insert(correlation, tx);
                continue;
            }
        };
        match event {
            Ok(Event::Incoming(Packet::SubAck(_))) => {
                if let Some(tx) = subacked.take() {
                    let _ = tx.send(());
                }
            }
            Ok(Event::Incoming(Packet::Publish(publish))) => {
                while let Ok((correlation, tx)) = registrations.try_recv() {
                    waiting.insert(correlation, tx);
                }
                if publish.topic.starts_with(NOTIFY_PREFIX.as_bytes()) {
                    if let Some(n) = notification(&publish) {
                        let _ = notifications.send(n);
                    }
                    continue;
                }
                let correlation = publish
                    .properties
                    .as_ref()
                    .and_then(|p| p.correlation_data.clone())
                    .unwrap_or_default();
                if let Some(tx) = waiting.remove(&correlation) {
                    let _ = tx.send(publish);
                }
            }
            Ok(Event::Incoming(Packet::Disconnect(d))) => {
                let _ = lost.send(format!("the broker disconnected: {:?}", d.reason_code));
                return;
            }
            Ok(_) => {}
            Err(e) => {
                let _ = lost.send(format!("connection lost: {e}"));
                return;
            }
        }
    }
}

/// Reads a notification: the key from the topic's last level (hex), the
/// change from the payload.
fn notification(publish: &Publish) -> Option<Notification> {
    let topic = std::str::from_utf8(&publish.topic).ok()?;
    let key = hex::decode(topic.rsplit('/').next()?).ok()?;
    let version = publish
        .properties
        .as_ref()
        .and_then(|p| property(&p.user_properties, "__ts"));
    let value = match parse_reply(&publish.payload).ok()? {
        Reply::Array(items) => match items.as_slice() {
            [_, Reply::Bulk(op), _, Reply::Bulk(value)] if op == b"SET" => Some(value.clone()),
            [_, Reply::Bulk(op)] if op == b"DELETE" => None,
            _ => return None,
        },
        _ => return None,
    };
    Some(Notification {
        key,
        value,
        version,
    })
}
