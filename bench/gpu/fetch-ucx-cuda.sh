#!/usr/bin/env bash
# PyPI's libucx-cu13 wheel (UCX 1.22 with cuda_copy, cuda_ipc and ucx_perftest), trimmed to what
# a GPU host needs and packed for carrying: .gpu-carry/ucx-cu13.tar.xz (about 7 MB of the 64 MiB
# carry limit; the wheel itself is 43 MB). The GPU hosts' own UCX (Ubuntu 1.16) has no CUDA
# transport. Run here (it downloads), after bench/gpu/build-carry.sh; kv_handoff.sh unpacks it.
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pip download 'libucx-cu13==1.22.*' --no-deps -d "$tmp" >/dev/null
python3 -m zipfile -e "$tmp"/libucx_cu13-*.whl "$tmp/x"
t=$tmp/trim
mkdir -p "$t/libucx/lib/ucx" "$t/libucx/bin" "$t/libucx_cu13.libs"
for l in ucp ucs uct ucm; do
  cp -L "$tmp/x/libucx/lib/lib$l.so.0" "$t/libucx/lib/"
  ln -s "lib$l.so.0" "$t/libucx/lib/lib$l.so"
done
# The modules UCX loads by name from UCX_MODULE_DIR: CUDA memory and transports, CMA (one host's
# shared memory), the perftest's CUDA allocator.
for m in libucm_cuda libuct_cma libuct_cuda libucx_perftest_cuda; do
  cp -L "$tmp/x/libucx/lib/ucx/$m.so.0" "$t/libucx/lib/ucx/"
  ln -s "$m.so.0" "$t/libucx/lib/ucx/$m.so"
done
cp "$tmp/x/libucx/bin/ucx_perftest" "$t/libucx/bin/"
chmod +x "$t/libucx/bin/ucx_perftest"  # zipfile -e keeps no modes
cp "$tmp"/x/libucx_cu13.libs/* "$t/libucx_cu13.libs/"
mkdir -p .gpu-carry
tar -cJf .gpu-carry/ucx-cu13.tar.xz -C "$t" .
du -h .gpu-carry/ucx-cu13.tar.xz
