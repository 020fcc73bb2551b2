"""The report of `compare.py`: its tables (comparison.md, the README's
Performance section), its raw numbers (comparison.json) and its charts
(comparison.png, pubsub.png)."""

import datetime
import json
import os
import sys

PUBSUB_PATTERNS = (("pairs", "64 pairs"), ("fan-in", "fan-in 64 → 1"), ("fan-out", "fan-out 1 → 64"))
# Redis driven by statebroker-bench (`--protocol resp`): the requests of row
# (1), sent by the same client; redis-benchmark's rows measure its own client
# too (see crates/bench/src/resp.rs).
REDIS_SAME_CLIENT = "redis, statebroker-bench's client (50/50 GET/SET)"
# The persisted section's mixed workload in memory: the base of its ratio.
MIX_IN_MEMORY = "statebroker 10% SETs, 90% GETs, in memory"


def persisted_table(p):
    if not p:
        return []
    rows = p["rows"]
    md = ["", f"Persisted writes, {p['connections']} connections, one request in flight each:", "",
          "| system | requests/s | p50 µs | p99 µs | vs the same in memory |", "|---|---|---|---|---|"]
    base = {"statebroker": rows.get("statebroker SET, in memory"), "redis": rows.get("redis SET, no persistence")}
    for name, r in rows.items():
        b = rows.get(MIX_IN_MEMORY) if "90% GETs" in name else base[name.split()[0]]
        ratio = f"{r['requests_per_sec'] / b['requests_per_sec']:.2f}×" if b else "—"
        md.append(f"| {name} | {r['requests_per_sec']:,.0f} | {r['p50_us']:,.0f} | {r['p99_us']:,.0f} | {ratio} |")
    return md


def pubsub_table(results):
    if not results:
        return []
    by = {(r["system"], r["pattern_name"], r["qos"]): r for r in results}
    systems = ["statebroker", "mosquitto", "rumqttd"]
    md = ["", "Publish/subscribe (`statebroker-bench pubsub`, 64-byte payloads, each publisher keeps 32 messages "
              "per subscriber on their way): messages delivered/s (p50 / p99 end-to-end µs), lost and duplicated "
              "deliveries counted exactly:", "",
          "| workload | QoS | " + " | ".join(systems) + " | statebroker / mosquitto |",
          "|---|---|" + "---|" * (len(systems) + 1)]
    for qos in (0, 1):
        for pattern, label in PUBSUB_PATTERNS:
            cells = []
            for system in systems:
                r = by.get((system, pattern, qos))
                if r is None:
                    cells.append("failed")
                    continue
                cell = f"{r['messages_per_sec']:,.0f} ({r['p50_us']:,} / {r['p99_us']:,})"
                if r["lost"] or r["duplicated"]:
                    cell += f", lost {r['lost']:,}, dup {r['duplicated']:,}"
                else:
                    cell += ", 0 lost"
                cells.append(cell)
            a, b = by.get(("statebroker", pattern, qos)), by.get(("mosquitto", pattern, qos))
            ratio = f"{a['messages_per_sec'] / b['messages_per_sec']:.2f}×" if a and b else "—"
            md.append(f"| {label} | {qos} | " + " | ".join(cells) + f" | {ratio} |")
    return md


def connections_list(extras):
    md = []
    if "memory" in extras:
        m = extras["memory"]
        md.append(f"- Resident memory per stored key after 1,000,000 SETs (16-byte keys, 32-byte values): "
                  f"statebroker {m['statebroker']:.0f} bytes, Redis {m['redis']:.0f} bytes.")
    if "idle" in extras:
        i = extras["idle"]
        line = (f"- {i['connections']:,} idle MQTT connections: statebroker resident {i['rss_mb']:.0f} MB "
                f"({i['rss_before_mb']:.0f} MB before they connected; {i['bytes_per_connection']:,.0f} bytes each")
        if i["connections"] < 100_000:
            line += (f"; 100,000 would take about {i['rss_before_mb'] + i['bytes_per_connection'] * 1e5 / 2**20:,.0f} MB, "
                     f"not measured: this machine's open-file limit is {i['nofile']:,}")
        md.append(line + ").")
    if "storm" in extras:
        st = extras["storm"]
        md.append(f"- {st['clients']:,} clients starting their handshakes at once: all connected in {st['seconds']:.1f} s.")
    if (r := extras.get("c1024")):
        md.append(f"- 1,024 busy connections (one request in flight each): {r['requests_per_sec']:,.0f} requests/s, "
                  f"{r['lost']} lost, {r['errors']} errors, p50 {r['p50_us']:,.0f} µs, p99 {r['p99_us']:,.0f} µs "
                  f"(the mean cannot be below 1,024 / throughput = {1024e6 / max(r['requests_per_sec'], 1):,.0f} µs).")
    return [""] + md if md else []


def pubsub_chart(results, now, machine, plt, out):
    if not results:
        return
    systems = ["statebroker", "mosquitto", "rumqttd"]
    groups = [(p, q) for q in (0, 1) for p, _ in PUBSUB_PATTERNS]
    labels = {p: l for p, l in PUBSUB_PATTERNS}
    by = {(r["system"], r["pattern_name"], r["qos"]): r["messages_per_sec"] for r in results}
    fig, ax = plt.subplots(figsize=(9, 5))
    width = 0.8 / len(systems)
    for k, system in enumerate(systems):
        xs = [g + (k - 1) * width for g in range(len(groups))]
        ax.bar(xs, [by.get((system, p, q), 0) for p, q in groups], width, label=system)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{labels[p]}\nQoS {q}" for p, q in groups], fontsize=8)
    ax.set_ylabel("messages delivered / s")
    ax.set_title(f"Publish/subscribe, {now}, {machine}")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "pubsub.png"), dpi=110)


def report(rows, extras, conns, machine, pinning, out, build="release build"):
    """Writes comparison.{md,json} and the charts to `out`, and prints the tables."""
    now = datetime.date.today().isoformat()
    by = {(r["system"], r["connections"]): r for r in rows}
    systems = ["statebroker (in-process store)", "statebroker + external responder",
               "mosquitto + external responder", "rumqttd + external responder", REDIS_SAME_CLIENT,
               "redis GET", "redis SET"]
    md = [f"Measured {now} on {machine}; {build}; load generator and server on the same machine, "
          f"{pinning}.", ""]
    if rows:
        md += request_response_tables(by, systems, conns)
    return finish_report(md, rows, extras, conns, machine, pinning, now, by, systems, out)


def request_response_tables(by, systems, conns):
    md = ["| system | " + " | ".join(f"C={c} req/s (p50 / p99 µs)" for c in conns) + " |",
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
    return md


def finish_report(md, rows, extras, conns, machine, pinning, now, by, systems, out):
    md += persisted_table(extras.get("persisted"))
    md += pubsub_table(extras.get("pubsub"))
    md += connections_list(extras)
    text = "\n".join(md) + "\n"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "comparison.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "comparison.json"), "w") as f:
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
        if rows:
            fig.savefig(os.path.join(out, "comparison.png"), dpi=110)
        pubsub_chart(extras.get("pubsub"), now, machine, plt, out)
    except Exception as e:  # the table matters more than the chart
        print("no chart:", e, file=sys.stderr)
    print(text)
