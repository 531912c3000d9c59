#!/usr/bin/env bash
# The KV hand-off on two GPUs of one host, with PyPI's UCX 1.22 (cuda_ipc; carried by
# bench/gpu/fetch-ucx-cuda.sh) for both the peer and cpfill:
#   1. the peer: ucx_perftest ucp_get of 256 MiB from GPU 0's memory into GPU 1's;
#   2. a check: 2 layers of the 8B geometry, pulled into GPU 1 by decode TP1 and TP2, each
#      against one fp32 CPU rank within bf16 tolerance;
#   3. cpfill serve --kv-handoff on GPU 0 (the Llama-3-8B geometry, all 32 layers, bf16 KV), a
#      prompt of TOKENS (default 131072: 16 GiB of KV) prefilled for remote decode, and
#      cpfill kv-pull on GPU 1 pulling it into GPU memory PULLS times on one connection (the
#      first connects, the others are a long-lived worker's), for RUNS requests;
#      UCX_PROTO_INFO shows the transport UCX chose.
#   4. the hosts' own UCX (Ubuntu 1.16, no CUDA transport): the server stages each hand-off
#      through pinned host memory; 2 layers checked as in 2, then STAGED_TOKENS (default 32768)
#      of all 32 layers pulled into host memory.
# Each process sees one GPU (CUDA_VISIBLE_DEVICES), the peer as cpfill. STEPS (default "0 1 2 3
# 4") picks steps. Output in $OUT.
#
#   run(command="bash bench/gpu/kv_handoff.sh", carry=[".gpu-carry"], kind="nvidia-h100-x2")
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/gpu/lib.sh
tokens=${TOKENS:-131072}
runs=${RUNS:-2}
steps=${STEPS:-0 1 2 3 4}
has() { [[ " $steps " == *" $1 "* ]]; }
ucx=$(mktemp -d)
tar -xJf "$carry/ucx-cu13.tar.xz" -C "$ucx"
host_library_path=$LD_LIBRARY_PATH
export LD_LIBRARY_PATH=$ucx/libucx/lib:$ucx/libucx_cu13.libs:$LD_LIBRARY_PATH
export UCX_MODULE_DIR=$ucx/libucx/lib/ucx
new_summary
nvidia-smi --query-gpu=name --format=csv,noheader | head -2 | tee -a "$summary"

# 0. cpfill's UCX transport tests, built against Debian's UCX 1.13 headers, on this UCX 1.22.
has 0 && timeout 120 "$carry/ucx_transport_test" > "$out/ucx_transport_test.log" 2>&1
has 0 && note "ucx_transport_test on UCX 1.22 (rc $?): $(grep -E 'PASSED|FAILED' "$out/ucx_transport_test.log" | head -2 | tr '\n' ' ')"

# 1. The peer, on the same cards and transport.
if has 1; then
CUDA_VISIBLE_DEVICES=0 "$ucx/libucx/bin/ucx_perftest" -p 13337 > "$out/perftest_server.log" 2>&1 &
sleep 2
CUDA_VISIBLE_DEVICES=1 "$ucx/libucx/bin/ucx_perftest" 127.0.0.1 -p 13337 -t ucp_get -m cuda,cuda \
  -s 268435456 -n 40 -w 5 > "$out/perftest.log" 2>&1
note "ucx_perftest ucp_get 256 MiB cuda->cuda (rc $?): $(grep -E '^Final|^ +[0-9]+ ' "$out/perftest.log" | tail -1)"
wait
fi

