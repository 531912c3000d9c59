#!/usr/bin/env python3
"""Perplexity of a fixed prose text through `cpfill serve` on SmolLM2 against the numpy fp64
reference, and echo in a stream (CTest serve_perplexity_smollm2).

    serve_perplexity_test.py build/cpfill WORKDIR [--layouts 1,4]

tests/data/perplexity_prose.txt (written for this test, some 400 tokens) is sent to a `serve` of
SmolLM2-135M-Instruct on 1 rank and on 4 ranks (TP1 x CP4) as {"echo": true, "logprobs": 1,
"max_tokens": 0}, as perplexity clients (lm-evaluation-harness) ask; the perplexity of the
prompt's token logprobs must equal that of tests/hf_llama_reference.py (fp64, the same ids)
within 1e-4 relative, and each token's logprob within 1e-4. On each server the same request
streamed must give one chunk holding the prompt's text and the same logprobs, finish_reason
"length" and no token; and a streamed echo that generates 4 greedy tokens must add up to the
non-streamed answer, text and logprobs. Prints both perplexities as JSON.
Exit 77 (SKIPPED) without the package index (1 where CI=true).
"""
import argparse
import json
import math
import os
import sys
import tempfile
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "models"))
import convert_smollm2  # noqa: E402
import hf_llama_reference as ref  # noqa: E402
from serve_test import fail, http, start_checkpoint_serve, stop_serve  # noqa: E402

REL_TOLERANCE = 1e-4  # perplexity, relative
LOGPROB_TOLERANCE = 1e-4  # each token's logprob, absolute (fp32 against fp64)
LAYOUTS = {"1": 1, "4": 4}  # ranks, all CP (TP1)


def stop(server, log, pid_file):
    code = stop_serve(server, pid_file)
    if code != 0:
        log.seek(0)
        print(log.read()[-4000:])
    log.close()
    return code


def stream(port, body):
    """The chunks of a streamed completion, up to [DONE]."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    chunks = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.decode().strip()
            if line == "data: [DONE]":
                return chunks
            if line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    fail(f"the stream ended without [DONE]: {chunks[-1:]}")


def reference_logprobs(checkpoint, ids):
    cfg = json.load(open(os.path.join(checkpoint, "config.json")))
    weights = ref.load_safetensors(os.path.join(checkpoint, "model.safetensors"))
    logits = ref.forward_logits(cfg, weights, ids)
    top = logits.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[:, 0]
    return np.array([logits[i, ids[i + 1]] - lse[i] for i in range(len(ids) - 1)])


def perplexity(logprobs):
    return math.exp(-sum(logprobs) / len(logprobs))


def echo(port, text):
    body = {"prompt": text, "echo": True, "logprobs": 1, "max_tokens": 0}
    status, answer = http(port, "POST", "/v1/completions", body, timeout=300)
    if status != 200:
        fail(f"echo: {status} {answer[:500]}")
    choice = json.loads(answer)["choices"][0]
    if choice["text"] != text or choice["logprobs"]["token_logprobs"][0] is not None:
        fail(f"echo's text or first logprob: {choice['text'][:80]!r}")
    return choice


def check_echo_stream(port, text, whole):
    body = {"prompt": text, "echo": True, "logprobs": 1, "max_tokens": 0}
    chunks = stream(port, body)
    if len(chunks) != 1 or chunks[0]["choices"][0]["text"] != text or \
            chunks[0]["choices"][0]["finish_reason"] != "length" or \
            chunks[0]["choices"][0]["logprobs"] != whole["logprobs"]:
        lp = chunks[0]["choices"][0]["logprobs"] or {}
        differ = [k for k in whole["logprobs"] if lp.get(k) != whole["logprobs"][k]]
        fail(f"streamed echo of the prompt alone: {len(chunks)} chunks, finish_reason "
             f"{chunks[0]['choices'][0]['finish_reason']}, logprobs differ in {differ}: "
             f"{ {k: (lp.get(k, [])[:3], whole['logprobs'][k][:3]) for k in differ} }")
    body = {"prompt": "The capital of France is", "echo": True, "logprobs": 2, "max_tokens": 4,
            "temperature": 0}
    status, answer = http(port, "POST", "/v1/completions", body, timeout=300)
    want = json.loads(answer)["choices"][0]
    chunks = stream(port, body)
    got_text = "".join(c["choices"][0]["text"] for c in chunks)
    got = {k: sum((c["choices"][0]["logprobs"][k] for c in chunks), [])
           for k in ("tokens", "token_logprobs", "text_offset")}
    # Logprobs as close as two runs of one request are (decode steps batch differently).
    near = all(a == b or (a is not None and b is not None and abs(a - b) <= LOGPROB_TOLERANCE)
               for a, b in zip(got["token_logprobs"], want["logprobs"]["token_logprobs"]))
    if status != 200 or got_text != want["text"] or not near or \
            any(got[k] != want["logprobs"][k] for k in ("tokens", "text_offset")) or \
            len(got["token_logprobs"]) != len(want["logprobs"]["token_logprobs"]):
        fail(f"streamed echo with generation: {got_text!r} {got}, whole: {want['text']!r} "
             f"{ {k: want['logprobs'][k] for k in got} }")
    print(f"echo stream: the prompt alone in one chunk; with 4 tokens {len(chunks)} chunks "
          f"= {want['text']!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cpfill")
    ap.add_argument("workdir")
    ap.add_argument("--layouts", default="1,4")
    args = ap.parse_args()
    checkpoint = convert_smollm2.require_checkpoint()
    text = open(os.path.join(HERE, "data", "perplexity_prose.txt"), encoding="utf-8").read()
    os.makedirs(args.workdir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="ppl-", dir=args.workdir)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json"))
    results, reference = {}, None
    for name in args.layouts.split(","):
        server, log, port, pid_file = start_checkpoint_serve(
            os.path.abspath(args.cpfill), checkpoint, tmp, LAYOUTS[name], "--tp", "1",
            tag=str(LAYOUTS[name]))
        try:
            choice = echo(port, text)
            check_echo_stream(port, text, choice)
        finally:
            code = stop(server, log, pid_file)
        if code != 0:
            fail(f"the {name}-rank server exited {code}")
        ids = choice["logprobs"]["token_ids"]
        if ids != tok.encode(text).ids:
            fail(f"the echoed ids are not what tokenizers encodes ({len(ids)} tokens)")
        if reference is None:
            reference = reference_logprobs(checkpoint, ids)
        got = np.array(choice["logprobs"]["token_logprobs"][1:], dtype=np.float64)
        worst = float(np.abs(got - reference).max())
        results[f"{LAYOUTS[name]}_ranks"] = {"perplexity": perplexity(got),
                                             "max_abs_logprob_diff": worst}
        rel = abs(perplexity(got) / perplexity(reference) - 1)
        if rel > REL_TOLERANCE or worst > LOGPROB_TOLERANCE:
            fail(f"{name} rank(s): perplexity {perplexity(got)!r}, fp64 reference "
                 f"{perplexity(reference)!r} (relative {rel:.2e}); worst logprob diff {worst:.2e}")
    print(json.dumps({"tokens": len(reference) + 1,
                      "reference_fp64_perplexity": perplexity(reference), **results}, indent=1))
    print("serve_perplexity: PASS")


if __name__ == "__main__":
    main()
