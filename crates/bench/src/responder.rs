//! The external responder: one plain MQTT 5 client that answers state store
//! requests from its own hash map, so that any broker can be measured on the
//! same workload as statebroker's in-process store.

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
use rumqttc::v5::{AsyncClient, Event, MqttOptions};
use statestore::resp3::{Frame, parse_request};
use tokio::sync::mpsc;

use crate::ResponderArgs;

/// The request topic of the external-responder workload: an ordinary topic
/// that every broker routes (statebroker serves its own request topic in process).
pub const EXTERNAL_TOPIC: &str = "bench/statestore/command/invoke";

/// Answers one request from `map`.
pub fn answer(map: &mut HashMap<Vec<u8>, Vec<u8>>, payload: &[u8]) -> Vec<u8> {
    let frame = match parse_request(payload).as_deref() {
        Ok([verb, key, value, ..]) if verb.eq_ignore_ascii_case(b"SET") => {
            map.insert(key.to_vec(), value.to_vec());
            Frame::Simple("OK")
        }
        Ok([verb, key]) if verb.eq_ignore_ascii_case(b"GET") => match map.get(*key) {
            Some(value) => Frame::Bulk(value.clone()),
            None => Frame::Null,
        },
        Ok(_) => Frame::Error("unknown command"),
        Err(_) => Frame::Error("syntax error"),
    };
    frame.to_vec()
}

pub async fn run(args: ResponderArgs) -> Result<(), String> {
    let mut options = MqttOptions::new(
        format!("bench-responder-{}", std::process::id()),
        args.target.ip().to_string(),
        args.target.port(),
    );
    options.set_keep_alive(Duration::from_secs(60));
    options.set_clean_start(true);
    options.set_outgoing_inflight_upper_limit(u16::MAX);
    let mut network = rumqttc::NetworkOptions::new();
    network.set_tcp_nodelay(true);
    options.set_network_options(network);
    let (client, mut eventloop) = AsyncClient::new(options, 4096);
    client
        .subscribe(args.topic.clone(), QoS::AtLeastOnce)
        .await
        .map_err(|e| e.to_string())?;

    // The event loop only moves packets; a worker answers, so that publishing
    // a response never waits on the loop that must send it.
    let (work_tx, mut work_rx) = mpsc::unbounded_channel::<(String, Option<Bytes>, Bytes)>();
    let publisher = client.clone();
    tokio::spawn(async move {
        let mut map = HashMap::new();
        while let Some((topic, correlation, payload)) = work_rx.recv().await {
            let response = answer(&mut map, &payload);
            let properties = PublishProperties {
                correlation_data: correlation,
                content_type: Some("application/octet-stream".into()),
                user_properties: vec![
                    ("__stat".into(), "200".into()),
                    ("__protVer".into(), "1.0".into()),
                ],
                ..PublishProperties::default()
            };
            if publisher
                .publish_with_properties(topic, QoS::AtLeastOnce, false, response, properties)
                .await
                .is_err()
            {
                return;
            }
        }
    });

    loop {
        match eventloop.poll().await {
            Ok(Event::Incoming(Packet::SubAck(_))) => println!("ready"),
            Ok(Event::Incoming(Packet::Publish(p))) => {
                let Some(props) = p.properties else { continue };
                let Some(topic) = props.response_topic else {
                    continue;
                };
                let _ = work_tx.send((topic, props.correlation_data, p.payload));
            }
            Ok(_) => {}
            Err(e) => return Err(format!("responder connection: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use statestore::resp3::encode_request;

    #[test]
    fn answers_get_and_set() {
        let mut map = HashMap::new();
        assert_eq!(answer(&mut map, &encode_request(&["GET", "k"])), b"$-1\r\n");
        assert_eq!(
            answer(&mut map, &encode_request(&["SET", "k", "v"])),
            b"+OK\r\n"
        );
        assert_eq!(
            answer(&mut map, &encode_request(&["GET", "k"])),
            b"$1\r\nv\r\n"
        );
        assert_eq!(answer(&mut map, b"junk"), b"-ERR syntax error\r\n");
    }
}
