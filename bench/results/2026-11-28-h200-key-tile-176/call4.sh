#!/usr/bin/env bash
# Call 4 (issue 17): after the review, the tests that changed, on the final build, one H200:
# memcheck and racecheck on the 176-key kernel, the 176-key CTest's cases (with the key split
# and paged ones), the default small and key-split cases. Each verdict prints as it ends.
set -u
dev_out=$OUT
tar -xJf .gpu-carry-z/s.tar.xz
o=/tmp/o4; mkdir -p $o
export LD_LIBRARY_PATH=$PWD/.gpu-carry-s/lib
t=.gpu-carry-s/attention_cuda_test
step() {  # step NAME SECONDS command...
  local name=$1 secs=$2; shift 2
  timeout "$secs" "$@" > $o/$name.log 2>&1
  echo "$name: rc $? $(grep -E '^\[  (PASSED|FAILED)|clean' $o/$name.log | tr '\n' ' ')" | tee -a $o/summary.txt
  tar -C /tmp -cf $dev_out/o4.tar o4
}
step sanitizer_keytile176 70 env CPFILL_HOPPER_KEY_TILE=176 bash tests/under_compute_sanitizer.sh $t \
  --gtest_filter='*WithoutTheCausalMask*:*Garbage*'
step keytile176 100 env CPFILL_HOPPER_KEY_TILE=176 $t --gtest_filter='*Small*:*Large.Long*:*KeySplit*:*Paged*'
step default_small_keysplit 40 $t --gtest_filter='*Small*:*KeySplit*'
