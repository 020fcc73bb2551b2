//! MQTT over WebSocket: the HTTP upgrade (subprotocol `mqtt`, any path) and
//! a byte stream over binary WebSocket messages, so that a WebSocket
//! connection runs on the same connection code as TCP
//! (the connection code takes any `AsyncRead + AsyncWrite`).
//!
//! MQTT packets may span WebSocket messages and one message may hold
//! several packets (MQTT 5, 6.0): reads hand on the bytes of each binary
//! message in order; each write (one flush of the connection) is one binary
//! message. Text messages are a protocol error. Pings are answered by
//! tungstenite. A message or frame larger than the listener's packet limit
//! (plus framing) ends the connection, so one client cannot make the broker
//! buffer more than that.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes};
use futures_util::{Sink, Stream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::{HeaderValue, StatusCode};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

/// Subprotocols a client may ask for, in order of preference.
const SUBPROTOCOLS: [&str; 2] = ["mqtt", "mqttv3.1"];

// tungstenite's callback type returns its (large) `ErrorResponse` as is.
#[allow(clippy::result_large_err)]
/// Upgrades an accepted stream to a WebSocket carrying MQTT. A client that
/// offers subprotocols but none of `mqtt`, `mqttv3.1` is answered 400.
pub async fn accept<S>(stream: S, max_packet_size: usize) -> Result<WsStream<S>, String>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let limit = max_packet_size.saturating_add(64 * 1024);
    let config = WebSocketConfig::default()
        .max_message_size(Some(limit))
        .max_frame_size(Some(limit));
    let choose = |request: &Request, mut response: Response| {
        let offered = request
            .headers()
            .get_all("sec-websocket-protocol")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .collect::<Vec<_>>();
        if offered.is_empty() {
            return Ok(response);
        }
        match SUBPROTOCOLS.iter().find(|p| offered.contains(p)) {
            Some(chosen) => {
                response
                    .headers_mut()
                    .insert("sec-websocket-protocol", HeaderValue::from_static(chosen));
                Ok(response)
            }
            None => {
                let mut refusal = ErrorResponse::new(Some("MQTT needs subprotocol mqtt".into()));
                *refusal.status_mut() = StatusCode::BAD_REQUEST;
                Err(refusal)
            }
        }
    };
    let ws = tokio_tungstenite::accept_hdr_async_with_config(stream, choose, Some(config))
        .await
        .map_err(|e| e.to_string())?;
    Ok(WsStream::new(ws))
}

/// A WebSocket as a byte stream.
pub struct WsStream<S> {
    ws: WebSocketStream<S>,
    /// What is left of the last binary message read.
    pending: Bytes,
}

impl<S> WsStream<S> {
    /// Wraps an open WebSocket, server's or client's (tests and tools
    /// speak MQTT over WebSocket with it too).
    pub fn new(ws: WebSocketStream<S>) -> WsStream<S> {
        WsStream {
            ws,
            pending: Bytes::new(),
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for WsStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            if !self.pending.is_empty() {
                let n = self.pending.len().min(buf.remaining());
                buf.put_slice(&self.pending[..n]);
                self.pending.advance(n);
                return Poll::Ready(Ok(()));
            }
            match ready!(Pin::new(&mut self.ws).poll_next(cx)) {
                Some(Ok(Message::Binary(data))) => self.pending = data,
                Some(Ok(Message::Text(_))) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "a text message: MQTT over WebSocket is binary",
                    )));
                }
                // End of stream: a close, or the connection gone.
                Some(Ok(Message::Close(_))) | None => return Poll::Ready(Ok(())),
                Some(Ok(_)) => {} // ping, pong, raw frame
                // Over the listener's limit: the connection says so
                // (DISCONNECT 0x95), as for a packet over it on TCP.
                Some(Err(tokio_tungstenite::tungstenite::Error::Capacity(e))) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        TooLarge(e.to_string()),
                    )));
                }
                Some(Err(e)) => return Poll::Ready(Err(io::Error::other(e))),
            }
        }
    }
}

/// A WebSocket message or frame larger than the listener takes (its
/// packet limit plus framing), as the read error's inner error.
#[derive(Debug)]
pub struct TooLarge(String);

impl std::fmt::Display for TooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "a WebSocket message over the packet size limit: {}",
            self.0
        )
    }
}

impl std::error::Error for TooLarge {}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for WsStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let ws = Pin::new(&mut self.ws);
        ready!(ws.poll_ready(cx)).map_err(io::Error::other)?;
        Pin::new(&mut self.ws)
            .start_send(Message::Binary(Bytes::copy_from_slice(buf)))
            .map_err(io::Error::other)?;
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.ws)
            .poll_flush(cx)
            .map_err(io::Error::other)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.ws)
            .poll_close(cx)
            .map_err(io::Error::other)
    }
}
