#!/usr/bin/env python3
"""The OpenAI surface clients rely on, against `cpfill serve` (tiny preset exported with a
trained tokenizer, CPU backend), on 1 rank and on 4 (TP2 x CP2):

    python3 tests/serve_openai_surface_test.py build/cpfill

  * echo + logprobs with max_tokens 0: one logprob per prompt token, the first null, each equal
    to the numpy fp64 reference (tests/hf_llama_reference.py) within 2e-3 and to the 1-rank
    server's within 1e-4 on 4 ranks; top_logprobs name the prompt token; echo without logprobs
    returns the prompt's text before the completion's;
  * the neutral values client libraries send (best_of 1, logit_bias {} or null, suffix null,
    penalties 0, user) are accepted; other values are 400 naming the field;
  * skip_special_tokens (default true) leaves special tokens' text out; false keeps it;
  * min_tokens masks the stop ids until that many tokens came; stream_options.include_usage ends
    a stream with a chunk whose choices are [] and continuous_usage_stats puts usage on each;
  * /v1/models gives max_model_len; /tokenize and /detokenize agree with `tokenizers`;
    /v1/chat/completions is 404 naming /v1/completions;
  * the official `openai` SDK (when installed): completions, streaming with include_usage,
    echo + logprobs, extra_body fields.
Each server stops on SIGTERM and must exit 0.
"""
import json
import math
import os
import signal
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from serve_test import MPI_ENV, fail, http, rank_pid, wait_port  # noqa: E402
from serve_generate_test import stream  # noqa: E402
import hf_llama_reference as ref  # noqa: E402
import serve_text_test as stt  # noqa: E402

PROMPT = "Once upon a time, in a land far away, there lived"


def start(cpfill, ckpt, tmp, ranks, tp, env):
    port_file = os.path.join(tmp, f"port{ranks}")
    log = open(os.path.join(tmp, f"serve{ranks}.log"), "w+")
    server = subprocess.Popen(
        ["mpirun", "-np", str(ranks), "--oversubscribe", cpfill, "serve", "--model", ckpt,
         "--tp", str(tp), "--port", "0", "--port-file", port_file, "--backend", "cpu",
         "--threads", "1", "--kv-capacity-tokens", "8192", "--timeout-s", "120"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    return server, wait_port(server, port_file, seconds=180, log=log), log


def post(port, path, body, want=200):
    status, text = http(port, "POST", path, body)
    if status != want:
        fail(f"{path} {json.dumps(body)[:200]}: {status} {text[:300]}")
    return json.loads(text)


def complete(port, **fields):
    return post(port, "/v1/completions", {"model": stt.MODEL, "temperature": 0, **fields})


def reference_prompt_logprobs(ckpt, ids):
    cfg = json.load(open(f"{ckpt}/config.json"))
    weights = ref.load_safetensors(f"{ckpt}/model.safetensors")
    logits = ref.forward_logits(cfg, weights, ids)
    lse = logits.max(-1) + np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
    return [float(logits[i - 1, ids[i]] - lse[i - 1]) for i in range(1, len(ids))]


def check_echo(port, tok, expect):
    """Prompt logprobs by echo; returns them for the comparison across layouts."""
    ids = tok.encode(PROMPT).ids
    got = complete(port, prompt=ids, echo=True, logprobs=2, max_tokens=0)
    choice = got["choices"][0]
    lp = choice["logprobs"]
    if choice["token_ids"] != [] or got["usage"]["completion_tokens"] != 0:
        fail(f"max_tokens 0 generated {choice['token_ids']} ({got['usage']})")
    if lp["token_ids"] != ids or lp["token_logprobs"][0] is not None or \
            lp["top_logprobs"][0] is not None or len(lp["token_logprobs"]) != len(ids):
        fail(f"echo logprobs do not cover the prompt {ids}: {lp}")
    for name, top, value in zip(lp["tokens"][1:], lp["top_logprobs"][1:], lp["token_logprobs"][1:]):
        if name not in top or not math.isclose(top[name], value, abs_tol=1e-9) or value > 0:
            fail(f"top_logprobs {top} do not name the prompt token {name!r} ({value})")
    if choice["text"] != tok.decode(ids, skip_special_tokens=True):
        fail(f"echo text {choice['text']!r}")
    worst = max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], expect))
    if worst > 2e-3:
        fail(f"prompt logprobs differ from the numpy reference by {worst}")
    # Echo without logprobs: the prompt's text as sent, then the completion's.
    plain = complete(port, prompt=PROMPT, echo=True, max_tokens=3)["choices"][0]
    alone = complete(port, prompt=PROMPT, max_tokens=3)["choices"][0]
    if plain["text"] != PROMPT + alone["text"]:
        fail(f"echo text {plain['text']!r}, want {PROMPT + alone['text']!r}")
    return lp["token_logprobs"][1:], worst


