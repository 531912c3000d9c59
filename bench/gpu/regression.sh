#!/usr/bin/env bash
# The figures a refactor must not make worse ("Measure"), each set in ONE device call,
# with the peers in the same call (only ratios taken together are compared across calls):
#   bash bench/gpu/regression.sh h100     # nvidia-h100-x1: the kernel grid beside PyTorch SDPA
#                                         # (run.sh bench), then the Llama-3-8B geometry cut to 2
#                                         # layers, prefill at 8K and 32K, beside transformers
#   bash bench/gpu/regression.sh h200x2   # nvidia-h200-x2: the 128K ring, CP1 and CP2 on NVLink
#                                         # and on sockets, beside PyTorch's context parallelism
# Run it on the binaries before and after (bench/gpu/build-carry.sh at each commit). Raw logs and
# JSON under $OUT; the short table last, also in $OUT/regression.md.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
what=${1:-}
case $what in
  h100 | h200x2) ;;
  *) echo "usage: bash bench/gpu/regression.sh h100|h200x2" >&2; exit 2 ;;
esac
new_summary
rc=0
if [ "$what" = h100 ]; then
  OUT=$out bash bench/gpu/run.sh bench > "$out/kernel.log" 2>&1 || rc=1
  note "kernel grid (run.sh bench): rc $rc, $(grep -c '^| heads' "$out/table.md") shapes"
  model_vs_transformers 8192 32768
fi
if [ "$what" = h200x2 ]; then
  ring_vs_torch 2
fi
echo "== summary"
cat "$summary"
echo "== regression ($what)"
python3 bench/gpu/summarize.py regression "$out" | tee "$out/regression.md"
exit $rc
