//! statebroker as a library: [`testing::TestBroker`] runs the broker inside
//! a test (the `statebroker` binary is `src/main.rs`; the broker itself is
//! the `broker` crate, re-exported here).

#![warn(missing_docs)]

pub mod testing;

pub use broker;
