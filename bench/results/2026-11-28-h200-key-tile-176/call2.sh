#!/usr/bin/env bash
# Call 2 (issue 17): the final kernel's attention tests in every environment CTest gives them
# (validate.sh attention), 2 x H200.
set -u
dev_out=$OUT
tar -xJf .gpu-carry-z/s.tar.xz
o=/tmp/o2; mkdir -p $o
CARRY=.gpu-carry-s OUT=$o timeout 560 bash bench/gpu/validate.sh attention
tar -C /tmp -cf $dev_out/o2.tar o2
