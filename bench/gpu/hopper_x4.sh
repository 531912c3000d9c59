#!/usr/bin/env bash
# Issue 5 and issue 7 runs on a 4-GPU host with the Hopper kernel, in two device calls:
#   bash bench/gpu/hopper_x4.sh cp       # GPU tests; 128K 16q:1kv CP1/CP4 on NVLink and sockets,
#                                        # cpfill and PyTorch context parallelism (cuDNN) in the
#                                        # same call; 8B (2 layers) on one GPU vs transformers
#   bash bench/gpu/hopper_x4.sh model    # multigpu tests; whole Llama-3-8B (32 layers) prefill,
#                                        # CP1 / CP2 / CP4 / TP2xCP2 at 32K and 128K
#   bash bench/gpu/hopper_x4.sh cp4      # multigpu tests; the 128K CP1/CP4 runs of `cp` alone
#   bash bench/gpu/hopper_x4.sh one      # on any one GPU: GPU tests (both kernels, the CLI
#                                        # checks), then the 8B cut to 2 layers vs transformers
# Binaries from .gpu-carry/ (bench/gpu/build-carry.sh); logs and JSON under $OUT.
set -uo pipefail
what=${1:-cp}
out=${OUT:-/tmp/cpfill-out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.gpu-carry/lib:${LD_LIBRARY_PATH:-}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 NCCL_NVLS_ENABLE=0
cpfill=$PWD/.gpu-carry/cpfill
summary=$out/summary.txt
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
sockets="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"

prefill() {  # prefill TAG NP ARGS...: one cpfill prefill run, its TTFT line into the summary
  local tag=$1 np=$2; shift 2
  mpirun -np "$np" "$cpfill" prefill --backend cuda --model llama3-8b --repeat 3 \
    --json "$out/$tag.json" "$@" > "$out/$tag.log" 2>&1
  local rc=$?
  note "$tag: $(grep -E '^TTFT' "$out/$tag.log" | cut -c1-150) (rc $rc)"
  [ $rc -eq 0 ] || tail -4 "$out/$tag.log"
}

small_gpu_tests() {  # the small cases of the kernel tests on the Hopper kernel
  timeout 150 .gpu-carry/attention_cuda_test --gtest_filter='*Small*' > "$out/gpu_tests.log" 2>&1
  note "gpu tests (hopper kernel): rc $? $(grep -E 'PASSED|FAILED' "$out/gpu_tests.log" | head -3)"
}

model_vs_transformers() {  # issue 5 on one GPU: the 8B geometry cut to 2 layers, same call
  for t in 8192 32768 131072; do prefill "cp1-2l-$t" 1 --layers 2 --prompt-lens $t; done
  python3 bench/gpu/hf_prefill_peer.py --layers 2 --lens 8192,32768,131072 \
    > "$out/hf_peer.log" 2>&1
  note "transformers: $(grep -h '^{\|^\[' "$out/hf_peer.log" | tail -3)"
}

cp_vs_torch() {  # 128K 16q:1kv, CP1 and CP4 on NVLink and sockets, cpfill and PyTorch CP
  for net in nvlink sockets; do
    envs=""; [ $net = sockets ] && envs=$sockets
    for np in 1 4; do
      [ $np = 1 ] && [ $net = sockets ] && continue
      xs=""; for e in $envs; do xs="$xs -x ${e%%=*}"; done
      env $envs mpirun -np $np $xs -x NCCL_NVLS_ENABLE "$cpfill" attention --backend cuda \
        --heads 16 --kv-heads 1 --head-dim 128 --seq-lens 131072 --algo pass-kv --repeat 5 \
        --json "$out/cpfill-cp$np-$net.json" > "$out/cpfill-cp$np-$net.log" 2>&1
      note "cpfill CP$np $net: $(grep -E 'run .*slowest' "$out/cpfill-cp$np-$net.log" | tail -1)"
      if [ $np = 1 ]; then
        python3 bench/gpu/torch_cp_peer.py --tokens 131072 > "$out/torch-cp1.log" 2>&1
      else
        env $envs timeout 150 python3 -m torch.distributed.run --nproc_per_node $np \
          bench/gpu/torch_cp_peer.py --tokens 131072 > "$out/torch-cp$np-$net.log" 2>&1
      fi
      note "torch CP$np $net: $(grep -h '^{' "$out"/torch-cp$np*.log | grep "\"cp\": $np" | tail -1)"
      [ -n "$(grep -h '^{' "$out"/torch-cp$np*.log)" ] || tail -3 "$out"/torch-cp$np*.log
    done
  done
}

if [ "$what" = cp4 ]; then
  timeout 240 bash tests/cli_test.sh multigpu_device_ring "$cpfill" > "$out/multigpu.log" 2>&1
  note "multigpu tests: rc $? $(tail -1 "$out/multigpu.log")"
  cp_vs_torch
fi

if [ "$what" = cp ]; then
  small_gpu_tests
  cp_vs_torch
  model_vs_transformers
fi

if [ "$what" = one ]; then
  small_gpu_tests
  CPFILL_ATTENTION_KERNEL=mma timeout 150 .gpu-carry/attention_cuda_test --gtest_filter='*Small*' \
    > "$out/gpu_tests_mma.log" 2>&1
  note "gpu tests (mma kernel): rc $? $(grep -E 'PASSED|FAILED' "$out/gpu_tests_mma.log" | head -3)"
  timeout 200 bash tests/cli_test.sh cuda_backend_check "$cpfill" > "$out/cli_cuda.log" 2>&1
  note "cli cuda_backend_check: rc $? $(tail -1 "$out/cli_cuda.log")"
  model_vs_transformers
fi

if [ "$what" = model ]; then
  timeout 200 bash tests/cli_test.sh multigpu_device_ring "$cpfill" > "$out/multigpu.log" 2>&1
  note "multigpu tests: rc $? $(grep -ciE 'pass' "$out/multigpu.log") pass lines"
  prefill cp4-32l-131072 4 --prompt-lens 131072
  prefill tp2cp2-32l-131072 4 --tp 2 --prompt-lens 131072
  prefill cp2-32l-131072 2 --prompt-lens 131072
  prefill cp1-32l-131072 1 --prompt-lens 131072
  prefill cp1-32l-32768 1 --prompt-lens 32768
  prefill cp4-32l-32768 4 --prompt-lens 32768
fi
echo "== summary"
cat "$summary"
