//! A raw MQTT client on rumqttc's packet codecs, for what the SDK never
//! does: QoS 0 requests, reserved topics, malformed payloads, bad packets.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{
    ConnAck, Connect, ConnectProperties, Disconnect, DisconnectReasonCode, Filter, LastWill,
    Packet, PubAck, Publish, PublishProperties, Subscribe, SubscribeReasonCode,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub use rumqttc::v5::mqttbytes::v5;

use super::TIMEOUT;

pub const REQUEST_TOPIC: &str = "statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke";
pub const LEGACY_REQUEST_TOPIC: &str = "$services/statestore/_any_/command/invoke/request";
pub const NOTIFY_NAMESPACE: &str = "clients/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8";

/// What a raw client saw when it waited for a packet.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Recv {
    Packet(Packet),
    Closed,
    Timeout,
}

/// Any byte stream a raw client can speak over (TCP, TLS, WebSocket).
pub trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// An MQTT 5 client speaking packets.
pub struct Raw {
    pub stream: Box<dyn Io>,
    rbuf: BytesMut,
    next_pkid: u16,
    pub client_id: String,
    pub response_topic: String,
    subscribed: bool,
    /// Publishes received (and acknowledged) while waiting for something else.
    pending: std::collections::VecDeque<Publish>,
}

impl Raw {
    /// Connects with a clean start and the default keep-alive (30 s).
    pub async fn connect(addr: SocketAddr, client_id: &str) -> Raw {
        let (raw, connack) = Raw::connect_with(addr, client_id, |_| {}).await;
        assert_eq!(connack.code, v5::ConnectReturnCode::Success, "{connack:?}");
        raw
    }

    /// Connects, letting `tweak` change the CONNECT; returns the CONNACK.
    pub async fn connect_with(
        addr: SocketAddr,
        client_id: &str,
        tweak: impl FnOnce(&mut (Connect, Option<LastWill>, Option<v5::Login>)),
    ) -> (Raw, ConnAck) {
        let stream = TcpStream::connect(addr).await.expect("connect to broker");
        stream.set_nodelay(true).unwrap();
        Raw::connect_over(Box::new(stream), client_id, tweak).await
    }

    /// [`Raw::connect_with`] that fails instead of panicking: the server
    /// refused the connection, closed it, or sent no CONNACK within
    /// `wait` (a paused process's socket still accepts).
    pub async fn try_connect(
        addr: SocketAddr,
        client_id: &str,
        wait: Duration,
        tweak: impl FnOnce(&mut (Connect, Option<LastWill>, Option<v5::Login>)),
    ) -> Result<(Raw, ConnAck), String> {
        let connecting = async {
            let stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
            stream.set_nodelay(true).map_err(|e| e.to_string())?;
            let mut raw = Raw::new(Box::new(stream), client_id);
            raw.send_connect(client_id, tweak).await;
            match raw.recv_within(wait).await {
                Recv::Packet(Packet::ConnAck(connack)) => Ok((raw, connack)),
                other => Err(format!("no CONNACK: {other:?}")),
            }
        };
        tokio::time::timeout(wait, connecting)
            .await
            .map_err(|_| format!("no CONNACK within {wait:?}"))?
    }

    fn new(stream: Box<dyn Io>, client_id: &str) -> Raw {
        Raw {
            stream,
            rbuf: BytesMut::new(),
            next_pkid: 0,
            client_id: client_id.to_owned(),
            response_topic: format!("clients/{client_id}/services/statestore/response"),
            subscribed: false,
            pending: Default::default(),
        }
    }

    async fn send_connect(
        &mut self,
        client_id: &str,
        tweak: impl FnOnce(&mut (Connect, Option<LastWill>, Option<v5::Login>)),
    ) {
        let mut connect = (
            Connect {
                keep_alive: 30,
                client_id: client_id.to_owned(),
                clean_start: true,
                properties: Some(ConnectProperties::new()),
            },
            None,
            None,
        );
        tweak(&mut connect);
        self.send(Packet::Connect(connect.0, connect.1, connect.2))
            .await;
    }