# start_server LAYERS CAPACITY: cpfill serve --kv-handoff on GPU 0 (the 8B geometry); sets $port.
start_server() {
  rm -f "$tmp/port"
  CUDA_VISIBLE_DEVICES=0 mpirun -np 1 -x LD_LIBRARY_PATH -x UCX_MODULE_DIR "$cpfill" serve \
    --model llama3-8b --layers "$1" --backend cuda --kv-handoff --kv-capacity-tokens "$2" \
    --max-batch-tokens "$tokens" --port 0 --port-file "$tmp/port" --timeout-s 900 \
    > "$out/serve_$1.log" 2>&1 &
  job=$!
  for _ in $(seq 600); do [ -s "$tmp/port" ] && break; sleep 0.5; done
  grep -E 'hand-off|http://' "$out/serve_$1.log" | tee -a "$summary"
  port=$(cat "$tmp/port" 2>/dev/null)
}
stop_server() {
  curl -s "localhost:$port/metrics" | grep -E '^cpfill:kv_(leases|cache)' | tee -a "$summary"
  pkill -TERM -f "^$cpfill serve"  # the rank, not mpirun (signalled, mpirun exits 1)
  wait $job
  note "serve exit: $?"
}
tmp=$(mktemp -d)

# 2. Correctness on GPUs: 2 layers, 2048 tokens, pulled into GPU 1 by decode TP1 (contiguous) and
#    TP2 rank 1 (paged), each checked against one fp32 CPU rank within bf16 tolerance.
if has 2; then
start_server 2 8192
for dst in "--decode-tp 1" "--decode-tp 2 --decode-tp-rank 1 --layout paged"; do
  CUDA_VISIBLE_DEVICES=1 "$cpfill" kv-pull --url "http://127.0.0.1:$port" --prompt-tokens 2048 \
    --dst-cuda-device 0 --model llama3-8b --layers 2 $dst > "$out/kv_pull_check.log" 2>&1
  note "kv-pull check ($dst, rc $?): $(grep -E '^verify' "$out/kv_pull_check.log")"
done
stop_server
fi

# 3. The measurement: every layer, TOKENS tokens, GPU memory to GPU memory.
if has 3; then
start_server 32 $((tokens + 4096))
for i in $(seq "$runs"); do
  CUDA_VISIBLE_DEVICES=1 UCX_PROTO_INFO=y "$cpfill" kv-pull --url "http://127.0.0.1:$port" \
    --prompt-tokens "$tokens" --prompt-seed "$i" --dst-cuda-device 0 --timeout-s 600 \
    --pulls "${PULLS:-3}" --json "$out/kv_pull_$i.json" > "$out/kv_pull_$i.log" 2>&1
  note "kv-pull $i (rc $?):"
  grep -E '^pull ' "$out/kv_pull_$i.log" | tee -a "$summary"
  grep -iE 'cuda_ipc|cuda_copy' "$out/kv_pull_$i.log" | head -4 >> "$summary"
done
stop_server
fi

# 4. The hosts' UCX, without a CUDA transport: hand-offs staged through pinned host memory.
if has 4; then
  export LD_LIBRARY_PATH=$host_library_path
  unset UCX_MODULE_DIR
  staged=${STAGED_TOKENS:-32768}
  start_server 2 8192
  for dst in "--decode-tp 1" "--decode-tp 2 --decode-tp-rank 1 --layout paged"; do
    CUDA_VISIBLE_DEVICES=1 "$cpfill" kv-pull --url "http://127.0.0.1:$port" --prompt-tokens 2048 \
      --model llama3-8b --layers 2 $dst > "$out/kv_pull_staged_check.log" 2>&1
    note "staged kv-pull check ($dst, rc $?): $(grep -E '^verify' "$out/kv_pull_staged_check.log")"
  done
  stop_server
  start_server 32 $((staged + 4096))
  CUDA_VISIBLE_DEVICES=1 "$cpfill" kv-pull --url "http://127.0.0.1:$port" --prompt-tokens "$staged" \
    --timeout-s 600 --pulls 2 --json "$out/kv_pull_staged.json" > "$out/kv_pull_staged.log" 2>&1
  note "staged kv-pull, $staged tokens into host memory (rc $?):"
  grep -E '^pull ' "$out/kv_pull_staged.log" | tee -a "$summary"
  grep -E 'batch:' "$out/serve_32.log" | tail -1 | tee -a "$summary"
  stop_server
fi
