#!/usr/bin/env bash
# The prefix cache end to end with the Llama-3-8B geometry (synthetic weights) on one
# GPU and on two (CP2): `cpfill serve` with the cache and with --no-prefix-cache, each driven by
# prefix_cache_client.py: a DOC-token document asked QUESTIONS questions (QUESTIONS_OFF without
# the cache: every question prefills the whole document again), then N samples of a PROMPT-token
# prompt. One JSON per run under $OUT, a line each in the summary. CACHES picks the servers:
# "on" (the cache, prefix batching), "off" (--no-prefix-cache) and "nobatch" (the cache with
# --no-prefix-batching: every question copies and reads the document's rows itself).
#   DOC=65536 QUESTIONS=64 QUESTIONS_OFF=8 PROMPT=4096 N=64 NPS="1 2" CACHES="on nobatch off" \
#     bash bench/gpu/prefix_cache.sh
set -uo pipefail
source "$(dirname "$0")/lib.sh"
new_summary
doc=${DOC:-65536} questions=${QUESTIONS:-64} questions_off=${QUESTIONS_OFF:-8}
prompt=${PROMPT:-4096} n=${N:-64}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
for np in ${NPS:-1 2}; do
  for cache in ${CACHES:-on off}; do
    tmp=$(mktemp -d) flag="" q=$questions
    [ $cache = off ] && flag=--no-prefix-cache && q=$questions_off
    [ $cache = nobatch ] && flag=--no-prefix-batching
    # Unbound: mpirun would pin each rank to one core (the engine's sampling threads).
    mpirun -np "$np" --bind-to none "$cpfill" serve --model llama3-8b --backend cuda --port 0 \
      --port-file "$tmp/port" --kv-capacity-tokens $((200000 / np + 65536)) \
      --max-batch-tokens 131072 $flag > "$out/serve_np${np}_$cache.log" 2>&1 &
    job=$!
    for _ in $(seq 600); do [ -s "$tmp/port" ] && break; sleep 0.5; done
    python3 bench/gpu/prefix_cache_client.py "$(cat "$tmp/port")" "$out/np${np}_$cache.json" \
      "$doc" "$q" "$prompt" "$n" > "$out/client_np${np}_$cache.log" 2>&1 || echo "client failed"
    note "np $np cache $cache: $(tr '\n' ' ' < "$out/client_np${np}_$cache.log")"
    note "  batches of several: $(grep -E 'request\(s\)' "$out/serve_np${np}_$cache.log" |
      grep -v ' 1 request' | head -3 | tr '\n' ' ')"
    pkill -TERM -f "^$cpfill serve"
    wait $job
  done
done
