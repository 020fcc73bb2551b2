//! Nothing but the tests in `tests/`, and the broker binary they start
//! (`statebroker-node`, the root package's `src/main.rs` with clustering).
