#!/usr/bin/env python3
"""`cpfill serve` when a rank stops answering (standard library only):

    python3 tests/serve_fault_test.py build/cpfill [--log-json]

Starts the server on 2 ranks (CPU backend, tiny preset, --timeout-s 6, --log-json), checks
/health is 200 and that the log lines are JSON, then stops world rank 1 with SIGSTOP and
asserts that
  * /health turns 503 within a few seconds, its JSON error naming world rank 1;
  * a generation and a stream under way when the rank stopped are answered: the first 503 with
    a JSON error saying the job is ending, naming the rank; the stream with an error event,
    then [DONE];
  * the job ends by itself with a nonzero exit and an error naming rank 1, within --timeout-s
    plus a margin (the engine's heartbeat misses its deadline).
"""
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from serve_test import MPI_ENV, fail, http, rank_pid, wait_port  # noqa: E402

GENERATION = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3000, "ignore_eos": True}


def stream_text(port):
    """The raw body of a streamed generation, read until the server closes it."""
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S + 60)
    conn.request("POST", "/v1/completions", json.dumps(dict(GENERATION, stream=True)),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    chunks = []
    try:
        while True:
            chunk = r.read1(65536)
            if not chunk:
                break
            chunks.append(chunk)
    except (OSError, http.client.HTTPException) as e:
        chunks.append(f"\n<cut: {e!r}>".encode())
    return r.status, b"".join(chunks).decode(errors="replace")


def check_answers(plain, streamed):
    status, body = plain
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    if status != 503 or not message or "job is ending" not in message or "rank" not in message:
        fail(f"the generation under way: {status} {body[:400]}; expected 503 saying the job is "
             "ending, naming the rank")
    status, text = streamed
    if status != 200 or '"error"' not in text or not text.rstrip().endswith("data: [DONE]"):
        fail(f"the stream under way: {status}, ends {text[-400:]!r}; expected an error event, "
             "then [DONE]")
    print(f"answered: 503 \"{message[:160]}\"; the stream with an error event and [DONE]")

TIMEOUT_S = 6


def health_turns_503(port):
    deadline = time.time() + 10
    while time.time() < deadline:
        status, body = http(port, "GET", "/health", timeout=10)
        if status == 503:
            return body
        time.sleep(0.3)
    fail("/health stayed 200 with world rank 1 stopped")


def main():
    cpfill = os.path.abspath(sys.argv[1])
    tmp = tempfile.mkdtemp(prefix="cpfill-serve-fault-")
    port_file = os.path.join(tmp, "port")
    env = MPI_ENV
    server = subprocess.Popen(
        ["mpirun", "-np", "2", cpfill, "serve", "--model", "tiny", "--port", "0", "--port-file",
         port_file, "--backend", "cpu", "--threads", "1", "--kv-capacity-tokens", "4096",
         "--timeout-s", str(TIMEOUT_S), "--log-json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stopped = None
    try:
        port = wait_port(server, port_file, seconds=120)
        status, body = http(port, "GET", "/health")
        if status != 200:
            fail(f"/health before the fault: {status} {body}")
        status, body = http(port, "POST", "/v1/completions",
                            {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1})
        if status != 200:
            fail(f"a request before the fault: {status} {body}")
        stopped = rank_pid(1, server.pid)
        if stopped is None:
            fail("cannot find world rank 1")
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
        plain = pool.submit(http, port, "POST", "/v1/completions", GENERATION, TIMEOUT_S + 60)
        streamed = pool.submit(stream_text, port)
        deadline = time.time() + 30
        while time.time() < deadline:  # both generating
            status, text = http(port, "GET", "/metrics")
            running = [line for line in text.splitlines() if line.startswith("cpfill:num_requests_running")]
            if running and float(running[0].split()[-1]) >= 2:
                break
            time.sleep(0.1)
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.time()
        body = health_turns_503(port)
        message = json.loads(body)["error"]["message"]
        if "world rank(s) 1" not in message:
            fail(f"/health's error does not name world rank 1: {message}")
        print(f"/health: 503 after {time.time() - t0:.1f} s: {message}")
        try:
            out, err = server.communicate(timeout=TIMEOUT_S + 30)
        except subprocess.TimeoutExpired:
            fail(f"the job did not end within --timeout-s {TIMEOUT_S} + 30 s")
        print(f"the job ended {time.time() - t0:.1f} s after SIGSTOP, exit {server.returncode}")
        check_answers(plain.result(), streamed.result())
        pool.shutdown()
        if server.returncode == 0:
            fail("the job exited 0 with a rank stopped")
        if "world rank 1" not in err:
            fail(f"the job's error does not name world rank 1:\n{err[-2000:]}")
        events = [json.loads(line)["event"] for line in out.splitlines() if line.startswith("{")]
        if "listening" not in events or "batch" not in events:
            fail(f"--log-json lines missing (events {events}):\n{out[-2000:]}")
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if server.poll() is None:
            server.kill()
    print("PASS: serve_rank_stalls")


if __name__ == "__main__":
    main()
