//! Starts and hurts real processes for statebroker's cluster tests.

mod etcd;
mod node;
mod process;

pub use etcd::{EtcdCluster, EtcdOptions, MemberStatus};
pub use node::{DIR_PLACEHOLDER, Node, NodeSpec};
pub use process::{KEEP_ENV, ProcState, free_port, keep_files, tail_file, wait_tcp};
