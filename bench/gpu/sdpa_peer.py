#!/usr/bin/env python3
"""The peer: PyTorch's scaled_dot_product_attention (flash and cuDNN backends) on the shapes that
bench/attention_cuda_bench.cc times, on the same GPU, timed the same way (CUDA events, median
after warm-up). GQA runs with enable_gqa=True where the backend takes it, else with K/V expanded
to every query head (marked in the output). Writes JSON: a list of {name, backend, ms, tflops,
gqa}.
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def median_ms(fn, warmup=3, iters=15):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def main(out_path):
    torch.manual_seed(0)
    shapes = []
    for heads, kv_heads in ((16, 1), (32, 8)):
        for causal in (1, 0):
            for tokens in (4096, 8192, 16384, 32768):
                shapes.append((heads, kv_heads, 128, tokens, causal))
    shapes.append((16, 1, 64, 16384, 1))
    results = []
    for heads, kv_heads, dim, tokens, causal in shapes:
        name = f"heads:{heads}/kv_heads:{kv_heads}/dim:{dim}/tokens:{tokens}/causal:{causal}"
        q = torch.rand(1, heads, tokens, dim, device="cuda", dtype=torch.bfloat16) * 2 - 1
        k = torch.rand(1, kv_heads, tokens, dim, device="cuda", dtype=torch.bfloat16) * 2 - 1
        v = torch.rand(1, kv_heads, tokens, dim, device="cuda", dtype=torch.bfloat16) * 2 - 1
        pairs = tokens * (tokens + 1) / 2 if causal else tokens * tokens
        flops = 4.0 * dim * heads * pairs
        for backend_name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                                      ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            entry = {"name": name, "backend": backend_name}
            try:
                with sdpa_kernel(backend):
                    try:
                        fn = lambda: F.scaled_dot_product_attention(
                            q, k, v, is_causal=bool(causal), enable_gqa=True)
                        fn()
                        entry["gqa"] = "enable_gqa"
                    except RuntimeError:
                        ke = k.repeat_interleave(heads // kv_heads, dim=1)
                        ve = v.repeat_interleave(heads // kv_heads, dim=1)
                        fn = lambda: F.scaled_dot_product_attention(q, ke, ve,
                                                                    is_causal=bool(causal))
                        fn()
                        entry["gqa"] = "expanded"
                    ms = median_ms(fn)
                entry.update(ms=ms, tflops=flops / ms / 1e9)
            except RuntimeError as e:
                entry.update(error=str(e).splitlines()[0][:200])
            results.append(entry)
            print(json.dumps(entry), flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
