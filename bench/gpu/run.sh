#!/usr/bin/env bash
# One device call: GPU tests (plus compute-sanitizer), the CUDA benchmark and the PyTorch peer on
# the same GPU, then the table. Run from the repository root on a GPU host, with the binaries
# built here and carried in .gpu-carry/ (bench/gpu/build-carry.sh makes it).
#   bash bench/gpu/run.sh [tests|bench|sanitizer|all|persistent-ab]
# persistent-ab: the small tests on every schedule, then the benchmark with the Hopper kernel's
# persistent schedule on and off (CPFILL_HOPPER_PERSISTENT=0) beside one run of the peer.
set -uo pipefail
what=${1:-all}
out=${OUT:-/tmp/cpfill-out}
mkdir -p "$out"
carry=.gpu-carry
export LD_LIBRARY_PATH=$PWD/$carry/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  echo "== gpu tests"
  "$carry/attention_cuda_test" 2>&1 | tee "$out/gpu_tests.log" | tail -25 || rc=1
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  echo "== cpfill benchmark"
  "$carry/attention_cuda_bench" --benchmark_out="$out/cpfill_cuda.json" \
    --benchmark_out_format=json --benchmark_min_time=0.3 2>&1 | tail -30
  echo "== PyTorch SDPA peer"
  python3 bench/gpu/sdpa_peer.py "$out/sdpa_peer.json" > "$out/sdpa_peer.log" 2>&1
  tail -3 "$out/sdpa_peer.log"
  python3 bench/gpu/report.py "$out/cpfill_cuda.json" "$out/sdpa_peer.json" | tee "$out/table.md"
fi
if [ "$what" = sanitizer ] || [ "$what" = all ]; then
  echo "== compute-sanitizer (memcheck, racecheck) on the small cases"
  timeout 300 bash tests/under_compute_sanitizer.sh "$carry/attention_cuda_test" \
    --gtest_filter='*Small*' > "$out/sanitizer.log" 2>&1 || rc=1
  grep -E "ERROR SUMMARY|clean|SKIPPED|FAILED" "$out/sanitizer.log" | tail -5
fi
if [ "$what" = persistent-ab ]; then
  for env in "" CPFILL_HOPPER_MAX_CTAS=3 CPFILL_HOPPER_PERSISTENT=0 CPFILL_ATTENTION_KERNEL=mma; do
    env $env timeout 90 "$carry/attention_cuda_test" --gtest_filter='*Small*' \
      > "$out/small-${env:-default}.log" 2>&1 || rc=1
    echo "small tests ${env:-(default)}: rc $rc $(grep -E '^\[  (PASSED|FAILED)' \
      "$out/small-${env:-default}.log" | head -2)"
    [ $rc -eq 0 ] || { tail -20 "$out/small-${env:-default}.log"; exit 1; }
  done
  timeout 200 "$carry/attention_cuda_test" > "$out/gpu_tests.log" 2>&1 || rc=1
  echo "all gpu tests (default): $(grep -E '^\[  (PASSED|FAILED)' "$out/gpu_tests.log" | head -3)"
  for mode in persistent single; do
    env $([ $mode = single ] && echo CPFILL_HOPPER_PERSISTENT=0) "$carry/attention_cuda_bench" \
      --benchmark_out="$out/cpfill_$mode.json" --benchmark_out_format=json \
      --benchmark_min_time=0.3 > /dev/null 2>&1 || rc=1
  done
  python3 bench/gpu/sdpa_peer.py "$out/sdpa_peer.json" > "$out/sdpa_peer.log" 2>&1
  for mode in persistent single; do
    echo "== Hopper kernel, $mode schedule"
    python3 bench/gpu/report.py "$out/cpfill_$mode.json" "$out/sdpa_peer.json" |
      tee "$out/table_$mode.md"
  done
fi
exit $rc
