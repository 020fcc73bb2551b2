#!/usr/bin/env python3
"""Side-by-side comparison: statebroker against mosquitto, rumqttd and Redis.

    python3 bench/compare.py [--duration 10] [--connections 1,16,64,256] [--quick]

Runs, on this machine, for each connection count:
  (1) statebroker, its in-process state store
  (2) statebroker, with the external responder
  (3) mosquitto 2.x (Debian), with the external responder
  (4) rumqttd's own broker binary, with the external responder
  (5) redis-benchmark GET and SET (no pipelining)
then the memory checks (bytes per stored key after 1,000,000 SETs for
statebroker and Redis; 10,000 idle MQTT connections) and 1,024 connections
with zero lost requests. Writes bench/results/comparison.{md,json,png}.

It installs what it needs (mosquitto, redis via apt; rumqttd via cargo
install; matplotlib via pip) and builds statebroker in release mode.

CPU placement: on a machine with two or more cores, every server (each
broker, the Redis server) runs pinned to core 0 and every load generator
(statebroker-bench with its external responder child, redis-benchmark) to
core 1, with `taskset`. The same rule holds for every system, so none of them
wins by stealing the load generator's core; multi-threaded servers (statebroker,
rumqttd) size their thread pools from the one core they are given. Unpinned, a
2-core machine runs 2 broker workers and 2 load-generator threads on 2 cores
and the tail latency measures the scheduler more than the server. `--no-pin`
turns placement off.
"""

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
TOOLS = os.path.join(ROOT, "bench", ".tools")
RELEASE = os.path.join(ROOT, "target", "release")
BENCH = os.path.join(RELEASE, "statebroker-bench")
BROKER = os.path.join(RELEASE, "statebroker")


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def run(cmd, **kw):
    log("$", " ".join(cmd))
    return subprocess.run(cmd, check=True, **kw)


# Filled in by main(): command prefixes that place servers and load generators.
PIN_SERVER, PIN_CLIENT = [], []


def placement(enabled):
    """`taskset` prefixes for servers (core 0) and load generators (core 1)."""
    cores = sorted(os.sched_getaffinity(0))
    if not enabled or len(cores) < 2 or shutil.which("taskset") is None:
        return [], [], "unpinned"
    server, client = str(cores[0]), str(cores[1])
    return (["taskset", "-c", server], ["taskset", "-c", client],
            f"servers pinned to core {server}, load generators to core {client}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def raise_nofile():
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# ------------------------------------------------------------------ setup

def install():
    missing = [p for p, b in [("mosquitto", "mosquitto"), ("redis-server", "redis-server"),
                              ("redis-tools", "redis-benchmark")] if not shutil.which(b)]
    if missing:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        run(["apt-get", "update", "-qq"], env=env)
        run(["apt-get", "install", "-y", "-qq", *missing], env=env)
    rumqttd = os.path.join(TOOLS, "bin", "rumqttd")
    if not os.path.exists(rumqttd):
        # Not --locked: the lockfile rumqttd published pins a `metrics` that
        # today's compilers reject; the newest compatible patch release builds.
        run(["cargo", "install", "--root", TOOLS, "rumqttd", "--version", "0.20.0"])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        run([sys.executable, "-m", "pip", "install", "-q", "matplotlib"])
    run(["cargo", "build", "--release", "-q", "-p", "statebroker", "-p", "statebroker-bench"], cwd=ROOT)
    return rumqttd


# ------------------------------------------------------------------ servers

class Server:
    def __init__(self, cmd, port, cwd=None):
        self.port = port
        self.proc = subprocess.Popen(PIN_SERVER + cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     cwd=cwd, start_new_session=True)
        wait_port(port)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def statebroker():
    port = free_port()
    return Server([BROKER, "--listen", f"127.0.0.1:{port}", "--in-memory"], port)


def mosquitto(tmp):
    port = free_port()
    conf = os.path.join(tmp, "mosquitto.conf")
    with open(conf, "w") as f:
        # Generous limits, so that mosquitto is measured, not its defaults.
        f.write(f"listener {port} 127.0.0.1\nallow_anonymous true\nmax_inflight_messages 0\n"
                "max_queued_messages 100000\nmax_connections -1\npersistence false\nset_tcp_nodelay true\n")
    return Server(["mosquitto", "-c", conf], port)


def rumqttd(binary, tmp):
    port = free_port()
    conf = os.path.join(tmp, "rumqttd.toml")
    with open(conf, "w") as f:
        f.write(f"""id = 0
[router]
max_connections = 20010
max_outgoing_packet_count = 200
max_segment_size = 104857600
max_segment_count = 10
[v5.1]
name = "v5-1"
listen = "127.0.0.1:{port}"
next_connection_delay_ms = 0
[v5.1.connections]
connection_timeout_ms = 60000
max_payload_size = 20480
max_inflight_count = 100
dynamic_filters = true
""")
    return Server([binary, "-c", conf], port)


def redis(tmp):
    port = free_port()
    return Server(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                   "--dir", tmp, "--maxclients", "20000"], port)


