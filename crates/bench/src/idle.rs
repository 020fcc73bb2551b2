//! `idle`: many connections that do nothing, to measure what the broker
//! spends per connection. Plain sockets with a hand-written CONNECT keep the
//! client side cheap (no MQTT client state per connection).

use std::time::Duration;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use crate::IdleArgs;

/// An MQTT 5 CONNECT with clean start and a 300 s keep-alive.
fn connect_packet(client_id: &str) -> Vec<u8> {
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 5, 0x02, 0x01, 0x2C, 0];
    body.extend_from_slice(&(client_id.len() as u16).to_be_bytes());
    body.extend_from_slice(client_id.as_bytes());
    let mut packet = vec![0x10];
    let mut len = body.len();
    loop {
        let mut byte = (len % 128) as u8;
        len /= 128;
        if len > 0 {
            byte |= 0x80;
        }
        packet.push(byte);
        if len == 0 {
            break;
        }
    }
    packet.extend(body);
    packet
}

/// Connections per source address: below the 28,232 ephemeral ports Linux
/// gives one (source, destination) pair by default.
const PER_SOURCE: usize = 10_000;

/// The source address of connection `i`: towards a loopback target, the
/// connections after the first [`PER_SOURCE`] are spread over 127.0.0.2,
/// 127.0.0.3, ... (all of 127/8 is loopback on Linux), [`PER_SOURCE`] each,
/// so that one machine can open more connections to one port than it has
/// ephemeral ports. The first ones connect without binding: binding first
/// makes the kernel search for a port free of every socket on that address,
/// TIME_WAIT ones included, which after a few runs took seconds.
fn source(target: SocketAddr, i: usize) -> Option<SocketAddr> {
    match target.ip() {
        IpAddr::V4(ip) if ip.is_loopback() && i >= PER_SOURCE => {
            let n = u32::try_from(1 + i / PER_SOURCE).ok()?;
            let ip = Ipv4Addr::from(u32::from(Ipv4Addr::new(127, 0, 0, 0)) + n);
            Some(SocketAddr::new(IpAddr::V4(ip), 0))
        }
        _ => None,
    }
}

async fn tcp(target: SocketAddr, i: usize) -> std::io::Result<TcpStream> {
    let Some(from) = source(target, i) else {
        return TcpStream::connect(target).await;
    };
    let socket = TcpSocket::new_v4()?;
    socket.bind(from)?;
    socket.connect(target).await
}

async fn open(args: &IdleArgs, i: usize) -> Result<TcpStream, String> {
    let mut stream = tcp(args.target, i)
        .await
        .map_err(|e| format!("connect #{i}: {e}"))?;
    stream
        .write_all(&connect_packet(&format!("idle-{}-{i}", std::process::id())))
        .await
        .map_err(|e| e.to_string())?;
    let mut connack = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut connack))
        .await
        .map_err(|_| format!("no CONNACK for #{i}"))?
        .map_err(|e| e.to_string())?;
    if n < 4 || connack[0] != 0x20 || connack[3] != 0 {
        return Err(format!("connection #{i} refused: {:?}", &connack[..n]));
    }
    Ok(stream)
}

pub async fn run(args: IdleArgs) -> Result<(), String> {
    raise_nofile(args.connections + 64);
    let started = std::time::Instant::now();
    let mut streams = Vec::with_capacity(args.connections);
    let mut pending = tokio::task::JoinSet::new();
    let mut next = 0;
    while streams.len() < args.connections {
        while next < args.connections && pending.len() < args.parallel.max(1) {
            let args = args.clone();
            pending.spawn(async move { open(&args, next).await });
            next += 1;
        }
        match pending.join_next().await {
            Some(Ok(result)) => streams.push(result?),
            Some(Err(e)) => return Err(e.to_string()),
            None => break,
        }
    }
    println!(
        "connected {} in {:.1} s; holding for {} s",
        streams.len(),
        started.elapsed().as_secs_f64(),
        args.hold
    );
    tokio::time::sleep(Duration::from_secs(args.hold)).await;
    println!("done");
    Ok(())
}

/// Raises this process's open-file limit to what `need` connections take:
/// the soft limit up to the hard one, and the hard one too where allowed
/// (root).
fn raise_nofile(need: usize) {
    use rlimit::Resource;
    let need = need as u64;
    let Ok((soft, hard)) = Resource::NOFILE.get() else {
        return;
    };
    if soft < need && Resource::NOFILE.set(need, hard.max(need)).is_err() {
        let _ = Resource::NOFILE.set(hard, hard);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_connections_spread_over_source_addresses() {
        let target: SocketAddr = "127.0.0.1:1883".parse().unwrap();
        let ip = |i| source(target, i).unwrap().ip().to_string();
        assert_eq!(source(target, 0), None);
        assert_eq!(source(target, PER_SOURCE - 1), None);
        assert_eq!(ip(PER_SOURCE), "127.0.0.2");
        assert_eq!(ip(2 * PER_SOURCE - 1), "127.0.0.2");
        assert_eq!(ip(5 * PER_SOURCE), "127.0.0.6");
        assert_eq!(source("10.0.0.1:1883".parse().unwrap(), 0), None);
    }
}
