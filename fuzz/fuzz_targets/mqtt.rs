//! The broker's MQTT input path: protocol detection, the pre-decode checks,
//! and rumqttd's decoders themselves (unguarded: a decoder panic must show
//! here, not be caught); and the state store request reader, which must
//! read whatever it takes as the decoder does.
#![no_main]

use broker::codec::{self, Protocol};
use broker::request_publish;
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = codec::detect(data, 1 << 20);
    request_publish::assert_read_as_decoded(data);
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
