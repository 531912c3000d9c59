#!/usr/bin/env python3
"""Per-sequence peers of bench/prefix_attention_cuda_bench.cc, on its grid, on the same
GPU, timed the same way (CUDA events behind torch.cuda._sleep, median of 15 after 3 warm-ups; the
prefix's K/V rotates over copies that together exceed 256 MiB):
  - fa3: FlashAttention-3's flash_attn_with_kvcache (wheel fa3-fwd) over a paged cache in which
    every sequence's page table points at the same prefix pages, then its own suffix pages (what
    vLLM does with a shared prefix): the prefix is stored once but read per sequence;
    decode q [B, 1, H, D], suffix prefills q [B, S, H, D] (causal, bottom-right). Where the
    wheel refuses paged KV (its decode path), "fa3-dense": each sequence's K/V dense
    [B, P + S, H_kv, D] with the prefix copied per sequence, skipped past 8 GiB;
  - sdpa-cudnn: PyTorch SDPA on cuDNN, decode only (its causal mask is top-left), each sequence's
    K/V dense [B, H_kv, P + S, D] with the prefix copied per sequence; skipped past 8 GiB.
Writes one JSON object a line to stdout: {impl, mode, heads, kv_heads, prefix, suffix, batch,
us} or {..., error}.

    python3 bench/gpu/prefix_peer.py [--quick] [--decode | --suffix]   (one mode: that one only)
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(__file__))
from decode_peer import median_us  # noqa: E402  (spin, events, median: as decode's peers)

DIM = 128
PAGE = 256
ROTATE_BYTES = 256 << 20


def grid(quick, modes):
    prefixes = [4096] if quick else [1024, 4096, 16384, 65536]
    for heads, kv_heads in ((8, 1), (32, 8)):
        for p in prefixes:
            for suffix in (1, 2048) if "decode" in modes else ():
                for b in (1, 8, 32, 64, 256):
                    yield "decode", heads, kv_heads, p, suffix, b
            for suffix in (256, 2048) if "suffix" in modes else ():
                for b in (1, 8, 32, 256):
                    if b * suffix <= 65536:
                        yield "suffix", heads, kv_heads, p, suffix, b


def rand(*shape):
    return torch.rand(*shape, device="cuda", dtype=torch.bfloat16) * 2 - 1


def fa3_fn(fa3, mode, heads, kv_heads, p, suffix, b):
    """fn(i) for FA3 over a paged cache sharing the prefix pages; prefix pages rotate."""
    prefix_pages = p // PAGE
    suffix_pages = -(-suffix // PAGE)
    copies = max(1, min(16, -(-ROTATE_BYTES // (2 * p * kv_heads * DIM * 2))))
    pages = copies * prefix_pages + b * suffix_pages
    k_cache, v_cache = rand(pages, PAGE, kv_heads, DIM), rand(pages, PAGE, kv_heads, DIM)
    tables = []
    for c in range(copies):
        shared = torch.arange(c * prefix_pages, (c + 1) * prefix_pages, dtype=torch.int32)
        own = copies * prefix_pages + torch.arange(b * suffix_pages, dtype=torch.int32)
        table = torch.cat([shared.expand(b, -1), own.view(b, suffix_pages)], dim=1)
        tables.append(table.cuda().contiguous())
    seqlens = torch.full((b,), p + suffix, dtype=torch.int32, device="cuda")
    q = rand(b, 1 if mode == "decode" else suffix, heads, DIM)
    return lambda i: fa3(q, k_cache, v_cache, cache_seqlens=seqlens,
                         page_table=tables[i % copies], causal=True)


def fa3_dense_fn(fa3, mode, heads, kv_heads, p, suffix, b):
    """fn(i) for FA3 over dense per-sequence K/V (the prefix copied into each), or None."""
    if 2 * b * (p + suffix) * kv_heads * DIM * 2 > 8 << 30:
        return None
    k, v = rand(b, p + suffix, kv_heads, DIM), rand(b, p + suffix, kv_heads, DIM)
    q = rand(b, 1 if mode == "decode" else suffix, heads, DIM)
    return lambda i: fa3(q, k, v, causal=True)


def cudnn_fn(heads, kv_heads, p, suffix, b):
    """fn(i) for SDPA on cuDNN, one query per sequence over its dense K/V, or None (too big)."""
    if 2 * b * (p + suffix) * kv_heads * DIM * 2 > 8 << 30:
        return None
    k = rand(b, p + suffix, kv_heads, DIM).transpose(1, 2)
    v = rand(b, p + suffix, kv_heads, DIM).transpose(1, 2)
    q = rand(b, 1, heads, DIM).transpose(1, 2)

    def run(i):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return run


def main():
    quick = "--quick" in sys.argv
    modes = [m for m in ("decode", "suffix") if f"--{m}" in sys.argv] or ["decode", "suffix"]
    try:
        import fa3_fwd_interface
        fa3 = fa3_fwd_interface.flash_attn_with_kvcache
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        fa3 = None
        print(json.dumps({"impl": "fa3", "error": f"{type(e).__name__}: {e}"[:200]}), flush=True)
    for mode, heads, kv_heads, p, suffix, b in grid(quick, modes):
        base = {"mode": mode, "heads": heads, "kv_heads": kv_heads, "prefix": p,
                "suffix": suffix, "batch": b}
        peers = [("fa3", lambda: fa3_fn(fa3, mode, heads, kv_heads, p, suffix, b)),
                 ("fa3-dense", lambda: fa3_dense_fn(fa3, mode, heads, kv_heads, p, suffix, b))
                 ] if fa3 else []
        if mode == "decode":
            peers.append(("sdpa-cudnn", lambda: cudnn_fn(heads, kv_heads, p, suffix, b)))
        for impl, make in peers:
            entry = dict(base, impl=impl)
            try:
                fn = make()
                if fn is None:
                    entry["error"] = "skipped: dense K/V past 8 GiB"
                else:
                    entry["us"] = round(median_us(fn, warmup=3, iters=15), 2)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
                entry["error"] = str(e).splitlines()[0][:200]
            print(json.dumps(entry), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
