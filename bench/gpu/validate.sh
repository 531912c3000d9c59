#!/usr/bin/env bash
# Every GPU and multi-GPU test of the system on a GPU host, in one device call, from the carried
# binaries (bench/gpu/build-carry.sh): the kernel tests (with the environments CTest runs them
# in: the mma kernel, 3 persistent CTAs, the static schedule, 176-key tiles, decode on the
# prefill kernel, and compute-sanitizer), the prefix-batched kernels (each root kind), the KV
# cache and UCX tests, the CUDA model against the CPU model, the CLI's CUDA check and memory
# refusals, the NCCL fault and device-ring tests (two GPUs), and transformers' checkpoints on
# every backend. Each step stops
# after 300 s. Logs go to $OUT (or /tmp/validate), with a verdict line per step in summary.txt.
# All of it takes about 12 minutes, more than one device call may run: "attention" runs the
# attention kernel's tests (about 6 minutes), "models" the prefix-batched, cache, GEMV, UCX and
# model tests, "kernels" both, "system" the rest.
#
#   run(command="bash bench/gpu/validate.sh [attention|models|kernels|system]",
#       carry=[".gpu-carry"], kind="nvidia-h200-x2")
set -uo pipefail
cd "$(dirname "$0")/../.."
part=${1:-all}
carry=${CARRY:-.gpu-carry}
out=${OUT:-/tmp/validate}
mkdir -p "$out"
export LD_LIBRARY_PATH="$PWD/$carry/lib:${LD_LIBRARY_PATH:-}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
nvidia-smi -L | tee "$out/gpus.txt"
failed=()
step() {  # step NAME command...: runs it, logs to $out/NAME.log, prints one verdict line
  local name=$1; shift
  local t0=$SECONDS
  timeout 300 "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$name: rc $rc ($((SECONDS - t0)) s) $(grep -E '^\[  (PASSED|FAILED)|SKIPPED|^FAIL|PASS' \
    "$out/$name.log" | tail -2 | tr '\n' ' ')" | tee -a "$out/summary.txt"
  [ $rc -eq 0 ] || [ $rc -eq 77 ] || failed+=("$name")
}
attention_steps() {
  step attention_cuda_test "$carry/attention_cuda_test"
  step attention_cuda_test_mma env CPFILL_ATTENTION_KERNEL=mma "$carry/attention_cuda_test"
  step attention_cuda_test_persistent3 env CPFILL_HOPPER_MAX_CTAS=3 "$carry/attention_cuda_test" \
    --gtest_filter='*Small*'
  step attention_cuda_test_static3 env CPFILL_HOPPER_MAX_CTAS=3 CPFILL_HOPPER_SCHEDULE=static \
    "$carry/attention_cuda_test" --gtest_filter='*Small*'
  step attention_cuda_test_keytile176 env CPFILL_HOPPER_KEY_TILE=176 "$carry/attention_cuda_test" \
    --gtest_filter='*Small*:*Large.Long*:*KeySplit*:*Paged*'
  step attention_cuda_test_nodecode env CPFILL_DECODE_KERNEL=0 "$carry/attention_cuda_test" \
    --gtest_filter='*Decode*:-*ManySplits*'
  step attention_cuda_sanitizer bash tests/under_compute_sanitizer.sh "$carry/attention_cuda_test" \
    --gtest_filter='*Small*'
  step attention_cuda_sanitizer_keytile176 env CPFILL_HOPPER_KEY_TILE=176 \
    bash tests/under_compute_sanitizer.sh "$carry/attention_cuda_test" \
    --gtest_filter='*WithoutTheCausalMask*:*Garbage*'
}

model_steps() {
  step prefix_batched_cuda_test "$carry/prefix_batched_cuda_test"
  for root in decode split; do
    step "prefix_batched_cuda_test_$root" env CPFILL_PREFIX_ROOT=$root \
      "$carry/prefix_batched_cuda_test"
  done
  step ucx_transport_test "$carry/ucx_transport_test"
  step kv_cache_cuda_test "$carry/kv_cache_cuda_test"
  step gemv_cuda_test "$carry/gemv_cuda_test"
  step llama_model_cuda_test mpirun -np 1 "$carry/llama_model_cuda_test"
}

system_steps() {
  step cli_cuda_backend_check bash tests/cli_test.sh cuda_backend_check "$carry/cpfill"
  step cli_memory_checked_first bash tests/cli_test.sh memory_checked_first "$carry/cpfill"
  step cli_multigpu_stopped_rank_named bash tests/cli_test.sh multigpu_stopped_rank_named \
    "$carry/cpfill"
  step cli_multigpu_device_ring bash tests/cli_test.sh multigpu_device_ring "$carry/cpfill"
  step cli_multigpu_device_ring_knobs env CPFILL_COMMUNICATION_PRIORITY=high \
    CPFILL_RING_EXCHANGE_CTAS=nccl bash tests/cli_test.sh multigpu_device_ring "$carry/cpfill"
  step hf_transformers_check python3 tests/hf_transformers_check.py "$carry/cpfill" /tmp/hf \
    --backend all
  # A batch too large for the GPU but not for the host: refused on the GPU's numbers, exit 2.
  # (30M tokens of 2 + 2 heads: about 157 GiB of host and 172 GiB of GPU buffers; an H200 host
  # has 256 GiB of memory.)
  step gpu_memory_refusal bash -c "'$carry/cpfill' attention --backend cuda --seq-lens 30000000 \
    --heads 2 --kv-heads 2 --head-dim 128 2>&1 | tee /dev/stderr | grep -q 'GPU buffers need'"
}

case $part in
  attention) attention_steps ;;
  models) model_steps ;;
  kernels) attention_steps; model_steps ;;
  system) system_steps ;;
  all) attention_steps; model_steps; system_steps ;;
  *) echo "validate.sh: unknown part '$part' (attention, models, kernels, system or all)" >&2
     exit 2 ;;
esac
echo "validate: ${#failed[@]} failed ${failed[*]:-}"
[ ${#failed[@]} -eq 0 ]
