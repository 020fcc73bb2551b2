//! A RESP connection to a Redis server, for `--protocol resp`: the load
//! run's requests (the same GETs and SETs, one in flight per connection),
//! sent by the same client loop as the MQTT ones, so that statebroker and
//! Redis are compared with one load generator.
//!
//! Why not only `redis-benchmark`: the client is part of what a round trip
//! measures. On a 2-core VM (2026-11-30), Redis GET at one connection gave
//! p50 63 µs with `redis-benchmark` and 75-78 µs with a plain blocking
//! client or a tokio one, and a bare TCP echo server 75-79 µs with either:
//! `redis-benchmark` makes more system calls between its write and its
//! wait (five `epoll_ctl` a request), and its core is still awake when the
//! answer comes. statebroker was only ever measured with this binary, so
//! its ratio to `redis-benchmark`'s figures counted the clients' difference
//! as the servers'.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Buf, BytesMut};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::request::Reply;

/// Replies larger than this are refused (the run's values are small).
const MAX_REPLY: usize = 1 << 20;

/// One connection: its socket and what was read and not yet parsed.
pub struct Resp {
    stream: TcpStream,
    rx: BytesMut,
}

impl Resp {
    /// Connects (30 s at most) with Nagle's algorithm off.
    pub async fn connect(target: SocketAddr) -> Result<Resp, String> {
        let stream = tokio::time::timeout(Duration::from_secs(30), TcpStream::connect(target))
            .await
            .map_err(|_| format!("{target}: connect timed out"))?
            .map_err(|e| format!("{target}: connect: {e}"))?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        Ok(Resp {
            stream,
            rx: BytesMut::with_capacity(4096),
        })
    }

    /// Sends `command` (an array of bulk strings, as Redis takes it: the
    /// state store's RESP3 request form) and returns what its reply is,
    /// judged where it was read (as the MQTT side's answers are).
    pub async fn request(&mut self, command: &[u8]) -> Result<Reply, String> {
        self.stream
            .write_all(command)
            .await
            .map_err(|e| format!("write: {e}"))?;
        loop {
            if let Some(len) = reply_len(&self.rx)? {
                let reply = Reply::of(&self.rx[..len]);
                self.rx.advance(len);
                return Ok(reply);
            }
            if self.rx.len() > MAX_REPLY {
                return Err("a reply larger than 1 MiB".into());
            }
            crate::wire::read_more(&mut self.stream, &mut self.rx).await?;
        }
    }
}

/// The length of the first reply in `buf` once it is all there (`None`:
/// not yet): a simple string, an error, an integer or a bulk string, the
/// replies GET and SET have.
fn reply_len(buf: &[u8]) -> Result<Option<usize>, String> {
    let Some(&kind) = buf.first() else {
        return Ok(None);
    };
    let Some(end) = buf.windows(2).position(|w| w == b"\r\n") else {
        return Ok(None);
    };
    let line = end + 2;
    match kind {
        b'+' | b'-' | b':' | b'_' => Ok(Some(line)),
        b'$' => {
            let len: i64 = std::str::from_utf8(&buf[1..end])
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or("a bulk reply without a length")?;
            if len < 0 {
                return Ok(Some(line));
            }
            let whole = line + len as usize + 2;
            Ok((buf.len() >= whole).then_some(whole))
        }
        other => Err(format!(
            "a reply of a kind this client does not read: {other:#x}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::reply_len;

    #[test]
    fn replies_are_read_whole() {
        assert_eq!(reply_len(b"+OK\r\n"), Ok(Some(5)));
        assert_eq!(reply_len(b"+OK\r"), Ok(None));
        assert_eq!(reply_len(b"$-1\r\n+OK"), Ok(Some(5)));
        assert_eq!(reply_len(b"$3\r\nabc\r\n$"), Ok(Some(9)));
        assert_eq!(reply_len(b"$3\r\nabc\r"), Ok(None));
        assert_eq!(reply_len(b""), Ok(None));
        assert!(reply_len(b"*1\r\n").is_err());
        assert!(reply_len(b"$x\r\n").is_err());
    }
}
