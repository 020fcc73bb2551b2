//! The state store client behind `statebroker-cli`, as a library: the
//! cluster tests drive their workloads with it.
//!
//! - [`client`]: requests, answers and KEYNOTIFY notifications over MQTT 5;
//! - [`tls`]: the client's TLS settings.

pub mod client;
pub mod tls;
