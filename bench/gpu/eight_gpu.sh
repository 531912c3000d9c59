#!/usr/bin/env bash
# The 8-GPU runs (nvidia-h200-x8), in one command, with the binaries of .gpu-carry/:
#   1. CP scaling of the Llama-3-405B per-GPU attention shape (16 q : 1 kv heads, d128), CP1 to
#      CP8, 128K and 512K, NVLink and TCP sockets;
#   2. whole-model prefill of synthetic Llama-3-70B (first LAYERS layers, default 8) at 128K:
#      TP8 vs TP4 x CP2 vs TP2 x CP4, with the TTFT breakdown (GEMMs, ring, all-reduce);
#   3. calibration at CP8 on sockets: Table 4 and every rule's regret.
#   bash bench/gpu/eight_gpu.sh [scaling|models|table4|all]
# Results under $OUT (JSON, Markdown tables, plots).
set -uo pipefail
what=${1:-all}
out=${OUT:-/tmp/cpfill-out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.gpu-carry/lib:${LD_LIBRARY_PATH:-}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
cpfill=$PWD/.gpu-carry/cpfill
gpus=$(nvidia-smi -L | grep -c GPU)
[ "$gpus" -ge 8 ] || echo "note: $gpus GPUs here; the 8-way runs need 8 (smaller ones still run)"

if [ "$what" = scaling ] || [ "$what" = all ]; then
  LENGTHS="131072 524288" NETS="nvlink sockets" bash bench/gpu/scaling.sh scaling
fi
if [ "$what" = models ] || [ "$what" = all ]; then
  np=$(( gpus >= 8 ? 8 : gpus ))
  for tp in 8 4 2; do
    [ $tp -le $np ] || continue
    echo "== 70B, TP$tp x CP$(( np / tp )), 128K, ${LAYERS:-8} layers"
    mpirun -np $np -x NCCL_NVLS_ENABLE "$cpfill" prefill --backend cuda --model llama3-70b \
      --layers "${LAYERS:-8}" --tp $tp --prompt-lens 131072 --repeat 2 --peak-tflops 989 \
      --json "$out/70b-tp$tp.json" 2>&1 | grep -E "TTFT|tokens/s|rror"
  done
fi
if [ "$what" = table4 ] || [ "$what" = all ]; then
  bash bench/gpu/scaling.sh table4
fi
