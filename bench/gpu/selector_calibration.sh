#!/usr/bin/env bash
# pass-KV against pass-Q on TCP sockets (the paper's Table 4) and the selector: `cpfill
# calibrate` at CP8, CP4 or CP2 (as many GPUs as there are) on P + T = 32K and 128K measures C and
# BW, times both algorithms on every point, fits the selector's rule and reports each rule's
# regret; summarize.py makes the table (table4.md) and the plot (table4.png).
#   bash bench/gpu/selector_calibration.sh
# Binaries from .gpu-carry/ (bench/gpu/build-carry.sh). The fit (fit-sockets.json), the report
# (table4-sockets.json), log, table and plot under $OUT.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
gpus=$(nvidia-smi -L | grep -c GPU)
np=$(( gpus >= 8 ? 8 : (gpus >= 4 ? 4 : gpus) ))
on_net sockets $np "$cpfill" calibrate --backend cuda $shape --context-lens 32768,131072 \
  --repeat 2 --out "$out/fit-sockets.json" --json "$out/table4-sockets.json" 2>&1 |
  tee "$out/table4-sockets.log" | tail -40
python3 bench/gpu/summarize.py table4 "$out/table4-sockets.json" "$out"
