#!/usr/bin/env bash
# cpfill's device ring against PyTorch's context parallelism, as cp_ring.sh, with every run kept
# for medians: CP1 and CP-way on NVLink alternated twice, CP-way on sockets, each `--repeat 8`
# (the first run of each is a warm-up), the last run's trace of each CP-way run; then the peer
# (CP1, NVLink, sockets). The SM clocks and throttle reasons are sampled every 250 ms meanwhile:
# under the software power cap one configuration's runs spread by up to 8%.
#   bash bench/gpu/cp_ring_runs.sh [CP]   # default 4; summary.txt: the runs' times, the peer
set -uo pipefail
source "$(dirname "$0")/lib.sh"
cp=${1:-4}
new_summary
gpu_info
nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,clocks_throttle_reasons.active \
  --format=csv -lms 250 > "$out/clocks.csv" 2>/dev/null &
sampler=$!
for i in 1 2; do
  ring nvlink 1 "$out/cp1-$i" --seq-lens 131072 --algo pass-kv --repeat 8
  note "CP1 ($i): $(run_times "$out/cp1-$i.log")"
  ring nvlink "$cp" "$out/cp$cp-nvlink-$i" --seq-lens 131072 --algo pass-kv --repeat 8 \
    --trace "$out/trace-cp$cp-nvlink-$i.json"
  note "CP$cp nvlink ($i): $(run_times "$out/cp$cp-nvlink-$i.log")"
done
ring sockets "$cp" "$out/cp$cp-sockets" --seq-lens 131072 --algo pass-kv --repeat 8
note "CP$cp sockets: $(run_times "$out/cp$cp-sockets.log")"
torch_cp 1 nvlink
torch_cp "$cp" nvlink
torch_cp "$cp" sockets
kill "$sampler" 2>/dev/null
echo "== summary"
cat "$summary"
