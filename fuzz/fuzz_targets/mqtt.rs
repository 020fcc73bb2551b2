//! The broker's MQTT input path: protocol detection, the pre-decode checks,
//! and rumqttd's decoders themselves (unguarded: a decoder panic must show
//! here, not be caught).
#![no_main]

use broker::codec::{self, Protocol};
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = codec::detect(data, 1 << 20);
    for protocol in [Protocol::V4, Protocol::V5] {
        let mut buf = BytesMut::from(data);
        // Read packets until the bytes run out or one is refused.
        for _ in 0..64 {
            match codec::inspect(&buf, 1 << 20) {
                Ok(Some(_)) => {
                    if protocol.decode(&mut buf, 1 << 20).is_err() {
                        break;
                    }
                }
                _ => break,
            }
        }
    }
});
