#!/usr/bin/env bash
# Instructions per state store request, as callgrind counts them (they do
# not depend on the machine's speed or load): the broker's user-space
# instructions, marginal between two runs of statebroker-bench of
# different lengths (so start-up and connecting cancel out).
#
#   bench/callgrind.sh BROKER_BINARY [CONNECTIONS] [BENCH_ARGS...]
#
# Prints the requests and instructions of each run and the marginal
# instructions per request.
set -euo pipefail
broker="$1"; shift
conns="${1:-16}"; shift || true
bench="${BENCH:-$(dirname "$0")/../target/release/statebroker-bench}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
run() {
    local secs="$1"; shift
    local port
    port=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
    valgrind --tool=callgrind --callgrind-out-file="$out/cg.$secs" \
        "$broker" --in-memory --no-http --listen "127.0.0.1:$port" >/dev/null 2>&1 &
    local pid=$!
    for _ in $(seq 200); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
        sleep 0.1
    done
    "$bench" --target "127.0.0.1:$port" -c "$conns" -d "$secs" --warmup 0 "$@" >"$out/bench.$secs" 2>&1
    kill -TERM "$pid"; wait "$pid" || true
    local requests ir
    requests=$(grep -oE 'requests [0-9]+' "$out/bench.$secs" | head -1 | awk '{print $2}')
    ir=$(grep -E '^(summary|totals):' "$out/cg.$secs" | head -1 | awk '{print $2}')
    echo "$secs s: requests $requests instructions $ir" >&2
    echo "$requests $ir"
}
read -r r1 i1 < <(run 4 "$@")
read -r r2 i2 < <(run 12 "$@")
python3 - "$r1" "$i1" "$r2" "$i2" <<'PY'
import sys
r1, i1, r2, i2 = map(int, sys.argv[1:])
print(f"marginal instructions per request: {(i2 - i1) / (r2 - r1):,.0f} ({r2 - r1:,} requests)")
PY
