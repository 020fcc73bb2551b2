//! The Azure IoT Operations **state store**, as a library.
//!
//! The state store is a key/value store that MQTT clients use by
//! request/response over their broker. This crate is the store itself, with
//! no MQTT in it: the broker hands it a request and the caller's identity,
//! and publishes what it returns. This page is a tour of the protocol; each
//! module teaches its part.
//!
//! # A request, on the wire
//!
//! A client publishes to
//! `statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke`
//! (MQTT 5, QoS 1) with a **Response Topic** and **Correlation Data**, content
//! type `application/octet-stream`, and user properties: `__ts` (the client's
//! hybrid logical clock, see [`hlc`]), `__protVer` = `1.0`, `__srcId` (its
//! client id), optionally `__ft` (a fencing token, see [`fencing`]) and
//! `aio-persistence` = `true` (keep this key on disk). The payload is a RESP3
//! array of bulk strings (see [`resp3`]):
//!
//! ```text
//! *3\r\n$3\r\nSET\r\n$7\r\nmachine\r\n$4\r\nbusy\r\n
//! ```
//!
//! The broker answers on the Response Topic with the same Correlation Data,
//! user properties `__stat` = `200` (the official client rejects a response
//! without it, `-ERR` answers included), `__ts` (the key's version) and
//! `__protVer` = `1.0`, and a RESP3 payload:
//!
//! ```text
//! +OK\r\n
//! ```
//!
//! # The commands
//!
//! `SET`, `GET`, `DEL`, `VDEL`, `KEYNOTIFY` and `SCAN`, one module each under
//! [`command`]; the table of answers is there. Errors are `-ERR <text>\r\n`
//! with the exact texts in [`Error`].
//!
//! # Identity
//!
//! The caller is the MQTT client id of the connection the request came in on
//! ([`Caller`]); an identity written in the payload or in user properties is
//! never trusted. KEYNOTIFY registrations belong to that client id and die
//! with its connection (see [`notify`]). They also count against the
//! caller's **owner** ([`Caller::owner`]), the user behind the connection
//! (the broker gives the authenticated username, or the network address of
//! an anonymous client), so that one user cannot take every registration by
//! opening many connections or cycling client ids.
//!
//! # Versions, fencing, expiry
//!
//! Every SET gets a version from the store's hybrid logical clock ([`hlc`]),
//! strictly greater than the request's `__ts` and than every version before
//! it. A lock holder uses the version of its lock as a fencing token
//! ([`fencing`]). Keys set with `PX` expire exactly on time and are removed by
//! [`Store::expire`], at a cost proportional to what expires ([`db`]).
//!
//! # Using the library
//!
//! ```
//! use statestore::{Caller, Config, Request, Store, resp3::encode_request};
//!
//! let mut store = Store::new(Config::default());
//! let alice = Caller { client_id: "alice", connection: 1, owner: "alice" };
//! let now = 1_700_000_000_000;
//!
//! // alice watches "door", then sets it
//! let watch = encode_request(&["KEYNOTIFY", "door"]);
//! store.execute(&Request { payload: &watch, ..Default::default() }, alice, now);
//! let set = encode_request(&["SET", "door", "open"]);
//! let out = store.execute(
//!     &Request { payload: &set, timestamp: Some("1700000000000:0:alice"), ..Default::default() },
//!     alice,
//!     now,
//! );
//! assert_eq!(out.payload, b"+OK\r\n");
//! assert_eq!(out.notices.len(), 1);
//! assert_eq!(&*out.notices[0].watchers[0], "alice");
//! assert_eq!(out.notices[0].payload(), b"*4\r\n$6\r\nNOTIFY\r\n$3\r\nSET\r\n$5\r\nVALUE\r\n$4\r\nopen\r\n");
//! ```

#![warn(missing_docs)]

pub mod access;
pub mod browse;
pub mod command;
pub mod config;
pub mod db;
pub mod error;
pub mod fencing;
pub mod glob;
pub mod hlc;
pub mod notify;
pub mod persist;
pub mod plan;
pub mod resp3;
pub mod state;
pub mod store;

pub use access::KeyAccess;
pub use command::Dialect;
pub use config::{Config, Quota};
pub use error::Error;
pub use notify::{Event, Notice};
pub use state::{Caller, Effects, Restored};
pub use store::{Outcome, Request, Store};
