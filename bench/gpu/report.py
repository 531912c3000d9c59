#!/usr/bin/env python3
"""Joins cpfill's Google Benchmark JSON with the peers' JSON (sdpa_peer.py: FA3, cuDNN, FA2) into
one table (TFLOP/s and ratios; the one-sequence grid, the mixed batch, the partial prefills),
printed as Markdown for bench/RESULTS.md.
  report.py cpfill.json peer.json
  report.py --variants peer.json NAME=cpfill.json [NAME=cpfill.json ...]   (A/B of kernel knobs
      run in one call: one TFLOP/s column per variant, each against FA3)"""
import json
import re
import sys


def tflops(b):
    t = b.get("TFLOPs", 0)
    return t / 1e12 if t > 1e6 else t


def variants(peer_path, named):
    """One TFLOP/s column per variant, each against FA3 (else cuDNN where FA3 is missing)."""
    runs = []
    for arg in named:
        label, path = arg.split("=", 1)
        runs.append((label, {b["name"]: b for b in json.load(open(path))["benchmarks"]}))
    peers = {}
    for e in json.load(open(peer_path)):
        if "name" in e and e.get("tflops"):
            peers[(e.get("family", "BM_Attention"), e["name"], e["backend"])] = e["tflops"]
    labels = [label for label, _ in runs]
    print("| shape | " + " | ".join(f"{l} TFLOP/s" for l in labels) + " | peer | peer TFLOP/s | " +
          " | ".join(f"{l} / peer" for l in labels) + " |")
    print("|---|" + "---:|" * len(labels) + "---|---:|" + "---:|" * len(labels))
    for name in runs[0][1]:
        m = re.match(r"(BM_Attention\w*)/(.*)/manual_time", name)
        if not m or m.group(1) not in FAMILIES:
            continue
        family, shape = m.groups()
        rates = [tflops(r.get(name, {})) for _, r in runs]
        peer = next(((k, peers[(family, shape, k)]) for k in ("fa3", "cudnn")
                     if (family, shape, k) in peers), ("", None))
        label = shape if family == "BM_Attention" else f"{family[12:].lower()} {shape}"
        cells = [f"{x:.0f}" for x in rates] + [peer[0], f"{peer[1]:.0f}" if peer[1] else ""]
        cells += [f"{x / peer[1]:.3f}" if peer[1] and x else "" for x in rates]
        print(f"| {label} | " + " | ".join(cells) + " |")


FAMILIES = ("BM_Attention", "BM_AttentionMixed", "BM_AttentionPartial")


def main(cpfill_path, peer_path):
    run = json.load(open(cpfill_path))
    ours = run["benchmarks"]
    print(f"cpfill kernel: {run['context'].get('attention_kernel', 'unknown')}\n")
    peer = {}
    for e in json.load(open(peer_path)):
        if "name" in e:  # older files have no family: the one-sequence grid
            peer[(e.get("family", "BM_Attention"), e["name"], e["backend"])] = e
    fmt = lambda x: f"{x:.0f}" if x else "n/a"
    print("| shape | cpfill ms | cpfill TFLOP/s | FA3 TFLOP/s | cuDNN TFLOP/s | FA2 TFLOP/s "
          "| cpfill / FA3 | cpfill / cuDNN |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for b in ours:
        m = re.match(r"(BM_Attention\w*)/(.*)/manual_time", b["name"])
        if not m or m.group(1) not in FAMILIES:
            continue
        family, name = m.groups()
        tf = tflops(b)
        fa3, cu, fl = (peer.get((family, name, k), {}).get("tflops")
                       for k in ("fa3", "cudnn", "flash"))
        ratio = lambda x: f"{tf / x:.2f}" if x else "n/a"
        label = name if family == "BM_Attention" else f"{family[12:].lower()} {name}"
        print(f"| {label} | {b['real_time']:.3f} | {tf:.0f} | {fmt(fa3)} | {fmt(cu)} | "
              f"{fmt(fl)} | {ratio(fa3)} | {ratio(cu)} |")
    print()
    for b in ours:
        if b["name"].startswith("BM_Merge"):
            extra = {k: v for k, v in b.items() if k in ("GBps",)}
            print(f"- {b['name']}: {b['real_time']:.3f} {b['time_unit']} {extra}")


if __name__ == "__main__":
    if sys.argv[1] == "--variants":
        variants(sys.argv[2], sys.argv[3:])
    else:
        main(sys.argv[1], sys.argv[2])
