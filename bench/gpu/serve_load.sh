#!/usr/bin/env bash
# cpfill serve under load (NVIDIA's AIPerf, `aiperf profile`, for a checkpoint with a tokenizer;
# bench/serve_load.py for the synthetic presets, whose empty answer text AIPerf counts as a
# failure) beside one-shot `cpfill prefill` of the same
# lengths, in one device call: the Llama-3-8B geometry (synthetic weights, all 32 layers) on one
# H200 (NP=1) or CP2 over two (NP=2). Steps:
#   1. `cpfill serve` starts on NP ranks;
#   2. low load: at each length of LENGTHS, a handful of Poisson arrivals one at a time
#      (--max-concurrency 1, mean gap 1.5x the estimated prefill), after one warm-up request;
#   3. saturation: SAT_N requests at once, lengths drawn from LENGTHS;
#   4. SIGTERM to every rank: the server drains and exits;
#   5. one-shot `cpfill prefill --repeat REPEAT` per length on the same GPUs;
#   6. bench/gpu/summarize.py serve: the targets (low load: client TTFT - one-shot <= 2 ms + 1%;
#      saturation: throughput >= 0.95x back-to-back one-shots; no failed request) as a table,
#      $OUT/serve_load.md, and $OUT/compare.json.
# Everything (load JSON and text, one-shot JSON and logs, the server log) goes under $OUT, packed
# into serve-load.tgz beside compare.json, serve_load.md and summary.txt.
# Estimated on one H200: start-up and the 5 model loads about 2 min, low load 2 min, saturation
# 1.5 min, one-shots 1 min: under 8 min. Carried build (build-carry.sh).
#
#   run(command="NP=1 bash bench/gpu/serve_load.sh", carry=[".gpu-carry"], kind="nvidia-h200")
#   run(command="NP=2 bash bench/gpu/serve_load.sh", carry=[".gpu-carry"], kind="nvidia-h200-x2")
#
# Environment (defaults for the 8B on H200s): NP (1), MODEL (llama3-8b), BACKEND (cuda), LAYERS
# (0: all), VOCAB (128000; tiny: 1024), LENGTHS ("4096 16384 65536 131072"), LOW_N (requests per
# length; default 400000 / length, within [3, 8]), LOW_RATE (req/s at every length; default from
# the 8B's measured prefill time), SAT_N (24 x NP), GOODPUT_TTFT_MS (unset: no goodput), REPEAT
# (2), KV_TOKENS (262144 per rank), SERVE_ARGS (more `serve` flags), CPFILL (the binary). A check
# LOADGEN (aiperf where MODEL/tokenizer.json exists, else serve_load), AIPERF (the command),
# TOKENIZER (AIPerf's: .gpu-carry/tokenizer, else .venv/models/smollm2-135m-instruct). With AIPerf
# each run is $OUT/TAG/ (profile_export_aiperf.json, per-request JSONL) and TAG.inputs.json.
# On a GPU host AIPerf comes from wheels in .whl/ (bench/README.md). A check with AIPerf on the
# CPU machine (bench/results/2026-12-07-cpu-aiperf):
#   CPFILL=build-tst/cpfill NP=2 MODEL=$PWD/.venv/models/smollm2-135m-instruct BACKEND=cpu \
#     VOCAB=49152 LENGTHS="64 256" LOW_N=3 LOW_RATE=1 SAT_N=8 KV_TOKENS=16384 \
#     GOODPUT_TTFT_MS=2000 OUT=/tmp/serve-load bash bench/gpu/serve_load.sh
# and of the serve_load.py path:
#   CPFILL=build-cpu/cpfill NP=2 MODEL=tiny BACKEND=cpu VOCAB=1024 LENGTHS="64 256 1024" \
#     LOW_RATE=2 SAT_N=12 KV_TOKENS=16384 OUT=/tmp/serve-load bash bench/gpu/serve_load.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
source bench/gpu/lib.sh
cpfill=${CPFILL:-$cpfill}
np=${NP:-1} model=${MODEL:-llama3-8b} backend=${BACKEND:-cuda} layers=${LAYERS:-0}
vocab=${VOCAB:-128000} lengths=${LENGTHS:-4096 16384 65536 131072}
sat_n=${SAT_N:-$((24 * np))} repeat=${REPEAT:-2} kv_tokens=${KV_TOKENS:-262144}
new_summary
note "serve_load.sh: $model (layers ${layers/#0/all}) on NP=$np, $backend; lengths $lengths"
[ "$backend" = cuda ] &&
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -"$np"

