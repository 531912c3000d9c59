#!/usr/bin/env python3
"""Decode peers on the shapes of bench/attention_cuda_bench.cc's BM_Decode, on the same GPU,
timed the same way (CUDA events, median after warm-up; K/V rotate over copies that together
exceed 256 MiB, so every call reads them from HBM; each call is queued behind a spin kernel,
torch.cuda._sleep, so Python's launch overhead stays out of the timed window):
  - PyTorch SDPA with the cuDNN backend, and with no backend forced (PyTorch's own choice);
    q [B, H, 1, D] against K/V [B, H_kv, ctx, D] as strided views of [B, ctx, H_kv, D],
    enable_gqa=True (K/V expanded to every head where a backend refuses GQA, marked);
    not causal: one query at the last position sees every key;
  - FlashAttention-3's flash_attn_with_kvcache (wheel fa3-fwd, module fa3_fwd_interface), where
    it loads: q [B, 1, H, D], k/v cache [B, ctx, H_kv, D], cache_seqlens = ctx.
Also the device copy bandwidth (torch copy_ of 1 GiB; bytes read + written per second).
Writes JSON: a list of {name, peer, us, gqa} and one {copy_GBps}.
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SPIN_CYCLES = 400_000  # about 200 us: longer than any peer's host overhead per call


def median_us(fn, warmup=3, iters=32):
    """fn(i) runs call i (i picks the K/V copy)."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        torch.cuda._sleep(SPIN_CYCLES)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth():
    a = torch.ones(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = median_us(lambda i: b.copy_(a))
    return 2 * a.numel() / (us * 1e-6) / 1e9


def sdpa_entry(q, kvs, backend):
    """(fn(i), gqa mode) for SDPA on `backend` (None: PyTorch's choice) over the K/V copies
    `kvs`, or raises RuntimeError."""
    def run(kk, vv, gqa):
        if backend is None:
            return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=gqa)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=gqa)
    try:
        run(*kvs[0], True)
        return (lambda i: run(*kvs[i % len(kvs)], True)), "enable_gqa"
    except RuntimeError:
        group = q.shape[1] // kvs[0][0].shape[1]
        expanded = [(k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
                    for k, v in kvs]
        run(*expanded[0], False)
        return (lambda i: run(*expanded[i % len(expanded)], False)), "expanded"


def load_fa3():
    try:
        import fa3_fwd_interface
        return fa3_fwd_interface.flash_attn_with_kvcache, None
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def main(out_path):
    torch.manual_seed(0)
    results = [{"copy_GBps": copy_bandwidth()}]
    print(json.dumps(results[0]), flush=True)
    fa3, fa3_error = load_fa3()
    if fa3 is None:
        results.append({"peer": "fa3", "error": fa3_error})
        print(json.dumps(results[-1]), flush=True)
    dim = 128
    for heads, kv_heads in ((16, 1), (32, 8)):
        for context in (32768, 131072):
            for batch in (1, 8, 32):
                name = f"context:{context}/batch:{batch}/heads:{heads}/kv_heads:{kv_heads}"
                kv_bytes = 2 * batch * context * kv_heads * dim * 2
                copies = max(1, min(16, -(-256_000_000 // kv_bytes)))
                q4 = torch.rand(batch, 1, heads, dim, device="cuda", dtype=torch.bfloat16) * 2 - 1
                kv4 = [(torch.rand(batch, context, kv_heads, dim, device="cuda",
                                   dtype=torch.bfloat16) * 2 - 1,
                        torch.rand(batch, context, kv_heads, dim, device="cuda",
                                   dtype=torch.bfloat16) * 2 - 1) for _ in range(copies)]
                q = q4.transpose(1, 2)
                kvs = [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in kv4]
                for peer, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                                      ("sdpa-default", None)):
                    entry = {"name": name, "peer": peer}
                    try:
                        fn, gqa = sdpa_entry(q, kvs, backend)
                        entry.update(us=median_us(fn), gqa=gqa)
                    except RuntimeError as e:
                        entry.update(error=str(e).splitlines()[0][:200])
                    results.append(entry)
                    print(json.dumps(entry), flush=True)
                    torch.cuda.empty_cache()
                if fa3 is not None:
                    entry = {"name": name, "peer": "fa3"}
                    seqlens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
                    try:
                        fn = lambda i: fa3(q4, *kv4[i % copies], cache_seqlens=seqlens,
                                           causal=True)
                        fn(0)
                        entry.update(us=median_us(fn), gqa="native")
                    except RuntimeError as e:
                        entry.update(error=str(e).splitlines()[0][:200])
                    results.append(entry)
                    print(json.dumps(entry), flush=True)
                del q4, kv4, q, kvs
                torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
