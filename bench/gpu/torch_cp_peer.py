#!/usr/bin/env python3
"""The context-parallel peer: PyTorch's own context parallelism
(torch.distributed.tensor.experimental.context_parallel, ring attention with its load-balanced
sharding) around scaled_dot_product_attention on cuDNN with enable_gqa, full causal prefill of
one sequence. Times the attention call with CUDA events (median after warm-up, slowest rank) and
prints one JSON line from rank 0.

  python3 -m torch.distributed.run --nproc_per_node 4 bench/gpu/torch_cp_peer.py \
      --tokens 131072 --heads 16 --kv-heads 1 --dim 128
One process (no torchrun) runs plain SDPA on one GPU: the CP1 reference.
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sdpa_peer import median_ms  # the same CUDA-event median as the one-GPU peer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(0)
    shape_q = (1, args.heads, args.tokens, args.dim)
    shape_kv = (1, args.kv_heads, args.tokens, args.dim)
    q = torch.rand(shape_q, device="cuda", dtype=torch.bfloat16) * 2 - 1
    k = torch.rand(shape_kv, device="cuda", dtype=torch.bfloat16) * 2 - 1
    v = torch.rand(shape_kv, device="cuda", dtype=torch.bfloat16) * 2 - 1
    attend = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        if world == 1:
            ms = median_ms(attend, 3, args.iters)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.experimental import context_parallel
            dist.init_process_group("nccl")
            mesh = init_device_mesh("cuda", (world,))
            with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
                ms = median_ms(attend, 3, args.iters)
            slowest = torch.tensor([ms], device="cuda")
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            ms = slowest.item()
    flops = 4.0 * args.dim * args.heads * args.tokens * (args.tokens + 1) / 2
    if rank == 0:
        print(json.dumps({"peer": "torch context_parallel + SDPA cuDNN", "cp": world,
                          "tokens": args.tokens, "heads": args.heads,
                          "kv_heads": args.kv_heads, "dim": args.dim, "ms": ms,
                          "tflops_per_gpu": flops / (ms * 1e-3) / world / 1e12,
                          "nccl_p2p_disable": os.environ.get("NCCL_P2P_DISABLE", "0"),
                          "nccl_shm_disable": os.environ.get("NCCL_SHM_DISABLE", "0")}),
              flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
