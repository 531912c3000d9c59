#!/usr/bin/env bash
# Call 3 (nvidia-h200-x2): the deferred NCCL settle (new) — its multi-GPU tests, CP2 decode A/B
# against HEAD's build (old), the full CP2 prefix-batched decode table, the prefix cache on CP2.
set -u
o=/tmp/o3
mkdir -p $o
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=index,name,clocks.max.sm,power.limit --format=csv > $o/gpu.txt
t() { local n=$1; shift; local t0=$SECONDS; timeout ${T:-150} "$@" > $o/$n.log 2>&1; echo "$n: rc $? $((SECONDS-t0)) s $(tail -1 $o/$n.log)" | tee -a $o/tests.txt; }
export LD_LIBRARY_PATH=$PWD/.gpu-carry-n/lib
t multigpu_device_ring bash tests/cli_test.sh multigpu_device_ring $PWD/.gpu-carry-n/cpfill
T=200 t stopped_rank_named bash tests/cli_test.sh multigpu_stopped_rank_named $PWD/.gpu-carry-n/cpfill
OUT=$o/old CARRY=.gpu-carry-s PROMPTS=2048,16384 NS=16,256 NPS=2 BATCHING=on bash bench/gpu/prefix_decode.sh > $o/old.log 2>&1
echo "old done $SECONDS s"
OUT=$o/new CARRY=.gpu-carry-n PROMPTS=2048,16384 NS=16,64,256 NPS=2 bash bench/gpu/prefix_decode.sh > $o/new.log 2>&1
echo "new done $SECONDS s"
OUT=$o/cache_np2 CARRY=.gpu-carry-n DOC=65536 QUESTIONS=64 QUESTIONS_OFF=4 PROMPT=4096 N=64 NPS=2 CACHES="on off" bash bench/gpu/prefix_cache.sh > $o/cache_np2.log 2>&1
echo "cache np2 done $SECONDS s"
export LD_LIBRARY_PATH=$PWD/.gpu-carry-n/lib
CPFILL_COMMUNICATION_PRIORITY=high CPFILL_RING_EXCHANGE_CTAS=nccl T=100 t device_ring_knobs bash tests/cli_test.sh multigpu_device_ring $PWD/.gpu-carry-n/cpfill