    /// [`Raw::connect_with`] over a stream already open (TLS, WebSocket).
    pub async fn connect_over(
        stream: Box<dyn Io>,
        client_id: &str,
        tweak: impl FnOnce(&mut (Connect, Option<LastWill>, Option<v5::Login>)),
    ) -> (Raw, ConnAck) {
        let mut raw = Raw::new(stream, client_id);
        raw.send_connect(client_id, tweak).await;
        match raw.recv().await {
            Recv::Packet(Packet::ConnAck(connack)) => (raw, connack),
            other => panic!("expected CONNACK, got {other:?}"),
        }
    }

    pub fn pkid(&mut self) -> u16 {
        self.next_pkid = self.next_pkid % 65535 + 1;
        self.next_pkid
    }

    pub async fn send(&mut self, packet: Packet) {
        let mut buf = BytesMut::new();
        packet.write(&mut buf, None).expect("encode");
        self.send_bytes(&buf).await;
    }

    pub async fn send_bytes(&mut self, bytes: &[u8]) {
        // A broker that already closed the socket may reset it: not our concern here.
        let _ = self.stream.write_all(bytes).await;
        // TLS and WebSocket streams send on flush.
        let _ = self.stream.flush().await;
    }

    /// The next packet, or `Closed`, or `Timeout` after `wait`.
    pub async fn recv_within(&mut self, wait: Duration) -> Recv {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            match Packet::read(&mut self.rbuf, None) {
                Ok(packet) => return Recv::Packet(packet),
                Err(rumqttc::v5::mqttbytes::Error::InsufficientBytes(_)) => {}
                Err(e) => panic!("broker sent a malformed packet: {e:?}"),
            }
            match tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.rbuf)).await {
                Err(_) => return Recv::Timeout,
                Ok(Ok(0)) | Ok(Err(_)) => return Recv::Closed,
                Ok(Ok(_)) => {}
            }
        }
    }

    pub async fn recv(&mut self) -> Recv {
        self.recv_within(TIMEOUT).await
    }

    /// The next PUBLISH (acknowledging it), skipping acks.
    pub async fn next_publish(&mut self) -> Publish {
        match self.pending.pop_front() {
            Some(p) => p,
            None => self.publish_from_socket().await,
        }
    }

    /// The next PUBLISH from the socket (acknowledged), skipping acks.
    async fn publish_from_socket(&mut self) -> Publish {
        loop {
            match self.recv().await {
                Recv::Packet(Packet::Publish(p)) => {
                    self.ack(&p).await;
                    return p;
                }
                Recv::Packet(_) => continue,
                other => panic!("expected PUBLISH, got {other:?}"),
            }
        }
    }

    async fn ack(&mut self, p: &Publish) {
        if p.qos != QoS::AtMostOnce {
            self.send(Packet::PubAck(PubAck::new(p.pkid, None))).await;
        }
    }

    /// Waits for a packet other than PUBLISH; publishes that arrive
    /// meanwhile are acknowledged and kept for [`Raw::next_publish`].
    async fn next_control(&mut self) -> Recv {
        loop {
            match self.recv().await {
                Recv::Packet(Packet::Publish(p)) => {
                    self.ack(&p).await;
                    self.pending.push_back(p);
                }
                other => return other,
            }
        }
    }

    /// Asserts that no PUBLISH arrives within `wait`.
    pub async fn no_publish_within(&mut self, wait: Duration) {
        if let Some(p) = self.pending.front() {
            panic!("unexpected PUBLISH on {:?}", p.topic);
        }
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.recv_within(left).await {
                Recv::Timeout => return,
                Recv::Packet(Packet::Publish(p)) => panic!("unexpected PUBLISH on {:?}", p.topic),
                Recv::Packet(_) => {}
                Recv::Closed => panic!("connection closed"),
            }
        }
    }

    /// Waits for the broker to end the connection; returns its DISCONNECT if any.
    pub async fn expect_disconnect(&mut self) -> Option<Disconnect> {
        loop {
            match self.recv().await {
                Recv::Packet(Packet::Disconnect(d)) => {
                    assert!(
                        matches!(self.recv().await, Recv::Closed),
                        "socket closed after DISCONNECT"
                    );
                    return Some(d);
                }
                Recv::Packet(_) => continue,
                Recv::Closed => return None,
                Recv::Timeout => panic!("the broker kept the connection open"),
            }
        }
    }

    pub async fn subscribe(&mut self, filter: &str, qos: QoS) -> Vec<SubscribeReasonCode> {
        self.subscribe_many(&[filter], qos).await
    }

    pub async fn subscribe_many(&mut self, filters: &[&str], qos: QoS) -> Vec<SubscribeReasonCode> {
        let pkid = self.pkid();
        let mut subscribe = Subscribe::new_many(filters.iter().map(|f| Filter::new(*f, qos)), None);
        subscribe.pkid = pkid;
        self.send(Packet::Subscribe(subscribe)).await;
        loop {
            match self.next_control().await {
                Recv::Packet(Packet::SubAck(ack)) => {
                    assert_eq!(ack.pkid, pkid);
                    return ack.return_codes;
                }
                Recv::Packet(_) => continue,
                other => panic!("expected SUBACK, got {other:?}"),
            }
        }
    }

    /// Unsubscribes from `filters` in one UNSUBSCRIBE; returns the
    /// UNSUBACK's reasons.
    pub async fn unsubscribe_many(&mut self, filters: &[&str]) -> Vec<v5::UnsubAckReason> {
        let pkid = self.pkid();
        let unsubscribe = v5::Unsubscribe {
            pkid,
            filters: filters.iter().map(|f| f.to_string()).collect(),
            properties: None,
        };
        self.send(Packet::Unsubscribe(unsubscribe)).await;
        loop {
            match self.next_control().await {
                Recv::Packet(Packet::UnsubAck(ack)) => {
                    assert_eq!(ack.pkid, pkid);
                    return ack.reasons;
                }
                Recv::Packet(_) => continue,
                other => panic!("expected UNSUBACK, got {other:?}"),
            }
        }
    }

    /// Publishes; at QoS 1 returns the PUBACK reason.
    pub async fn publish(
        &mut self,
        topic: &str,
        payload: impl Into<Bytes>,
        qos: QoS,
        properties: Option<PublishProperties>,
    ) -> Option<v5::PubAckReason> {
        let mut publish = Publish::new(topic, qos, payload.into(), properties);
        if qos != QoS::AtMostOnce {
            publish.pkid = self.pkid();
        }
        let pkid = publish.pkid;
        self.send(Packet::Publish(publish)).await;
        if qos != QoS::AtLeastOnce {
            return None;
        }
        loop {
            match self.next_control().await {
                Recv::Packet(Packet::PubAck(ack)) if ack.pkid == pkid => return Some(ack.reason),
                Recv::Packet(_) => continue,
                other => panic!("expected PUBACK, got {other:?}"),
            }
        }
    }

    /// Request properties the way the SDK sends them.
    pub fn request_properties(
        &self,
        correlation: &[u8],
        user: &[(&str, &str)],
    ) -> PublishProperties {
        PublishProperties {
            response_topic: Some(self.response_topic.clone()),
            correlation_data: Some(Bytes::copy_from_slice(correlation)),
            content_type: Some("application/octet-stream".into()),
            user_properties: user
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..PublishProperties::default()
        }
    }

    /// Subscribes to its response topic (once) and sends a state store
    /// request with `payload` at QoS 1, then returns the response.
    pub async fn request_raw(
        &mut self,
        topic: &str,
        payload: &[u8],
        user: &[(&str, &str)],
    ) -> Publish {
        self.ensure_response_subscription().await;
        let correlation = self.pkid().to_be_bytes();
        let properties = self.request_properties(&correlation, user);
        let ack = self
            .publish(
                topic,
                Bytes::copy_from_slice(payload),
                QoS::AtLeastOnce,
                Some(properties),
            )
            .await;
        assert_eq!(ack, Some(v5::PubAckReason::Success));
        let is_response = |p: &Publish| {
            p.properties
                .as_ref()
                .and_then(|props| props.correlation_data.as_deref())
                == Some(&correlation[..])
        };
        if let Some(at) = self.pending.iter().position(&is_response) {
            return self.pending.remove(at).unwrap();
        }
        loop {
            let response = self.publish_from_socket().await;
            if is_response(&response) {
                return response;
            }
            // Someone else's message: keep it for the test.
            self.pending.push_back(response);
        }
    }

    /// A request with `__ts` = now, like the SDK's.
    pub async fn request(&mut self, args: &[&[u8]]) -> Publish {
        let ts = now_hlc(&self.client_id);
        let payload = statestore::resp3::encode_request(args);
        self.request_raw(
            REQUEST_TOPIC,
            &payload,
            &[("__ts", &ts), ("__protVer", "1.0")],
        )
        .await
    }

    pub async fn ensure_response_subscription(&mut self) {
        if self.subscribed {
            return;
        }
        let topic = self.response_topic.clone();
        let codes = self.subscribe(&topic, QoS::AtLeastOnce).await;
        assert_eq!(codes, vec![SubscribeReasonCode::Success(QoS::AtLeastOnce)]);
        self.subscribed = true;
    }
}

