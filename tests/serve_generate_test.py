#!/usr/bin/env python3
"""`cpfill serve` generating, end to end (standard library only):

    python3 tests/serve_generate_test.py build/cpfill

Starts the server under mpirun (TP2 x CP2, CPU backend, the tiny preset) and asserts that
  * greedy generations from concurrent clients equal one-shot prefills of every prefix on one
    rank (`cpfill prefill --save-logits`: each generated token is the argmax after the tokens
    before it, or a near tie);
  * a streamed request of two prompts (server-sent events) gives the same tokens, each prompt's
    finish reason on its last chunk, a usage chunk, then [DONE];
  * seeded sampling repeats, another seed differs; stop_token_ids stop generation ("stop");
  * a session's next turn continues after the generated tokens and reuses their KV;
  * the prefix cache: questions about one document reuse its KV (cached_tokens) and equal one
    rank's prefills; "n": 4 greedy choices of one prompt are its greedy generation four times,
    its tokens counted once; /metrics counts the hits;
  * a client that leaves a stream ends its generation (no sequence left running);
  * bad generation requests get 400s naming the field; /metrics counts generated tokens;
  * SIGTERM to rank 0 drains and every rank exits 0.
"""
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from serve_test import (MPI_ENV, complete, fail, http, in_threads, metric,  # noqa: E402
                        rank_pid, read_logits, wait_port)

VOCAB = 1024  # the tiny preset's
NEW = 10


