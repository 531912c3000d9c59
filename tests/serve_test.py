#!/usr/bin/env python3
"""End-to-end test of `cpfill serve` (standard library only).

    python3 tests/serve_test.py build/cpfill [--ranks 4 --tp 2]

Starts the server under mpirun (TP2 x CP2 on emulated nodes of 2 ranks, CPU backend, the tiny
preset), waits for /health, then 8 concurrent clients send 200+ requests: plain prompts of mixed
lengths, one 3-turn session each, and bad requests. It asserts that
  * every good answer's first token and top-5 logprobs equal a one-shot `cpfill prefill` of the
    same tokens on one rank (a session turn: of the whole conversation so far);
  * every bad request gets its 4xx with a JSON error naming the problem, and the server stays up;
  * /metrics counts what was sent; /v1/sessions and DELETE /v1/sessions/{id} work;
  * SIGTERM to rank 0 drains and every rank exits 0.
"""
import argparse
import concurrent.futures
import json
import math
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

VOCAB = None  # read from /v1/models' model (the tiny preset's vocabulary below)
CLIENTS = 8
PLAIN_PER_CLIENT = 20
MAX_BATCH = 2048


# mpirun as root on a small machine (the tests of `serve` and the embedding API share it).
MPI_ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")


def fail(msg):
    print("FAIL:", msg, flush=True)
    sys.exit(1)


