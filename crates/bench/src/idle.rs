//! `idle`: many connections that do nothing, to measure what the broker
//! spends per connection. Plain sockets with a hand-written CONNECT keep the
//! client side cheap (no MQTT client state per connection).

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

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

async fn open(args: &IdleArgs, i: usize) -> Result<TcpStream, String> {
    let mut stream = TcpStream::connect(args.target)
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
    let started = std::time::Instant::now();
    let mut streams = Vec::with_capacity(args.connections);
    let mut pending = tokio::task::JoinSet::new();
    let mut next = 0;
    while streams.len() < args.connections {
        while next < args.connections && pending.len() < 128 {
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
