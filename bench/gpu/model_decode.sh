#!/usr/bin/env bash
# Decode on one GPU:  bash bench/gpu/model_decode.sh check|tpot|all
#   1. (check) the GPU tests of the kernels (decode included), the KV cache and the model, and the CLI's
#      CUDA check;
#   2. (check) `cpfill generate --backend cuda --check`: greedy generation on bf16 against one rank (fp32
#      CPU) teacher-forced on the same tokens: tiny, and the 8B geometry cut to 2 layers;
#      and tests/hf_transformers_check.py --backend all (prefill and greedy generate against
#      transformers on checkpoints transformers wrote);
#   3. (tpot) time per output token of the Llama-3-8B geometry (LAYERS, default 32; synthetic bf16
#      weights) at CONTEXTS (default 32768,131040: 128K less NEW, within the model's 131072 positions), NEW tokens (default 64) greedy: cpfill
#      generate, then transformers' generate (bench/gpu/hf_generate_peer.py) in the same call;
#      GEMV=ab adds each context with the decode GEMMs on cuBLASLt (CPFILL_DECODE_GEMV=0).
# Binaries from .gpu-carry/ (bench/gpu/build-carry.sh); logs, JSON and summary.txt under $OUT,
# packed into $OUT/model-decode.tgz.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
layers=${LAYERS:-32}
contexts=${CONTEXTS:-32768,131040}
new=${NEW:-64}
what=${1:-all}
new_summary

if [ "$what" != tpot ] && [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS=1: not the kernel tests
small_gpu_tests
timeout 120 "$carry/attention_cuda_test" --gtest_filter='*Decode*' > "$out/gpu_decode_tests.log" 2>&1
note "gpu tests (decode kernel): rc $? $(grep -E 'PASSED|FAILED' "$out/gpu_decode_tests.log" | head -3)"
timeout 120 "$carry/gemv_cuda_test" > "$out/gemv_cuda.log" 2>&1
note "gemv_cuda_test: rc $? $(grep -E 'PASSED|FAILED' "$out/gemv_cuda.log" | head -2)"
timeout 120 "$carry/kv_cache_cuda_test" > "$out/kv_cache_cuda.log" 2>&1
note "kv_cache_cuda_test: rc $? $(grep -E 'PASSED|FAILED' "$out/kv_cache_cuda.log" | head -2)"
timeout 200 mpirun -np 1 "$carry/llama_model_cuda_test" > "$out/llama_model_cuda.log" 2>&1
note "llama_model_cuda_test: rc $? $(grep -E 'PASSED|FAILED' "$out/llama_model_cuda.log" | head -2)"
fi

if [ "$what" != tpot ]; then
timeout 200 bash tests/cli_test.sh cuda_backend_check "$cpfill" > "$out/cli_cuda.log" 2>&1
note "cli cuda_backend_check: rc $? $(tail -1 "$out/cli_cuda.log")"

check() {  # check TAG ARGS...: cpfill generate --check on the GPU
  local tag=$1
  shift
  timeout 240 mpirun -np 1 "$cpfill" generate --backend cuda --check --json "$out/$tag.json" "$@" \
    > "$out/$tag.log" 2>&1
  note "$tag: rc $? $(grep -E '^check: prompt' "$out/$tag.log" | cut -c1-160)"
}
check generate-check-tiny --model tiny --prompt-lens 700,33,1 --max-tokens 32
check generate-check-8b-2l --model llama3-8b --layers 2 --prompt-lens 513,64 --max-tokens 24
timeout 300 python3 tests/hf_transformers_check.py "$cpfill" /tmp/cpfill-hfc --backend all \
  > "$out/hf_transformers_check.log" 2>&1
note "hf_transformers_check: rc $? $(tail -1 "$out/hf_transformers_check.log")"
fi

if [ "$what" != check ]; then
# GEMV=ab: each context also with the decode GEMMs on cuBLASLt (CPFILL_DECODE_GEMV=0), same call.
variants=("")
[ "${GEMV:-}" = ab ] && variants+=("CPFILL_DECODE_GEMV=0")
for ctx in ${contexts//,/ }; do
  for v in "${variants[@]}"; do
    tag=cpfill-generate-$ctx${v:+-cublaslt}
    env $v timeout 200 mpirun -np 1 "$cpfill" generate --backend cuda --model llama3-8b \
      --layers "$layers" --prompt-lens "$ctx" --max-tokens "$new" --ignore-eos \
      --kv-capacity-tokens $((ctx + 4096)) --json "$out/$tag.json" > "$out/$tag.log" 2>&1
    note "$tag: rc $? $(grep -E 'TTFT|TPOT' "$out/$tag.log" | head -2 | tr '\n' ' ')"
  done
done
timeout 250 python3 bench/gpu/hf_generate_peer.py --layers "$layers" --lens "$contexts" \
  --new-tokens "$new" > "$out/hf-generate.jsonl" 2> "$out/hf-generate.err"
note "transformers generate: rc $? $(cat "$out/hf-generate.jsonl" | tr '\n' ' ' | cut -c1-400)"
fi
tar -czf "$out/model-decode.tgz" -C "$out" --exclude model-decode.tgz .
echo "== summary"
cat "$summary"