# ------------------------------------------------------------------ measurements

def bench(port, connections, duration, warmup, external=False):
    cmd = PIN_CLIENT + [BENCH, "--target", f"127.0.0.1:{port}", "-c", str(connections), "-d", str(duration),
           "--warmup", str(warmup), "--json"]
    if external:
        cmd += ["--responder", "external"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=duration + warmup + 300)
    return json.loads(out.stdout)


def redis_benchmark(port, connections, duration):
    # Size the run to last about `duration` seconds at ~80k ops/s per test.
    n = max(20000, int(80000 * duration))
    out = subprocess.run(PIN_CLIENT + ["redis-benchmark", "-p", str(port), "-c", str(connections), "-n", str(n),
                          "-t", "get,set", "-d", "32", "-r", "10000", "-P", "1", "--csv"],
                         check=True, capture_output=True, text=True)
    results = {}
    for line in out.stdout.splitlines():
        cells = [c.strip('"') for c in line.split('","')]
        if cells[0] in ("SET", "GET"):
            results[cells[0]] = {"requests_per_sec": float(cells[1]), "p50_us": float(cells[4]) * 1000,
                                 "p99_us": float(cells[6]) * 1000}
    return results


def memory_per_key(tmp):
    keys = 1_000_000
    sb = statebroker()
    try:
        before = rss_kb(sb.proc.pid)
        subprocess.run(PIN_CLIENT + [BENCH, "fill", "--target", f"127.0.0.1:{sb.port}", "--keys", str(keys)],
                       check=True, capture_output=True)
        after = rss_kb(sb.proc.pid)
    finally:
        sb.stop()
    sb_bytes = (after - before) * 1024 / keys
    r = redis(tmp)
    try:
        before = rss_kb(r.proc.pid)
        # The same shape: 16-byte keys, 32-byte values, pipelined.
        payload = "".join(f"*3\r\n$3\r\nSET\r\n$16\r\n{i:016d}\r\n$32\r\n{'v' * 32}\r\n" for i in range(keys))
        subprocess.run(["redis-cli", "-p", str(r.port), "--pipe"], input=payload.encode(), check=True,
                       capture_output=True)
        after = rss_kb(r.proc.pid)
    finally:
        r.stop()
    return {"statebroker": sb_bytes, "redis": (after - before) * 1024 / keys}


def idle_connections(count=10_000, hold=8):
    sb = statebroker()
    try:
        before = rss_kb(sb.proc.pid)
        idle = subprocess.Popen(PIN_CLIENT + [BENCH, "idle", "--target", f"127.0.0.1:{sb.port}", "-c", str(count),
                                 "--hold", str(hold)], stdout=subprocess.PIPE, text=True)
        line = idle.stdout.readline()
        if not line.startswith("connected"):
            raise RuntimeError(f"idle connections failed: {line}")
        time.sleep(2)
        during = rss_kb(sb.proc.pid)
        idle.wait()
    finally:
        sb.stop()
    return {"connections": count, "rss_mb": during / 1024, "rss_before_mb": before / 1024}


# ------------------------------------------------------------------ report

