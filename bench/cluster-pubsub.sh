#!/usr/bin/env bash
# MQTT publish/subscribe across cluster nodes on this machine: one etcd
# member and 3 statebroker nodes on loopback (release builds), then, in the
# same run, statebroker-bench pubsub (pairs, fan-in, fan-out at QoS 0 and 1)
# with publishers on node 1 and subscribers on node 2 ("cross"), both on
# node 1 ("same node": its publishes still go to the two other nodes), the
# single node (no cluster) and mosquitto.
#   bench/cluster-pubsub.sh [SECONDS] [CLIENTS]   (default 5 s, 16 clients)
# PERSISTENT=1: subscribers keep persistent sessions (a cluster node then
# keeps each QoS 1 message for them in etcd too, until acknowledged);
# NODE=path: another statebroker-node binary (an older build, to compare);
# CROSS_ONLY=1: only the cross-node QoS 1 rows, each with how far etcd's
# revision moved during it (what the nodes wrote there) and each node's
# CPU time (user + kernel) per message during it.
# PERF=DIR (with CROSS_ONLY=1): also sample each node with `perf record -e
# cpu-clock -g` during each row, into DIR/PATTERN-sbI.data (software
# sampling: works where the machine has no hardware counters; PERF_ARGS
# replaces `-g`, e.g. `--call-graph dwarf` for Rust frames).
# Needs etcd and mosquitto on PATH; builds what it runs.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-5}" n="${2:-16}"
cargo build --release -q -p statebroker-cluster-tests --bin statebroker-node
cargo build --release -q --bin statebroker-bench
node="${NODE:-target/release/statebroker-node}"
persistent=()
[ "${PERSISTENT:-0}" = 1 ] && persistent=(--persistent)
bench=target/release/statebroker-bench
# shellcheck source=bench/one-etcd.sh
source bench/one-etcd.sh
declare -a mp hp
for i in 1 2 3; do
    mp[$i]=$(port) hp[$i]=$(port)
    "$node" --listen "127.0.0.1:${mp[$i]}" --http "127.0.0.1:${hp[$i]}" --in-memory \
        --cluster-node-id "sb$i" --etcd-endpoints "$endpoints" >"$dir/sb$i.log" 2>&1 &
    pids+=($!)
    nodepid[$i]=$!
done
single=$(port) mosq=$(port)
"$node" --listen "127.0.0.1:$single" --no-http --in-memory >"$dir/single.log" 2>&1 &
pids+=($!)
printf 'listener %s 127.0.0.1\nallow_anonymous true\nmax_queued_messages 100000\n' "$mosq" >"$dir/mosquitto.conf"
mosquitto -c "$dir/mosquitto.conf" >"$dir/mosquitto.log" 2>&1 &
pids+=($!)
for p in "${mp[@]}" "$single" "$mosq"; do
    timeout 30 bash -c "until (exec 3<>/dev/tcp/127.0.0.1/$p) 2>/dev/null; do sleep 0.2; done"
done
# Every node linked to the two others, and taking clients.
for h in "${hp[@]}"; do
    timeout 30 bash -c "until curl -s 127.0.0.1:$h/metrics | grep -q '^statebroker_cluster_peer_links 2'; do sleep 0.2; done"
    timeout 30 bash -c "until curl -sf 127.0.0.1:$h/readyz >/dev/null; do sleep 0.2; done"
done
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $n clients, $secs s each; node $node${persistent:+, persistent subscribers}"
printf '%-8s %-4s %-22s %12s %10s %10s %6s %6s\n' pattern qos system msgs/s p50_us p99_us lost dup
run() { # pattern qos name publisher-port [subscriber-port]
    local pattern=$1 qos=$2 name=$3 pub=$4 sub=${5:-$4} out
    out=$("$bench" pubsub --json --pattern "$pattern" -n "$n" --qos "$qos" -d "$secs" --warmup 1 "${persistent[@]}" \
        --target "127.0.0.1:$pub" --subscriber-target "127.0.0.1:$sub")
    python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print("%-8s %-4s %-22s %12.0f %10d %10d %6d %6d" % (sys.argv[2], sys.argv[3], sys.argv[4], r["messages_per_sec"], r["p50_us"], r["p99_us"], r["lost"], r["duplicated"]))' \
        "$out" "$pattern" "$qos" "$name"
}
if [ "${CROSS_ONLY:-0}" = 1 ]; then
    revision() {
        ETCDCTL_API=3 etcdctl --endpoints="$endpoints" endpoint status -w json |
            python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["Status"]["header"]["revision"])'
    }
    # Clock ticks (user + kernel) each node has used so far.
    ticks() {
        for i in 1 2 3; do
            awk '{print $14 + $15}' "/proc/${nodepid[$i]}/stat"
        done | paste -sd' '
    }
    for pattern in pairs fan-in fan-out; do
        before=$(revision)
        perfs=()
        if [ -n "${PERF:-}" ]; then
            mkdir -p "$PERF"
            for i in 1 2 3; do
                perf record -q -e cpu-clock ${PERF_ARGS:--g} -p "${nodepid[$i]}" -o "$PERF/$pattern-sb$i.data" 2>/dev/null &
                perfs+=($!)
            done
        fi
        cpu_before=$(ticks)
        row=$(run "$pattern" 1 "cluster: cross" "${mp[1]}" "${mp[2]}")
        cpu_after=$(ticks)
        for p in "${perfs[@]}"; do kill -INT "$p"; wait "$p" || true; done
        echo "$row"
        echo "  etcd revisions during it: $(($(revision) - before))"
        python3 -c 'import sys
before, after = [list(map(int, a.split())) for a in sys.argv[1:3]]
rate, secs, hz = float(sys.argv[3].split()[4]), float(sys.argv[4]), float(sys.argv[5])
# The run lasts its warm-up second too: CPU over all of it, messages at
# the measured rate over all of it (an estimate).
msgs = rate * (secs + 1)
print("  CPU per message, nodes 1 2 3 (us): " + " ".join("%.2f" % ((a - b) / hz * 1e6 / msgs) for b, a in zip(before, after)))' \
            "$cpu_before" "$cpu_after" "$row" "$secs" "$(getconf CLK_TCK)"
    done
    exit
fi
for pattern in pairs fan-in fan-out; do
    for qos in 0 1; do
        run "$pattern" "$qos" "cluster: cross" "${mp[1]}" "${mp[2]}"
        run "$pattern" "$qos" "cluster: same node" "${mp[1]}"
        run "$pattern" "$qos" "single node" "$single"
        run "$pattern" "$qos" "mosquitto" "$mosq"
    done
done
