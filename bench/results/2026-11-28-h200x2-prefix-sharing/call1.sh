#!/usr/bin/env bash
# Call 1 (nvidia-h200-x2): the prefix attention grid (GPU 0) beside the one-GPU prefix-batched
# decode runs (GPU 1), then GPU tests of HEAD in pairs.
set -u
C=.gpu-carry-s o=/tmp/o1
mkdir -p $o
export LD_LIBRARY_PATH=$PWD/$C/lib OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=index,name,clocks.max.sm,power.limit --format=csv > $o/gpu.txt
(CUDA_VISIBLE_DEVICES=0 OUT=$o/grid CARRY=$C TESTS=0 bash bench/gpu/prefix_attention.sh > $o/grid.log 2>&1; echo "grid done $SECONDS s") &
(CUDA_VISIBLE_DEVICES=1 OUT=$o/e2e_np1 CARRY=$C PROMPTS=2048,16384 NS=16,64,256 NPS=1 bash bench/gpu/prefix_decode.sh > $o/e2e_np1.log 2>&1; echo "e2e done $SECONDS s") &
wait
head -4 $o/grid.log; cat $o/e2e_np1/summary.txt
t() { local n=$1; shift; local t0=$SECONDS; timeout 120 "$@" > $o/$n.log 2>&1; echo "$n: rc $? $((SECONDS-t0)) s $(grep -E '^\[  (PASSED|FAILED)' $o/$n.log | tr '\n' ' ')" | tee -a $o/tests.txt; }
CUDA_VISIBLE_DEVICES=0 t prefix_batched $C/prefix_batched_cuda_test &
CUDA_VISIBLE_DEVICES=1 t llama_model mpirun -np 1 $C/llama_model_cuda_test &
wait
CUDA_VISIBLE_DEVICES=0 t position_runs $C/position_runs_cuda_test &
CUDA_VISIBLE_DEVICES=1 t token_draw $C/token_draw_cuda_test &
wait
CUDA_VISIBLE_DEVICES=0 t attention_decode_paged $C/attention_cuda_test --gtest_filter='*Decode*:*Paged*:*Small*' &
CUDA_VISIBLE_DEVICES=1 t kv_cache $C/kv_cache_cuda_test &
wait
