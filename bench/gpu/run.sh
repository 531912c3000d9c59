#!/usr/bin/env bash
# One device call: GPU tests (plus compute-sanitizer), the CUDA benchmark and its peers on
# the same GPU, then the table. Run from the repository root on a GPU host, with the binaries
# built here and carried in .gpu-carry/ (bench/gpu/build-carry.sh makes it).
#   bash bench/gpu/run.sh [tests|bench|sanitizer|all]
#   bash bench/gpu/run.sh ab VAR=value[,VAR=value] ...   the benchmark on the default and on each
#       knob setting, beside one run of the peer (the small tests pass on every setting first);
#       BENCH_FILTER narrows the shapes
#   bash bench/gpu/run.sh profile BENCH_FILTER    Nsight Compute on one launch of one shape
#   bash bench/gpu/run.sh profile-fa3 FAMILY/NAME  the same for FlashAttention-3 (sdpa_peer.py)
# Carry .wheels/ too (fa3-fwd): FlashAttention-3 is the peer beside PyTorch's cuDNN and FA2.
set -uo pipefail
what=${1:-all}
source "$(dirname "$0")/lib.sh"
use_fa3_wheel
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
    --benchmark_out_format=json --benchmark_min_time=0.3 --benchmark_filter="${BENCH_FILTER:-.}" \
    2>&1 | tail -30
  echo "== peers: FA3 (from .wheels/ where carried), PyTorch SDPA on cuDNN and FA2"
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
if [ "$what" = ab ]; then
  # Knob A/B in one call: "$@" are environment settings (VAR=value[,VAR=value]) to compare with
  # the default; the small tests pass on each first.
  shift
  variants=(default "$@")
  knobs() { [ "$1" = default ] || echo "${1//,/ }"; }  # a setting as env arguments
  for v in "${variants[@]}" CPFILL_HOPPER_MAX_CTAS=3 CPFILL_HOPPER_MAX_CTAS=3,CPFILL_HOPPER_SCHEDULE=static \
           CPFILL_HOPPER_PERSISTENT=0 CPFILL_ATTENTION_KERNEL=mma; do
    log="$out/small-$(echo "$v" | tr -c 'A-Za-z0-9_.\n-' '_').log"
    env $(knobs "$v") timeout 90 "$carry/attention_cuda_test" \
      --gtest_filter='*Small*' > "$log" 2>&1 || rc=1
    echo "small tests $v: rc $rc $(grep -E '^\[  (PASSED|FAILED)' "$log" | head -2)"
    [ $rc -eq 0 ] || { tail -20 "$log"; exit 1; }
  done
  timeout 200 "$carry/attention_cuda_test" > "$out/gpu_tests.log" 2>&1 || rc=1
  echo "all gpu tests (default): $(grep -E '^\[  (PASSED|FAILED)' "$out/gpu_tests.log" | head -3)"
  named=()
  for i in "${!variants[@]}"; do
    v=${variants[$i]}
    env $(knobs "$v") "$carry/attention_cuda_bench" \
      --benchmark_filter="${BENCH_FILTER:-.}" --benchmark_out="$out/cpfill_v$i.json" \
      --benchmark_out_format=json --benchmark_min_time=0.2 > /dev/null 2>&1 || rc=1
    named+=("v$i=$out/cpfill_v$i.json")
    echo "v$i: $v"
  done
  python3 bench/gpu/sdpa_peer.py "$out/sdpa_peer.json" > "$out/sdpa_peer.log" 2>&1
  python3 bench/gpu/report.py --variants "$out/sdpa_peer.json" "${named[@]}" | tee "$out/ab.md"
fi
# profile TAG KERNEL_REGEX COMMAND...: Nsight Compute on the 4th launch of the kernels matching
# KERNEL_REGEX in COMMAND: the details page to stdout and $OUT/ncu_details_TAG.txt, the
# per-SASS-instruction stall samples to $OUT/source_TAG.csv.
profile() {
  local tag=$1 kernel=$2
  shift 2
  ncu --clock-control none --set full -k "regex:$kernel" --launch-skip 3 --launch-count 1 \
    -o "/tmp/prof_$tag" -f "$@" > "$out/ncu_run_$tag.log" 2>&1 || rc=1
  tail -3 "$out/ncu_run_$tag.log"
  ncu -i "/tmp/prof_$tag.ncu-rep" --page details --print-units base 2>&1 |
    grep -vE '^ *-+ *$' | tee "$out/ncu_details_$tag.txt" | head -400
  ncu -i "/tmp/prof_$tag.ncu-rep" --page source --csv --print-source sass \
    > "$out/source_$tag.csv" 2>&1 || rc=1
  wc -l "$out/source_$tag.csv"
}
shape_tag() { echo "$1" | tr -c 'A-Za-z0-9\n' '_' | tail -c 40; }
if [ "$what" = profile ]; then
  # cpfill's kernel on one benchmark shape ($2, a benchmark filter).
  profile "$(shape_tag "$2")" HopperFlashKernel "$carry/attention_cuda_bench" \
    --benchmark_filter="$2" --benchmark_min_time=0.01
fi
if [ "$what" = profile-fa3 ]; then
  # FlashAttention-3 on one shape ($2: FAMILY/NAME of sdpa_peer.py, e.g.
  # BM_Attention/heads:32/kv_heads:8/dim:128/tokens:16384/causal:1). Its forward kernel is
  # CUTLASS's device_kernel; the call's other kernels are PyTorch's.
  profile "fa3_$(shape_tag "$2")" device_kernel python3 bench/gpu/sdpa_peer.py --profile-fa3 "$2"
fi
exit $rc