/// `__ts` for now, as the SDK formats it.
pub fn now_hlc(node: &str) -> String {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    format!("{ms:015}:00000:{node}")
}

/// A user property of a publish.
pub fn user_property<'a>(publish: &'a Publish, name: &str) -> Option<&'a str> {
    publish
        .properties
        .as_ref()?
        .user_properties
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

pub fn disconnect_reason(d: &Option<Disconnect>) -> Option<DisconnectReasonCode> {
    d.as_ref().map(|d| d.reason_code)
}

/// An MQTT 3.1.1 client speaking packets.
pub struct Raw4 {
    stream: TcpStream,
    rbuf: BytesMut,
    next_pkid: u16,
}

impl Raw4 {
    pub async fn connect(addr: SocketAddr, client_id: &str) -> Raw4 {
        use rumqttc::mqttbytes::v4;
        let stream = TcpStream::connect(addr).await.unwrap();
        let mut raw = Raw4 {
            stream,
            rbuf: BytesMut::new(),
            next_pkid: 0,
        };
        let mut connect = v4::Connect::new(client_id);
        connect.keep_alive = 30;
        raw.send(v4::Packet::Connect(connect)).await;
        match raw.recv().await {
            Some(v4::Packet::ConnAck(ack)) => assert_eq!(ack.code, v4::ConnectReturnCode::Success),
            other => panic!("expected CONNACK, got {other:?}"),
        }
        raw
    }

