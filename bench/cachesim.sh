#!/usr/bin/env bash
# Cache misses per request, as callgrind's cache simulation counts them for
# a given machine's caches (most VMs expose no hardware counters): the
# server's user-space instructions and L1/L2 misses, marginal between two
# runs of different lengths, at 64 connections, for statebroker's state
# store or for redis-server, the same requests from the same client
# (statebroker-bench, 50/50 GET/SET; `--protocol resp` for Redis; before
# 2026-12-01 Redis's load was redis-benchmark's GETs). callgrind
# simulates two levels: its "LL" stands for the L2 here (the machines' L3
# hold either server's working set).
#
#   bench/cachesim.sh statebroker|redis amd|amd1m|intel [BROKER_BINARY]
#
# PIN=1 runs the server on core 0 only, as bench/compare.py and
# bench/cputime.py run it (with one core statebroker runs tokio's
# current-thread scheduler, unpinned on two its multi-thread one: ~200
# instructions a request fewer, 2026-12-03). Unpinned is how every
# earlier session's numbers were taken.
#
# amd:   L1i 32 KiB 8-way, L1d 32 KiB 8-way, L2 512 KiB 8-way (the AMD EPYC
#        VMs of the earlier sessions)
# amd1m: L1i 32 KiB 8-way, L1d 32 KiB 8-way, L2 1 MiB 8-way (the AMD EPYC
#        VM of 2026-12-01)
# intel: L1i 32 KiB 8-way, L1d 48 KiB 12-way, L2 2 MiB 16-way (the Intel
#        Xeon VM of 2026-11-29)
set -euo pipefail
server="$1"; machine="$2"
broker="${3:-$(dirname "$0")/../target/release/statebroker}"
bench="${BENCH:-$(dirname "$0")/../target/release/statebroker-bench}"
case "$machine" in
    amd) caches=(--I1=32768,8,64 --D1=32768,8,64 --LL=524288,8,64) ;;
    amd1m) caches=(--I1=32768,8,64 --D1=32768,8,64 --LL=1048576,8,64) ;;
    intel) caches=(--I1=32768,8,64 --D1=49152,12,64 --LL=2097152,16,64) ;;
    *) echo "machine: amd, amd1m or intel" >&2; exit 2 ;;
esac
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
free_port() {
    python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'
}
wait_port() {
    for _ in $(seq 300); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.1
    done
    return 1
}
# run SECONDS: the load's length.
run() {
    local size="$1" port pid requests
    port=$(free_port)
    local cg=(${PIN:+taskset -c 0} valgrind --tool=callgrind --cache-sim=yes "${caches[@]}" --callgrind-out-file="$out/cg.$size")
    if [ "$server" = statebroker ]; then
        "${cg[@]}" "$broker" --in-memory --no-http --listen "127.0.0.1:$port" >/dev/null 2>&1 &
        pid=$!
        wait_port "$port"
        "$bench" --target "127.0.0.1:$port" -c 64 -d "$size" --warmup 0 >"$out/bench.$size" 2>&1
        requests=$(grep -oE 'requests [0-9]+' "$out/bench.$size" | head -1 | awk '{print $2}')
    else
        "${cg[@]}" redis-server --port "$port" --save '' --appendonly no >/dev/null 2>&1 &
        pid=$!
        wait_port "$port"
        "$bench" --protocol resp --target "127.0.0.1:$port" -c 64 -d "$size" --warmup 0 >"$out/bench.$size" 2>&1
        requests=$(grep -oE 'requests [0-9]+' "$out/bench.$size" | head -1 | awk '{print $2}')
    fi
    kill -TERM "$pid"; wait "$pid" || true
    # events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw
    echo "$requests $(grep -E '^(summary|totals):' "$out/cg.$size" | head -1 | cut -d' ' -f2-)"
}
sizes=(4 12)
read -r -a a < <(run "${sizes[0]}")
read -r -a b < <(run "${sizes[1]}")
python3 - "$server" "$machine" "${a[@]}" "${b[@]}" <<'PY'
import sys
server, machine = sys.argv[1:3]
a = list(map(int, sys.argv[3:13])); b = list(map(int, sys.argv[13:23]))
n = b[0] - a[0]
d = [(y - x) / n for x, y in zip(a[1:], b[1:])]
ir, dr, dw, i1, d1r, d1w, ilr, dlr, dlw = d
print(f"{server} on {machine} caches, {n:,} requests: per request "
      f"Ir {ir:,.0f}, data refs {dr + dw:,.0f}, "
      f"L1i misses {i1:,.1f}, L1d misses {d1r + d1w:,.1f}, "
      f"L2 misses {ilr + dlr + dlw:,.1f} (instr {ilr:,.1f}, data {dlr + dlw:,.1f})")
PY
