#!/usr/bin/env bash
# Decode across two GPUs:  bash bench/gpu/decode_cp2.sh [tests]
#   time per output token of the Llama-3-8B geometry (LAYERS, default 32; synthetic bf16
#   weights), greedy, NEW tokens (default 32), for each batch of CASES (default "32768 131040
#   32768,32768,32768,32768": prompt lengths, one batch per word) on CP1 (one GPU), then CP2
#   (batched ring pass-Q, paper Alg. 4; each rank holds half of every sequence's KV) over NVLink
#   and over sockets (NCCL_P2P_DISABLE, NCCL_SHM_DISABLE: a slow inter-node link), same call.
#   With "tests" first: the multi-GPU tests (tests/cli_test.sh multigpu_device_ring), whose
#   generate --check runs decode on CP2 and TP2 against one fp32 rank. RUNS picks and orders
#   the runs (default "cp1 cp2-nvlink cp2-sockets"); MPI_ARGS adds mpirun options and TAG a
#   suffix to the sockets runs' names (e.g. MPI_ARGS="--bind-to none" TAG=-unbound).
# Binaries from .gpu-carry/ (bench/gpu/build-carry.sh); logs, JSON and summary.txt under $OUT,
# packed into $OUT/decode-cp2.tgz.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
layers=${LAYERS:-32}
new=${NEW:-32}
cases=${CASES:-32768 131040 32768,32768,32768,32768}
runs=${RUNS:-cp1 cp2-nvlink cp2-sockets}  # which of the three to run, and in that order
new_summary
[ "${1:-}" = tests ] && multigpu_tests

generate() {  # generate TAG NET NP LENS: one cpfill generate, its TPOT and step phases noted
  local tag=$1 net=$2 np=$3 lens=$4 total=0 l
  for l in ${lens//,/ }; do total=$((total + l)); done
  on_net "$net" "$np" timeout 240 "$cpfill" generate --backend cuda --model llama3-8b \
    --layers "$layers" --prompt-lens "$lens" --max-tokens "$new" --ignore-eos \
    --kv-capacity-tokens $((total / np + 4096)) --json "$out/$tag.json" > "$out/$tag.log" 2>&1
  note "$tag: rc $? $(grep -E 'TPOT|per decode step' "$out/$tag.log" | head -2 | tr -s ' \n' ' ')"
}

for lens in $cases; do
  name=$(echo "$lens" | awk -F, '{print NF "x" $1}')
  for run in $runs; do
    case $run in
      cp1) generate "cp1-$name" nvlink 1 "$lens" ;;
      cp2-nvlink) generate "cp2-nvlink-$name" nvlink 2 "$lens" ;;
      cp2-sockets) generate "cp2-sockets-$name${TAG:-}" sockets 2 "$lens" ;;
    esac
  done
done
tar -czf "$out/decode-cp2.tgz" -C "$out" --exclude decode-cp2.tgz .
echo "== summary"
cat "$summary"
