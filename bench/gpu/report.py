#!/usr/bin/env python3
"""Joins cpfill's Google Benchmark JSON with the PyTorch peer's JSON into one table (TFLOP/s and
ratios), printed as Markdown for bench/RESULTS.md. Usage: report.py cpfill.json peer.json"""
import json
import re
import sys


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
        tf = b.get("TFLOPs", 0) / 1e12 if b.get("TFLOPs", 0) > 1e6 else b.get("TFLOPs", 0)
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
    main(sys.argv[1], sys.argv[2])
