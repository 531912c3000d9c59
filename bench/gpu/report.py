#!/usr/bin/env python3
"""Joins cpfill's Google Benchmark JSON with the PyTorch peer's JSON into one table (TFLOP/s and
ratios), printed as Markdown for bench/RESULTS.md.
  report.py cpfill.json peer.json
  report.py --variants peer.json NAME=cpfill.json [NAME=cpfill.json ...]   (A/B of kernel knobs
      run in one call: one TFLOP/s column per variant, each against cuDNN)"""
import json
import re
import sys


def tflops(b):
    t = b.get("TFLOPs", 0)
    return t / 1e12 if t > 1e6 else t


def variants(peer_path, named):
    runs = []
    for arg in named:
        label, path = arg.split("=", 1)
        runs.append((label, {b["name"]: b for b in json.load(open(path))["benchmarks"]}))
    cudnn = {e["name"]: e.get("tflops") for e in json.load(open(peer_path))
             if e["backend"] == "cudnn"}
    labels = [label for label, _ in runs]
    print("| shape | " + " | ".join(f"{l} TFLOP/s" for l in labels) + " | cuDNN | " +
          " | ".join(f"{l} / cuDNN" for l in labels) + " |")
    print("|---|" + "---:|" * (2 * len(labels) + 1))
    for name in runs[0][1]:
        m = re.match(r"BM_Attention(Mixed)?/(.*)/manual_time", name)
        if not m:
            continue
        shape = m.group(2) if not m.group(1) else "mixed " + m.group(2)
        rates = [tflops(r.get(name, {})) for _, r in runs]
        cu = cudnn.get(m.group(2)) if not m.group(1) else None
        cells = [f"{x:.0f}" for x in rates] + [f"{cu:.0f}" if cu else ""]
        cells += [f"{x / cu:.3f}" if cu and x else "" for x in rates]
        print(f"| {shape} | " + " | ".join(cells) + " |")


def main(cpfill_path, peer_path):
    run = json.load(open(cpfill_path))
    ours = run["benchmarks"]
    print(f"cpfill kernel: {run['context'].get('attention_kernel', 'unknown')}\n")
    peer = {}
    for e in json.load(open(peer_path)):
        peer[(e["name"], e["backend"])] = e
    print("| shape (heads:kv, dim, tokens, causal) | cpfill ms | cpfill TFLOP/s | flash TFLOP/s "
          "| cuDNN TFLOP/s | cpfill / flash | cpfill / cuDNN |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for b in ours:
        m = re.match(r"BM_Attention/(.*)/manual_time", b["name"])
        if not m:
            continue
        name = m.group(1)
        tf = tflops(b)
        cells = []
        for backend in ("flash", "cudnn"):
            e = peer.get((name, backend), {})
            cells.append(e.get("tflops"))
        fl, cu = cells
        fmt = lambda x: f"{x:.0f}" if x else "n/a"
        ratio = lambda x: f"{tf / x:.2f}" if x else "n/a"
        print(f"| {name} | {b['real_time']:.3f} | {tf:.0f} | {fmt(fl)} | {fmt(cu)} | "
              f"{ratio(fl)} | {ratio(cu)} |")
    print()
    for b in ours:
        if b["name"].startswith("BM_AttentionMixed") or b["name"].startswith("BM_Merge"):
            extra = {k: v for k, v in b.items() if k in ("TFLOPs", "GBps", "sequences")}
            print(f"- {b['name']}: {b['real_time']:.3f} {b['time_unit']} {extra}")


if __name__ == "__main__":
    if sys.argv[1] == "--variants":
        variants(sys.argv[2], sys.argv[3:])
    else:
        main(sys.argv[1], sys.argv[2])
