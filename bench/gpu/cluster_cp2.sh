#!/usr/bin/env bash
# The cluster issue's measurements on two GPUs, one call: the GPU tests (kernel, KV cache, the
# model with cuBLASLt opened at run time, the multi-GPU CLI cases with a mixed batch and its
# trace), then on NVLink and on TCP sockets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1):
#   - `cpfill calibrate` on P + T = 32K, 64K, 128K: C, BW, the fit, in-sample and held-out regret;
#   - a mixed batch (one 128K full prefill beside three 256-token follow-ups after 128K cached):
#     per-request selection under that link's fit against each algorithm for the whole batch;
#   - a traced 128K pass-KV run and a traced mixed run (Chrome trace JSON; plots made here).
#   bash bench/gpu/cluster_cp2.sh [tests] [nvlink] [sockets]   (nvidia-h200-x2; default: all)
# Binaries from .gpu-carry/ (bench/gpu/build-carry.sh); logs, JSON and summary.txt under $OUT.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
parts=("${@:-tests nvlink sockets}")
parts=(${parts[*]})
[ -f "$summary" ] || new_summary
if [[ " ${parts[*]} " == *" tests "* ]]; then
  small_gpu_tests
  timeout 120 "$carry/kv_cache_cuda_test" > "$out/kv_tests.log" 2>&1
  note "kv cache gpu tests: rc $? $(grep -E 'PASSED|FAILED' "$out/kv_tests.log" | head -2)"
  timeout 200 "$carry/llama_model_cuda_test" > "$out/model_tests.log" 2>&1
  note "model gpu tests: rc $? $(grep -E 'PASSED|FAILED' "$out/model_tests.log" | head -2)"
  multigpu_tests
fi

# Two mixed batches: a 128K full prefill beside three 256-token follow-ups, and a 32K one beside
# three 1K follow-ups (where the follow-ups' share of the work is larger).
mixes=("131072,256,256,256" "32768,1024,1024,1024")
for net in nvlink sockets; do
  [[ " ${parts[*]} " == *" $net "* ]] || continue
  on_net $net 2 "$cpfill" calibrate --backend cuda $shape --context-lens 32768,65536,131072 \
    --repeat 2 --out "$out/fit-$net.json" --json "$out/calibrate-$net.json" \
    > "$out/calibrate-$net.log" 2>&1
  note "calibrate $net: rc $?"
  grep -iE 'measured|whole grid|held-out|fit:' "$out/calibrate-$net.log" | head -12 | tee -a "$summary"
  for m in 0 1; do
    for algo in auto pass-kv pass-q; do
      sel=(--algo "$algo")
      [ "$algo" = auto ] && sel=(--rule fitted --fit "$out/fit-$net.json")
      f=$out/mixed$m-$net-$algo
      ring $net 2 "$f" --seq-lens "${mixes[$m]}" --cached-lens 0,131072,131072,131072 \
        --repeat 5 "${sel[@]}" --trace "$f.trace.json"
      note "mixed ${mixes[$m]} $net $algo (rc $?): $(grep '^algorithm' "$f.log")" \
        "$(slowest "$f.log")"
    done
  done
  ring $net 2 "$out/full-$net" --seq-lens 131072 --algo pass-kv --repeat 3 \
    --trace "$out/full-$net.trace.json"
  note "128K pass-kv $net (rc $?): $(slowest "$out/full-$net.log")"
done
echo "== summary"
cat "$summary"
