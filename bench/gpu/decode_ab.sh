#!/usr/bin/env bash
# One device call for tuning the decode kernel: BM_Decode (the 16:1 and 32:8 shapes of
# bench/gpu/decode.sh) under each knob setting given, then ncu's kernel times of the split and
# combine kernels per shape. Raw JSON and logs into $OUT/decode_ab.tar, a table printed last.
#   bash bench/gpu/decode_ab.sh "LABEL=ENV ..." ...   e.g. "base=" "tiles8=CPFILL_DECODE_MIN_TILES=8"
# (CARRY=DIR among a variant's settings runs another carried build).
# FILTER (a benchmark regex) narrows the shapes; NCU=0 skips the profile, NCU_FILTER,
# NCU_KERNELS (a kernel-name regex) and NCU_METRICS (more metrics) shape it; TESTS=0: no tests;
# TEST_VARIANTS: the knob settings the decode tests run under, space-separated, each a
# comma-separated list of ENV=VALUE or "default" (default: the combine's parts 0, 1, 2, 4);
# PREFIX=1: also prefix_attention_cuda_bench under each variant (prefix_LABEL.jsonl), with
# PREFIX_ARGS (default --quick).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
dest=$out
out=/tmp/cpfill-decode-ab && rm -rf "$out" && mkdir -p "$out"
filter=${FILTER:-BM_Decode}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader |
  tee "$out/gpu.txt"
test_variants=${TEST_VARIANTS:-CPFILL_DECODE_COMBINE_PARTS=0 CPFILL_DECODE_COMBINE_PARTS=1
  CPFILL_DECODE_COMBINE_PARTS=2 CPFILL_DECODE_COMBINE_PARTS=4}
if [ "${TESTS:-1}" = 1 ]; then
  i=0
  for tv in $test_variants; do
    i=$((i + 1))
    envs=${tv//,/ } && [ "$tv" = default ] && envs=""
    timeout 150 env $envs "$carry/attention_cuda_test" \
      --gtest_filter='*Decode*' > "$out/tests_$i.log" 2>&1
    echo "decode tests ($tv): rc $? $(grep -E '^\[  (PASSED|FAILED)' \
      "$out/tests_$i.log" | tr '\n' ' ')"
  done
fi
for variant in "$@"; do
  label=${variant%%=*} envs=${variant#*=}
  bin=$carry  # CARRY=DIR in a variant's settings: another carried build
  for e in $envs; do case $e in CARRY=*) bin=$PWD/${e#CARRY=} ;; esac; done
  timeout 120 env $envs LD_LIBRARY_PATH="$bin/lib:$LD_LIBRARY_PATH" "$bin/attention_cuda_bench" \
    --benchmark_filter="$filter" --benchmark_out="$out/bench_$label.json" --benchmark_out_format=json \
    --benchmark_min_time=0.05 > "$out/bench_$label.log" 2>&1
  echo "bench $label ($envs): rc $?"
  if [ "${PREFIX:-0}" = 1 ]; then
    timeout 200 env $envs LD_LIBRARY_PATH="$bin/lib:$LD_LIBRARY_PATH" \
      "$bin/prefix_attention_cuda_bench" ${PREFIX_ARGS:---quick} > "$out/prefix_$label.jsonl" 2> "$out/prefix_$label.err"
    echo "prefix bench $label: rc $? $(wc -l < "$out/prefix_$label.jsonl") lines"
  fi
done
if [ "${NCU:-1}" = 1 ]; then
  mkdir -p "$out/ncu"
  i=0
  for name in $("$carry/attention_cuda_bench" --benchmark_list_tests \
    --benchmark_filter="${NCU_FILTER:-$filter}"); do
    i=$((i + 1))
    echo "$name" > "$out/ncu/$i.name"
    timeout 60 ncu --clock-control none --cache-control none -k "regex:${NCU_KERNELS:-Decode}" \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed${NCU_METRICS:+,$NCU_METRICS} \
      --csv --log-file "$out/ncu/$i.csv" "$carry/attention_cuda_bench" \
      --benchmark_filter="^${name}\$" --benchmark_min_time=3x > "$out/ncu/$i.log" 2>&1
  done
  echo "ncu: $i shapes"
fi
python3 bench/gpu/decode_ab_report.py "$out" "$@" | tee "$out/table.md"
tar -C "$out" -cf "$dest/decode_ab.tar" . && cp "$out/table.md" "$dest/"
