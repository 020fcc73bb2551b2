//! MQTT framing over any byte stream.
//!
//! [`Socket`] owns the stream (a `TcpStream` today; a TLS or WebSocket stream
//! is just another `AsyncRead + AsyncWrite`) and a read buffer that packets
//! are decoded from; what goes to the client is encoded by the connection's
//! machine into a buffer of its own, written in one go per turn of the
//! connection's loop.

use bytes::BytesMut;
use router::protocol::Packet;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::codec::{self, CodecError, Incoming, Protocol};
use crate::request_publish::{self, RequestPublish};

/// What a connection needs of its byte stream.
pub(crate) trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> Stream for S {}

/// Free room in the read buffer before each read (the buffer's size when
/// a connection is idle).
const READ_ROOM: usize = 1024;

/// A stream with its read buffer and codec.
pub(crate) struct Socket<S> {
    stream: S,
    rbuf: BytesMut,
    /// The protocol the client speaks (known after CONNECT).
    pub protocol: Protocol,
    /// The first packet was found to be a CONNECT of `protocol` (so a
    /// refusal may be told in that protocol even if the rest is malformed).
    pub detected: bool,
}

impl<S: Stream> Socket<S> {
    pub fn new(stream: S) -> Socket<S> {
        Socket {
            stream,
            rbuf: BytesMut::with_capacity(READ_ROOM),
            protocol: Protocol::V5,
            detected: false,
        }
    }

    /// Reads the first packet, which tells the protocol (and must be CONNECT).
    pub async fn read_connect(&mut self, max_packet_size: usize) -> Result<Packet, CodecError> {
        loop {
            if let Some(protocol) = codec::detect(&self.rbuf, max_packet_size)? {
                self.protocol = protocol;
                self.detected = true;
                if let Some(incoming) = protocol.read(&mut self.rbuf, max_packet_size)? {
                    return Ok(incoming.packet);
                }
            }
            match self.stream.read_buf(&mut self.rbuf).await {
                Ok(0) => return Err(CodecError::Malformed("closed before CONNECT".into())),
                Ok(_) => {}
                Err(e) => return Err(CodecError::Malformed(e.to_string())),
            }
        }
    }

    /// Reads what the stream has; `Ok(0)` when it closed.
    ///
    /// Decoded packets are split off the front of the read buffer, so its
    /// room shrinks with every packet; before reading, the room is brought
    /// back to [`READ_ROOM`] (the buffer reuses its own space once the
    /// packets split off it are gone). A read that fills all the room
    /// leaves the socket marked readable and costs a second `recv` for the
    /// rest of the packet; one that does not tells tokio the socket is
    /// drained. (With the room left to shrink, a third of the requests at
    /// 64 connections took two `recv`s.)
    pub async fn fill(&mut self) -> std::io::Result<usize> {
        if self.rbuf.capacity() - self.rbuf.len() < READ_ROOM / 2 {
            self.rbuf.reserve(READ_ROOM);
        }
        self.stream.read_buf(&mut self.rbuf).await
    }

    /// Whether bytes read are waiting to be decoded (those that came with
    /// the CONNECT, before the connection's first wait).
    pub fn has_buffered(&self) -> bool {
        !self.rbuf.is_empty()
    }

    /// Whether the client closed its side (or the stream failed), by one
    /// read that does not wait: what it reads is kept for the packets.
    pub fn closed_by_peer(&mut self) -> bool {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let read = std::pin::pin!(self.stream.read_buf(&mut self.rbuf));
        matches!(
            std::future::Future::poll(read, &mut cx),
            std::task::Poll::Ready(Ok(0) | Err(_))
        )
    }

    /// The state store request at the front of what was read, if it is
    /// one [`request_publish::read`] takes, and its length: the caller
    /// [`Socket::consume`]s that once done with it (else
    /// [`Socket::next_packet`] decodes the front packet).
    pub fn next_request(&self, max_packet_size: usize) -> Option<(RequestPublish<'_>, usize)> {
        match self.protocol {
            Protocol::V5 => request_publish::read(&self.rbuf, max_packet_size),
            Protocol::V4 => None,
        }
    }

    /// Drops `len` bytes from the front of what was read (a request
    /// [`Socket::next_request`] gave).
    pub fn consume(&mut self, len: usize) {
        bytes::Buf::advance(&mut self.rbuf, len);
    }

    /// The packet id of the PUBACK without reason code or properties at
    /// the front of what was read, taken off it ([`codec::puback_at`]).
    pub fn next_puback(&mut self, max_packet_size: usize) -> Option<u16> {
        let pkid = codec::puback_at(&self.rbuf, max_packet_size)?;
        bytes::Buf::advance(&mut self.rbuf, 4);
        Some(pkid)
    }

    /// Decodes the next complete packet from what was read (what a client
    /// may not send is the machine's to refuse: `codec::check_from_client`).
    pub fn next_packet(&mut self, max_packet_size: usize) -> Result<Option<Incoming>, CodecError> {
        self.protocol.read(&mut self.rbuf, max_packet_size)
    }

    /// Writes all of `out` and empties it.
    ///
    /// On plain TCP the bytes are first offered to the socket as they are
    /// ([`TcpStream::try_write`]): nearly always all of them go, and the
    /// write costs no future, no waker and no cooperative budget (tokio's
    /// `write_all` took ~130 instructions a request around the `send`).
    /// What the socket does not take then goes as on any stream. (Reading
    /// still spends the budget, so a busy connection still gives way.)
    pub async fn write_all(&mut self, out: &mut BytesMut) -> std::io::Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        // A type check the compiler settles: `S` is or is not `TcpStream`.
        if let Some(tcp) = (&mut self.stream as &mut dyn std::any::Any).downcast_mut::<TcpStream>()
        {
            match tcp.try_write(out) {
                Ok(sent) if sent == out.len() => {
                    out.clear();
                    return Ok(());
                }
                Ok(sent) => bytes::Buf::advance(out, sent),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        self.stream.write_all(out).await?;
        out.clear();
        // A no-op on TCP; TLS and WebSocket streams send here.
        self.stream.flush().await
    }

    /// Writes raw bytes at once (for answers that precede any codec).
    pub async fn write_raw(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes).await?;
        self.stream.flush().await
    }

