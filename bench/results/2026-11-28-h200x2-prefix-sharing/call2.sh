#!/usr/bin/env bash
# Call 2 (nvidia-h200-x2): the new tree rule's tests and its A/B against HEAD's on the 22 suffix
# shapes that had roots (GPU 0) beside the prefix cache on one GPU (GPU 1); then the CP2 runs.
set -u
o=/tmp/o2
mkdir -p $o
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=index,name,clocks.max.sm,power.limit --format=csv > $o/gpu.txt
SHAPES="--shape suffix:8:1:4096:256:256 --shape suffix:8:1:16384:256:8 --shape suffix:8:1:16384:256:32 --shape suffix:8:1:16384:256:256 --shape suffix:8:1:65536:256:8 --shape suffix:8:1:65536:256:32 --shape suffix:8:1:65536:256:256 --shape suffix:8:1:65536:2048:8 --shape suffix:8:1:65536:2048:32 --shape suffix:32:8:4096:256:8 --shape suffix:32:8:4096:256:32 --shape suffix:32:8:4096:256:256 --shape suffix:32:8:16384:256:8 --shape suffix:32:8:16384:256:32 --shape suffix:32:8:16384:256:256 --shape suffix:32:8:16384:2048:8 --shape suffix:32:8:16384:2048:32 --shape suffix:32:8:65536:256:8 --shape suffix:32:8:65536:256:32 --shape suffix:32:8:65536:256:256 --shape suffix:32:8:65536:2048:8 --shape suffix:32:8:65536:2048:32"
t() { local n=$1; shift; local t0=$SECONDS; timeout ${T:-150} "$@" > $o/$n.log 2>&1; echo "$n: rc $? $((SECONDS-t0)) s $(grep -aE 'PASSED|FAILED' $o/$n.log | tail -2 | tr '\n' ' ')" | tee -a $o/tests.txt; }
ab() {
  export CUDA_VISIBLE_DEVICES=0
  export LD_LIBRARY_PATH=$PWD/.gpu-carry-n/lib; t prefix_batched .gpu-carry-n/prefix_batched_cuda_test
  for i in 1 2; do
    LD_LIBRARY_PATH=$PWD/.gpu-carry-s/lib .gpu-carry-s/prefix_attention_cuda_bench $SHAPES > $o/old_$i.jsonl 2>$o/old_$i.err
    LD_LIBRARY_PATH=$PWD/.gpu-carry-n/lib .gpu-carry-n/prefix_attention_cuda_bench $SHAPES > $o/new_$i.jsonl 2>$o/new_$i.err
  done
  echo "ab done $SECONDS s"
}
cache1() {
  export CUDA_VISIBLE_DEVICES=1
  export LD_LIBRARY_PATH=$PWD/.gpu-carry-n/lib; t llama_model mpirun -np 1 .gpu-carry-n/llama_model_cuda_test
  OUT=$o/cache_np1 CARRY=.gpu-carry-n DOC=65536 QUESTIONS=64 QUESTIONS_OFF=4 PROMPT=4096 N=64 NPS=1 CACHES="on off" bash bench/gpu/prefix_cache.sh > $o/cache_np1.log 2>&1
  echo "cache np1 done $SECONDS s"
}
ab & cache1 & wait
unset CUDA_VISIBLE_DEVICES
OUT=$o/e2e_np2 CARRY=.gpu-carry-n PROMPTS=2048,16384 NS=16,64,256 NPS=2 bash bench/gpu/prefix_decode.sh > $o/e2e_np2.log 2>&1
echo "e2e np2 done $SECONDS s"
export LD_LIBRARY_PATH=$PWD/.gpu-carry-n/lib; T=280 t multigpu_device_ring bash tests/cli_test.sh multigpu_device_ring $PWD/.gpu-carry-n/cpfill
tail -2 $o/multigpu_device_ring.log
cat $o/tests.txt $o/cache_np1/summary.txt $o/e2e_np2/summary.txt | cut -c1-400
