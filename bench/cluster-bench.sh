#!/usr/bin/env bash
# The clustered state store's speed on this machine: 3 etcd members and 3
# statebroker nodes on loopback (release builds), statebroker-bench against
# one node, SETs and GETs at 1 and 64 connections; GETs against a fourth
# node with [clustering] cached_reads; raw etcd requests shaped like a
# node's (etcd-txn-bench: the floor); then the single node (no etcd) with
# the same load, all in the same run.
#   bench/cluster-bench.sh [SECONDS] [SET|GET ...]
#       SECONDS per workload (default 10); the workloads (default both).
#   NODE=path/to/statebroker-node: run that build of the node (to compare
#   two builds side by side); the default is this tree's release build.
#   ROUNDS=n: raw etcd and the cluster alternate n times on each line.
#   CONNECTIONS="1 64": the connection counts measured.
#   SPREAD=1: each round also runs etcd-txn-bench against etcd's leader
#   alone ("etcd-leader") and statebroker-bench against a fifth node with
#   [clustering] requests_to_leader = false ("spread"), which sends its
#   requests to every member as etcd's client does.
# Each cluster line ends with node 1's mean time per request from its
# /metrics (arrival to answer, and etcd's part of it).
# Needs etcd 3.4+ on PATH; builds what it runs.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-10}"
shift || true
workloads=("${@:-SET GET}")
# shellcheck disable=SC2206
workloads=(${workloads[*]})
cargo build --release -q -p statebroker-cluster-tests --bins
txnbench=target/release/etcd-txn-bench
cargo build --release -q --bin statebroker-bench
node="${NODE:-target/release/statebroker-node}"
bench=target/release/statebroker-bench
dir="$(mktemp -d)"
pids=()
cleanup() { kill -9 "${pids[@]}" 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
cluster="" endpoints=""
declare -a cp pp
for i in 1 2 3; do cp[$i]=$(port); pp[$i]=$(port); done
for i in 1 2 3; do
    cluster+="m$i=http://127.0.0.1:${pp[$i]},"
    endpoints+="http://127.0.0.1:${cp[$i]},"
done
cluster="${cluster%,}" endpoints="${endpoints%,}"
for i in 1 2 3; do
    etcd --name "m$i" --data-dir "$dir/m$i" \
        --listen-client-urls "http://127.0.0.1:${cp[$i]}" --advertise-client-urls "http://127.0.0.1:${cp[$i]}" \
        --listen-peer-urls "http://127.0.0.1:${pp[$i]}" --initial-advertise-peer-urls "http://127.0.0.1:${pp[$i]}" \
        --initial-cluster "$cluster" --initial-cluster-token "bench$$" --initial-cluster-state new \
        --pre-vote=true --heartbeat-interval=100 --election-timeout=2500 >"$dir/m$i.log" 2>&1 &
    pids+=($!)
done
ETCDCTL_API=3 timeout 60 bash -c "until etcdctl --endpoints=$endpoints endpoint health >/dev/null 2>&1; do sleep 0.5; done"
declare -a mp
declare -a hp
for i in 1 2 3; do
    mp[$i]=$(port) hp[$i]=$(port)
    "$node" --listen "127.0.0.1:${mp[$i]}" --http "127.0.0.1:${hp[$i]}" --in-memory \
        --cluster-node-id "sb$i" --etcd-endpoints "$endpoints" >"$dir/sb$i.log" 2>&1 &
    pids+=($!)
done
mp[4]=$(port) hp[4]=$(port)
STATEBROKER__CLUSTERING__CACHED_READS=true "$node" --listen "127.0.0.1:${mp[4]}" --http "127.0.0.1:${hp[4]}" --in-memory \
    --cluster-node-id sb4 --etcd-endpoints "$endpoints" >"$dir/sb4.log" 2>&1 &
pids+=($!)
mp[5]=$(port) hp[5]=$(port)
if [ -n "${SPREAD:-}" ]; then
    STATEBROKER__CLUSTERING__REQUESTS_TO_LEADER=false "$node" --listen "127.0.0.1:${mp[5]}" --http "127.0.0.1:${hp[5]}" --in-memory \
        --cluster-node-id sb5 --etcd-endpoints "$endpoints" >"$dir/sb5.log" 2>&1 &
    pids+=($!)
else
    unset 'mp[5]' 'hp[5]'
fi
single=$(port)
"$node" --listen "127.0.0.1:$single" --no-http --in-memory >"$dir/single.log" 2>&1 &
pids+=($!)
for p in "${mp[@]}" "$single"; do
    timeout 30 bash -c "until (exec 3<>/dev/tcp/127.0.0.1/$p) 2>/dev/null; do sleep 0.2; done"
done
# A cluster node takes clients once the others have linked to it.
for h in "${hp[@]}"; do
    timeout 30 bash -c "until curl -sf 127.0.0.1:$h/readyz >/dev/null; do sleep 0.2; done"
done
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
# etcd's leader's client URL (for SPREAD's etcd-leader line).
leader_endpoint() {
    ETCDCTL_API=3 etcdctl --endpoints="$endpoints" endpoint status -w json | python3 -c '
import json, sys
for e in json.load(sys.stdin):
    if e["Status"]["leader"] == e["Status"]["header"]["member_id"]:
        print(e["Endpoint"])'
}
# Node 1's time per request, from its /metrics: the sums and counts of
# arrival-to-answer and of etcd's answers (reads for GET, writes for SET).
split() { # what
    local kind
    kind=$([ "$1" = SET ] && echo write || echo read)
    curl -s "127.0.0.1:${hp[1]}/metrics" | awk -v kind="$kind" '
        /^statebroker_statestore_request_duration_seconds_sum/ {s=$2}
        /^statebroker_statestore_request_duration_seconds_count/ {c=$2}
        $0 ~ "^statebroker_cluster_etcd_request_duration_seconds_sum.*kind=\"" kind "\"" {es=$2}
        $0 ~ "^statebroker_cluster_etcd_request_duration_seconds_count.*kind=\"" kind "\"" {ec=$2}
        END {print s+0, c+0, es+0, ec+0}'
}
means() { # before after: the node's and etcd's mean times between them
    python3 -c 'import sys
b = [float(x) for x in sys.argv[1].split()]; a = [float(x) for x in sys.argv[2].split()]
m = lambda i: (a[i] - b[i]) / max(a[i + 1] - b[i + 1], 1) * 1e6
print(f"| node 1 mean: arrival to answer {m(0):.0f} us, etcd {m(2):.0f} us")' "$1" "$2"
}
run() { # name what c: one line
    local name=$1 what=$2 c=$3 ratio line
    ratio=$([ "$what" = SET ] && echo 1 || echo 0)
    case $name in
        etcd) line=$("$txnbench" --endpoints "$endpoints" -c "$c" -d "$secs" --warmup 2 --set-ratio "$ratio") ;;
        etcd-leader) line=$("$txnbench" --endpoints "$(leader_endpoint)" -c "$c" -d "$secs" --warmup 2 --set-ratio "$ratio") ;;
        spread) line=$("$bench" --target "127.0.0.1:${mp[5]}" -c "$c" -d "$secs" --warmup 2 --set-ratio "$ratio" 2>&1 | grep -E "requests/s|p50" | tr '\n' ' ') ;;
        cluster)
            local before
            before=$(split "$what")
            line=$("$bench" --target "127.0.0.1:${mp[1]}" -c "$c" -d "$secs" --warmup 2 --set-ratio "$ratio" 2>&1 | grep -E "requests/s|p50" | tr '\n' ' ')
            line+=$(means "$before" "$(split "$what")")
            ;;
        cached) line=$("$bench" --target "127.0.0.1:${mp[4]}" -c "$c" -d "$secs" --warmup 2 --set-ratio "$ratio" 2>&1 | grep -E "requests/s|p50" | tr '\n' ' ') ;;
        single) line=$("$bench" --target "127.0.0.1:$single" -c "$c" -d "$secs" --warmup 2 --set-ratio "$ratio" 2>&1 | grep -E "requests/s|p50" | tr '\n' ' ') ;;
    esac
    echo "$name $what c=$c: $line"
}
# ROUNDS=n: raw etcd and the cluster alternate n times per line (the
# machine's speed drifts over a run; compare each round's pair).
for what in "${workloads[@]}"; do
    for c in ${CONNECTIONS:-1 64}; do
        for _ in $(seq "${ROUNDS:-1}"); do
            names=(etcd cluster)
            [ -n "${SPREAD:-}" ] && names=(etcd etcd-leader cluster spread)
            for name in "${names[@]}"; do run "$name" "$what" "$c"; done
        done
        run single "$what" "$c"
        [ "$what" = GET ] && run cached GET "$c"
    done
done