def report(rows, extras, conns, machine, pinning):
    now = datetime.date.today().isoformat()
    by = {(r["system"], r["connections"]): r for r in rows}
    systems = ["statebroker (in-process store)", "statebroker + external responder",
               "mosquitto + external responder", "rumqttd + external responder", "redis GET", "redis SET"]
    md = [f"Measured {now} on {machine}; release build; load generator and server on the same machine, "
          f"{pinning}.", "",
          "| system | " + " | ".join(f"C={c} req/s (p50 / p99 µs)" for c in conns) + " |",
          "|---|" + "---|" * len(conns)]
    for s in systems:
        cells = []
        for c in conns:
            r = by.get((s, c))
            cells.append("—" if r is None else
                         f"{r['requests_per_sec']:,.0f} ({r['p50_us']:,.0f} / {r['p99_us']:,.0f})"
                         + (f", lost {r['lost']}" if r.get("lost") else ""))
        md.append(f"| {s} | " + " | ".join(cells) + " |")
    md += ["", "Ratios of (1), statebroker's in-process store, to each other row:", "",
           "| vs | " + " | ".join(f"C={c}" for c in conns) + " |", "|---|" + "---|" * len(conns)]
    for s in systems[1:]:
        cells = []
        for c in conns:
            a, b = by.get((systems[0], c)), by.get((s, c))
            cells.append("—" if not a or not b else f"{a['requests_per_sec'] / b['requests_per_sec']:.2f}×")
        md.append(f"| {s} | " + " | ".join(cells) + " |")
    if extras:
        md += [""]
        if "memory" in extras:
            m = extras["memory"]
            md.append(f"- Resident memory per stored key after 1,000,000 SETs (16-byte keys, 32-byte values): "
                      f"statebroker {m['statebroker']:.0f} bytes, Redis {m['redis']:.0f} bytes.")
        if "idle" in extras:
            i = extras["idle"]
            md.append(f"- {i['connections']:,} idle MQTT connections: statebroker resident {i['rss_mb']:.0f} MB "
                      f"({i['rss_before_mb']:.0f} MB before they connected).")
        if "c1024" in extras:
            r = extras["c1024"]
            md.append(f"- 1,024 connections: {r['requests_per_sec']:,.0f} requests/s, {r['lost']} lost, "
                      f"{r['errors']} errors, p99 {r['p99_us']:,.0f} µs.")
    text = "\n".join(md) + "\n"
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "comparison.md"), "w") as f:
        f.write(text)
    with open(os.path.join(RESULTS, "comparison.json"), "w") as f:
        json.dump({"date": now, "machine": machine, "placement": pinning, "rows": rows, "extras": extras}, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 5))
        for s in systems:
            pts = [(c, by[(s, c)]["requests_per_sec"]) for c in conns if (s, c) in by]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
        ax.set_xscale("log", base=2)
        ax.set_xticks(conns)
        ax.set_xticklabels([str(c) for c in conns])
        ax.set_xlabel("concurrent connections (one request in flight each)")
        ax.set_ylabel("requests / s")
        ax.set_title(f"State store request/response, {now}, {machine}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(RESULTS, "comparison.png"), dpi=110)
    except Exception as e:  # the table matters more than the chart
        log("no chart:", e)
    print(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=10)
    ap.add_argument("--warmup", type=float, default=2)
    ap.add_argument("--connections", default="1,16,64,256")
    ap.add_argument("--quick", action="store_true", help="skip the memory and 1,024-connection checks")
    ap.add_argument("--no-pin", action="store_true", help="do not pin servers and load generators to cores")
    args = ap.parse_args()
    global PIN_SERVER, PIN_CLIENT
    PIN_SERVER, PIN_CLIENT, pinning = placement(not args.no_pin)
    log("placement:", pinning)
    conns = [int(c) for c in args.connections.split(",")]
    raise_nofile()
    rumqttd_bin = install()
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    rows, extras = [], {}
    tmp = tempfile.mkdtemp(prefix="sb-compare-")

    def record(system, c, r):
        r = dict(r, system=system, connections=c)
        rows.append(r)
        log(f"{system:36} C={c:<4} {r['requests_per_sec']:>10,.0f} req/s  p50 {r['p50_us']:>8,.0f} µs"
            f"  p99 {r['p99_us']:>8,.0f} µs  lost {r.get('lost', 0)}")

    for c in conns:
        sb = statebroker()
        try:
            record("statebroker (in-process store)", c, bench(sb.port, c, args.duration, args.warmup))
            record("statebroker + external responder", c, bench(sb.port, c, args.duration, args.warmup, True))
        finally:
            sb.stop()
        m = mosquitto(tmp)
        try:
            record("mosquitto + external responder", c, bench(m.port, c, args.duration, args.warmup, True))
        finally:
            m.stop()
        rq = rumqttd(rumqttd_bin, tmp)
        try:
            record("rumqttd + external responder", c, bench(rq.port, c, args.duration, args.warmup, True))
        finally:
            rq.stop()
        r = redis(tmp)
        try:
            rb = redis_benchmark(r.port, c, args.duration)
            for op in ("GET", "SET"):
                record(f"redis {op}", c, rb[op])
        finally:
            r.stop()
    if not args.quick:
        extras["memory"] = memory_per_key(tmp)
        extras["idle"] = idle_connections()
        sb = statebroker()
        try:
            extras["c1024"] = bench(sb.port, 1024, args.duration, args.warmup)
        finally:
            sb.stop()
    report(rows, extras, conns, machine, pinning)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
