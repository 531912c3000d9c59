#!/usr/bin/env bash
# CP scaling of full prefill and the pass-KV / pass-Q crossover, on one multi-GPU host, with the
# links as they are (NVLink) and slowed to inter-node speeds: NCCL through host shared memory
# (NCCL_P2P_DISABLE=1) and through TCP sockets (also NCCL_SHM_DISABLE=1).
#   bash bench/gpu/scaling.sh scaling   # CP1/2/4/8 (as many as there are GPUs) x LENGTHS x
#                                       # NETS (defaults: 32K 128K 512K; nvlink shm sockets)
#   bash bench/gpu/scaling.sh table4    # P + T = 32K and 128K on sockets, calibrate, regret
# Binaries from .gpu-carry/ (bench/gpu/build-carry.sh). JSON per run and the summary under $OUT.
set -uo pipefail
what=${1:-scaling}
out=${OUT:-/tmp/cpfill-out}
mkdir -p "$out/runs"
export LD_LIBRARY_PATH=$PWD/.gpu-carry/lib:${LD_LIBRARY_PATH:-}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 NCCL_NVLS_ENABLE=0
cpfill=$PWD/.gpu-carry/cpfill
gpus=$(nvidia-smi -L | grep -c GPU)
shape="--heads 16 --kv-heads 1 --head-dim 128"

net_env() {  # prints the NCCL environment of a link kind
  case $1 in
    nvlink) echo "" ;;
    shm) echo "NCCL_P2P_DISABLE=1" ;;
    sockets) echo "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1" ;;
  esac
}
run() {  # run NET NP TAG ARGS...
  local net=$1 np=$2 tag=$3; shift 3
  local envs=$(net_env $net) xs=""
  for e in $envs; do xs="$xs -x ${e%%=*}"; done
  env $envs mpirun -np $np $xs -x NCCL_NVLS_ENABLE "$cpfill" attention --backend cuda $shape \
    --json "$out/runs/$tag.json" "$@" > "$out/runs/$tag.log" 2>&1
  local rc=$?
  grep -E "run .*slowest" "$out/runs/$tag.log" | tail -1 | sed "s/^/$tag: /"
  [ $rc -eq 0 ] || { echo "$tag failed (rc $rc):"; tail -5 "$out/runs/$tag.log"; }
}

if [ "$what" = scaling ]; then
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
fi
if [ "$what" = table4 ]; then
  np=$(( gpus >= 8 ? 8 : (gpus >= 4 ? 4 : gpus) ))
  env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 mpirun -np $np -x NCCL_P2P_DISABLE -x NCCL_SHM_DISABLE \
    -x NCCL_NVLS_ENABLE "$cpfill" calibrate --backend cuda $shape --context-lens 32768,131072 \
    --repeat 2 --out "$out/fit-sockets.json" --json "$out/table4-sockets.json" 2>&1 |
    tee "$out/table4-sockets.log" | tail -40
  python3 bench/gpu/summarize.py table4 "$out/table4-sockets.json" "$out"
fi
