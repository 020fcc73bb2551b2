#!/usr/bin/env python3
"""Side-by-side comparison: statebroker against mosquitto, rumqttd and Redis.

    python3 bench/compare.py [--duration 10] [--connections 1,16,64,256] [--quick]
                             [--only reqresp,persist,pubsub,connections] [--out DIR] [--pgo]

Runs, on this machine:
  request/response, for each connection count:
    (1) statebroker, its in-process state store
    (2) statebroker, with the external responder
    (3) mosquitto 2.x (Debian), with the external responder
    (4) rumqttd's own broker binary, with the external responder
    (5) Redis with the same requests as (1), sent by statebroker-bench
        (`--protocol resp`): the servers compared with one client
    (6) redis-benchmark GET and SET (no pipelining): its own client, which
        on a 2-core VM saturates its core before Redis does at 64
        connections (120,000 against 217,000 requests/s), and is faster
        than any other client measured at 1 (p50 63 against 75-82 µs)
  persisted writes at 64 connections: statebroker SETs in memory and
    persisted (`fsync` mode), Redis SETs without and with `appendonly yes`
    + `appendfsync always`; statebroker with 10% SETs and 90% GETs, the
    SETs in memory and persisted
  publish/subscribe (`statebroker-bench pubsub`) on statebroker, mosquitto
    and rumqttd, QoS 0 and 1: 64 pairs, fan-in (64 -> 1), fan-out (1 -> 64)
  connections: bytes per stored key after 1,000,000 SETs (statebroker and
    Redis), 100,000 idle MQTT connections (as many as the open-file limit
    allows), 10,000 clients connecting at once, 1,024 busy connections
Writes comparison.{md,json} and the charts comparison.png (request/response)
and pubsub.png to --out (default bench/results, which the README shows);
compare_report.py makes them.

It installs what it needs (mosquitto, redis via apt; rumqttd via cargo
install; matplotlib via pip) and builds statebroker in release mode; with
`--pgo` it measures the profile-guided build of `bench/pgo.sh` instead (and
installs rustc's `llvm-NN` with apt for its llvm-profdata); with `BOLT=1`
in the environment as well, that build laid out by BOLT (`bolt-NN`: see
bench/pgo.sh).

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

from compare_report import MIX_IN_MEMORY, PUBSUB_PATTERNS, REDIS_SAME_CLIENT, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")  # --out changes it
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


def raise_nofile(want=250_000):
    """Open-file limit for this process and its children: `want` if the
    hard limit can be raised (root, outside a restricted container), else
    the hard limit. Returns the limit in force."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(hard, want), max(hard, want)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ------------------------------------------------------------------ setup

def apt_install(*packages):
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", *packages], env=env)


def install():
    missing = [p for p, b in [("mosquitto", "mosquitto"), ("redis-server", "redis-server"),
                              ("redis-tools", "redis-benchmark")] if not shutil.which(b)]
    if missing:
        apt_install(*missing)
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


def pgo_build():
    """Builds target/pgo/statebroker with bench/pgo.sh and measures it."""
    global BROKER
    major = re.search(r"LLVM version: (\d+)", subprocess.run(["rustc", "-vV"], capture_output=True,
                                                            text=True, check=True).stdout).group(1)
    if not shutil.which(f"llvm-profdata-{major}"):
        apt_install(f"llvm-{major}")
    BROKER = os.path.join(ROOT, "target", "pgo", "statebroker")
    run(["bash", os.path.join(ROOT, "bench", "pgo.sh"), BROKER], cwd=ROOT)


# ------------------------------------------------------------------ servers

class Server:
    def __init__(self, cmd, port, cwd=None, env=None):
        self.port = port
        self.proc = subprocess.Popen(PIN_SERVER + cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     cwd=cwd, start_new_session=True,
                                     env=None if env is None else dict(os.environ, **env))
        wait_port(port)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def statebroker(data_dir=None, max_connections=None):
    """In memory, or with `data_dir` (persistence in its default `fsync` mode)."""
    port = free_port()
    store = ["--data-dir", data_dir] if data_dir else ["--in-memory"]
    env = {"STATEBROKER__ROUTER__MAX_CONNECTIONS": str(max_connections)} if max_connections else None
    return Server([BROKER, "--listen", f"127.0.0.1:{port}", "--no-http", *store], port, env=env)


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


def redis(tmp, aof=False):
    """Redis without persistence, or with `appendonly yes` and
    `appendfsync always` (every write fsynced before the answer)."""
    port = free_port()
    durability = ["--appendonly", "yes", "--appendfsync", "always"] if aof else ["--appendonly", "no"]
    data = tempfile.mkdtemp(dir=tmp)
    return Server(["redis-server", "--port", str(port), "--save", "", *durability,
                   "--dir", data, "--maxclients", "20000"], port)


# ------------------------------------------------------------------ measurements

