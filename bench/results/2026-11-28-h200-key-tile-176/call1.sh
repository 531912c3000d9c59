#!/usr/bin/env bash
# Call 1 (issue 17): 176-key tiles for non-causal head_dim-128 calls against 128-key tiles, one
# H200: the small GPU tests on each knob setting and all tests on the default (run.sh ab), then
# the non-causal grid (and 16K causal as a control) alternated twice more.
set -u
dev_out=$OUT
tar -xJf .gpu-carry-z/s.tar.xz
o=/tmp/o1; mkdir -p $o
export CARRY=.gpu-carry-s OUT=$o
export BENCH_FILTER='BM_Attention/.*(causal:0|tokens:16384/causal:1)'
timeout 400 bash bench/gpu/run.sh ab CPFILL_HOPPER_KEY_TILE=128 > $o/ab.log 2>&1; echo "ab rc $?" >> $o/ab.log
tail -40 $o/ab.log
export LD_LIBRARY_PATH=$PWD/.gpu-carry-s/lib
for r in 1 2; do
  for v in auto 128; do
    CPFILL_HOPPER_KEY_TILE=$v timeout 60 .gpu-carry-s/attention_cuda_bench --benchmark_filter="$BENCH_FILTER" \
      --benchmark_min_time=0.2 --benchmark_out=$o/alt_${v}_$r.json --benchmark_out_format=json > /dev/null 2>&1
  done
done
python3 - <<'PY'
import json,glob,collections
d=collections.defaultdict(dict)
for f in sorted(glob.glob('/tmp/o1/alt_*.json')):
    v=f.split('alt_')[1][:-5]
    for b in json.load(open(f))['benchmarks']:
        d[b['name']][v]=b['TFLOPs']/1e12 if b['TFLOPs']>1e6 else b['TFLOPs']
for n,x in d.items():
    a=max(x.get('auto_1',0),x.get('auto_2',0)); b=max(x.get('128_1',0),x.get('128_2',0))
    print(f"{n:70s} auto {x.get('auto_1',0):6.1f} {x.get('auto_2',0):6.1f}  128 {x.get('128_1',0):6.1f} {x.get('128_2',0):6.1f}  best ratio {a/b if b else 0:.3f}")
PY
tar -C /tmp -cf $dev_out/o1.tar o1 2>/dev/null
