#!/usr/bin/env bash
# The long fault run of the clustered state store (docs/cluster.md): for
# each seed, 3 etcd members and 3 nodes under a 12-process random workload
# for 120 s while a node is killed and restarted, the etcd leader is killed
# and restarted, the etcd leader is paused for 10 s and a node is paused
# for 8 s; the history is checked for linearizability and versions.
#   bench/cluster-faults.sh [SEED ...]     (default: seeds 1 to 5)
# STATEBROKER_ETCD_ELECTION_MS=1000 runs etcd with its own default election
# timeout instead of the harness's 2,500 ms (a leader kill stalls about that).
set -euo pipefail
cd "$(dirname "$0")/.."
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(1 2 3 4 5)
cargo build --release -p statebroker-cluster-tests --tests --bins
for seed in "${seeds[@]}"; do
    echo "== seed $seed"
    STATEBROKER_SEED=$seed STATEBROKER_FAULT_RUN=long \
        cargo test --release -p statebroker-cluster-tests --test linearizable \
        a_workload_under_node_and_etcd_leader_kills_is_linearizable -- --nocapture \
        | grep -E "seed|operations|killed|paused|resumed|restarted|test result|panicked|violation"
done
