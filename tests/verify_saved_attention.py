#!/usr/bin/env python3
"""Checks a `cpfill attention --save` file with nothing but the Python standard library.

Reads the safetensors file (8-byte header length, JSON header, raw little-endian data), recomputes
causal attention in float64 for every query from q, k, v and the metadata (sequence lengths, cached
lengths, softmax scale), and compares with the o and lse cpfill wrote. Proves the file is usable by
an outside tool, not only by cpfill. Exit 0 when every value agrees within --tolerance.
"""
import argparse
import array
import json
import math
import struct
import sys


def load(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    tensors = {}
    for name, info in header.items():
        if info["dtype"] != "F32":
            sys.exit(f"{name}: dtype {info['dtype']}, expected F32")
        begin, end = info["data_offsets"]
        values = array.array("f")
        values.frombytes(blob[base + begin:base + end])
        if sys.byteorder != "little":
            values.byteswap()
        tensors[name] = (info["shape"], values)
    return tensors, meta


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    args = ap.parse_args()
    t, meta = load(args.file)
    (nq, heads, dim), q = t["q"]
    (nk, kv_heads, _), k = t["k"]
    _, v = t["v"]
    _, o = t["o"]
    _, lse = t["lse"]
    new = [int(x) for x in meta["seq_lens"].split(",")]
    cached = [int(x) for x in meta["cached_lens"].split(",")] if meta.get("cached_lens") else [0] * len(new)
    scale = float(meta["softmax_scale"])
    causal = meta.get("causal", "true") == "true"
    group = heads // kv_heads
    worst_o = worst_lse = 0.0
    q_row = k_row = 0
    for t_new, p in zip(new, cached):
        for i in range(t_new):
            pos = p + i
            for h in range(heads):
                kh = h // group
                qv = q[((q_row + i) * heads + h) * dim:((q_row + i) * heads + h + 1) * dim]
                keys = range(p + t_new) if not causal else range(pos + 1)
                scores = []
                for j in keys:
                    kv = k[((k_row + j) * kv_heads + kh) * dim:((k_row + j) * kv_heads + kh + 1) * dim]
                    scores.append(scale * sum(a * b for a, b in zip(qv, kv)))
                m = max(scores)
                w = [math.exp(s - m) for s in scores]
                z = sum(w)
                ref_lse = m + math.log(z)
                got_lse = lse[(q_row + i) * heads + h]
                worst_lse = max(worst_lse, abs(got_lse - ref_lse))
                for d in range(dim):
                    acc = sum(w[n] * v[((k_row + j) * kv_heads + kh) * dim + d]
                              for n, j in enumerate(keys)) / z
                    worst_o = max(worst_o, abs(o[((q_row + i) * heads + h) * dim + d] - acc))
        q_row += t_new
        k_row += p + t_new
    ok = worst_o <= args.tolerance and worst_lse <= args.tolerance
    print(f"verify: {nq} queries x {heads} heads: max |o - ref| = {worst_o:.3g}, "
          f"max |lse - ref| = {worst_lse:.3g} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
