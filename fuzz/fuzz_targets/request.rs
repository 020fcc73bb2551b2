//! The request path of the store: arbitrary payloads and user properties
//! against a store with some keys, watchers and expiries. Never panics, and
//! every answer is one RESP3 frame.
#![no_main]

use libfuzzer_sys::fuzz_target;
use statestore::resp3::{encode_request, parse_reply};
use statestore::{Caller, Config, Dialect, Quota, Request, Store};

const NOW: u64 = 1_700_000_000_000;

fuzz_target!(|data: &[u8]| {
    let mut store = Store::new(Config {
        quota: Quota { max_keys: 64, max_bytes: 4096, max_key_size: 64, max_value_size: 256 },
        scan_page_size: 3,
        ..Config::default()
    });
    let me = Caller { client_id: "fuzz", connection: 1, owner: "fuzz" };
    let ts = format!("{NOW}:0:fuzz");
    for (i, args) in [
        vec!["SET", "a", "1"],
        vec!["SET", "b", "2", "PX", "5"],
        vec!["KEYNOTIFY", "a"],
        vec!["KEYNOTIFY", "b"],
    ]
    .iter()
    .enumerate()
    {
        let payload = encode_request(args);
        let request = Request { payload: &payload, timestamp: Some(&ts), ..Request::default() };
        store.execute(&request, me, NOW + i as u64);
    }
    // Split the input into user properties and payload(s).
    let mut parts = data.splitn(4, |&b| b == 0xFF);
    let timestamp = parts.next().and_then(|p| std::str::from_utf8(p).ok());
    let fencing_token = parts.next().and_then(|p| std::str::from_utf8(p).ok());
    let flags = parts.next().and_then(|p| p.first().copied()).unwrap_or(0);
    let payload = parts.next().unwrap_or(data);
    let request = Request {
        payload,
        timestamp,
        fencing_token,
        persist: flags & 1 == 1,
        dialect: if flags & 2 == 2 { Dialect::Legacy2023 } else { Dialect::V1 },
        access: None,
    };
    for step in 0..3u64 {
        let out = store.execute(&request, me, NOW + 3 + step);
        assert!(parse_reply(&out.payload).is_ok(), "{:?}", out.payload);
    }
    let _ = store.expire(u64::MAX);
});
