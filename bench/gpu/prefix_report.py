#!/usr/bin/env python3
"""The table of bench/gpu/prefix_attention.sh: cpfill's attention step with prefix batching (one
JSON object a line from prefix_attention_cuda_bench: "cpfill", and "cpfill-flat" without it)
against the per-sequence peers (prefix_peer.py) on the same shapes, and against the HBM floor of
reading the prefix once.

    python3 bench/gpu/prefix_report.py cpfill.jsonl peers.jsonl > table.md
"""
import json
import sys


def load(path):
    rows = []
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def key(r):
    return (r["mode"], r["heads"], r["kv_heads"], r["prefix"], r["suffix"], r["batch"])


def main(ours_path, peers_path):
    ours = {}
    for r in load(ours_path):
        if "mode" in r:
            ours.setdefault(key(r), {})[r["impl"]] = r
    peers = {}
    for r in load(peers_path):
        if "mode" in r:
            peers.setdefault(key(r), {})[r["impl"]] = r
    print("| mode | heads | prefix | suffix | batch | cpfill µs | roots | cpfill flat µs "
          "| FA3 paged µs | FA3 dense µs | cuDNN µs | floor µs | best peer / cpfill "
          "| flat / cpfill | cpfill / floor |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, impls in sorted(ours.items(), key=lambda kv: kv[0]):
        mode, heads, kv_heads, prefix, suffix, batch = k
        r = impls.get("cpfill", {})
        if "us" not in r:
            continue

        def us(table, impl):
            e = table.get(impl)
            return e["us"] if e and "us" in e else None
        p = peers.get(k, {})
        fa3, dense, cudnn = us(p, "fa3"), us(p, "fa3-dense"), us(p, "sdpa-cudnn")
        flat = us(impls, "cpfill-flat")
        best = min([x for x in (fa3, dense, cudnn) if x is not None], default=None)
        cell = lambda x: f"{x:.1f}" if x is not None else "—"  # noqa: E731
        ratio = lambda x: f"{x / r['us']:.2f}" if x is not None else "—"  # noqa: E731
        print(f"| {mode} | {heads}:{kv_heads} | {prefix} | {suffix} | {batch} | {r['us']:.1f} "
              f"| {r['roots']} | {cell(flat)} | {cell(fa3)} | {cell(dense)} | {cell(cudnn)} "
              f"| {r['floor_us']:.1f} | {ratio(best)} | {ratio(flat)} "
              f"| {r['us'] / r['floor_us']:.2f} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
