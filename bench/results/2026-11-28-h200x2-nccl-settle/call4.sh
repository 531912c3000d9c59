#!/usr/bin/env bash
# Call 4 (nvidia-h200-x2): decode TPOT on the final build (new): CP1 and CP2 over NVLink, with
# HEAD's build (old) on CP2 beside it (the NCCL settle's A/B); then one GPU against transformers.
set -u
o=/tmp/o4
mkdir -p $o
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 NCCL_NVLS_ENABLE=0
OUT=$o/cp2 CARRY=.gpu-carry-n RUNS="cp1 cp2-nvlink" CASES="32768 131040" bash bench/gpu/decode_cp2.sh > $o/cp2.log 2>&1
echo "new cp1/cp2 done $SECONDS s"
OUT=$o/cp2_old CARRY=.gpu-carry-s RUNS="cp2-nvlink" CASES="32768 131040" bash bench/gpu/decode_cp2.sh > $o/cp2_old.log 2>&1
echo "old cp2 done $SECONDS s"
OUT=$o/cp2_b4 CARRY=.gpu-carry-n RUNS="cp1 cp2-nvlink" CASES="32768,32768,32768,32768" bash bench/gpu/decode_cp2.sh > $o/cp2_b4.log 2>&1
echo "batch 4 done $SECONDS s"
CUDA_VISIBLE_DEVICES=0 OUT=$o/tpot CARRY=.gpu-carry-n NEW=32 bash bench/gpu/model_decode.sh tpot > $o/tpot.log 2>&1
echo "tpot done $SECONDS s"
cat $o/cp2/summary.txt $o/cp2_old/summary.txt $o/cp2_b4/summary.txt $o/tpot/summary.txt | cut -c1-300
rm -f $o/*/*.tgz
