#!/usr/bin/env python3
"""Draws `cpfill plan --json` as TTFT against nodes, one line per context length (the paper's
Figure 6 style: log-log axes, the ideal 1/N scaling dashed from each first point).

    for t in 2048 8192 32768 131072; do
      build/cpfill plan --model llama3-405b --prompt-lens $t --gpus-per-node 8 --nodes 1..16 \
          --tp 8 --device-profile bench/plan/h100-fp8ffn.json \
          --link-profile bench/plan/links-paper-gtt.json --json plan-$t.json
    done
    python3 bench/plot_plan.py plan-*.json --out ttft.png

Each file holds one request batch planned over several node counts (the first ranked grid of
each). It always prints the table; without matplotlib (launch/setup.sh's .venv has it; Debian's
python3 does not) it says so and exits 0 without drawing.
"""
import argparse
import json
import sys


def series(path):
    d = json.load(open(path))
    pts = []
    for p in d["plans"]:
        # The fastest grid that fits (--search ranks those that do not last); else the first.
        fits = [r for r in p["ranked"] if r["memory_per_gpu"]["fits"]]
        best = (fits or p["ranked"])[0]
        pts.append((p["nodes"], best["ttft_ms"] / 1e3, "TP%d x CP%d" % (best["tp"], best["cp"])))
    tokens = sum(r["new_tokens"] for r in d["plans"][0]["ranked"][0]["requests"])
    # A context's line; each point says its grid (and the table says when nothing fits).
    return "%dK" % (tokens // 1024), pts


def main():
    ap = argparse.ArgumentParser(description="TTFT vs nodes from cpfill plan --json")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default="plan.png")
    ap.add_argument("--title", default="predicted TTFT (cpfill plan)")
    a = ap.parse_args()
    all_series = [series(f) for f in a.files]
    for label, pts in all_series:
        print(label + ": " + ", ".join("%d node(s) %.2f s (%s)" % p for p in pts))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: printed the table instead of drawing %s" % a.out)
        return 0
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in all_series:
        nodes = [p[0] for p in pts]
        ttft = [p[1] for p in pts]
        line, = ax.plot(nodes, ttft, marker="o", label=label)
        ax.plot(nodes, [ttft[0] * nodes[0] / n for n in nodes], ls="--", color=line.get_color(),
                alpha=0.4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes (CP ranks)")
    ax.set_ylabel("TTFT, s")
    ax.set_title(a.title)
    ax.legend(title="context")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
