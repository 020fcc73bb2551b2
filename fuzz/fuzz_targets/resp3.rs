//! The RESP3 request parser: never panics, and what it accepts re-encodes
//! to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use statestore::resp3::{encode_request, parse_request};

fuzz_target!(|data: &[u8]| {
    if let Ok(args) = parse_request(data) {
        assert_eq!(encode_request(&args), data, "accepted bytes re-encode to themselves");
    }
});
