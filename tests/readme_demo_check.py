#!/usr/bin/env python3
"""launch/demo.sh, the README's first command after set-up, checked answer by answer.

    CPFILL=build/cpfill python3 tests/readme_demo_check.py launch/demo.sh

Runs the demo (SmolLM2-135M-Instruct served on 4 ranks, requests with curl, SIGTERM), prints
what it printed, and requires its exit status 0 and every answer it shows (standard library only):
  1. GET /v1/models lists the converted SmolLM2 checkpoint;
  2. "The capital of France is", greedy: 8 tokens of text that say Paris, each token with its
     top 3 log-probabilities;
  3. turn 1 of session chat-1, a ChatML question about France's capital: an answer that says
     Paris and ends at the model's EOS (finish_reason "stop");
  4. turn 2, about Italy's: turn 1's prompt and answer cached (all but the last token, EOS,
     whose KV is never computed), an answer that says Rome;
  5. two prompts as token ids in one request: two choices, Paris and Berlin;
  6. a token outside the vocabulary: 400 with an error naming it;
  7. DELETE /v1/sessions/chat-1: deleted;
  8. /metrics: 5 requests answered and 1 refused (4xx);
  9. SIGTERM: the server drained and mpirun exited 0.
The answers are greedy on fp32: the words checked are the model's top choice by a wide margin.
Exit 0: all of these; 1: the demo failed, or an answer is missing or wrong; 77: the demo could not
get the model from the package index (the conversion says why; exit 1 there where CI=true).
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
    ok = len(ids) == 1 and ids[0].endswith("smollm2-135m-instruct")
    return None if ok else f"models {ids}, want the one SmolLM2 checkpoint"


def says(choice, word, finish=None):
    """None when the choice's text holds `word` (and ends with `finish`)."""
    if not choice["text"].strip() or word not in choice["text"]:
        return f"text {choice['text']!r} does not say {word}"
    if finish and choice["finish_reason"] != finish:
        return f"finish_reason {choice['finish_reason']!r}, want {finish!r}"
    return None


def check_text(a):
    (choice,) = a["choices"]
    tops = choice["logprobs"]["top_logprobs"]
    if len(choice["token_ids"]) != 8 or len(tops) != 8 or any(len(t) != 3 for t in tops):
        return f"tokens {choice['token_ids']}, top log-probabilities {tops}: want 8 of 3"
    return says(choice, "Paris")


TURNS = {}


def check_turn1(a):
    TURNS[1] = a["usage"]
    return says(a["choices"][0], "Paris", "stop")


def check_turn2(a):
    cached = a["usage"]["prompt_tokens_details"]["cached_tokens"]
    turn1 = TURNS.get(1, {})
    want = turn1.get("prompt_tokens", 0) + turn1.get("completion_tokens", 0) - 1
    if cached != want:
        return f"usage {a['usage']}: want {want} cached tokens (turn 1's KV)"
    return says(a["choices"][0], "Rome", "stop")


def check_batch(a):
    choices = sorted(a["choices"], key=lambda c: c["index"])
    if len(choices) != 2:
        return f"{len(choices)} choices, want 2"
    return says(choices[0], "Paris") or says(choices[1], "Berlin")


def check_refused(a):
    error = a.get("error", {})
    if error.get("code") != 400 or "outside the vocabulary" not in error.get("message", ""):
        return f"want a 400 error naming the token outside the vocabulary, got {a}"
    return None


def check_deleted(a):
    return None if a == {"deleted": "chat-1"} else f"want {{\"deleted\": \"chat-1\"}}, got {a}"


# The request bodies exactly as launch/demo.sh shows them.
TEXT = '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 3}'
TURN1 = (r'{"prompt": "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained '
         r'by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>'
         r'\n<|im_start|>assistant\n", "max_tokens": 48, "temperature": 0, "session": "chat-1"}')
TURN2 = (r'{"prompt": "\n<|im_start|>user\nAnd the capital of Italy?<|im_end|>\n<|im_start|>'
         r'assistant\n", "max_tokens": 48, "temperature": 0, "session": "chat-1"}')
BATCH = ('{"prompt": [[504, 3575, 282, 4649, 314], [504, 3575, 282, 4521, 314]], '
         '"max_tokens": 3, "temperature": 0}')
BAD = '{"prompt": [1, 99999], "max_tokens": 1}'
EXPECTED = [
    ("GET /v1/models", ("GET", "/v1/models", None), check_models),
    ("the text completion", ("POST", "/v1/completions", TEXT), check_text),
    ("turn 1 of chat-1", ("POST", "/v1/completions", TURN1), check_turn1),
    ("turn 2 of chat-1", ("POST", "/v1/completions", TURN2), check_turn2),
    ("two prompts at once", ("POST", "/v1/completions", BATCH), check_batch),
    ("a token outside the vocabulary", ("POST", "/v1/completions", BAD), check_refused),
    ("DELETE /v1/sessions/chat-1", ("DELETE", "/v1/sessions/chat-1", None), check_deleted),
]
METRICS = ['cpfill:requests_total{status="ok"} 5', 'cpfill:requests_total{status="http_4xx"} 1']


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
    if demo.returncode == 77:
        print("SKIPPED: the demo could not get SmolLM2 from the package index (above)")
        return 77
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
