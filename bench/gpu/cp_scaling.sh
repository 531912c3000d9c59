#!/usr/bin/env bash
# CP scaling of full prefill (pass-KV, 16 q : 1 kv heads, d128) on one multi-GPU host, with the
# links as they are (NVLink) and slowed to inter-node speeds: NCCL through host shared memory
# (NCCL_P2P_DISABLE=1) and through TCP sockets (also NCCL_SHM_DISABLE=1). CP1/2/4/8 (as many as
# there are GPUs) x LENGTHS x NETS (defaults: 32K 128K 512K; nvlink shm sockets).
#   bash bench/gpu/cp_scaling.sh
#   LENGTHS="131072 524288" NETS="nvlink sockets" bash bench/gpu/cp_scaling.sh   # the 8-GPU call
# Binaries from .gpu-carry/ (bench/gpu/build-carry.sh). JSON per run under $OUT/runs, the table
# (scaling.md) and plot (scaling.png) under $OUT.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
mkdir -p "$out/runs"
gpus=$(nvidia-smi -L | grep -c GPU)

run() {  # run NET NP TAG ARGS...
  local net=$1 np=$2 tag=$3 rc
  shift 3
  ring "$net" "$np" "$out/runs/$tag" "$@"
  rc=$?
  slowest "$out/runs/$tag.log" | sed "s/^/$tag: /"
  [ $rc -eq 0 ] || { echo "$tag failed (rc $rc):"; tail -5 "$out/runs/$tag.log"; }
}

for t in ${LENGTHS:-32768 131072 524288}; do
  run nvlink 1 "cp1-$t" --seq-lens $t --algo pass-kv --repeat 3
  for net in ${NETS:-nvlink shm sockets}; do
    for np in 2 4 8; do
      [ $np -le $gpus ] || continue
      run $net $np "cp$np-$t-$net" --seq-lens $t --algo pass-kv --repeat 3
    done
  done
done
python3 bench/gpu/summarize.py scaling "$out/runs" "$out"