def in_threads(function, args):
    """[function(a) for a in args], each call on a thread of its own; waits for all of them.

    The first failure, in the order of `args`, is raised again here in the main thread: fail()'s
    SystemExit or any exception. (On a threading.Thread either would end only that thread: the
    SystemExit unseen, an exception as a printed traceback, and the test would go on.)
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(args)) as pool:
        futures = [pool.submit(function, a) for a in args]
    return [f.result() for f in futures]


def wait_port(server, port_file, seconds=180, log=None):
    """The port `cpfill serve --port-file` wrote; fails (with the log's tail) if the server ends
    or `seconds` pass first."""
    deadline = time.time() + seconds
    while not os.path.exists(port_file) or not open(port_file).read().strip():
        if server.poll() is not None or time.time() > deadline:
            tail = ""
            if log is not None:
                log.seek(0)
                tail = ":\n" + log.read()[-3000:]
            fail(f"the server did not start{tail}")
        time.sleep(0.2)
    return int(open(port_file).read())


def start_checkpoint_serve(cpfill, model, tmp, ranks, *extra, tag="", kv_tokens=4096):
    """`cpfill serve --model MODEL` on `ranks` CPU ranks, on a free port of 127.0.0.1, with its
    port, pid and log files under `tmp` (named with `tag`; stale ones removed) and `extra` flags;
    (server, log, port, pid file) once it listens."""
    port_file, pid_file = os.path.join(tmp, f"port{tag}"), os.path.join(tmp, f"pid{tag}")
    for f in (port_file, pid_file):
        if os.path.exists(f):
            os.remove(f)
    log = open(os.path.join(tmp, f"serve{tag}.log"), "w+")
    server = subprocess.Popen(
        ["mpirun", "-np", str(ranks), cpfill, "serve", "--model", model, "--backend", "cpu",
         "--host", "127.0.0.1", "--port", "0", "--port-file", port_file, "--pid-file", pid_file,
         "--kv-capacity-tokens", str(kv_tokens), "--timeout-s", "120", *extra],
        stdout=log, stderr=subprocess.STDOUT, env=MPI_ENV)
    return server, log, wait_port(server, port_file, log=log), pid_file


def stop_serve(server, pid_file):
    """SIGTERM to rank 0 (it drains and ends every rank): mpirun's exit code, or None when the
    pid could not be read or the job outlived 60 s (then it is killed)."""
    try:
        os.kill(int(open(pid_file).read()), signal.SIGTERM)
        return server.wait(timeout=60)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        server.kill()
        server.wait()
        return None


def stop_serve_cleanly(server, pid_file):
    """stop_serve, failing the test unless every rank exited 0."""
    code = stop_serve(server, pid_file)
    if code is None:
        fail("the server did not stop on SIGTERM")
    if code != 0:
        fail(f"the server exited {code} after SIGTERM")


def http(port, method, path, body=None, timeout=120):
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def complete(port, body):
    """POST /v1/completions: the answer's JSON; fails on any status but 200."""
    status, text = http(port, "POST", "/v1/completions", body)
    if status != 200:
        fail(f"{json.dumps(body)[:160]}: {status} {text}")
    return json.loads(text)


def metric(port, name):
    """One unlabelled series of /metrics; fails when it is missing."""
    _, text = http(port, "GET", "/metrics")
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    fail(f"/metrics lacks {name}")


def parent_pid(pid):
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def rank_pid(rank, launcher):
    """The pid of world rank `rank` of the cpfill serve that `launcher` (mpirun's pid) started:
    only its own descendants, so that two suites on one host never signal each other's servers."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if not (len(cmd) > 1 and cmd[0].endswith(b"cpfill") and cmd[1] == b"serve" and
                f"OMPI_COMM_WORLD_RANK={rank}".encode() in env):
            continue
        ancestor = int(pid)
        while ancestor not in (None, 0, 1, launcher):
            ancestor = parent_pid(ancestor)
        if ancestor == launcher:
            return int(pid)
    return None


def read_logits(path):
    """[sequences][vocab] float32 from `cpfill prefill --save-logits` (safetensors)."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    info = header["logits"]
    rows, cols = info["shape"]
    b, _ = info["data_offsets"]
    data = raw[8 + n + b:8 + n + b + rows * cols * 4]
    flat = struct.unpack(f"<{rows * cols}f", data)
    return [flat[i * cols:(i + 1) * cols] for i in range(rows)]


def top_logprobs(logits, k):
    m = max(logits)
    log_z = m + math.log(sum(math.exp(x - m) for x in logits))
    order = sorted(range(len(logits)), key=lambda i: -logits[i])[:k]
    return {f"token_id:{i}": logits[i] - log_z for i in order}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cpfill")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()
    cpfill = os.path.abspath(args.cpfill)
    tmp = tempfile.mkdtemp(prefix="cpfill-serve-")
    port_file = os.path.join(tmp, "port")
    log = open(os.path.join(tmp, "serve.log"), "w+")
    env = MPI_ENV
    server = subprocess.Popen(
        ["mpirun", "-np", str(args.ranks), cpfill, "serve", "--model", "tiny", "--tp",
         str(args.tp), "--ranks-per-node", str(args.tp), "--port", "0", "--port-file", port_file,
         "--backend", "cpu", "--threads", "1", "--max-batch-tokens", str(MAX_BATCH),
         "--kv-capacity-tokens", "65536", "--timeout-s", "60"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        run(cpfill, server, port_file, log, tmp, env)
    finally:
        if server.poll() is None:
            server.kill()
        log.seek(0)
        print("---- server log (last 40 lines) ----")
        print("".join(log.readlines()[-40:]))


def run(cpfill, server, port_file, log, tmp, env):
    port = wait_port(server, port_file)
    status, body = http(port, "GET", "/health")
    if status != 200:
        fail(f"/health: {status} {body}")
    status, body = http(port, "GET", "/v1/models")
    if status != 200 or json.loads(body)["data"][0]["id"] != "tiny":
        fail(f"/v1/models: {status} {body}")
    vocab = 1024  # the tiny preset's; token ids below are drawn under it
    rng = random.Random(1)

    # Each client: plain prompts, a 3-turn session, bad requests, interleaved.
    results, errors = {}, []
    lock = threading.Lock()
    bad_sent = [0]

    def client(k):
        r = random.Random(k)
        conversation = []
        for i in range(PLAIN_PER_CLIENT):
            prompt = [r.randrange(vocab) for _ in range(r.choice([1, 7, 33, 130, 400]))]
            status, body = http(port, "POST", "/v1/completions",
                                {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                 "temperature": 0, "logprobs": 5})
            with lock:
                results[("plain", k, i)] = (prompt, status, body)
            if i % 7 == 3 and len(conversation) < 3 * 40:  # a session turn
                said = [r.randrange(vocab) for _ in range(40)]
                conversation = conversation + said
                status, body = http(port, "POST", "/v1/completions",
                                    {"prompt": said, "session": f"c{k}", "logprobs": 5,
                                     "max_tokens": 1, "temperature": 0})
                with lock:
                    results[("turn", k, len(conversation))] = (list(conversation), status, body)
            if i % 5 == 0:  # a bad one, with what its error must say
                bad = [({"prompt": [1, vocab + 5]}, 400, "outside the vocabulary"),
                       ({"prompt": [1], "max_tokens": 0}, 400, "\"max_tokens\""),
                       (b"{not json", 400, "not valid JSON"),
                       ({"prompt": "text"}, 400, "tokenizer"),
                       ({"prompt": [1] * (MAX_BATCH + 1)}, 400, "more than a batch takes")][i // 5 % 5]
                status, body = http(port, "POST", "/v1/completions", bad[0])
                with lock:
                    bad_sent[0] += 1
                    if status != bad[1] or bad[2] not in json.loads(body)["error"]["message"]:
                        errors.append(f"bad request {bad[0]!r:.60}: {status} {body}")

    in_threads(client, range(CLIENTS))
    if errors:
        fail("\n".join(errors[:5]))

    # Sessions: listed, one deleted, an unknown one 404.
    status, body = http(port, "GET", "/v1/sessions")
    held = json.loads(body)["sessions"]
    if sorted(held) != sorted(f"c{k}" for k in range(CLIENTS)):
        fail(f"/v1/sessions: {body}")
    if http(port, "DELETE", "/v1/sessions/c0")[0] != 200:
        fail("DELETE /v1/sessions/c0")
    status, body = http(port, "DELETE", "/v1/sessions/nobody")
    if status != 404 or "no session" not in body:
        fail(f"DELETE unknown session: {status} {body}")
    if http(port, "GET", "/no/such/route")[0] != 404:
        fail("an unknown route is not 404")

    # Every good answer against a one-shot prefill of the same tokens on one rank.
    good = [(key, v) for key, v in sorted(results.items())]
    for key, (prompt, status, body) in good:
        if status != 200:
            fail(f"{key}: {status} {body}")
    tokens_file = os.path.join(tmp, "tokens.json")
    json.dump([prompt for _, (prompt, _, _) in good], open(tokens_file, "w"))
    logits_file = os.path.join(tmp, "logits.safetensors")
    ref = subprocess.run([cpfill, "prefill", "--model", "tiny", "--tokens", tokens_file,
                          "--backend", "cpu", "--save-logits", logits_file],
                         capture_output=True, text=True, env=env)
    if ref.returncode != 0:
        fail(f"reference prefill: {ref.stderr[-500:]}")
    logits = read_logits(logits_file)
    cached_seen = 0
    for (key, (prompt, status, body)), row in zip(good, logits):
        answer = json.loads(body)
        choice = answer["choices"][0]
        want_first = max(range(len(row)), key=lambda i: row[i])
        if choice["token_ids"][0] != want_first:
            fail(f"{key}: first token {choice['token_ids'][0]}, one-shot prefill {want_first}")
        want = top_logprobs(row, 5)
        got = choice["logprobs"]["top_logprobs"][0]
        for tok, lp in want.items():
            if tok not in got or abs(got[tok] - lp) > 1e-3:
                fail(f"{key}: logprob of {tok} {got.get(tok)} vs one-shot {lp}")
        if key[0] == "turn" and key[2] > 40:
            cached_seen += answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    turns = sum(1 for key, _ in good if key[0] == "turn" and key[2] > 40)
    if cached_seen != turns:
        fail(f"only {cached_seen} of {turns} later turns reused their session's KV")

    # /metrics counts what was sent.
    status, text = http(port, "GET", "/metrics")
    def sample(name):
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        fail(f"/metrics lacks {name}")
    answered = sample('cpfill:requests_total{status="ok"}')
    if answered != len(good):
        fail(f"requests ok {answered} != {len(good)}")
    if sample('cpfill:requests_total{status="http_4xx"}') < bad_sent[0] + 2:
        fail("4xx not counted")
    if sample("cpfill:prompt_tokens_total") != sum(
            len(p) if k[0] == "plain" else 40 for k, (p, _, _) in good):
        fail("prompt tokens miscounted")
    print(f"serve_test: {len(good)} good and {bad_sent[0]} bad requests from {CLIENTS} clients: "
          f"answers equal one-shot prefills; {turns} later session turns reused their KV")

    # SIGTERM to rank 0: drain, every rank exits, mpirun 0.
    pid = rank_pid(0, server.pid)
    if pid is None:
        fail("cannot find world rank 0")
    os.kill(pid, signal.SIGTERM)
    try:
        code = server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        fail("SIGTERM did not stop the server within 60 s")
    if code != 0:
        fail(f"the server exited {code} after SIGTERM")
    print("PASS: serve_answers_requests")


if __name__ == "__main__":
    main()
