#!/usr/bin/env bash
# Instructions per message across cluster nodes, as callgrind counts them
# (they do not depend on the machine's speed or load): one etcd member and
# 3 statebroker nodes on loopback, each under callgrind; statebroker-bench
# pubsub with publishers on node 1 and subscribers on node 2 (node 3 has
# neither, and gets every publish over its link), a short and a long run;
# each node's user-space instructions per message, marginal between the two
# runs (connecting and subscribing cancel out).
#
#   bench/cluster-callgrind.sh [PATTERN] [QOS] [CLIENTS]   (pairs 1 16)
#
# NODE=path: another statebroker-node binary (an older build, to compare);
# KEEP=DIR: keep each node's callgrind file of the long run there
# (DIR/sbI.callgrind, for callgrind_annotate).
# Needs etcd and valgrind on PATH; builds what it runs.
set -euo pipefail
cd "$(dirname "$0")/.."
pattern="${1:-pairs}" qos="${2:-1}" n="${3:-16}"
cargo build --release -q -p statebroker-cluster-tests --bin statebroker-node
cargo build --release -q --bin statebroker-bench
node="${NODE:-target/release/statebroker-node}"
bench=target/release/statebroker-bench
# shellcheck source=bench/one-etcd.sh
source bench/one-etcd.sh
declare -a mp hp vg
for i in 1 2 3; do
    mp[$i]=$(port) hp[$i]=$(port)
    valgrind --tool=callgrind --callgrind-out-file="$dir/cg.sb$i" \
        "$node" --listen "127.0.0.1:${mp[$i]}" --http "127.0.0.1:${hp[$i]}" --in-memory \
        --cluster-node-id "sb$i" --etcd-endpoints "$endpoints" >"$dir/sb$i.log" 2>&1 &
    pids+=($!)
    vg[$i]=$!
done
for i in 1 2 3; do
    timeout 120 bash -c "until curl -s 127.0.0.1:${hp[$i]}/metrics | grep -q '^statebroker_cluster_peer_links 2'; do sleep 0.5; done"
    timeout 120 bash -c "until curl -sf 127.0.0.1:${hp[$i]}/readyz >/dev/null; do sleep 0.5; done"
done
# Instructions of node i since its last dump (callgrind_control -d starts
# a new count).
dumped() {
    local before after
    before=$(find "$dir" -name "cg.sb$1.*" | wc -l)
    callgrind_control -d "${vg[$1]}" >/dev/null 2>&1
    timeout 60 bash -c "until [ \$(find $dir -name 'cg.sb$1.*' | wc -l) -gt $before ]; do sleep 0.2; done"
    sleep 0.5
    after=$(ls -t "$dir"/cg.sb"$1".* | head -1)
    [ -n "${KEEP:-}" ] && mkdir -p "$KEEP" && cp "$after" "$KEEP/sb$1.callgrind"
    grep -E '^(summary|totals):' "$after" | head -1 | awk '{print $2}'
}
run() { # seconds -> messages received
    "$bench" pubsub --pattern "$pattern" -n "$n" --qos "$qos" -d "$1" --warmup 0 \
        --target "127.0.0.1:${mp[1]}" --subscriber-target "127.0.0.1:${mp[2]}" >"$dir/bench.$1" 2>&1
    grep -oE 'received [0-9]+' "$dir/bench.$1" | head -1 | awk '{print $2}'
}
for i in 1 2 3; do dumped "$i" >/dev/null; done
m1=$(run 5)
for i in 1 2 3; do a[$i]=$(dumped "$i"); done
m2=$(run 15)
for i in 1 2 3; do b[$i]=$(dumped "$i"); done
echo "node $node; $pattern QoS $qos, $n clients; messages $m1 and $m2"
for i in 1 2 3; do
    python3 -c 'import sys; i, a, b, m1, m2 = sys.argv[1:]; print("sb%s: %s and %s instructions, %.0f a message" % (i, a, b, (int(b) - int(a)) / (int(m2) - int(m1))))' \
        "$i" "${a[$i]}" "${b[$i]}" "$m1" "$m2"
done
