#!/usr/bin/env bash
# Prefix-batched decode end to end with the Llama-3-8B geometry (synthetic weights) on
# NPS GPUs (1: one GPU; 2: CP2): `cpfill serve` with prefix-batched decode and with
# --no-prefix-batching (the prefix cache on in both: the n choices fork the cached prompt either
# way, and only how decode reads the shared blocks differs), each driven by
# prefix_decode_client.py over PROMPTS x NS. One JSON per run under $OUT, a line each in the
# summary.
#   PROMPTS=2048,16384 NS=16,64,256 NPS="1 2" bash bench/gpu/prefix_decode.sh
# BATCHING=on (or off) runs one of the two.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
new_summary
prompts=${PROMPTS:-2048,16384} ns=${NS:-16,64,256}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
for np in ${NPS:-1 2}; do
  for batching in ${BATCHING:-on off}; do
    tmp=$(mktemp -d) flag=""
    [ $batching = off ] && flag=--no-prefix-batching
    # --bind-to none: rank 0 samples on several cores (mpirun binds 1 or 2 ranks to one each).
    mpirun -np "$np" --bind-to none "$cpfill" serve --model llama3-8b --backend cuda --port 0 \
      --port-file "$tmp/port" --kv-capacity-tokens $((65536 / np + 65536)) \
      --max-running-requests 256 $flag > "$out/serve_np${np}_$batching.log" 2>&1 &
    job=$!
    for _ in $(seq 600); do [ -s "$tmp/port" ] && break; sleep 0.5; done
    python3 bench/gpu/prefix_decode_client.py "$(cat "$tmp/port")" \
      "$out/np${np}_$batching.json" "$prompts" "$ns" > "$out/client_np${np}_$batching.log" 2>&1 ||
      echo "client failed"
    note "np $np batching $batching:"
    while read -r line; do note "  $line"; done < "$out/client_np${np}_$batching.log"
    pkill -TERM -f "^$cpfill serve"
    wait $job
  done
done
