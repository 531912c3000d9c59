#!/usr/bin/env python3
"""SparQ decode through `cpfill serve` and `cpfill generate`, end to end (standard library only):

    python3 tests/serve_sparq_test.py build/launch/cpfill

Starts the server under mpirun on 2 ranks (TP1 x CP2, CPU backend, the tiny preset, head_dim 64)
and asserts that
  * a greedy request with "sparq" at k >= the prompt's length gives the tokens of the same
    request without it (SparQ then chooses every position: dense attention);
  * with a small k the response's timing object (body["cpfill"]["prompts"][i]) reports SparQ
    decode steps, and /metrics' cpfill:sparq_decode_steps_total grows by at least as many;
  * bad "sparq" values (r > head_dim, k < 1, l < 0, a non-integer, an unknown key, not an
    object) get a 400 JSON error naming the field;
then SIGTERM to rank 0 and every rank exits 0. Then `cpfill generate --sparq` on one rank gives
the CP2 server's SparQ tokens (every decode step SparQ only, the dense ring skipped), bad values
exit 2 naming the flag, and a good one runs.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from serve_test import MPI_ENV, complete, fail, http, metric, rank_pid, wait_port  # noqa: E402

VOCAB = 1024  # the tiny preset's
HEAD_DIM = 64
PROMPT = [(j * 7919 + 13) % VOCAB for j in range(300)]
NEW = 12


def greedy(port, sparq=None):
    body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    if sparq is not None:
        body["sparq"] = sparq
    r = complete(port, body)
    tokens = r["choices"][0].get("token_ids")
    if tokens is None:  # the text of a tokenizer-less model: the ids, space separated
        tokens = r["choices"][0]["text"]
    return tokens, r["cpfill"]["prompts"][0]


BAD = [({"r": HEAD_DIM + 1, "k": 16}, "sparq.r"),
       ({"r": 8, "k": 0}, "sparq.k"),
       ({"r": 8, "k": 16, "l": -1}, "sparq.l"),
       ({"r": 8.5, "k": 16}, "sparq.r"),
       ({"r": 8, "k": "16"}, "sparq.k"),
       ({"r": 8, "k": 16, "window": 4}, "sparq.window"),
       ({"k": 16}, "sparq.r"),
       ([8, 16], "sparq")]


def check_serve(port):
    dense, timing = greedy(port)
    if timing.get("sparq_decode_steps") != 0:
        fail(f"a request without sparq reports SparQ steps: {timing}")
    before = metric(port, "cpfill:sparq_decode_steps_total")
    same, timing = greedy(port, {"r": 16, "k": len(PROMPT) + NEW, "l": 4})
    if same != dense:
        fail(f"sparq with k >= the sequence's length: {same}, dense {dense}")
    sparse, timing = greedy(port, {"r": 8, "k": 32, "l": 8})
    steps = timing.get("sparq_decode_steps")
    # NEW - 1 decode steps follow the prefill's token; every one is longer than k + l.
    if steps != NEW - 1:
        fail(f"sparq k 32: {steps} SparQ decode steps reported, want {NEW - 1}: {timing}")
    after = metric(port, "cpfill:sparq_decode_steps_total")
    if after - before < steps:
        fail(f"cpfill:sparq_decode_steps_total grew by {after - before}, want >= {steps}")
    agree = sum(a == b for a, b in zip(sparse, dense))
    print(f"serve: k >= S equals dense ({NEW} tokens); k 32: {steps} SparQ steps, "
          f"{agree}/{len(dense)} tokens equal dense (random weights: not judged)")
    for sparq, field in BAD:
        body = {"prompt": PROMPT[:8], "max_tokens": 2, "sparq": sparq}
        status, text = http(port, "POST", "/v1/completions", body)
        try:
            message = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            fail(f"sparq {sparq}: {status} not a JSON error: {text[:300]}")
        if status != 400 or field not in message:
            fail(f"sparq {sparq}: {status} {message}, want 400 naming {field}")
    print(f"serve: {len(BAD)} bad sparq values refused (400, naming the field)")
    return sparse


def check_one_rank(cpfill, tmp, sparse):
    """SparQ over CP2 (every decode step SparQ only: no dense ring) equals one rank's."""
    tokens, report = os.path.join(tmp, "prompt.json"), os.path.join(tmp, "one-rank.json")
    json.dump([PROMPT], open(tokens, "w"))
    r = subprocess.run([cpfill, "generate", "--model", "tiny", "--backend", "cpu", "--tokens",
                        tokens, "--max-tokens", str(NEW), "--ignore-eos", "--sparq", "8,32,8",
                        "--json", report], capture_output=True, text=True, env=MPI_ENV,
                       timeout=300)
    if r.returncode != 0:
        fail(f"generate on one rank: exit {r.returncode}\n{(r.stdout + r.stderr)[-2000:]}")
    one = json.load(open(report))["sequences"][0]["tokens"]
    if one != sparse:
        fail(f"sparq 8,32,8: CP2 serve {sparse}, one-rank generate {one}")
    print(f"generate: one rank's SparQ tokens equal CP2 serve's ({len(one)})")


