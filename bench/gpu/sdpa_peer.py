#!/usr/bin/env python3
"""The peers of bench/attention_cuda_bench.cc's prefill shapes, on the same GPU, timed the same
way (CUDA events, median after warm-up):
  - PyTorch's scaled_dot_product_attention on its flash (FlashAttention-2) and cuDNN backends;
    GQA with enable_gqa=True where the backend takes it, else K/V expanded to every query head
    (marked in the output);
  - FlashAttention-3 (`fa3`: flash_attn_func, flash_attn_varlen_func of the fa3-fwd wheel, where
    it imports; bench/gpu/run.sh installs it from .wheels/).
Families, as the benchmark's: BM_Attention (one sequence, causal or not, 4K-32K),
BM_AttentionMixed (12 sequences of mixed lengths in one varlen call against one 16K sequence;
FA3 only), BM_AttentionPartial (1K-16K new queries after 128K - new cached keys, the causal mask
aligned to the bottom right: FA3's causal, SDPA's causal_lower_right where a backend takes it).
Writes JSON: a list of {family, name, backend, ms, tflops, gqa} (or error).
"""
import itertools
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

MIXED = [6144, 4096, 2048, 1536, 1024, 768, 512, 256, 64, 16, 8, 8]  # the benchmark's, 16384
CONTEXT = 131072  # BM_AttentionPartial's sequence length


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


def rand(*shape):
    return torch.rand(*shape, device="cuda", dtype=torch.bfloat16) * 2 - 1


def visible_pairs(new, cached, causal):
    return new * cached + new * (new + 1) / 2 if causal else new * (cached + new)


def shapes():
    """(family, name, heads, kv_heads, dim, lengths, cached, causal) of every benchmark shape."""
    for heads, kv_heads in ((16, 1), (32, 8)):
        for causal in (1, 0):
            for tokens in (4096, 8192, 16384, 32768):
                yield ("BM_Attention", f"heads:{heads}/kv_heads:{kv_heads}/dim:128/tokens:{tokens}"
                       f"/causal:{causal}", heads, kv_heads, 128, [tokens], 0, causal)
    yield ("BM_Attention", "heads:16/kv_heads:1/dim:64/tokens:16384/causal:1", 16, 1, 64,
           [16384], 0, 1)
    for heads, kv_heads in ((16, 1), (32, 8)):
        for mixed in (0, 1):
            yield ("BM_AttentionMixed", f"heads:{heads}/kv_heads:{kv_heads}/mixed:{mixed}", heads,
                   kv_heads, 128, MIXED if mixed else [16384], 0, 1)
    for heads, kv_heads in ((16, 1), (32, 8)):
        for new in (1024, 2048, 4096, 8192, 16384):
            yield ("BM_AttentionPartial", f"heads:{heads}/kv_heads:{kv_heads}/new_tokens:{new}",
                   heads, kv_heads, 128, [new], CONTEXT - new, 1)


def sdpa_fn(backend, q, k, v, heads, kv_heads, cached, causal):
    """fn() for SDPA on one sequence (q: 1, H, S, D), and how GQA was passed."""
    mask = None
    if causal and cached:
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(q.shape[2], k.shape[2])

    masking = {"attn_mask": mask} if mask is not None else {"is_causal": bool(causal)}

    def call(kk, vv, **gqa):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, kk, vv, **masking, **gqa)
    try:
        call(k, v, enable_gqa=True)
        return (lambda: call(k, v, enable_gqa=True)), "enable_gqa"
    except RuntimeError:
        ke = k.repeat_interleave(heads // kv_heads, dim=1)
        ve = v.repeat_interleave(heads // kv_heads, dim=1)
        call(ke, ve)
        return (lambda: call(ke, ve)), "expanded"


def fa3_fn(fa3, heads, kv_heads, dim, lengths, cached, causal):
    """fn() for FlashAttention-3: one sequence dense, several as one varlen call."""
    if len(lengths) == 1:
        q = rand(1, lengths[0], heads, dim)
        k, v = rand(1, cached + lengths[0], kv_heads, dim), rand(1, cached + lengths[0], kv_heads, dim)
        return lambda: fa3.flash_attn_func(q, k, v, causal=bool(causal))
    total = sum(lengths)
    q, k, v = rand(total, heads, dim), rand(total, kv_heads, dim), rand(total, kv_heads, dim)
    cu = torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=torch.int32,
                      device="cuda")
    return lambda: fa3.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths),
                                              causal=bool(causal))


def measure(family, name, backend, make, flops):
    entry = {"family": family, "name": name, "backend": backend}
    try:
        fn, gqa = make()
        ms = median_ms(fn)
        entry.update(ms=ms, tflops=flops / ms / 1e9, gqa=gqa)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
        entry.update(error=str(e).splitlines()[0][:200])
    print(json.dumps(entry), flush=True)
    torch.cuda.empty_cache()
    return entry


def main(out_path):
    torch.manual_seed(0)
    try:
        import fa3_fwd_interface as fa3
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        fa3 = None
        print(json.dumps({"backend": "fa3", "error": f"{type(e).__name__}: {e}"[:200]}))
    results = []
    for family, name, heads, kv_heads, dim, lengths, cached, causal in shapes():
        flops = sum(4.0 * dim * heads * visible_pairs(n, cached, causal) for n in lengths)
        if len(lengths) == 1:
            q = rand(1, heads, lengths[0], dim)
            k = rand(1, kv_heads, cached + lengths[0], dim)
            v = rand(1, kv_heads, cached + lengths[0], dim)
            for backend_name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                results.append(measure(family, name, backend_name, lambda: sdpa_fn(
                    backend, q, k, v, heads, kv_heads, cached, causal), flops))
            del q, k, v
        if fa3 is not None:
            results.append(measure(family, name, "fa3", lambda: (fa3_fn(
                fa3, heads, kv_heads, dim, lengths, cached, causal), "native"), flops))
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


def profile_fa3(family, name):
    """FA3 on one shape, five calls (for Nsight Compute: run.sh profile-fa3)."""
    import fa3_fwd_interface as fa3
    for fam, nm, heads, kv_heads, dim, lengths, cached, causal in shapes():
        if (fam, nm) == (family, name):
            fn = fa3_fn(fa3, heads, kv_heads, dim, lengths, cached, causal)
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            return
    sys.exit(f"sdpa_peer: no shape {family}/{name}")


if __name__ == "__main__":
    if sys.argv[1] == "--profile-fa3":  # --profile-fa3 FAMILY/NAME
        profile_fa3(*sys.argv[2].split("/", 1))
    else:
        main(sys.argv[1])
