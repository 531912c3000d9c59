#!/usr/bin/env bash
# One device call for prefix-batched attention: its GPU test, then
# prefix_attention_cuda_bench and the per-sequence peers (prefix_peer.py: FA3 from .wheels/ over
# a paged cache sharing the prefix pages, cuDNN) on the same grid, and the table
# (prefix_report.py). QUICK=1: the 4K prefix only; TESTS=0: no tests first.
#   run(command="bash bench/gpu/prefix_attention.sh", carry=[".gpu-carry", ".wheels"])
set -uo pipefail
source "$(dirname "$0")/lib.sh"
quick=${QUICK:+--quick}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
use_fa3_wheel
if [ "${TESTS:-1}" = 1 ]; then  # TESTS=0: the tests ran in an earlier call on this build
  timeout 120 "$carry/prefix_batched_cuda_test" > "$out/test.log" 2>&1
  echo "prefix_batched_cuda_test: rc $? $(grep -E '^\[  (PASSED|FAILED)' "$out/test.log" | tr '\n' ' ')"
  grep -E 'Failure|error' "$out/test.log" | head -5
  if [ -x "$carry/attention_cuda_test" ]; then  # the decode kernel's dispatch changed with it
    timeout 200 "$carry/attention_cuda_test" --gtest_filter='*Small*:*Decode*' > "$out/attention_test.log" 2>&1
    echo "attention_cuda_test (Small, Decode): rc $? $(grep -E '^\[  (PASSED|FAILED)' "$out/attention_test.log" | tr '\n' ' ')"
  fi
fi
timeout 300 "$carry/prefix_attention_cuda_bench" $quick > "$out/cpfill.jsonl" 2> "$out/bench.err"
echo "bench: rc $? $(wc -l < "$out/cpfill.jsonl") lines"
PYTHONUNBUFFERED=1 timeout 300 python3 bench/gpu/prefix_peer.py $quick > "$out/peers.jsonl" \
  2> "$out/peers.err"
echo "peers: rc $? $(wc -l < "$out/peers.jsonl") lines"; tail -2 "$out/peers.err"
python3 bench/gpu/prefix_report.py "$out/cpfill.jsonl" "$out/peers.jsonl" | tee "$out/table.md"
