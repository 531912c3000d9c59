#!/usr/bin/env python3
"""SparQ decode quality on a real model, CPU backend: greedy agreement with dense decode.

Starts one `cpfill serve` (CPU, --ranks ranks as CP) of --model and sends, per prompt, a greedy
completion of --max-tokens tokens (ignore_eos, logprobs) dense and once per setting: SparQ at
compression 1/2, 1/4, 1/8 (r = d_h * compression, k = --k, l = --l, the paper's recipe) and the
oracle top-k (r = d_h: exact scores choose the top k, attention/sparq/sparq.h). Prompts are
natural text: windows of --text cut at paragraph ends to about --prompt-tokens tokens each
(counted by the server's tokenizer), starting at evenly spaced paragraphs. Prefill stays dense,
so the prefix cache serves every setting's prompt after the first.

Per setting: the fraction of generated tokens equal to dense (position by position), the tokens
before the first divergence, and the mean |logprob difference| of the chosen tokens over the
positions before the first divergence (there both runs have the same history: the same token
under the same prefix, dense vs SparQ).

  python3 bench/sparq_quality.py --cpfill build-sq/launch/cpfill \
      --model .venv/models/smollm2-135m-instruct --text tests/data/sparq_prose.txt \
      --prompts 6 --prompt-tokens 1500 --max-tokens 64 \
      --out bench/results/2026-12-07-cpu-sparq-quality/raw.json
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def http(port, method, path, body=None, timeout=1800):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def start(args, tmp):
    port_file = os.path.join(tmp, "port")
    log = open(os.path.join(tmp, "serve.log"), "w+")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    cmd = [args.cpfill, "serve", "--model", args.model, "--backend", "cpu", "--host",
           "127.0.0.1", "--port", "0", "--port-file", port_file, "--kv-capacity-tokens", "16384",
           "--timeout-s", "600"]
    if args.ranks > 1:
        cmd = ["mpirun", "-np", str(args.ranks)] + cmd + ["--tp", "1"]
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 300
    while not (os.path.exists(port_file) and open(port_file).read().strip()):
        if server.poll() is not None or time.time() > deadline:
            log.seek(0)
            sys.exit(f"the server did not start:\n{log.read()[-3000:]}")
        time.sleep(0.5)
    return server, int(open(port_file).read())


def count_tokens(port, text):
    status, r = http(port, "POST", "/v1/completions",
                     {"prompt": text, "max_tokens": 1, "temperature": 0})
    if status != 200:
        sys.exit(f"tokenizing: {status} {r}")
    return r["usage"]["prompt_tokens"]


def prompts(port, args):
    """--prompts windows of whole paragraphs, each about --prompt-tokens tokens."""
    paragraphs = [p for p in open(args.text).read().split("\n\n") if p.strip()]
    sizes = [count_tokens(port, p + "\n\n") for p in paragraphs]
    out = []
    for i in range(args.prompts):
        first = i * len(paragraphs) // (args.prompts + 1)
        last, total = first, 0
        while last < len(paragraphs) and total + sizes[last] <= args.prompt_tokens:
            total += sizes[last]
            last += 1
        out.append("\n\n".join(paragraphs[first:last]) + "\n\n")
    return out


def greedy(port, text, args, sparq):
    body = {"prompt": text, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 1}
    if sparq is not None:
        body["sparq"] = sparq
    status, r = http(port, "POST", "/v1/completions", body)
    if status != 200:
        sys.exit(f"sparq {sparq}: {status} {r}")
    c = r["choices"][0]
    return {"tokens": c["token_ids"], "logprobs": c["logprobs"]["token_logprobs"],
            "prompt_tokens": r["usage"]["prompt_tokens"],
            "sparq_decode_steps": r["cpfill"]["prompts"][0]["sparq_decode_steps"],
            "tpot_ms": r["cpfill"]["prompts"][0]["tpot_ms"],
            "attention_ring_ms":
                r["cpfill"]["prompts"][0]["decode_step_phases_ms"]["attention_ring"]}


def compare(dense, other):
    first, same, total, diffs = [], 0, 0, []
    for d, o in zip(dense, other):
        a, b = d["tokens"], o["tokens"]
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        first.append(n)
        same += sum(x == y for x, y in zip(a, b))
        total += len(a)
        diffs += [abs(x - y) for x, y in zip(d["logprobs"][:n], o["logprobs"][:n])]
    return {"token_agreement": same / max(total, 1), "tokens_before_first_divergence": first,
            "mean_tokens_before_first_divergence": sum(first) / max(len(first), 1),
            "mean_abs_logprob_diff_before_divergence": sum(diffs) / max(len(diffs), 1),
            "logprob_positions": len(diffs),
            "sparq_decode_steps": [o["sparq_decode_steps"] for o in other],
            "tpot_ms": [round(o["tpot_ms"], 1) for o in other],
            "attention_ring_ms": [round(o["attention_ring_ms"], 2) for o in other]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpfill", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--text", default=os.path.join(os.path.dirname(__file__),
                                                  "../tests/data/sparq_prose.txt"))
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=128)
    p.add_argument("--l", type=int, default=16)
    p.add_argument("--out")
    args = p.parse_args()
    settings = [(f"1/{c}", {"r": max(1, args.head_dim // c), "k": args.k, "l": args.l})
                for c in (2, 4, 8)]
    settings.append(("oracle top-k", {"r": args.head_dim, "k": args.k, "l": args.l}))
    tmp = tempfile.mkdtemp(prefix="cpfill-sparq-quality-")
    server, port = start(args, tmp)
    t0 = time.time()
    try:
        texts = prompts(port, args)
        dense = [greedy(port, t, args, None) for t in texts]
        print(json.dumps({"dense": {"prompt_tokens": [d["prompt_tokens"] for d in dense],
                                    "tpot_ms": [round(d["tpot_ms"], 1) for d in dense],
                                    "attention_ring_ms": [round(d["attention_ring_ms"], 2)
                                                          for d in dense]}}),
              flush=True)
        results = {"args": vars(args), "dense": dense, "settings": []}
        for name, sparq in settings:
            other = [greedy(port, t, args, sparq) for t in texts]
            row = {"compression": name, "sparq": sparq, **compare(dense, other)}
            results["settings"].append({**row, "runs": other})
            print(json.dumps(row), flush=True)
        results["wall_s"] = time.time() - t0
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    if args.out:
        json.dump(results, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