def stream(port, body):
    """The events of a streamed completion (parsed JSON, then the string '[DONE]')."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\nConnection: close\r\n\r\n"
                 + payload)
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    sock.close()
    head, _, body_bytes = raw.partition(b"\r\n\r\n")
    if b" 200 " not in head.split(b"\r\n")[0]:
        fail(f"stream: {head[:200]!r} {body_bytes[:300]!r}")
    events = []
    for line in dechunk(body_bytes).decode().split("\n"):
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def dechunk(data):
    """HTTP/1.1 chunked transfer coding to bytes."""
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2:]
    return out


def check_against_prefixes(cpfill, tmp, generations):
    """Each (prompt, tokens): token i is the one-rank argmax after prompt + tokens[:i]."""
    prefixes, expect = [], []
    for prompt, tokens in generations:
        for i, t in enumerate(tokens):
            prefixes.append(prompt + tokens[:i])
            expect.append(t)
    tokens_file, logits_file = os.path.join(tmp, "prefixes.json"), os.path.join(tmp, "lg.st")
    json.dump(prefixes, open(tokens_file, "w"))
    ref = subprocess.run([cpfill, "prefill", "--model", "tiny", "--tokens", tokens_file,
                          "--backend", "cpu", "--save-logits", logits_file],
                         capture_output=True, text=True, env=MPI_ENV)
    if ref.returncode != 0:
        fail(f"reference prefill: {ref.stderr[-500:]}")
    for i, (row, t) in enumerate(zip(read_logits(logits_file), expect)):
        best = max(row)
        if row[t] != best and best - row[t] > 1e-3:
            fail(f"prefix {i}: generated {t}, one rank's argmax {row.index(best)}")
    return len(expect)


def main():
    cpfill = os.path.abspath(sys.argv[1])
    tmp = tempfile.mkdtemp(prefix="cpfill-generate-")
    port_file = os.path.join(tmp, "port")
    log = open(os.path.join(tmp, "serve.log"), "w+")
    server = subprocess.Popen(
        ["mpirun", "-np", "4", cpfill, "serve", "--model", "tiny", "--tp", "2",
         "--ranks-per-node", "2", "--port", "0", "--port-file", port_file, "--backend", "cpu",
         "--threads", "1", "--kv-capacity-tokens", "65536", "--timeout-s", "60"],
        stdout=log, stderr=subprocess.STDOUT, env=MPI_ENV)
    try:
        run(cpfill, server, wait_port(server, port_file, log=log), tmp)
    finally:
        if server.poll() is None:
            server.kill()
        log.seek(0)
        print("---- server log (last 30 lines) ----")
        print("".join(log.readlines()[-30:]))


def greedy(port, rng_seed, count):
    """`count` greedy generations from 3 concurrent clients: [(prompt, tokens)]."""
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.choice([1, 9, 64, 300]))]
               for _ in range(count)]
    out = [None] * count

    def client(k):
        for i in range(k, count, 3):
            r = complete(port, {"prompt": prompts[i], "max_tokens": NEW, "temperature": 0})
            choice = r["choices"][0]
            if choice["finish_reason"] != "length" or r["usage"]["completion_tokens"] != NEW:
                fail(f"greedy {i}: {choice['finish_reason']} {r['usage']}")
            out[i] = (prompts[i], choice["token_ids"])
    in_threads(client, range(3))
    return out


def check_stream(port, generations):
    (p0, g0), (p1, g1) = generations[0], generations[1]
    events = stream(port, {"prompt": [p0, p1], "max_tokens": NEW, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}})
    if events[-1] != "[DONE]":
        fail(f"the stream did not end with [DONE]: {events[-1]}")
    usage = events[-2]
    if usage["choices"] or usage["usage"]["completion_tokens"] != 2 * NEW:
        fail(f"usage chunk: {usage}")
    got = {0: [], 1: []}
    for e in events[:-2]:
        c = e["choices"][0]
        got[c["index"]] += c["token_ids"]
        last = len(got[c["index"]]) == NEW
        if (c["finish_reason"] == "length") != last:
            fail(f"finish reason {c['finish_reason']} at token {len(got[c['index']])}")
    if got[0] != g0 or got[1] != g1:
        fail(f"streamed tokens differ from the same greedy requests: {got} vs {g0} {g1}")


def check_sampling_and_stop(port, prompt, tokens):
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 7}
    a, b = complete(port, body), complete(port, body)
    c = complete(port, dict(body, seed=8))
    ids = lambda r: r["choices"][0]["token_ids"]  # noqa: E731
    if ids(a) != ids(b):
        fail(f"seed 7 twice: {ids(a)} vs {ids(b)}")
    if ids(a) == ids(c):
        fail("seeds 7 and 8 gave the same 12 tokens")
    stop = tokens[3]
    r = complete(port, {"prompt": prompt, "max_tokens": NEW, "temperature": 0,
                        "stop_token_ids": [stop]})
    want = tokens[:tokens.index(stop) + 1]
    if ids(r) != want or r["choices"][0]["finish_reason"] != "stop":
        fail(f"stop_token_ids: {ids(r)} {r['choices'][0]['finish_reason']}, want {want}")


def check_session(cpfill, port, tmp):
    a = [(i * 13 + 5) % VOCAB for i in range(41)]
    b = [(i * 7 + 3) % VOCAB for i in range(6)]
    t1 = complete(port, {"prompt": a, "session": "g", "max_tokens": 5, "temperature": 0})
    g1 = t1["choices"][0]["token_ids"]
    t2 = complete(port, {"prompt": b, "session": "g", "max_tokens": 1, "temperature": 0})
    if t2["usage"]["prompt_tokens_details"]["cached_tokens"] != len(a) + 5 - 1:
        fail(f"turn 2 cached {t2['usage']}")
    check_against_prefixes(cpfill, tmp, [(a, g1), (a + g1 + b, t2["choices"][0]["token_ids"])])
    if http(port, "DELETE", "/v1/sessions/g")[0] != 200:
        fail("DELETE /v1/sessions/g")


def check_prefix_cache(cpfill, port, tmp, generations):
    doc = [(i * 31 + 11) % VOCAB for i in range(200)]
    asked = []
    for q in range(3):
        prompt = doc + [(q * 97 + i) % VOCAB for i in range(5 + q)]
        r = complete(port, {"prompt": prompt, "max_tokens": 4, "temperature": 0})
        cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        if (q == 0) != (cached == 0) or (q > 0 and cached < 192):
            fail(f"question {q} about the document reused {cached} tokens")
        asked.append((prompt, r["choices"][0]["token_ids"]))
    check_against_prefixes(cpfill, tmp, asked)
    prompt, tokens = max(generations, key=lambda g: len(g[0]))  # generated before: cached
    r = complete(port, {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "n": 4})
    if r["usage"]["prompt_tokens_details"]["cached_tokens"] != len(prompt) - 1:
        fail(f"n 4: the prompt generated before reused {r['usage']}")
    if [c["index"] for c in r["choices"]] != [0, 1, 2, 3]:
        fail(f"n 4: choices {[c['index'] for c in r['choices']]}")
    if any(c["token_ids"] != tokens for c in r["choices"]):
        fail(f"n 4: {[c['token_ids'] for c in r['choices']]}, want {tokens} four times")
    if r["usage"]["prompt_tokens"] != len(prompt) or r["usage"]["completion_tokens"] != 4 * NEW:
        fail(f"n 4: usage {r['usage']}")
    if metric(port, "cpfill:prefix_cache_hits_total") < 2:
        fail("prefix cache hits not counted")
    # The 4 choices' decode steps read the prompt's whole shared blocks (64 rows; 2 on each CP
    # rank once the prompt has 256 tokens) once for all of them.
    if len(prompt) >= 256 and metric(port, "cpfill:prefix_batched_key_rows_total") <= 0:
        fail("n 4: no decode step batched the choices over their shared prompt")
    metric(port, "cpfill:kv_cache_shared_blocks")


def check_client_leaves(port):
    """A stream of 100000 tokens whose reader leaves after a few events: generation ends."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    payload = json.dumps({"prompt": [1, 2, 3], "max_tokens": 100000, "temperature": 0,
                          "ignore_eos": True, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    seen = b""
    while seen.count(b"data: ") < 3:
        seen += sock.recv(4096)
    sock.close()
    deadline = time.time() + 30
    while metric(port, "cpfill:num_requests_running") != 0:
        if time.time() > deadline:
            fail("the generation of a stream whose client left is still running after 30 s")
        time.sleep(0.2)


