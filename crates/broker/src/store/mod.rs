//! The state store inside the broker.
//!
//! - [`binding`]: the MQTT face: which PUBLISH is a request and whether it
//!   may be served; the properties of responses and notifications.
//! - [`service`]: the [`statestore::Store`] behind a lock, the expiry timer,
//!   and the hand-off to persistence before anything is answered.
//! - `pending`: which changes not on disk yet an answer could show, and so
//!   must wait for.
//! - [`tickets`]: a cluster node's acknowledgements, held until their
//!   requests' outcome is out.
//!
//! Persisted keys go to disk through [`crate::persistence`].

pub mod binding;
#[cfg(feature = "cluster")]
mod clustered;
mod pending;
pub mod service;
pub mod tickets;

/// What a cluster node's service adds (nothing without the `cluster`
/// feature).
#[cfg(feature = "cluster")]
pub(crate) type ClusterPart = clustered::Clustered;
/// What a cluster node's service adds (nothing without the `cluster`
/// feature).
#[cfg(not(feature = "cluster"))]
pub(crate) type ClusterPart = std::convert::Infallible;

pub use service::StateStoreService;