def check_fields(port, tok):
    neutral = complete(port, prompt=[1, 2, 3], max_tokens=2, best_of=1, logit_bias={},
                       suffix=None, presence_penalty=0, frequency_penalty=0, user="u")
    if len(neutral["choices"][0]["token_ids"]) < 1:
        fail(f"neutral values: {neutral}")
    complete(port, prompt=[1, 2, 3], logit_bias=None, max_tokens=1)
    for field, value in [("best_of", 3), ("logit_bias", {"5": 2}), ("suffix", "x"),
                         ("presence_penalty", 0.5)]:
        status, text = http(port, "POST", "/v1/completions",
                            {"prompt": [1, 2], field: value})
        if status != 400 or f'\\"{field}\\"' not in text:
            fail(f"{field}={value!r}: {status} {text}")
    # Special tokens: echo of ids holding one, text with and without them.
    special = tok.token_to_id("<|eot_id|>")
    ids = tok.encode("Hello").ids + [special]
    skipped = complete(port, prompt=ids, echo=True, max_tokens=0)["choices"][0]["text"]
    kept = complete(port, prompt=ids, echo=True, max_tokens=0,
                    skip_special_tokens=False)["choices"][0]["text"]
    if "<|eot_id|>" in skipped or not kept.endswith("<|eot_id|>"):
        fail(f"skip_special_tokens: {skipped!r} / {kept!r}")
    # min_tokens: the greedy first token, made a stop id, cannot come before min_tokens.
    first = complete(port, prompt=[5, 6, 7], max_tokens=1)["choices"][0]["token_ids"][0]
    held = complete(port, prompt=[5, 6, 7], max_tokens=4, min_tokens=2,
                    stop_token_ids=[first])["choices"][0]["token_ids"]
    if held[0] == first or len(held) < 2:
        fail(f"min_tokens 2 with stop id {first}: generated {held}")


def check_stream_usage(port):
    events = stream(port, {"model": stt.MODEL, "prompt": [1, 2, 3], "max_tokens": 4,
                           "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True,
                                              "continuous_usage_stats": True}})
    if events[-1] != "[DONE]" or events[-2]["choices"] != [] or \
            events[-2]["usage"]["prompt_tokens"] != 3:
        fail(f"no usage chunk with empty choices before [DONE]: {events[-2:]}")
    counts = [e["usage"]["completion_tokens"] for e in events[:-2]]
    if counts != sorted(counts) or counts[-1] != events[-2]["usage"]["completion_tokens"]:
        fail(f"continuous usage {counts}, final {events[-2]['usage']}")


def check_routes(port, tok):
    status, text = http(port, "GET", "/v1/models")
    if status != 200 or json.loads(text)["data"][0]["max_model_len"] <= 0:
        fail(f"/v1/models: {status} {text}")
    t = post(port, "/tokenize", {"model": stt.MODEL, "prompt": PROMPT})
    if t["tokens"] != tok.encode(PROMPT).ids or t["count"] != len(t["tokens"]):
        fail(f"/tokenize {t}, tokenizers {tok.encode(PROMPT).ids}")
    d = post(port, "/detokenize", {"tokens": t["tokens"]})
    if d["prompt"] != tok.decode(t["tokens"], skip_special_tokens=False):
        fail(f"/detokenize {d}")
    status, text = http(port, "POST", "/v1/chat/completions", {"messages": []})
    if status != 404 or "/v1/completions" not in text:
        fail(f"/v1/chat/completions without a renderer: {status} {text}")


def check_sdk(port):
    try:
        import openai
    except ImportError:
        print("openai SDK: not installed, its checks left out (launch/setup.sh installs it)")
        return
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    c = client.completions.create(model=stt.MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                  extra_body={"skip_special_tokens": True, "min_tokens": 1})
    if c.usage.completion_tokens < 1 or not isinstance(c.choices[0].text, str):
        fail(f"SDK completion: {c}")
    chunks = list(client.completions.create(model=stt.MODEL, prompt=PROMPT, max_tokens=4,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    if chunks[-1].choices or chunks[-1].usage.completion_tokens != c.usage.completion_tokens or \
            "".join(x.choices[0].text for x in chunks[:-1]) != c.choices[0].text:
        fail(f"SDK stream: {chunks}")
    e = client.completions.create(model=stt.MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                  logprobs=1, temperature=0)
    lp = e.choices[0].logprobs
    if e.choices[0].text != PROMPT or lp.token_logprobs[0] is not None or \
            any(x is None or x > 0 for x in lp.token_logprobs[1:]):
        fail(f"SDK echo: {e}")
    print(f"openai SDK {openai.__version__}: completions, stream+usage, echo+logprobs OK")


def serve_and_check(cpfill, ckpt, tok, tmp, ranks, tp, expect):
    server, port, log = start(cpfill, ckpt, tmp, ranks, tp, MPI_ENV)
    try:
        got, worst = check_echo(port, tok, expect)
        check_fields(port, tok)
        check_stream_usage(port)
        check_routes(port, tok)
        if ranks == 1:
            check_sdk(port)
        os.kill(rank_pid(0, server.pid), signal.SIGTERM)
        if server.wait(timeout=60) != 0:
            fail(f"the {ranks}-rank server exited {server.returncode} after SIGTERM")
        print(f"{ranks} rank(s): prompt logprobs within {worst:.2g} of the numpy reference")
        return got
    finally:
        if server.poll() is None:
            server.kill()
            log.seek(0)
            print(log.read()[-3000:])


def main():
    cpfill = os.path.abspath(sys.argv[1])
    tmp = tempfile.mkdtemp(prefix="cpfill-serve-openai-")
    ckpt, tok = stt.make_checkpoint(cpfill, tmp, MPI_ENV)
    stt.MODEL = ckpt
    expect = reference_prompt_logprobs(ckpt, tok.encode(PROMPT).ids)
    one = serve_and_check(cpfill, ckpt, tok, tmp, 1, 1, expect)
    four = serve_and_check(cpfill, ckpt, tok, tmp, 4, 2, expect)
    worst = max(abs(a - b) for a, b in zip(one, four))
    if worst > 1e-4:
        fail(f"prompt logprobs on TP2 x CP2 differ from one rank's by {worst}")
    print(f"PASS: serve_openai_surface (4 ranks within {worst:.2g} of 1 rank)")


if __name__ == "__main__":
    main()
