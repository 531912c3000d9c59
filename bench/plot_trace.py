#!/usr/bin/env python3
"""Draws a ring run of `cpfill attention` as a PNG: every rank's timeline and step table.

    mpirun -np 4 build/cpfill attention ... --trace trace.json --json report.json
    python3 bench/plot_trace.py --trace trace.json --report report.json --out ring.png

Also draws `cpfill prefill --trace` (each layer's phases; no --report there).

Top: one row per rank and lane (compute, exchange) from --trace, milliseconds from the earliest
rank's start; a step's exposed wait is red, so skew and waits stand out. Bottom (with --report):
each rank's step table from the report's "ranks", compute, exposed wait and transfer per step,
side by side. Needs matplotlib (on the GPU hosts; `pip install matplotlib` elsewhere).
"""
import argparse
import json
import sys

COLOURS = {"attention": "#4c72b0", "wait": "#d62728", "exchange": "#55a868",
           "all-to-all": "#8172b2", "all-gather": "#8172b2", "merge": "#ccb974",
           "pack": "#999999", "unpack": "#999999", "repack": "#999999",
           # cpfill prefill --trace: a layer's phases (the GEMMs orange, the ring blue)
           "attention ring": "#4c72b0", "qkv": "#dd8452", "o proj": "#dd8452",
           "gate/up": "#dd8452", "down": "#dd8452", "all-reduce": "#8172b2",
           "kv cache": "#937860"}


def colour(name):
    for key, c in COLOURS.items():
        if name.endswith(key):
            return c
    return "#64b5cd"


def read_spans(path):
    """{pid: (process name, {lane: [(start ms, duration ms, span name)]})}."""
    events = json.load(open(path))["traceEvents"]
    ranks = {}
    lanes = {}
    for e in events:
        if e.get("ph") == "M" and e["name"] == "process_name":
            ranks.setdefault(e["pid"], [e["args"]["name"], {}])[0] = e["args"]["name"]
        if e.get("ph") == "M" and e["name"] == "thread_name":
            lanes[(e["pid"], e["tid"])] = e["args"]["name"]
    for e in events:
        if e.get("ph") != "X":
            continue
        lane = lanes.get((e["pid"], e["tid"]), str(e["tid"]))
        entry = ranks.setdefault(e["pid"], [f"rank {e['pid']}", {}])
        entry[1].setdefault(lane, []).append((e["ts"] / 1e3, e["dur"] / 1e3, e["name"]))
    return ranks


def plot_timeline(ax, ranks):
    labels = []
    row = 0
    for pid in sorted(ranks):
        name, by_lane = ranks[pid]
        for lane in ("compute", "exchange"):
            for start, dur, span in by_lane.get(lane, []):
                ax.broken_barh([(start, max(dur, 1e-3))], (row - 0.4, 0.8),
                               facecolors=colour(span), edgecolor="white", linewidth=0.3)
            labels.append(f"{name.split(' (')[0]} {lane}")
            row += 1
    ax.set_yticks(range(row))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the first rank's start")
    ax.set_title("every rank's timeline (red: exposed wait; prefill: GEMMs orange, "
                 "attention ring blue, all-reduce purple)")


def plot_steps(ax, report):
    ranks = report["ranks"]
    width = 0.8 / max(1, len(ranks))
    # A mixed batch runs one ring per algorithm: its steps are told apart by their ring.
    names = [f"{s.get('algorithm', '')} {s['step']}" for s in ranks[0]["steps"]]
    mixed = len({s.get("algorithm") for s in ranks[0]["steps"]}) > 1
    for i, r in enumerate(ranks):
        steps = r["steps"]
        x = [j + i * width for j in range(len(steps))]
        compute = [s["compute_ms"] for s in steps]
        wait = [s["exposed_wait_ms"] for s in steps]
        ax.bar(x, compute, width, color="#4c72b0", edgecolor="white", linewidth=0.3,
               label="compute" if i == 0 else None)
        ax.bar(x, wait, width, bottom=compute, color="#d62728", edgecolor="white",
               linewidth=0.3, label="exposed wait" if i == 0 else None)
        ax.plot(x, [s["transfer_ms"] for s in steps], "x", color="#55a868",
                label="transfer" if i == 0 else None)
    ax.set_xticks([j + (len(ranks) - 1) * width / 2 for j in range(len(names))])
    ax.set_xticklabels(names if mixed else [n.split()[-1] for n in names], fontsize=7)
    ax.set_xlabel(f"ring step (bars left to right: world ranks 0-{len(ranks) - 1})")
    ax.set_ylabel("ms")
    ax.set_title(f"step table, {report.get('algorithm', '')}")
    ax.legend(fontsize=7)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True, help="cpfill attention --trace output")
    ap.add_argument("--report", help="cpfill attention --json output (adds the step table)")
    ap.add_argument("--out", default="ring.png")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_trace: needs matplotlib (pip install matplotlib)")
    ranks = read_spans(args.trace)
    rows = 2 if args.report else 1
    fig, axes = plt.subplots(rows, 1, figsize=(11, 2 + 0.45 * 2 * len(ranks) + 3 * (rows - 1)),
                             squeeze=False)
    plot_timeline(axes[0][0], ranks)
    if args.report:
        plot_steps(axes[1][0], json.load(open(args.report)))
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(f"plot_trace: wrote {args.out}")


if __name__ == "__main__":
    main()
