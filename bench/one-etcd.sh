# Sourced by the cluster benchmarks (bash, set -euo pipefail): a scratch
# directory `dir`, the processes to kill at exit `pids`, a free loopback
# port from `port`, and one etcd member on loopback (`endpoints`), healthy.
dir="$(mktemp -d)"
pids=()
cleanup() { kill -9 "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
cp=$(port) pp=$(port)
etcd --name m1 --data-dir "$dir/m1" \
    --listen-client-urls "http://127.0.0.1:$cp" --advertise-client-urls "http://127.0.0.1:$cp" \
    --listen-peer-urls "http://127.0.0.1:$pp" --initial-advertise-peer-urls "http://127.0.0.1:$pp" \
    --initial-cluster "m1=http://127.0.0.1:$pp" >"$dir/m1.log" 2>&1 &
pids+=($!)
endpoints="http://127.0.0.1:$cp"
ETCDCTL_API=3 timeout 60 bash -c "until etcdctl --endpoints=$endpoints endpoint health >/dev/null 2>&1; do sleep 0.5; done"