    pub async fn send(&mut self, packet: rumqttc::mqttbytes::v4::Packet) {
        self.send_all(vec![packet]).await;
    }

    /// Sends `packets` in one write.
    pub async fn send_all(&mut self, packets: Vec<rumqttc::mqttbytes::v4::Packet>) {
        let mut buf = BytesMut::new();
        for packet in packets {
            packet.write(&mut buf, usize::MAX).unwrap();
        }
        self.stream.write_all(&buf).await.unwrap();
    }

    /// The next packet; `None` if the connection closed.
    pub async fn recv(&mut self) -> Option<rumqttc::mqttbytes::v4::Packet> {
        use rumqttc::mqttbytes::v4;
        loop {
            match v4::Packet::read(&mut self.rbuf, usize::MAX) {
                Ok(packet) => return Some(packet),
                Err(rumqttc::mqttbytes::Error::InsufficientBytes(_)) => {}
                Err(e) => panic!("broker sent a malformed packet: {e:?}"),
            }
            match tokio::time::timeout(TIMEOUT, self.stream.read_buf(&mut self.rbuf)).await {
                Err(_) => panic!("timed out waiting for a packet"),
                Ok(Ok(0)) | Ok(Err(_)) => return None,
                Ok(Ok(_)) => {}
            }
        }
    }

    pub fn pkid(&mut self) -> u16 {
        self.next_pkid = self.next_pkid % 65535 + 1;
        self.next_pkid
    }
}