    /// Ends the stream (after what was flushed).
    pub async fn shutdown(&mut self) {
        let _ = self.stream.shutdown().await;
    }

    /// After [`Socket::shutdown`]: reads and discards what the client still
    /// sends, until it closes or `linger` passes (at most 1 MiB). Closing a
    /// socket with unread input makes the kernel reset the connection, and
    /// a reset throws away what the client had not read yet (the
    /// DISCONNECT that says why, among others).
    pub async fn linger(&mut self, linger: std::time::Duration) {
        let mut scratch = [0u8; 8192];
        let mut read = 0usize;
        let _ = tokio::time::timeout(linger, async {
            while read < 1 << 20 {
                match self.stream.read(&mut scratch).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => read += n,
                }
            }
        })
        .await;
    }

    /// Sends `packet`, then closes.
    pub async fn send_and_close(mut self, packet: Packet) {
        let mut out = BytesMut::new();
        if self.protocol.write(packet, &mut out).is_ok() {
            let _ = self.write_all(&mut out).await;
        }
        self.shutdown().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use router::protocol::PingResp;

    fn connect_v4() -> Vec<u8> {
        let mut b = vec![0x10, 12, 0, 4];
        b.extend(b"MQTT");
        b.extend([4, 0x02, 0, 60, 0, 0]);
        b
    }

    /// Framing works over any duplex stream: CONNECT split over two
    /// writes, then two packets in one write, then one answer out.
    #[tokio::test]
    async fn frames_over_any_stream() {
        let (client, server) = tokio::io::duplex(64);
        let mut socket = Socket::new(server);
        let (mut client_read, mut client_write) = tokio::io::split(client);
        let connect = connect_v4();
        client_write.write_all(&connect[..5]).await.unwrap();
        let writer = tokio::spawn(async move {
            tokio::task::yield_now().await;
            client_write.write_all(&connect[5..]).await.unwrap();
            // PINGREQ twice in one write.
            client_write.write_all(&[0xC0, 0, 0xC0, 0]).await.unwrap();
            client_write
        });
        let packet = socket.read_connect(1024).await.unwrap();
        assert!(matches!(packet, Packet::Connect(..)));
        assert_eq!(socket.protocol, Protocol::V4);
        let _client_write = writer.await.unwrap();
        let mut pings = 0;
        while pings < 2 {
            match socket.next_packet(1024).unwrap() {
                Some(incoming) => {
                    assert!(matches!(incoming.packet, Packet::PingReq(_)));
                    pings += 1;
                }
                None => assert!(socket.fill().await.unwrap() > 0),
            }
        }
        let mut out = BytesMut::new();
        Protocol::V4
            .write(Packet::PingResp(PingResp), &mut out)
            .unwrap();
        socket.write_all(&mut out).await.unwrap();
        let mut answer = [0; 2];
        client_read.read_exact(&mut answer).await.unwrap();
        assert_eq!(answer, [0xD0, 0]);
    }

    /// On TCP, what the socket does not take at once (more than its
    /// buffers hold, while the peer is not reading) still goes, whole and
    /// in order, once the peer reads.
    #[tokio::test]
    async fn a_write_larger_than_the_socket_takes_goes_whole() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peer = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let mut socket = Socket::new(server);
        let sent: Vec<u8> = (0..16 << 20).map(|i: u32| (i % 251) as u8).collect();
        let mut out = BytesMut::from(&sent[..]);
        let reader = tokio::spawn(async move {
            let mut peer = peer;
            // Not reading yet: the first offer fills the socket's buffers.
            tokio::task::yield_now().await;
            let mut got = Vec::new();
            peer.read_to_end(&mut got).await.unwrap();
            got
        });
        socket.write_all(&mut out).await.unwrap();
        assert!(out.is_empty(), "emptied once written");
        socket.shutdown().await;
        drop(socket);
        let got = reader.await.unwrap();
        assert_eq!(got.len(), sent.len());
        assert!(got == sent, "the bytes arrive as written");
    }

    /// A packet that arrives whole is read whole: the read buffer's room
    /// comes back after the packets split off it (not so, one read in
    /// three took two `recv`s at 64 busy connections).
    #[tokio::test]
    async fn each_packet_is_read_in_one_read() {
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let mut socket = Socket::new(server);
        client.write_all(&connect_v4()).await.unwrap();
        socket.read_connect(1 << 16).await.unwrap();
        // QoS 0 PUBLISH, 300 bytes: topic "t", 295 bytes of payload.
        let mut publish = vec![0x30, 0xAA, 0x02, 0, 1, b't'];
        publish.extend([b'x'; 295]);
        assert_eq!(publish.len(), 301);
        for i in 0..50 {
            client.write_all(&publish).await.unwrap();
            let read = socket.fill().await.unwrap();
            assert_eq!(read, publish.len(), "packet {i} took more than one read");
            let incoming = socket
                .next_packet(1 << 16)
                .unwrap()
                .expect("a whole packet");
            assert!(matches!(incoming.packet, Packet::Publish(..)));
            assert!(socket.next_packet(1 << 16).unwrap().is_none());
        }
        assert!(
            socket.rbuf.capacity() <= 2 * READ_ROOM,
            "the buffer reuses its space"
        );
    }
}