def run(cpfill, server, port, tmp):
    generations = greedy(port, 1, 9)
    checked = check_against_prefixes(cpfill, tmp, generations)
    check_stream(port, generations)
    check_sampling_and_stop(port, *generations[3])
    check_session(cpfill, port, tmp)
    check_prefix_cache(cpfill, port, tmp, generations)
    check_client_leaves(port)
    for body, message in [({"prompt": [1], "max_tokens": 131073}, "positions"),
                          ({"prompt": [1], "max_tokens": 4, "stop": ["x"]},
                           "\"stop\" strings need the model's tokenizer"),
                          ({"prompt": [1], "max_tokens": 4, "top_p": 0}, "\"top_p\""),
                          ({"prompt": [1], "max_tokens": 4, "stop_token_ids": [VOCAB]},
                           "outside the vocabulary")]:
        status, text = http(port, "POST", "/v1/completions", body)
        if status != 400 or message not in json.loads(text)["error"]["message"]:
            fail(f"{body}: {status} {text}")
    if metric(port, "cpfill:generation_tokens_total") < checked:
        fail("generated tokens not counted")
    if metric(port, "cpfill:time_per_output_token_seconds_count") < len(generations):
        fail("time per output token not observed")
    if http(port, "GET", "/health")[0] != 200:
        fail("/health after the tests")
    pid = rank_pid(0, server.pid)
    os.kill(pid, signal.SIGTERM)
    if server.wait(timeout=60) != 0:
        fail("the server did not exit 0 after SIGTERM")
    print(f"PASS: serve_generates ({checked} greedy tokens against one-rank prefills, a stream, "
          "seeds, stop ids, a session, the prefix cache and n, an abandoned stream)")


if __name__ == "__main__":
    main()
