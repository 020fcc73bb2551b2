#!/usr/bin/env bash
# The long fault runs of the cluster (docs/cluster.md), 3 etcd members and
# 3 nodes for 120 s while a node is killed and restarted, the etcd leader
# is killed and restarted, the etcd leader is paused for 10 s and a node is
# paused for 8 s:
#   bench/cluster-faults.sh [SEED ...]       the state store: a 12-process
#       random workload per seed (default seeds 1 to 5), its history checked
#       for linearizability and versions;
#   bench/cluster-faults.sh mqtt [ROUNDS]     MQTT: numbered QoS 1/2 and
#       retained publishers and persistent QoS 2 subscribers on every node
#       (tests/mqtt_faults.rs), ROUNDS times (default 5), deliveries checked.
# The store's runs start etcd with its own default election timeout, 1,000
# ms (STATEBROKER_ETCD_ELECTION_MS=2500 for the harness's default, which
# keeps a loaded CI machine from spurious elections); a leader kill stalls
# requests about that long, and each run prints etcd's election time and
# when answers came again.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p statebroker-cluster-tests --tests --bins
if [ "${1:-}" = mqtt ]; then
    rounds="${2:-5}"
    failed=0
    for round in $(seq "$rounds"); do
        echo "== round $round"
        STATEBROKER_FAULT_RUN=long \
            cargo test --release -p statebroker-cluster-tests --test mqtt_faults -- --nocapture \
            | grep -E "^(nemesis|publisher|s[0-9]: [0-9]|retained|test result)|panicked|left:|right:" \
            || failed=$((failed + 1))
    done
    echo "$failed of $rounds rounds failed"
    [ "$failed" -eq 0 ]
    exit
fi
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(1 2 3 4 5)
for seed in "${seeds[@]}"; do
    echo "== seed $seed"
    STATEBROKER_SEED=$seed STATEBROKER_FAULT_RUN=long \
        STATEBROKER_ETCD_ELECTION_MS="${STATEBROKER_ETCD_ELECTION_MS:-1000}" \
        cargo test --release -p statebroker-cluster-tests --test linearizable \
        a_workload_under_node_and_etcd_leader_kills_is_linearizable -- --nocapture \
        | grep -E "seed|operations|without any answer|new leader|no election|watcher|fenced|killed|paused|resumed|restarted|test result|panicked|violation"
done