low_n() {  # requests at length $1: fewer for the long ones (each 128K prefill is seconds)
  [ -n "${LOW_N:-}" ] && { echo "$LOW_N"; return; }
  local n=$((400000 / $1))
  echo $((n < 3 ? 3 : n > 8 ? 8 : n))
}

low_rate() {  # arrivals/s at length $1: a mean gap of 1.5x the 8B's prefill on one H200
  # (RESULTS.md, whole 8B at 128K: GEMMs and the rest 3.08 s linear in T, attention 8.33 s
  # quadratic; CP2 1.95x faster), scaled by the layers run
  [ -n "${LOW_RATE:-}" ] && { echo "$LOW_RATE"; return; }
  awk -v t="$1" -v np="$np" -v layers="$layers" 'BEGIN {
    x = t / 131072; s = (3.08 * x + 8.33 * x * x) / np * (layers > 0 ? layers / 32 : 1)
    printf "%.4g\n", 1 / (1.5 * s) }'
}

stop_server() {  # SIGTERM to every rank (as scancel would); rank 0 drains; bounded wait
  pkill -TERM -P "$server" 2>/dev/null
  for _ in $(seq 240); do kill -0 "$server" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$server" 2>/dev/null; then
    note "server: no exit 120 s after SIGTERM; killed"
    pkill -KILL -P "$server"; kill -KILL "$server"
  fi
  wait "$server"
  note "server exit after SIGTERM: $? ($(tail -1 "$out/serve.log" | cut -c1-120))"
}

start_server() {  # sets $server (mpirun's pid) and $url; returns 1 when no port appears
  local port_file=$out/serve.port serve_args
  read -ra serve_args <<< "${SERVE_ARGS:-}"
  rm -f "$port_file"
  mpirun -np "$np" "$cpfill" serve --model "$model" --layers "$layers" --backend "$backend" \
    --port 0 --port-file "$port_file" --kv-capacity-tokens "$kv_tokens" "${serve_args[@]}" \
    > "$out/serve.log" 2>&1 &
  server=$!
  trap 'kill -0 $server 2>/dev/null && stop_server' EXIT
  for _ in $(seq 1200); do
    [ -s "$port_file" ] && break
    kill -0 "$server" 2>/dev/null || break
    sleep 0.5
  done
  [ -s "$port_file" ] || { note "server did not start:"; tail -20 "$out/serve.log"; return 1; }
  url=http://127.0.0.1:$(cat "$port_file")
  model_id=$(python3 -c 'import json, sys, urllib.request
print(json.load(urllib.request.urlopen(sys.argv[1] + "/v1/models"))["data"][0]["id"])' "$url")
  note "server up after ${SECONDS} s at $url"
}

# AIPerf: .venv/bin/aiperf here; on a GPU host `python3 -m aiperf` from wheels carried in .whl/
# (bench/README.md), installed under /tmp/site. AIPERF overrides.
if [ -n "${AIPERF:-}" ]; then read -ra aiperf <<< "$AIPERF"
elif ls .whl/aiperf-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$out/aiperf_install.log" 2>&1 || {
    note "aiperf wheels: install failed ($out/aiperf_install.log)"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}; aiperf=(python3 -m aiperf)
elif [ -x .venv/bin/aiperf ]; then aiperf=(.venv/bin/aiperf)
else aiperf=(aiperf); fi
# AIPerf needs a tokenizer even where it counts nothing (--use-server-token-count): SmolLM2's
# (tests/models/convert_smollm2.py), or TOKENIZER; the prompts are token ids (below).
tokenizer=${TOKENIZER:-$([ -d .gpu-carry/tokenizer ] && echo .gpu-carry/tokenizer ||
  echo .venv/models/smollm2-135m-instruct)}

# load_py TAG ARGS...: one serve_load.py run; its table to $out/TAG.txt, a line noted.
load_py() {
  python3 bench/serve_load.py --url "$url" --vocab "$vocab" --seed 1 --json "$out/$1.json" \
    "${@:2}" > "$out/$1.txt" 2> "$out/$1.err"
  note "$1: rc $? at ${SECONDS} s; $(grep -E '^requests' "$out/$1.txt" | tr -s ' ');" \
    "$(grep -E '^throughput' "$out/$1.txt" | tr -s ' ')"
}

