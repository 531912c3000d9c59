#!/usr/bin/env bash
# Whole-model prefill (synthetic bf16 weights, TTFT = median of 3 after a warm-up, slowest rank):
#   bash bench/gpu/model_prefill.sh transformers  # one GPU: the GPU tests (both kernels, the CLI
#                      # check), then the Llama-3-8B geometry cut to 2 layers at 8K, 32K and 128K
#                      # against transformers (bench/gpu/hf_prefill_peer.py) in the same call
#   bash bench/gpu/model_prefill.sh cp-scaling    # 4 GPUs: the multi-GPU tests, then the whole
#                      # Llama-3-8B (32 layers): CP1 / CP2 / CP4 / TP2 x CP2 at 32K and 128K
#   bash bench/gpu/model_prefill.sh tp-vs-cp-70b  # 8 GPUs: Llama-3-70B (first LAYERS layers,
#                      # default 8) at 128K, TP8 vs TP4 x CP2 vs TP2 x CP4, TTFT breakdown
# Binaries from .gpu-carry/ (bench/gpu/build-carry.sh); logs, JSON and summary.txt under $OUT.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
what=${1:-transformers}
case $what in
  transformers | cp-scaling | tp-vs-cp-70b) ;;
  *) echo "usage: bash bench/gpu/model_prefill.sh transformers|cp-scaling|tp-vs-cp-70b" >&2; exit 2 ;;
esac
new_summary

if [ "$what" = transformers ]; then
  small_gpu_tests
  CPFILL_ATTENTION_KERNEL=mma timeout 150 "$carry/attention_cuda_test" --gtest_filter='*Small*' \
    > "$out/gpu_tests_mma.log" 2>&1
  note "gpu tests (mma kernel): rc $? $(grep -E 'PASSED|FAILED' "$out/gpu_tests_mma.log" | head -3)"
  timeout 200 bash tests/cli_test.sh cuda_backend_check "$cpfill" > "$out/cli_cuda.log" 2>&1
  note "cli cuda_backend_check: rc $? $(tail -1 "$out/cli_cuda.log")"
  model_vs_transformers 8192 32768 131072
fi

if [ "$what" = cp-scaling ]; then
  multigpu_tests
  prefill cp4-32l-131072 4 --prompt-lens 131072
  prefill tp2cp2-32l-131072 4 --tp 2 --prompt-lens 131072
  prefill cp2-32l-131072 2 --prompt-lens 131072
  prefill cp1-32l-131072 1 --prompt-lens 131072
  prefill cp1-32l-32768 1 --prompt-lens 32768
  prefill cp4-32l-32768 4 --prompt-lens 32768
fi

if [ "$what" = tp-vs-cp-70b ]; then
  gpus=$(nvidia-smi -L | grep -c GPU)
  [ "$gpus" -ge 8 ] || echo "note: $gpus GPUs here; the 8-way runs need 8 (smaller ones still run)"
  np=$(( gpus >= 8 ? 8 : gpus ))
  for tp in 8 4 2; do
    [ $tp -le $np ] || continue
    echo "== 70B, TP$tp x CP$(( np / tp )), 128K, ${LAYERS:-8} layers"
    mpirun -np $np -x NCCL_NVLS_ENABLE "$cpfill" prefill --backend cuda --model llama3-70b \
      --layers "${LAYERS:-8}" --tp $tp --prompt-lens 131072 --repeat 2 --peak-tflops 989 \
      --json "$out/70b-tp$tp.json" 2>&1 | grep -E "TTFT|tokens/s|rror"
  done
fi
echo "== summary"
cat "$summary"
