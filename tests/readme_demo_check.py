#!/usr/bin/env python3
"""launch/demo.sh, the README's first command after set-up, checked answer by answer.

    CPFILL=build/cpfill python3 tests/readme_demo_check.py launch/demo.sh

Runs the demo (`cpfill serve` on 4 ranks, requests with curl, SIGTERM), prints what it printed,
and requires its exit status 0 and every answer it shows (standard library only):
  1. GET /v1/models lists the tiny preset;
  2. turn 1 of session chat-1 (6 tokens): one token with its top 3 log-probabilities;
  3. turn 2 (3 new tokens): turn 1's 6 tokens cached;
  4. two prompts in one request: two choices of one token;
  5. a token outside the vocabulary: 400 with an error naming it;
  6. DELETE /v1/sessions/chat-1: deleted;
  7. /metrics: 4 requests answered and 1 refused (4xx);
  8. SIGTERM: the server drained and mpirun exited 0.
Exit 0: all of these; 1: the demo failed, or an answer is missing or wrong.
"""
import json
import os
import re
import signal
import subprocess
import sys

DEMO_TIMEOUT_S = 240  # the demo waits 60 s at most for the server, then for /health


def answers(output):
    """{(method, path, body or None): answer line} of the `$ curl -X ...` blocks, and the
    /metrics lines the demo greps."""
    shown, metrics = {}, []
    lines = output.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\$ curl -X (\w+) http://[^/ ]+(\S+) ?(?:-d '(.*)')?$", line)
        if m and i + 1 < len(lines):
            shown[(m.group(1), m.group(2), m.group(3))] = lines[i + 1]
        if re.match(r"\$ curl \S+/metrics ", line):
            metrics = [x for x in lines[i + 1:] if x.startswith("cpfill:requests_total")]
    return shown, metrics


def check_models(a):
    ids = [m["id"] for m in a["data"]]
    return None if ids == ["tiny"] else f"models {ids}, want ['tiny']"


def check_turn1(a):
    (choice,) = a["choices"]
    top = choice["logprobs"]["top_logprobs"][0]
    if len(choice["token_ids"]) != 1 or len(top) != 3:
        return f"tokens {choice['token_ids']}, top log-probabilities {top}: want 1 and 3"
    if a["usage"]["prompt_tokens"] != 6:
        return f"usage {a['usage']}: want 6 prompt tokens"
    return None


def check_turn2(a):
    cached = a["usage"]["prompt_tokens_details"]["cached_tokens"]
    if a["usage"]["prompt_tokens"] != 3 or cached != 6:
        return f"usage {a['usage']}: want 3 prompt tokens on 6 cached (turn 1's KV)"
    return None


def check_batch(a):
    got = [(c["index"], len(c["token_ids"])) for c in a["choices"]]
    return None if got == [(0, 1), (1, 1)] else f"choices (index, tokens) {got}"


def check_refused(a):
    error = a.get("error", {})
    if error.get("code") != 400 or "outside the vocabulary" not in error.get("message", ""):
        return f"want a 400 error naming the token outside the vocabulary, got {a}"
    return None


def check_deleted(a):
    return None if a == {"deleted": "chat-1"} else f"want {{\"deleted\": \"chat-1\"}}, got {a}"


TURN1 = ('{"model": "tiny", "prompt": [1, 17, 250, 3, 99, 7], "max_tokens": 1, '
         '"temperature": 0, "logprobs": 3, "session": "chat-1"}')
TURN2 = ('{"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0, '
         '"session": "chat-1"}')
BATCH = '{"model": "tiny", "prompt": [[1, 2, 3], [4, 5, 6, 7, 8]], "max_tokens": 1}'
BAD = '{"model": "tiny", "prompt": [1, 99999], "max_tokens": 1}'
EXPECTED = [
    ("GET /v1/models", ("GET", "/v1/models", None), check_models),
    ("turn 1 of chat-1", ("POST", "/v1/completions", TURN1), check_turn1),
    ("turn 2 of chat-1", ("POST", "/v1/completions", TURN2), check_turn2),
    ("two prompts at once", ("POST", "/v1/completions", BATCH), check_batch),
    ("a token outside the vocabulary", ("POST", "/v1/completions", BAD), check_refused),
    ("DELETE /v1/sessions/chat-1", ("DELETE", "/v1/sessions/chat-1", None), check_deleted),
]
METRICS = ['cpfill:requests_total{status="ok"} 4', 'cpfill:requests_total{status="http_4xx"} 1']


def main():
    if len(sys.argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 1
    demo = subprocess.Popen(["bash", sys.argv[1]], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = demo.communicate(timeout=DEMO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(demo.pid, signal.SIGKILL)  # the demo, mpirun and its ranks
        output, _ = demo.communicate()
        print(output)
        print(f"FAIL: the demo did not end within {DEMO_TIMEOUT_S} s")
        return 1
    print(output)
    problems = []
    if demo.returncode != 0:
        problems.append(f"the demo exited {demo.returncode}, not 0")
    shown, metrics = answers(output)
    for name, request, check in EXPECTED:
        if request not in shown:
            problems.append(f"{name}: no such request in the demo's output")
            continue
        try:
            problem = check(json.loads(shown[request]))
        except (ValueError, KeyError, TypeError, IndexError) as e:
            problem = f"unexpected answer ({type(e).__name__}: {e})"
        if problem:
            problems.append(f"{name}: {problem}; the answer: {shown[request][:300]}")
    for want in METRICS:
        if want not in metrics:
            problems.append(f"/metrics: no line {want!r} in {metrics}")
    if not output.rstrip().endswith("the server drained its queue; mpirun exited 0"):
        problems.append("the demo's last line is not the drained server's 'mpirun exited 0'")
    for p in problems:
        print(f"FAIL: {p}")
    if problems:
        return 1
    print(f"PASS: readme_demo: exit 0, {len(EXPECTED)} answers, /metrics and the drained server "
          "as the README shows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
