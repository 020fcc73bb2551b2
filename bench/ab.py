#!/usr/bin/env python3
"""Before/after: two statebroker binaries measured side by side, alternating.

    python3 bench/ab.py --a OLD_BINARY --b NEW_BINARY [--rounds 3] [--duration 5]
                        [--only reqresp,pubsub] [--bench target/release/statebroker-bench]

Each round runs every workload once on A and once on B, in alternating
order (A then B in odd rounds, B then A in even ones), each on a fresh
in-memory broker on a free loopback port, pinned to core 0 with the load
generator on core 1 (as bench/compare.py pins). Workloads:

  reqresp  the in-process state store, 1 and 64 connections (requests/s, p50, p99)
  pubsub   64 pairs, fan-in 64 -> 1, fan-out 1 -> 64, at QoS 0, 1 and 2
           (messages/s; lost and duplicated must be 0)

Prints one line per run and, at the end, the median of each side and B/A.
A ratio from one run is noise on a shared VM: quote medians of several
alternating rounds, and the machine (`lscpu`).
"""

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or shutil.which("taskset") is None:
        return [], []
    return ["taskset", "-c", str(cores[0])], ["taskset", "-c", str(cores[1])]


def start(binary, port, server_pin):
    cmd = server_pin + [binary, "--in-memory", "--no-http", "--listen", f"127.0.0.1:{port}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    sys.exit(f"{binary} did not start listening on {port}")


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def workloads(only, duration):
    out = []
    if "reqresp" in only:
        for c in (1, 64):
            out.append((f"reqresp c={c}", ["-c", str(c), "-d", str(duration)]))
    if "pubsub" in only:
        for pattern in ("pairs", "fan-in", "fan-out"):
            for qos in (0, 1, 2):
                out.append((f"pubsub {pattern} q{qos}",
                            ["pubsub", "--pattern", pattern, "-n", "64", "--qos", str(qos),
                             "-d", str(duration)]))
    return out


def measure(bench, client_pin, port, args):
    cmd = client_pin + [bench, "--target", f"127.0.0.1:{port}"] + args
    if args[0] == "pubsub":
        cmd = client_pin + [bench] + args[:1] + ["--target", f"127.0.0.1:{port}"] + args[1:]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    text = run.stdout + run.stderr
    if run.returncode != 0:
        return None, text.strip().splitlines()[-1:] or ["failed"]
    return parse(text), text


def parse(text):
    """The throughput, latency percentiles (µs) and lost/duplicated counts
    statebroker-bench prints."""
    found = {}
    m = re.search(r"(?:requests|messages)/s\s+([\d.]+)", text)
    if m:
        found["rate"] = float(m.group(1))
    unit = 1000 if re.search(r"latency ms", text) else 1
    for key in ("p50", "p99"):
        m = re.search(r"latency.*?\b" + key + r"\s+([\d.]+)", text)
        if m:
            found[key] = float(m.group(1)) * unit
    for key in ("lost", "duplicated"):
        m = re.search(r"\b" + key + r"\s+(\d+)", text)
        if m:
            found[key] = int(m.group(1))
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="the binary before")
    ap.add_argument("--b", required=True, help="the binary after")
    ap.add_argument("--bench", default=os.path.join(ROOT, "target", "release", "statebroker-bench"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--only", default="reqresp,pubsub")
    args = ap.parse_args()
    only = set(args.only.split(","))
    server_pin, client_pin = pinned()
    results = {}
    for round_ in range(args.rounds):
        order = [("A", args.a), ("B", args.b)]
        if round_ % 2:
            order.reverse()
        for name, wargs in workloads(only, args.duration):
            for side, binary in order:
                port = free_port()
                proc = start(binary, port, server_pin)
                try:
                    found, text = measure(args.bench, client_pin, port, wargs)
                finally:
                    stop(proc)
                if found is None or "rate" not in (found or {}):
                    print(f"round {round_ + 1} {side} {name}: could not read a rate: {text}", flush=True)
                    continue
                results.setdefault(name, {}).setdefault(side, []).append(found)
                extra = " ".join(f"{k}={v:g}" for k, v in found.items() if k != "rate")
                print(f"round {round_ + 1} {side} {name}: {found['rate']:,.0f}/s {extra}", flush=True)
    print()
    print(f"{'workload':<22} {'A median':>12} {'B median':>12} {'B/A':>7}  runs A / B")
    for name, sides in results.items():
        a = [r["rate"] for r in sides.get("A", [])]
        b = [r["rate"] for r in sides.get("B", [])]
        if not a or not b:
            continue
        ma, mb = statistics.median(a), statistics.median(b)
        runs = " ".join(f"{x:,.0f}" for x in a) + " / " + " ".join(f"{x:,.0f}" for x in b)
        print(f"{name:<22} {ma:>12,.0f} {mb:>12,.0f} {mb / ma:>7.3f}  {runs}")
        bad = [r for side in sides.values() for r in side if r.get("lost") or r.get("duplicated")]
        if bad:
            print(f"  !! {name}: messages lost or duplicated in {len(bad)} runs")


if __name__ == "__main__":
    main()
