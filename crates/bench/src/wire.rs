//! A lean MQTT 5 client connection for the load generator: rumqttc's packet
//! codec over a plain `TcpStream`, with no event loop, no channel and no
//! client state beyond two buffers and a packet id.
//!
//! Why not rumqttc's `AsyncClient` here: it hands every publish through a
//! channel to its event loop and writes each packet on its own, so a request
//! cost the load generator two `writev`s (the PUBLISH, then the PUBACK of
//! the previous response) and a wake-up of the event loop. At 64 connections
//! the load generator used 6.65 s of CPU in a 6.7 s run: its core was
//! saturated before the server's, and the benchmark measured the client.
//! Here a request is one write (the PUBACK of the previous response queued
//! in front of the next PUBLISH, as redis-benchmark writes one command per
//! request) and, when the server answers PUBACK and response together, one
//! read.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Buf, BytesMut};
use rumqttc::v5::mqttbytes::v5::{
    ConnAck, ConnectProperties, ConnectReturnCode, Filter, Packet, Subscribe, SubscribeReasonCode,
};
use rumqttc::v5::mqttbytes::{Error as CodecError, QoS};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::request::{self, Answer, Template};

/// One MQTT 5 connection: what to write next, and what was read and not
/// yet parsed.
pub struct Wire {
    stream: TcpStream,
    rx: BytesMut,
    tx: BytesMut,
    next_pkid: u16,
}

impl Wire {
    /// Connects with clean start and a 60 s keep-alive (longer than any run
    /// between two requests), and waits up to 30 s for a successful CONNACK.
    pub async fn connect(target: SocketAddr, client_id: &str) -> Result<Self, String> {
        let stream = tokio::time::timeout(Duration::from_secs(30), TcpStream::connect(target))
            .await
            .map_err(|_| format!("{client_id}: connect timed out"))?
            .map_err(|e| format!("{client_id}: connect: {e}"))?;
        stream
            .set_nodelay(true)
            .map_err(|e| format!("{client_id}: {e}"))?;
        let mut wire = Wire {
            stream,
            rx: BytesMut::with_capacity(4096),
            tx: BytesMut::with_capacity(1024),
            next_pkid: 0,
        };
        let connect = rumqttc::v5::mqttbytes::v5::Connect {
            keep_alive: 60,
            client_id: client_id.to_owned(),
            clean_start: true,
            properties: Some(ConnectProperties {
                max_packet_size: Some(1 << 20),
                ..ConnectProperties::new()
            }),
        };
        wire.queue(&Packet::Connect(connect, None, None))?;
        wire.flush().await?;
        match wire.next_within(Duration::from_secs(30)).await? {
            Packet::ConnAck(ConnAck {
                code: ConnectReturnCode::Success,
                ..
            }) => Ok(wire),
            other => Err(format!("{client_id}: not connected: {other:?}")),
        }
    }

    /// Subscribes to `filter` and waits up to 30 s for a successful SUBACK.
    pub async fn subscribe(&mut self, filter: &str, qos: QoS) -> Result<(), String> {
        let pkid = self.pkid();
        let subscribe = Subscribe::new(Filter::new(filter, qos), None);
        let subscribe = Subscribe { pkid, ..subscribe };
        self.queue(&Packet::Subscribe(subscribe))?;
        self.flush().await?;
        match self.next_within(Duration::from_secs(30)).await? {
            Packet::SubAck(ack)
                if ack.pkid == pkid
                    && ack
                        .return_codes
                        .iter()
                        .all(|c| matches!(c, SubscribeReasonCode::Success(_))) =>
            {
                Ok(())
            }
            other => Err(format!("subscription to {filter} refused: {other:?}")),
        }
    }

    /// The next packet identifier (1..=65535, then round again).
    pub fn pkid(&mut self) -> u16 {
        self.next_pkid = self.next_pkid.checked_add(1).unwrap_or(1);
        self.next_pkid
    }

    /// Queues a DISCONNECT (normal).
    pub fn disconnect(&mut self) -> Result<(), String> {
        self.queue(&Packet::Disconnect(
            rumqttc::v5::mqttbytes::v5::Disconnect::new(
                rumqttc::v5::mqttbytes::v5::DisconnectReasonCode::NormalDisconnection,
            ),
        ))
    }

    /// Queues a state store request (see [`crate::request`]) with the
    /// next packet identifier; `flush` sends it.
    pub fn request(
        &mut self,
        template: &mut Template,
        correlation: u64,
        persist: bool,
        now_ms: u64,
        payload: &[u8],
    ) {
        let pkid = self.pkid();
        template.encode(&mut self.tx, pkid, correlation, persist, now_ms, payload);
    }

    /// The next PUBLISH from the server, read by hand (see
    /// [`crate::request`]), its PUBACK queued; other packets (the PUBACKs
    /// of requests) are passed over. Cancel-safe, as [`Wire::next`].
    pub async fn next_answer(&mut self) -> Result<Answer, String> {
        loop {
            while let Some((answer, len)) = request::read_answer(&self.rx)? {
                self.rx.advance(len);
                if let Some(answer) = answer {
                    if let Some(pkid) = answer.pkid {
                        request::put_puback(&mut self.tx, pkid);
                    }
                    return Ok(answer);
                }
            }
            self.receive().await?;
        }
    }

    fn queue(&mut self, packet: &Packet) -> Result<(), String> {
        packet
            .write(&mut self.tx, None)
            .map(drop)
            .map_err(|e| format!("cannot encode {packet:?}: {e}"))
    }

    /// Writes everything queued, in one write when the socket takes it.
    pub async fn flush(&mut self) -> Result<(), String> {
        if !self.tx.is_empty() {
            self.stream
                .write_all(&self.tx)
                .await
                .map_err(|e| format!("write: {e}"))?;
            self.tx.clear();
        }
        Ok(())
    }

    /// The next packet from the server. Cancel-safe: a packet partly read
    /// stays in the buffer for the next call.
    pub async fn next(&mut self) -> Result<Packet, String> {
        loop {
            match Packet::read(&mut self.rx, None) {
                Ok(packet) => return Ok(packet),
                Err(CodecError::InsufficientBytes(_)) => {}
                Err(e) => return Err(format!("bad packet from the server: {e}")),
            }
            self.receive().await?;
        }
    }

    /// Reads what the server sent into `rx`, with room for it first.
    async fn receive(&mut self) -> Result<(), String> {
        if self.rx.capacity() - self.rx.len() < 1024 {
            self.rx.reserve(4096);
        }
        read_more(&mut self.stream, &mut self.rx).await
    }

    async fn next_within(&mut self, limit: Duration) -> Result<Packet, String> {
        tokio::time::timeout(limit, self.next())
            .await
            .map_err(|_| format!("no answer within {limit:?}"))?
    }
}

/// Reads what `stream` has into `rx` (cancel-safe: what was read stays);
/// the server closing the connection is an error. Shared with
/// [`crate::resp`].
pub(crate) async fn read_more(stream: &mut TcpStream, rx: &mut BytesMut) -> Result<(), String> {
    let n = stream
        .read_buf(rx)
        .await
        .map_err(|e| format!("read: {e}"))?;
    if n == 0 {
        return Err("the server closed the connection".into());
    }
    Ok(())
}
