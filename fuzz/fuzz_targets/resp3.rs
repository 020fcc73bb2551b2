//! The RESP3 parsers: the request parser never panics, and what it accepts
//! re-encodes to the same bytes; the client-side reply and SCAN page
//! decoders never panic either.
#![no_main]

use libfuzzer_sys::fuzz_target;
use statestore::command::Page;
use statestore::resp3::{encode_request, parse_reply, parse_request};

fuzz_target!(|data: &[u8]| {
    if let Ok(args) = parse_request(data) {
        assert_eq!(encode_request(&args[..]), data, "accepted bytes re-encode to themselves");
    }
    let _ = parse_reply(data);
    let _ = Page::decode(data);
});
