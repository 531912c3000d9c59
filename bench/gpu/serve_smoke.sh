#!/usr/bin/env bash
# cpfill serve on GPUs: the 8B geometry cut to 2 layers on CP2 (two GPUs; NP=1 for one), a few
# requests (an 8K prompt twice, a two-turn session), each first token against a one-shot `cpfill
# prefill` of the same tokens on the same GPUs, /metrics, then SIGTERM to every rank and a clean
# exit. Carried build (build-carry.sh).
#
#   run(command="bash bench/gpu/serve_smoke.sh", carry=[".gpu-carry"], kind="nvidia-h200-x2")
set -uo pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH="$PWD/.gpu-carry/lib:${LD_LIBRARY_PATH:-}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
C=$PWD/.gpu-carry/cpfill
tmp=$(mktemp -d)
np=${NP:-2}
mpirun -np "$np" "$C" serve --model llama3-8b --layers 2 --backend cuda --port 0 \
  --port-file "$tmp/port" --kv-capacity-tokens 65536 > "$tmp/serve.log" 2>&1 &
job=$!
for _ in $(seq 300); do [ -s "$tmp/port" ] && break; sleep 0.5; done
port=$(cat "$tmp/port")
python3 - "$port" "$C" "$tmp" "$np" <<'PY'
import json, subprocess, sys, urllib.request
port, cpfill, tmp, np = sys.argv[1:]
def post(body):
    r = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                               data=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(r, timeout=300))
long = [(i * 7919) % 128000 for i in range(8192)]
t1, t2 = [(i * 31) % 128000 for i in range(3000)], [(i * 17) % 128000 for i in range(500)]
asked = [(long, post({"prompt": long})), (long, post({"prompt": long})),
         (t1, post({"prompt": t1, "session": "s"})), (t1 + t2, post({"prompt": t2, "session": "s"}))]
json.dump([p for p, _ in asked], open(f"{tmp}/tokens.json", "w"))
ref = subprocess.run(["mpirun", "-np", np, cpfill, "prefill", "--model", "llama3-8b", "--layers",
                      "2", "--backend", "cuda", "--tokens", f"{tmp}/tokens.json", "--json",
                      f"{tmp}/ref.json"], capture_output=True, text=True)
print(ref.stdout[-400:], ref.stderr[-400:])
want = [s["first_token"] for s in json.load(open(f"{tmp}/ref.json"))["sequences"]]
for i, ((p, a), w) in enumerate(zip(asked, want)):
    c = a["cpfill"]["prompts"][0]
    print(f"request {i}: {len(p)} tokens, cached {a['usage']['prompt_tokens_details']['cached_tokens']}, "
          f"first token {a['choices'][0]['token_ids'][0]} (one-shot {w}), ttft {c['ttft_ms']:.1f} ms, "
          f"prefill {c['prefill_ms']:.1f} ms, {c['algorithm']}")
PY
curl -s "localhost:$port/metrics" | grep -E '^cpfill:(requests_total|prompt_tokens_total|cached_tokens_total)'
pkill -TERM -f "^$C serve"  # every rank, as scancel would: rank 0 drains
wait $job
echo "serve exit: $?"
tail -4 "$tmp/serve.log"