def bench(port, connections, duration, warmup, external=False, extra=()):
    cmd = PIN_CLIENT + [BENCH, "--target", f"127.0.0.1:{port}", "-c", str(connections), "-d", str(duration),
           "--warmup", str(warmup), "--json", *extra]
    if external:
        cmd += ["--responder", "external"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=duration + warmup + 300)
    return json.loads(out.stdout)


def redis_benchmark(port, connections, duration, tests="get,set", rate=80000):
    # Size the run to last about `duration` seconds at `rate` ops/s per test.
    n = max(20000, int(rate * duration))
    out = subprocess.run(PIN_CLIENT + ["redis-benchmark", "-p", str(port), "-c", str(connections), "-n", str(n),
                          "-t", tests, "-d", "32", "-r", "10000", "-P", "1", "--csv"],
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


def idle_connections(count, hold=8):
    """Resident memory of statebroker holding `count` idle MQTT connections."""
    sb = statebroker(max_connections=count + 1000)
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
    return {"connections": count, "rss_mb": during / 1024, "rss_before_mb": before / 1024,
            "bytes_per_connection": (during - before) * 1024 / count}


def connect_storm(count=10_000):
    """`count` clients start their handshakes at the same moment: seconds
    until the last CONNACK."""
    sb = statebroker()
    try:
        out = subprocess.run(PIN_CLIENT + [BENCH, "idle", "--target", f"127.0.0.1:{sb.port}", "-c", str(count),
                              "--parallel", str(count), "--hold", "0"],
                             check=True, capture_output=True, text=True, timeout=300)
    finally:
        sb.stop()
    m = re.search(r"connected (\d+) in ([\d.]+) s", out.stdout)
    if not m:
        raise RuntimeError(f"connect storm: {out.stdout} {out.stderr}")
    return {"clients": int(m.group(1)), "seconds": float(m.group(2))}


def persisted_writes(tmp, duration, warmup, connections=64):
    """SETs at `connections` connections: in memory against kept on disk,
    for statebroker (fsync mode) and Redis (appendfsync always); and
    statebroker with 10% SETs, 90% GETs, the SETs in memory or persisted."""
    rows = {}
    for name, extra in (("statebroker SET, in memory", ["--set-ratio", "1"]),
                        ("statebroker SET, persisted (fsync)", ["--set-ratio", "1", "--persist"]),
                        (MIX_IN_MEMORY, ["--set-ratio", "0.1"]),
                        ("statebroker 10% SETs persisted (fsync), 90% GETs", ["--set-ratio", "0.1", "--persist"])):
        sb = statebroker(data_dir=tempfile.mkdtemp(dir=tmp))
        try:
            rows[name] = bench(sb.port, connections, duration, warmup, extra=extra)
        finally:
            sb.stop()
    # Redis's SETs from the same load generator (`--protocol resp`): before
    # 2026-11-30 redis-benchmark's, whose client capped the in-memory side.
    for name, aof in (("redis SET, no persistence", False), ("redis SET, appendfsync always", True)):
        r = redis(tmp, aof=aof)
        try:
            rows[name] = bench(r.port, connections, duration, warmup,
                               extra=("--protocol", "resp", "--set-ratio", "1"))
        finally:
            r.stop()
    for name, r in rows.items():
        log(f"{name:40} {r['requests_per_sec']:>10,.0f} req/s  p50 {r['p50_us']:>8,.0f} µs  p99 {r['p99_us']:>8,.0f} µs")
    return {"connections": connections, "rows": rows}


def pubsub(port, pattern, qos, duration, warmup):
    cmd = PIN_CLIENT + [BENCH, "pubsub", "--target", f"127.0.0.1:{port}", "--pattern", pattern, "-n", "64",
                        "--qos", str(qos), "-d", str(duration), "--warmup", str(warmup), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + warmup + 120)
    if out.returncode != 0 or not out.stdout.strip():
        log(f"pubsub {pattern} QoS {qos} failed: {out.stderr.strip()[-300:]}")
        return None
    return json.loads(out.stdout)


def pubsub_all(rumqttd_bin, tmp, duration, warmup):
    """Every pattern at QoS 0 and 1 on each broker, a fresh broker per run."""
    brokers = (("statebroker", lambda: statebroker()), ("mosquitto", lambda: mosquitto(tmp)),
               ("rumqttd", lambda: rumqttd(rumqttd_bin, tmp)))
    results = []
    for qos in (0, 1):
        for pattern, _ in PUBSUB_PATTERNS:
            for system, start in brokers:
                server = start()
                try:
                    r = pubsub(server.port, pattern, qos, duration, warmup)
                finally:
                    server.stop()
                if r is not None:
                    results.append(dict(r, system=system, pattern_name=pattern))
                    log(f"pubsub {system:12} {pattern:8} QoS {qos}: {r['messages_per_sec']:>10,.0f} msg/s"
                        f"  p50 {r['p50_us']:>8,} µs  p99 {r['p99_us']:>8,} µs  lost {r['lost']}  dup {r['duplicated']}")
    return results


SECTIONS = ("reqresp", "persist", "pubsub", "connections")


def describe_machine():
    """The machine a run's ratios belong to: architecture, cores, `lscpu`'s
    model name and cache sizes (#30: a ratio without its machine is not a
    result)."""
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return machine
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    info = {k.strip(): v.strip() for k, v in info.items()}
    caches = ", ".join(f"{level} {info[level + ' cache']}"
                       for level in ("L1d", "L2", "L3") if level + " cache" in info)
    model = info.get("Model name")
    guest = info.get("Hypervisor vendor") and f"{info['Hypervisor vendor']} guest"
    return ", ".join(x for x in (model, machine, caches, guest, describe_idle()) if x)


def describe_idle():
    """How an idle core waits: on a virtual machine that halts its idle
    cores, a request to an idle server waits for the host to wake it
    (one connection: p50 91-95 us here for either server, 11-12 us with
    the guest polling 200 us before it halts; see docs/performance.md,
    thirty-ninth session). None where the kernel does not say."""
    base = "/sys/devices/system/cpu/cpuidle/"
    try:
        with open(base + "current_driver") as f:
            driver = f.read().strip()
    except OSError:
        return None
    try:
        with open("/sys/module/haltpoll/parameters/guest_halt_poll_ns") as f:
            poll = f.read().strip()
        return f"idle {driver}, guest_halt_poll_ns {poll}"
    except OSError:
        return f"idle {driver}"


def main():
    global RESULTS, PIN_SERVER, PIN_CLIENT
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=10, help="measured seconds per request/response cell")
    ap.add_argument("--warmup", type=float, default=2)
    ap.add_argument("--connections", default="1,16,64,256")
    ap.add_argument("--pubsub-duration", type=float, default=5, help="measured seconds per publish/subscribe run")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all)")
    ap.add_argument("--quick", action="store_true", help="skip the connections section")
    ap.add_argument("--out", default=RESULTS, help="where the tables and charts go (default: bench/results, "
                    "the copy the README shows)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin servers and load generators to cores")
    ap.add_argument("--pgo", action="store_true", help="measure the profile-guided build of bench/pgo.sh "
                    "(target/pgo/statebroker) instead of the plain release build")
    args = ap.parse_args()
    sections = {x.strip() for x in args.only.split(",") if x.strip()}
    unknown = sections - set(SECTIONS)
    if unknown:
        ap.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if args.quick:
        sections.discard("connections")
    RESULTS = os.path.abspath(args.out)
    PIN_SERVER, PIN_CLIENT, pinning = placement(not args.no_pin)
    log("placement:", pinning)
    conns = [int(c) for c in args.connections.split(",")]
    nofile = raise_nofile()
    rumqttd_bin = install()
    build = "release build"
    if args.pgo:
        pgo_build()
        build = "profile-guided release build (bench/pgo.sh)"
        if os.environ.get("BOLT") == "1":
            build = "profile-guided release build laid out by BOLT (BOLT=1 bench/pgo.sh)"
    machine = describe_machine()
    rows, extras = [], {}
    tmp = tempfile.mkdtemp(prefix="sb-compare-")

    def record(system, c, r):
        r = dict(r, system=system, connections=c)
        rows.append(r)
        log(f"{system:36} C={c:<4} {r['requests_per_sec']:>10,.0f} req/s  p50 {r['p50_us']:>8,.0f} µs"
            f"  p99 {r['p99_us']:>8,.0f} µs  lost {r.get('lost', 0)}")

    for c in conns if "reqresp" in sections else []:
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
            record(REDIS_SAME_CLIENT, c,
                   bench(r.port, c, args.duration, args.warmup, extra=("--protocol", "resp")))
            rb = redis_benchmark(r.port, c, args.duration)
            for op in ("GET", "SET"):
                record(f"redis {op}", c, rb[op])
        finally:
            r.stop()
    if "persist" in sections:
        extras["persisted"] = persisted_writes(tmp, args.duration, args.warmup)
    if "pubsub" in sections:
        extras["pubsub"] = pubsub_all(rumqttd_bin, tmp, args.pubsub_duration, min(args.warmup, 1))
    if "connections" in sections:
        extras["memory"] = memory_per_key(tmp)
        # Each connection takes a descriptor in the broker and one in the
        # load generator; keep some for everything else.
        extras["idle"] = dict(idle_connections(min(100_000, nofile - 1000)), nofile=nofile)
        extras["storm"] = connect_storm()
        sb = statebroker()
        try:
            extras["c1024"] = bench(sb.port, 1024, args.duration, args.warmup)
        finally:
            sb.stop()
    report(rows, extras, conns, machine, pinning, RESULTS, build)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
