#!/usr/bin/env python3
"""User and kernel CPU time per request of statebroker's state store and of
redis-server, at 64 connections, alternated for ROUNDS rounds: the same
requests (50/50 GET/SET) from the same load generator (statebroker-bench,
`--protocol resp` for Redis; before 2026-11-30 Redis's load came from
redis-benchmark, GETs only, whose client saturated its core first), the
server pinned to core 0 and the load generator to core 1, as
bench/compare.py pins them; the server's utime/stime from /proc/PID/stat
over the load's length, divided by the requests the load generator
counted.

    python3 bench/cputime.py [--broker BINARY]... [--rounds 3] [--duration 5]

With `--broker` given more than once (two builds to compare, say
`bench/pgo.sh`'s with and without BOLT), each round measures every
broker and Redis, in an order that turns by one each round, and the
end prints each broker's medians: requests/s against Redis's of the
same round, and user time per request against Redis's.
"""

import argparse
import os
import re
import socket
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TICK = os.sysconf("SC_CLK_TCK")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port):
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"nothing listens on {port}")


def cpu(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def measure(server, load, port, count):
    proc = subprocess.Popen(["taskset", "-c", "0", *server], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        before, start = cpu(proc.pid), time.monotonic()
        out = subprocess.run(["taskset", "-c", "1", *load], capture_output=True, text=True,
                             check=True).stdout
        after, elapsed = cpu(proc.pid), time.monotonic() - start
        requests = count(out)
        user, kernel = (b - a for a, b in zip(before, after))
        return requests / elapsed, user * 1e6 / requests, kernel * 1e6 / requests
    finally:
        proc.terminate()
        proc.wait()


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return (xs[n // 2] + xs[(n - 1) // 2]) / 2


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--broker", action="append",
                   help="a statebroker binary; more than once to compare builds "
                   "(default: target/release/statebroker)")
    p.add_argument("--bench", default=os.path.join(ROOT, "target/release/statebroker-bench"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=int, default=5)
    a = p.parse_args()
    brokers = a.broker or [os.path.join(ROOT, "target/release/statebroker")]
    for b in brokers:
        if not os.access(b, os.X_OK):
            p.error(f"{b}: not an executable")
    names = ["statebroker"] if len(brokers) == 1 else [os.path.basename(b) for b in brokers]
    # The same binary twice (a control: what the machine alone moves) gets
    # a name of its own each time.
    names = [n if names[:i].count(n) == 0 else f"{n}#{names[:i].count(n) + 1}"
             for i, n in enumerate(names)]
    count = lambda out: int(re.search(r"requests (\d+)", out).group(1))  # noqa: E731

    def run_broker(binary):
        port = free_port()
        return measure(
            [binary, "--in-memory", "--no-http", "--listen", f"127.0.0.1:{port}"],
            [a.bench, "--target", f"127.0.0.1:{port}", "-c", "64", "-d", str(a.duration),
             "--warmup", "0"],
            port, count)

    def run_redis():
        port = free_port()
        return measure(
            ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
            [a.bench, "--protocol", "resp", "--target", f"127.0.0.1:{port}", "-c", "64", "-d",
             str(a.duration), "--warmup", "0"],
            port, count)

    systems = [(name, lambda b=b: run_broker(b)) for name, b in zip(names, brokers)]
    systems.append(("redis", run_redis))
    print("| round | " + " | ".join(f"{n} req/s, user / kernel µs per request" for n, _ in systems) + " |")
    print("|---" * (len(systems) + 1) + "|")
    results = {n: [] for n, _ in systems}
    for r in range(1, a.rounds + 1):
        turn = (r - 1) % len(systems)
        row = {}
        for name, measure_one in systems[turn:] + systems[:turn]:
            row[name] = measure_one()
            results[name].append(row[name])
        cells = [f"{row[n][0]:,.0f}, {row[n][1]:.2f} / {row[n][2]:.2f}" for n, _ in systems]
        print(f"| {r} | " + " | ".join(cells) + " |", flush=True)
    redis = results["redis"]
    for name in names:
        ours = results[name]
        rates = [o[0] / x[0] for o, x in zip(ours, redis)]
        user = median([o[1] / x[1] for o, x in zip(ours, redis)])
        print(f"{name}: median of rounds, requests/s {median(rates):.2f}x Redis's "
              f"(rounds {min(rates):.2f}-{max(rates):.2f}), "
              f"user time per request {user:.2f}x Redis's")
    # Builds against the first, round by round: the comparison the rounds
    # alternate for (Redis's own rate moves with the machine as theirs do).
    first = results[names[0]]
    for name in names[1:]:
        rates = [o[0] / f[0] for o, f in zip(results[name], first)]
        print(f"{name} against {names[0]}: median of rounds, requests/s {median(rates):.3f}x "
              f"(rounds {min(rates):.2f}-{max(rates):.2f})")


if __name__ == "__main__":
    main()