def check_generate(cpfill, tmp):
    base = ["mpirun", "-np", "2", cpfill, "generate", "--model", "tiny", "--backend", "cpu",
            "--threads", "1", "--prompt-lens", "200", "--max-tokens", "6", "--ignore-eos"]
    for value in ["65,16", "8,0", "8,16,-1", "8", "8,16,4,2", "x,16", "8.5,16", ""]:
        r = subprocess.run(base + ["--sparq", value], capture_output=True, text=True,
                           env=MPI_ENV, timeout=300)
        out = r.stdout + r.stderr
        if r.returncode != 2 or "--sparq" not in out:
            fail(f"generate --sparq {value!r}: exit {r.returncode}, want 2 naming the flag:\n"
                 f"{out[-1500:]}")
    report = os.path.join(tmp, "generate.json")
    r = subprocess.run(base + ["--sparq", "8,32,8", "--json", report], capture_output=True,
                       text=True, env=MPI_ENV, timeout=300)
    if r.returncode != 0:
        fail(f"generate --sparq 8,32,8: exit {r.returncode}\n{(r.stdout + r.stderr)[-2000:]}")
    steps = json.load(open(report))["sequences"][0]["sparq_decode_steps"]
    if steps != 5:
        fail(f"generate --sparq 8,32,8: {steps} SparQ decode steps, want 5")
    print("generate: 8 bad --sparq values exit 2 naming the flag; 8,32,8 ran 5 SparQ steps")


def main():
    cpfill = os.path.abspath(sys.argv[1])
    tmp = tempfile.mkdtemp(prefix="cpfill-sparq-")
    port_file = os.path.join(tmp, "port")
    log = open(os.path.join(tmp, "serve.log"), "w+")
    server = subprocess.Popen(
        ["mpirun", "-np", "2", cpfill, "serve", "--model", "tiny", "--tp", "1", "--host",
         "127.0.0.1", "--port", "0", "--port-file", port_file, "--backend", "cpu", "--threads",
         "1", "--kv-capacity-tokens", "8192", "--timeout-s", "60"],
        stdout=log, stderr=subprocess.STDOUT, env=MPI_ENV)
    try:
        sparse = check_serve(wait_port(server, port_file, log=log))
        pid = rank_pid(0, server.pid)
        if pid is None:
            fail("rank 0 of the server not found")
        os.kill(pid, signal.SIGTERM)
        if server.wait(timeout=60) != 0:
            fail("the server did not exit 0 after SIGTERM")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)
        log.seek(0)
        print("---- server log (last 15 lines) ----")
        print("".join(log.readlines()[-15:]))
    check_one_rank(cpfill, tmp, sparse)
    check_generate(cpfill, tmp)
    print("PASS: serve_sparq")


if __name__ == "__main__":
    main()
