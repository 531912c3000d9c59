#!/usr/bin/env bash
# One device call for the decode kernel (decode part 3): the kernel tests (the small prefill
# cases and the decode cases; the decode cases again with the decode kernel off, and under
# compute-sanitizer), BM_Decode with the decode kernel and with it off (CPFILL_DECODE_KERNEL=0:
# the prefill kernel), the peers (decode_peer.py: cuDNN, SDPA's default, FA3 from .wheels/ where
# it loads), then the table. Raw outputs are packed into $OUT/decode.tar, the table beside it.
#   bash bench/gpu/decode.sh        (from the repository root, binaries in .gpu-carry/)
set -uo pipefail
source "$(dirname "$0")/lib.sh"
dest=$out
out=/tmp/cpfill-decode && rm -rf "$out" && mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader |
  tee "$out/gpu.txt"
rc=0
use_fa3_wheel
step() {  # step NAME TIMEOUT COMMAND...: the command's output to NAME.log, its verdict printed
  local name=$1 limit=$2 r=0
  shift 2
  timeout "$limit" "$@" > "$out/$name.log" 2>&1 || r=$?
  [ $r -eq 0 ] || rc=1
  echo "$name: rc $r $(grep -E '^\[  (PASSED|FAILED)|clean|SKIPPED' "$out/$name.log" | head -3 |
    tr '\n' ' ')"
}
step gpu_tests 100 "$carry/attention_cuda_test" --gtest_filter='*Small*:*Decode*'
step gpu_tests_nodecode 60 env CPFILL_DECODE_KERNEL=0 "$carry/attention_cuda_test" \
  --gtest_filter='*Decode*:-*ManySplits*'
grep -E 'FAILED|Failure|error' "$out/gpu_tests.log" | head -20
step bench 60 "$carry/attention_cuda_bench" --benchmark_filter=BM_Decode \
  --benchmark_out="$out/cpfill_decode.json" --benchmark_out_format=json --benchmark_min_time=0.05
step bench_nodecode 40 env CPFILL_DECODE_KERNEL=0 "$carry/attention_cuda_bench" \
  --benchmark_filter=BM_Decode --benchmark_out="$out/cpfill_nodecode.json" \
  --benchmark_out_format=json --benchmark_min_time=0.02
PYTHONUNBUFFERED=1 timeout 100 python3 bench/gpu/decode_peer.py "$out/decode_peer.json" \
  > "$out/decode_peer.log" 2>&1 || rc=1
tail -2 "$out/decode_peer.log"
step sanitizer 60 bash tests/under_compute_sanitizer.sh "$carry/attention_cuda_test" \
  --gtest_filter='*Decode*HeadDim64*'
python3 bench/gpu/decode_report.py "$out/cpfill_decode.json" "$out/decode_peer.json" \
  "$out/cpfill_nodecode.json" | tee "$out/decode_table.md"
tar -C "$out" -cf "$dest/decode.tar" . && cp "$out/decode_table.md" "$dest/"
exit $rc