# load TAG SPEC N AIPERF_ARGS...: one `aiperf profile` run into $out/TAG/. The requests (N
# prefill-only completions, token ids of lengths SPEC, seed 1) come from serve_load.py
# --aiperf-inputs: AIPerf synthesizes text only, and the synthetic models have no tokenizer.
# AIPerf sends them (Poisson arrivals, concurrency, goodput), streamed, and times them.
load() {
  local tag=$1 spec=$2 n=$3
  python3 bench/serve_load.py --url "$url" --vocab "$vocab" --seed 1 --rate inf \
    --lengths "$spec" --num-requests "$n" --aiperf-inputs "$out/$tag.inputs.json" \
    > "$out/$tag.err" 2>&1 || { note "$tag: no inputs (rc $?)"; return; }
  "${aiperf[@]}" profile --model "$model_id" --tokenizer "$tokenizer" \
    --endpoint-type completions --streaming --url "$url" --use-server-token-count \
    --input-file "$out/$tag.inputs.json" --custom-dataset-type inputs_json \
    --dataset-sampling-strategy sequential --request-count "$n" --random-seed 1 \
    --request-timeout-seconds 1800 --artifact-dir "$out/$tag" --ui-type none \
    --no-gpu-telemetry ${GOODPUT_TTFT_MS:+--goodput "time_to_first_token:$GOODPUT_TTFT_MS"} \
    "${@:4}" > "$out/$tag.txt" 2>> "$out/$tag.err"
  note "$tag: aiperf rc $? at ${SECONDS} s; $(python3 bench/gpu/summarize.py aiperf-line "$out/$tag")"
}

start_server || exit 1
# AIPerf reads the streamed text: a model without a tokenizer (the synthetic presets) answers
# token ids with empty text, which AIPerf 0.13 counts as a failed request ("No responses with
# actual content"). Those run serve_load.py (LOADGEN=serve_load); checkpoints, AIPerf.
loadgen=${LOADGEN:-$([ -f "$model/tokenizer.json" ] && echo aiperf || echo serve_load)}
note "load generator: $loadgen"
for t in $lengths; do  # step 2: low load, one at a time
  if [ "$loadgen" = aiperf ]; then
    load "low-$t" "fixed:$t" "$(low_n "$t")" --request-rate "$(low_rate "$t")" \
      --arrival-pattern poisson --concurrency 1 --warmup-request-count 1
  else
    load_py "low-$t" --lengths "fixed:$t" --num-requests "$(low_n "$t")" \
      --rate "$(low_rate "$t")" --max-concurrency 1 --warmup 1
  fi
done
if [ "$loadgen" = aiperf ]; then
  load saturation "choice:$(echo "$lengths" | tr ' ' ,)" "$sat_n" --concurrency "$sat_n"
else
  load_py saturation --lengths "choice:$(echo "$lengths" | tr ' ' ,)" --num-requests "$sat_n" \
    --rate inf ${GOODPUT_TTFT_MS:+--goodput-ttft-ms "$GOODPUT_TTFT_MS"}
fi
stop_server
trap - EXIT
for t in $lengths; do  # step 5: one-shot prefills of the same lengths on the same ranks
  mpirun -np "$np" "$cpfill" prefill --model "$model" --layers "$layers" --backend "$backend" \
    --prompt-lens "$t" --repeat "$repeat" --json "$out/oneshot-$t.json" > "$out/oneshot-$t.log" 2>&1
  note "one-shot $t: rc $? at ${SECONDS} s; $(grep -oE '^TTFT [0-9.]+ ms' "$out/oneshot-$t.log")"
done
echo "== summary"
cat "$summary"
echo "== serve under load vs one-shot prefill"
python3 bench/gpu/summarize.py serve "$out" | tee "$out/serve_load.md"
# The device tool returns few files a call: everything goes into one archive, beside the tables.
tar czf "/tmp/serve-load.$$.tgz" -C "$out" . && mv "/tmp/serve-load.$$.tgz" "$out/serve-load.tgz" &&
  find "$out" -maxdepth 1 -type f ! -name serve-load.tgz ! -name compare.json \
    ! -name serve_load.md ! -name summary.txt -delete
