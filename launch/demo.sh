#!/usr/bin/env bash
# The main job in one command: a real model, SmolLM2-135M-Instruct (converted once from the
# package index by tests/models/convert_smollm2.py, cached in .venv/models), served by
# `cpfill serve` on 4 ranks (TP1 x CP4: its 3 KV heads allow TP 1 or 3; CPU backend), a few
# requests against it with curl, then SIGTERM (the server drains and exits 0).
#
#   launch/demo.sh            # serve, send the requests below, stop
#   launch/demo.sh --keep     # serve, send them, and leave the server up (it says how to stop)
#
# Environment: CPFILL (the binary, default build/cpfill), PORT (default 0: a free port),
# SERVE_FLAGS (more `cpfill serve` flags, e.g. "--backend cuda" on a GPU host). Exit 77 where
# the package index cannot give the model (the conversion says why).
set -euo pipefail
cd "$(dirname "$0")/.."
CPFILL=${CPFILL:-build/cpfill}
keep=0
[[ "${1:-}" == "--keep" ]] && keep=1
python=.venv/bin/python3
[[ -x "$python" ]] || python=python3
model=$("$python" tests/models/convert_smollm2.py)
work=$(mktemp -d)
log="$work/serve.log"

launch/mpirun.sh -np 4 "$CPFILL" serve --model "$model" --tp 1 --backend cpu \
  --host 127.0.0.1 --port "${PORT:-0}" --port-file "$work/port" --pid-file "$work/pid" --kv-capacity-tokens 8192 \
  ${SERVE_FLAGS:-} >"$log" 2>&1 &
server=$!
# SIGTERM goes to rank 0, which drains the queue and releases every rank (mpirun, signalled
# itself, would exit 1 and kill the ranks after a few seconds).
stop() {
  if kill -0 "$server" 2>/dev/null; then
    if [[ -s "$work/pid" ]]; then kill -TERM "$(cat "$work/pid")"; else kill -TERM "$server"; fi
    local rc=0; wait "$server" || rc=$?
    echo "demo: SIGTERM to rank 0: the server drained its queue; mpirun exited $rc"
    (( rc == 0 )) || exit "$rc"
  fi
  rm -rf "$work"
}
(( keep )) || trap stop EXIT

for _ in $(seq 600); do  # the weights take a few seconds; 60 s at most
  [[ -s "$work/port" ]] && break
  kill -0 "$server" 2>/dev/null || { cat "$log"; echo "demo: the server ended" >&2; exit 1; }
  sleep 0.1
done
[[ -s "$work/port" ]] || { cat "$log"; echo "demo: the server did not start" >&2; exit 1; }
url="http://127.0.0.1:$(cat "$work/port")"
for _ in $(seq 300); do curl -sf "$url/health" >/dev/null && break; sleep 0.2; done
curl -sf "$url/health" >/dev/null || { cat "$log"; echo "demo: /health is not 200" >&2; exit 1; }

show() {  # METHOD PATH [BODY]: prints the request and the answer
  echo; echo "\$ curl -X $1 $url$2 ${3:+-d '$3'}"
  curl -s -X "$1" "$url$2" -H 'Content-Type: application/json' ${3:+-d "$3"}; echo
}
show GET /v1/models
# Text in, text out (greedy), with each token's top 3 log-probabilities.
show POST /v1/completions \
  '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 3}'
# A chat turn in ChatML (the template in tokenizer_config.json, rendered by hand), turn 1 of
# session chat-1; generation ends at <|im_end|>, the model's EOS.
show POST /v1/completions \
  '{"prompt": "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n", "max_tokens": 48, "temperature": 0, "session": "chat-1"}'
# Turn 2 prefills only its new text on top of turn 1's KV (usage.cached_tokens).
show POST /v1/completions \
  '{"prompt": "\n<|im_start|>user\nAnd the capital of Italy?<|im_end|>\n<|im_start|>assistant\n", "max_tokens": 48, "temperature": 0, "session": "chat-1"}'
# Two prompts in one fused batch; token ids work as well as text.
show POST /v1/completions '{"prompt": [[504, 3575, 282, 4649, 314], [504, 3575, 282, 4521, 314]], "max_tokens": 3, "temperature": 0}'
# Bad input gets a 4xx with a JSON error naming the problem.
show POST /v1/completions '{"prompt": [1, 99999], "max_tokens": 1}'
show DELETE /v1/sessions/chat-1
echo; echo "\$ curl $url/metrics | grep requests_total"
curl -s "$url/metrics" | grep '^cpfill:requests_total'
echo; echo "server log:"; cat "$log"
if (( keep )); then
  echo "demo: the server is still up at $url; stop it with: kill -TERM $(cat "$work/pid")"
fi
