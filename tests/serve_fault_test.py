#!/usr/bin/env python3
"""`cpfill serve` when a rank stops answering or dies (standard library only):

    python3 tests/serve_fault_test.py build/cpfill [--signals STOP,KILL]

For each signal, starts the server on 2 ranks (CPU backend, tiny preset, --timeout-s 6,
--log-json), checks /health is 200 and that the log lines are JSON, starts a generation and a
stream, then signals world rank 1 and asserts that
  * SIGSTOP: /health turns 503, its JSON error naming world rank 1;
  * the generation and the stream under way are answered: the first 503 with a JSON error
    saying the job is ending, naming world rank 1; the stream with an error event, then [DONE];
  * the job ends by itself with a nonzero exit and cpfill's own error naming rank 1 ("stopped
    answering" or "died"), within --timeout-s + 2 s of the signal (a deadline, not a
    benchmark: the time is printed).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from serve_test import MPI_ENV, fail, http, in_threads, rank_pid, wait_port  # noqa: E402

TIMEOUT_S = 6
# The README's promise is --timeout-s + 1 s; one more for a loaded CI machine.
END_BOUND_S = TIMEOUT_S + 2
GENERATION = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3000, "ignore_eos": True}
# What cpfill's own error and the clients' 503 must say of world rank 1, per signal.
RANK_WORDS = {"STOP": "rank 1 stopped answering", "KILL": "rank 1 died"}


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


def client(job):
    """One client of the generation under way: ("plain"|"stream", port)."""
    kind, port = job
    if kind == "stream":
        return stream_text(port)
    try:
        return http(port, "POST", "/v1/completions", GENERATION, TIMEOUT_S + 60)
    except OSError as e:  # a connection cut without an answer
        return None, f"<cut: {e!r}>"


def check_answers(sig, plain, streamed):
    words = RANK_WORDS[sig]
    status, body = plain
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    if status != 503 or not message or "job is ending" not in message or words not in message:
        fail(f"SIG{sig}: the generation under way: {status} {body[:400]}; expected 503 saying "
             f"the job is ending, naming the rank ({words!r})")
    status, text = streamed
    if status != 200 or '"error"' not in text or not text.rstrip().endswith("data: [DONE]"):
        fail(f"SIG{sig}: the stream under way: {status}, ends {text[-400:]!r}; expected an error "
             "event, then [DONE]")
    if words not in text:
        fail(f"SIG{sig}: the stream's error event does not name the rank ({words!r}): "
             f"{text[-400:]!r}")
    print(f"SIG{sig}: answered: 503 \"{message[:200]}\"; the stream with an error event and "
          "[DONE]")


def health_turns_503(port):
    deadline = time.time() + 10
    while time.time() < deadline:
        status, body = http(port, "GET", "/health", timeout=10)
        if status == 503:
            return body
        time.sleep(0.3)
    fail("/health stayed 200 with world rank 1 stopped")


def wait_generating(port, count):
    """Until the server runs `count` requests (bounded)."""
    deadline = time.time() + 30
    while time.time() < deadline:
        status, text = http(port, "GET", "/metrics")
        running = [line for line in text.splitlines()
                   if line.startswith("cpfill:num_requests_running")]
        if running and float(running[0].split()[-1]) >= count:
            return
        time.sleep(0.1)
    fail(f"{count} requests did not start generating within 30 s")


def start_server(cpfill, tmp):
    port_file = os.path.join(tmp, "port")
    server = subprocess.Popen(
        ["mpirun", "-np", "2", cpfill, "serve", "--model", "tiny", "--port", "0", "--port-file",
         port_file, "--backend", "cpu", "--threads", "1", "--kv-capacity-tokens", "4096",
         "--timeout-s", str(TIMEOUT_S), "--log-json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=MPI_ENV)
    return server, wait_port(server, port_file, seconds=120)


def fault(cpfill, sig):
    """One server, world rank 1 signalled with SIG`sig` while two generations run."""
    tmp = tempfile.mkdtemp(prefix=f"cpfill-serve-fault-{sig.lower()}-")
    server, port = start_server(cpfill, tmp)
    signalled = None
    try:
        status, body = http(port, "GET", "/health")
        if status != 200:
            fail(f"/health before the fault: {status} {body}")
        status, body = http(port, "POST", "/v1/completions",
                            {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1})
        if status != 200:
            fail(f"a request before the fault: {status} {body}")
        signalled = rank_pid(1, server.pid)
        if signalled is None:
            fail("cannot find world rank 1")
        answers, t0 = {}, []

        def act(job):
            if job != "signal":
                return client(job)
            wait_generating(port, 2)
            os.kill(signalled, getattr(signal, "SIG" + sig))
            t0.append(time.time())
            if sig == "STOP":
                message = json.loads(health_turns_503(port))["error"]["message"]
                if "world rank(s) 1" not in message:
                    fail(f"/health's error does not name world rank 1: {message}")
                print(f"SIGSTOP: /health 503 after {time.time() - t0[0]:.1f} s: {message}")
            try:
                answers["out"], answers["err"] = server.communicate(timeout=TIMEOUT_S + 30)
            except subprocess.TimeoutExpired:
                fail(f"SIG{sig}: the job did not end within --timeout-s {TIMEOUT_S} + 30 s")
            answers["ended_s"] = time.time() - t0[0]

        plain, streamed, _ = in_threads(act, [("plain", port), ("stream", port), "signal"])
        ended_s = answers["ended_s"]
        print(f"SIG{sig}: the job ended {ended_s:.1f} s after the signal, exit "
              f"{server.returncode} (bound: --timeout-s {TIMEOUT_S} + 2 s)")
        check_answers(sig, plain, streamed)
        check_end(sig, server.returncode, ended_s, answers["out"], answers["err"])
    finally:
        if signalled is not None:
            try:
                os.kill(signalled, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if server.poll() is None:
            server.kill()
            server.wait()


def check_end(sig, returncode, ended_s, out, err):
    if ended_s > END_BOUND_S:
        fail(f"SIG{sig}: the job ended {ended_s:.1f} s after the signal, past --timeout-s "
             f"{TIMEOUT_S} + 2 s:\n{err[-2000:]}")
    if returncode == 0:
        fail(f"SIG{sig}: the job exited 0 with a rank gone")
    own = [line for line in err.splitlines() if line.startswith("cpfill: error")]
    if not any(RANK_WORDS[sig] in line for line in own):
        fail(f"SIG{sig}: cpfill's own error does not say {RANK_WORDS[sig]!r}:\n{err[-2000:]}")
    events = [json.loads(line)["event"] for line in out.splitlines() if line.startswith("{")]
    if "listening" not in events or "batch" not in events:
        fail(f"--log-json lines missing (events {events}):\n{out[-2000:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cpfill")
    ap.add_argument("--signals", default="STOP,KILL")
    args = ap.parse_args()
    for sig in args.signals.split(","):
        fault(os.path.abspath(args.cpfill), sig)
    print("PASS: serve_rank_faults")


if __name__ == "__main__":
    main()
