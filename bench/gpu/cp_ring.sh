#!/usr/bin/env bash
# cpfill's device ring against PyTorch's context parallelism (context_parallel over SDPA on
# cuDNN), 128K tokens, 16 q : 1 kv heads, d128, pass-KV: CP1 on one GPU and CP-way on NVLink and
# on TCP sockets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1), both sides in the same call, after the
# multi-GPU CLI tests.
#   bash bench/gpu/cp_ring.sh [CP]      # CP ranks, default 4 (nvidia-h200-x4); 2 on nvidia-h200-x2
# Binaries from .gpu-carry/ (bench/gpu/build-carry.sh); logs, JSON and summary.txt under $OUT.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
new_summary
multigpu_tests
ring_vs_torch "${1:-4}"
echo "== summary"
cat "$summary"
