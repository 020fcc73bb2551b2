#!/usr/bin/env bash
# A profile-guided build of the broker, for packagers and for
# `bench/compare.py --pgo` (docs/performance.md, twenty-seventh session:
# 20% fewer instructions per state store request than the plain release
# build).
#
#   bench/pgo.sh [OUT]        # OUT defaults to target/pgo/statebroker
#
# 1. builds an instrumented broker (-Cprofile-generate) in target/pgo/gen;
# 2. trains it on loopback with statebroker-bench: state store requests at
#    1, 16 and 64 connections, persisted SETs, publish/subscribe pairs,
#    fan-in and fan-out at QoS 0, 1 and 2, retained and persistent
#    sessions;
# 3. merges the profile with llvm-profdata (the one of rustc's LLVM
#    version: `llvm-profdata-NN` from apt.llvm.org or Debian's `llvm-NN`);
# 4. builds the broker again with -Cprofile-use into OUT;
# 5. with BOLT=1 (llvm-bolt of the same LLVM, Debian's `bolt-NN`), lays the
#    optimized binary's code out again by where the same training spends
#    it (BOLT's instrumentation: no hardware counters needed): hot code
#    together, cold blocks split off, for fewer instruction cache misses.
#
# The release profile (Cargo.toml) already has fat LTO and one codegen
# unit; PGO adds the code layout and inlining of the measured paths.
# Extra cargo arguments go in PGO_CARGO_ARGS (e.g. "--features cluster";
# the training then covers only the single node's paths).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-target/pgo/statebroker}"
triple="$(rustc -vV | sed -n 's/^host: //p')"
llvm_major="$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')"
# An LLVM tool of rustc's LLVM version, or nothing.
llvm_tool() {
    local p
    for p in "$1-$llvm_major" "/usr/lib/llvm-$llvm_major/bin/$1" "$1"; do
        if command -v "$p" >/dev/null && "$p" --version 2>/dev/null | grep -q "LLVM version $llvm_major\."; then
            echo "$p"; return 0
        fi
    done
}
profdata="$(llvm_tool llvm-profdata)"
if [ -z "$profdata" ]; then
    echo "bench/pgo.sh: no llvm-profdata of LLVM $llvm_major (rustc's); on Debian: apt-get install llvm-$llvm_major" >&2
    exit 1
fi
bolt=""
if [ "${BOLT:-0}" = 1 ]; then
    bolt="$(llvm_tool llvm-bolt)"
    merge_fdata="$(llvm_tool merge-fdata)"
    if [ -z "$bolt" ] || [ -z "$merge_fdata" ]; then
        echo "bench/pgo.sh: BOLT=1 needs llvm-bolt of LLVM $llvm_major (rustc's); on Debian: apt-get install bolt-$llvm_major" >&2
        exit 1
    fi
fi
# A fixed directory for the raw profiles, so that the instrumented build
# (whose flags name it) is reused by the next run; the merged profile gets
# a new path each run, so that every crate is built again with it.
data="$PWD/target/pgo/profiles"
work="$(mktemp -d)"
pid=""
# A failed training step leaves no broker behind.
trap '[ -z "$pid" ] || kill "$pid" 2>/dev/null; rm -rf "$work"' EXIT
# shellcheck disable=SC2086
build() {
    local flags="$1" dir="$2"
    RUSTFLAGS="$flags" CARGO_TARGET_DIR="$dir" \
        cargo build --release --locked -q -p statebroker --bin statebroker --target "$triple" ${PGO_CARGO_ARGS:-}
}
echo "pgo: instrumented build" >&2
build "-Cprofile-generate=$data" target/pgo/gen
cargo build --release --locked -q -p statebroker-bench --bin statebroker-bench
bench=target/release/statebroker-bench
broker=target/pgo/gen/$triple/release/statebroker

free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
start() {
    port=$(free_port)
    "$broker" --listen "127.0.0.1:$port" --http "127.0.0.1:$(free_port)" "$@" >"$work/broker.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return 0
        sleep 0.1
    done
    echo "pgo: the instrumented broker did not start:" >&2; cat "$work/broker.log" >&2; exit 1
}
stop() {
    kill -TERM "$pid"
    wait "$pid" || { echo "pgo: the instrumented broker did not stop cleanly:" >&2; tail "$work/broker.log" >&2; exit 1; }
    pid=""
}
b() { "$bench" --target "127.0.0.1:$port" --warmup 0 "$@" >/dev/null; }
bp() { "$bench" pubsub --target "127.0.0.1:$port" --warmup 0 "$@" >/dev/null; }

train() {
    start --in-memory
    for c in 1 16 64; do b -c "$c" -d 4; done
    b -c 64 -d 2 --set-ratio 0
    b -c 64 -d 2 --wildcard-subscribers 16
    for qos in 0 1 2; do
        for pattern in pairs fan-in fan-out; do
            bp --pattern "$pattern" -n 64 --qos "$qos" -d 2
        done
    done
    bp --pattern pairs -n 16 --qos 1 -d 2 --retain
    stop
    start --data-dir "$work/data"
    b -c 64 -d 3 --set-ratio 1 --persist
    b -c 64 -d 2 --set-ratio 0.1 --persist
    bp --pattern pairs -n 16 --qos 1 -d 2 --persistent
    stop
    rm -rf "$work/data"
}
echo "pgo: training (about 90 s)" >&2
rm -rf "$data"
train

"$profdata" merge -o "$work/merged.profdata" "$data"
echo "pgo: optimized build" >&2
flags="-Cprofile-use=$work/merged.profdata"
# BOLT rewrites a binary that keeps its relocations.
[ -z "$bolt" ] || flags="$flags -Clink-arg=-Wl,--emit-relocs"
build "$flags" target/pgo/use
mkdir -p "$(dirname "$out")"
optimized="target/pgo/use/$triple/release/statebroker"
if [ -n "$bolt" ]; then
    echo "pgo: BOLT instrumentation and training (about 90 s)" >&2
    "$bolt" "$optimized" -instrument --instrumentation-file="$work/bolt.fdata" \
        --instrumentation-file-append-pid -o "$work/statebroker-inst" >"$work/bolt.log" 2>&1 \
        || { cat "$work/bolt.log" >&2; exit 1; }
    broker="$work/statebroker-inst"
    train
    "$merge_fdata" "$work"/bolt.fdata.* >"$work/bolt.fdata"
    echo "pgo: BOLT layout" >&2
    "$bolt" "$optimized" -data="$work/bolt.fdata" -o "$out" \
        -reorder-blocks=ext-tsp -reorder-functions=cdsort -split-functions -split-all-cold \
        -split-eh -icf=1 -use-gnu-stack -dyno-stats >"$work/bolt.log" 2>&1 \
        || { cat "$work/bolt.log" >&2; exit 1; }
    grep -E "BOLT-INFO: (basic block reordering|.*profile)" "$work/bolt.log" >&2 || true
else
    cp "$optimized" "$out"
fi
echo "pgo: $out" >&2
