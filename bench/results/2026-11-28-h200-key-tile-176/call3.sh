#!/usr/bin/env bash
# Call 3 (issue 17): the model, cache and multi-GPU tests on the final build (validate.sh models,
# system), then, in the time left, the mixed and partial-prefill kernel shapes against FA3,
# 2 x H200.
set -u
dev_out=$OUT
[ -d .gpu-carry-s ] || tar -xJf .gpu-carry-z/s.tar.xz
o=/tmp/o3; mkdir -p $o
CARRY=.gpu-carry-s OUT=$o/validate timeout 300 bash bench/gpu/validate.sh models
CARRY=.gpu-carry-s OUT=$o/validate timeout $((540 - SECONDS)) bash bench/gpu/validate.sh system
left=$((565 - SECONDS))
[ $left -gt 40 ] && CARRY=.gpu-carry-s OUT=$o/bench BENCH_FILTER='BM_AttentionMixed|BM_AttentionPartial' \
  timeout $left bash bench/gpu/run.sh bench
tar -C /tmp -cf $dev_out/o3.tar o3
