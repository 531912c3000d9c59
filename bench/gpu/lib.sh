# Sourced by the GPU scripts (not run): where the carried binaries and the output are, MPI as
# root, and the runs several measurements share. Run from the repository root on a GPU host with
# the binaries of bench/gpu/build-carry.sh in .gpu-carry/; every step writes its raw log and JSON
# under $out and, where it says so, one line into $summary.
out=${OUT:-/tmp/cpfill-out}
mkdir -p "$out"
carry=$PWD/${CARRY:-.gpu-carry}  # CARRY: another carried build (a before/after pair)
cpfill=$carry/cpfill
export LD_LIBRARY_PATH=$carry/lib:${LD_LIBRARY_PATH:-}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 NCCL_NVLS_ENABLE=0
summary=$out/summary.txt
# The Llama-3-405B per-GPU attention shape on TP8: every ring measurement uses it.
shape="--heads 16 --kv-heads 1 --head-dim 128"

# FlashAttention-3, a peer, from the carried wheel (.wheels/fa3_fwd-*.whl, PyPI fa3-fwd) where
# there is one: installed under /tmp/fa3 and put on PYTHONPATH (the host's PyTorch loads it).
use_fa3_wheel() {
  ls .wheels/fa3_fwd-*.whl >/dev/null 2>&1 || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fa3 \
    .wheels/fa3_fwd-*.whl > "$out/fa3_install.log" 2>&1 && export PYTHONPATH=/tmp/fa3:${PYTHONPATH:-}
}

new_summary() { : > "$summary"; }      # scripts that note lines start with this
note() { echo "$*" | tee -a "$summary"; }

net_env() {  # the NCCL environment of a link kind; shm and sockets emulate slower links
  case $1 in
    nvlink) echo "" ;;
    shm) echo "NCCL_P2P_DISABLE=1" ;;
    sockets) echo "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1" ;;
  esac
}

# on_net NET NP COMMAND...: mpirun of NP ranks, NET's NCCL settings on every rank; MPI_ARGS adds
# mpirun options (e.g. "--bind-to none": mpirun binds each of 2 ranks to one core by default).
on_net() {
  local net=$1 np=$2 envs xs="" e
  shift 2
  envs=$(net_env "$net")
  for e in $envs; do xs="$xs -x ${e%%=*}"; done
  env $envs mpirun -np "$np" ${MPI_ARGS:-} $xs -x NCCL_NVLS_ENABLE "$@"
}

ring() {  # ring NET NP FILE ARGS...: one `cpfill attention` on the device ring; FILE.json, FILE.log
  local net=$1 np=$2 file=$3
  shift 3
  on_net "$net" "$np" "$cpfill" attention --backend cuda $shape --json "$file.json" "$@" \
    > "$file.log" 2>&1
}

slowest() { grep -E 'run .*slowest' "$1" | tail -1; }  # the last run's slowest-rank line
# Every `run i/n: T ms` time of a log, on one line.
run_times() { grep -oE 'run [0-9]+/[0-9]+: [0-9.]+ ms' "$1" | awk '{printf "%s ", $3}'; }
# The GPUs' names, top clocks and power limits (a power cap spreads runs), into $out/gpu.txt.
gpu_info() {
  nvidia-smi --query-gpu=index,name,clocks.max.sm,power.limit --format=csv > "$out/gpu.txt"
}

prefill() {  # prefill TAG NP ARGS...: one cpfill prefill of the 8B geometry, its TTFT line noted
  local tag=$1 np=$2 rc
  shift 2
  mpirun -np "$np" "$cpfill" prefill --backend cuda --model llama3-8b --repeat 3 \
    --json "$out/$tag.json" "$@" > "$out/$tag.log" 2>&1
  rc=$?
  note "$tag: $(grep -E '^TTFT' "$out/$tag.log" | cut -c1-150) (rc $rc)"
  [ $rc -eq 0 ] || tail -4 "$out/$tag.log"
}

small_gpu_tests() {  # the small cases of the kernel tests on the default (Hopper) kernel
  timeout 150 "$carry/attention_cuda_test" --gtest_filter='*Small*' > "$out/gpu_tests.log" 2>&1
  note "gpu tests (hopper kernel): rc $? $(grep -E 'PASSED|FAILED' "$out/gpu_tests.log" | head -3)"
}

multigpu_tests() {  # tests/cli_test.sh multigpu_device_ring: every algorithm, TP x CP, the model
  timeout 240 bash tests/cli_test.sh multigpu_device_ring "$cpfill" > "$out/multigpu.log" 2>&1
  note "multigpu tests: rc $? $(tail -1 "$out/multigpu.log")"
}

model_vs_transformers() {  # model_vs_transformers T...: the 8B cut to 2 layers on one GPU, then
  local t lens                   # transformers on the same lengths, in the same call
  for t in "$@"; do prefill "cp1-2l-$t" 1 --layers 2 --prompt-lens "$t"; done
  lens=$(IFS=,; echo "$*")
  python3 bench/gpu/hf_prefill_peer.py --layers 2 --lens "$lens" > "$out/hf_peer.log" 2>&1
  note "transformers: $(grep -h '^{\|^\[' "$out/hf_peer.log" | tail -$#)"
  grep -q '^{' "$out/hf_peer.log" || tail -3 "$out/hf_peer.log"
}

ring_vs_torch() {  # ring_vs_torch CP: 128K, CP1 and CP-way on NVLink and sockets, cpfill's ring
  local cp=$1 net np  # then PyTorch's context parallelism (cuDNN), same call
  for net in nvlink sockets; do
    for np in 1 "$cp"; do
      [ "$np" = 1 ] && [ $net = sockets ] && continue
      ring $net "$np" "$out/cpfill-cp$np-$net" --seq-lens 131072 --algo pass-kv --repeat 5
      note "cpfill CP$np $net: $(slowest "$out/cpfill-cp$np-$net.log")"
      torch_cp "$np" $net
    done
  done
}

torch_cp() {  # torch_cp NP NET: PyTorch's context parallelism (cuDNN) at 128K, its line noted
  local np=$1 net=$2 peer_log
  if [ "$np" = 1 ]; then
    peer_log=$out/torch-cp1.log
    python3 bench/gpu/torch_cp_peer.py --tokens 131072 > "$peer_log" 2>&1
  else
    peer_log=$out/torch-cp$np-$net.log
    env $(net_env "$net") timeout 200 python3 -m torch.distributed.run --nproc_per_node "$np" \
      bench/gpu/torch_cp_peer.py --tokens 131072 > "$peer_log" 2>&1
  fi
  note "torch CP$np $net: $(grep -h '^{' "$peer_log" | tail -1)"
  grep -q '^{' "$peer_log" || tail -3 "$peer_log"
}
