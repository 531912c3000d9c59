#!/usr/bin/env python3
"""`cpfill serve` against clients that misbehave (standard library only, bounded in count and time).

    python3 tests/serve_adversary_test.py build/cpfill

One server (TP1 x CP2, CPU backend, the tiny preset) with an API key from a file, and the checks,
in order:
  * auth: /health and /metrics open; every other route 401 (authentication_error) without the
    key, with another key or another scheme; the key never in the server's log;
  * pipelining: three requests in one write answered in order; a refused one among them
    answered, then the connection closed: never a request silently dropped;
  * bodies: a Content-Length past --max-body-bytes answered 413 before any of it is sent; a 1 GiB
    chunked body (a bounded client loop) answered 413 with rank 0's RSS peak bounded; a head past
    64 KiB 431; bodies past --max-pending-bytes 503 with Retry-After; a 60 MB body of 30M
    token ids answered 413 naming --max-batch-tokens, rank 0's RSS growth under 192 MiB (a DOM
    took 1.2 GB);
  * memory: after a burst of large bodies rank 0's RSS returns near where it was (malloc_trim);
  * connections: /health within 1 s and a completion answered while 300 clients drip their
    headers; past --max-connections a fast 503; the drips answered 408 and closed;
  * disconnects: 100 clients that hang up mid-generation (streamed or not): running sequences,
    open requests and KV usage back to their baseline within 2 s;
  * drain: SIGTERM with generations running past --drain-timeout-s: each answered 503 (a stream:
    an error event), every rank exits 0.
Prints what it measured.
"""
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_test import MPI_ENV, fail, in_threads, wait_port  # noqa: E402

KEY = "cpfill-test-key-7f3a9c"
MAX_BODY = 64 << 20  # the server's default --max-body-bytes
MAX_PENDING = 128 << 20
HEADER_TIMEOUT_S = 6
DRAIN_TIMEOUT_S = 2
MAX_CONNECTIONS = 400
DRIPS = 300
HANGUPS = 100
RSS_PEAK_BOUND = 256 << 20  # over the baseline, during the 1 GiB chunked body
measured = {}


def request_bytes(method, path, body=None, key=KEY, extra=""):
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if key is not None:
        head += f"Authorization: Bearer {key}\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    head += extra + "\r\n"
    return head.encode() + (body or b"")


class Conn:
    """A client connection that reads whole HTTP responses, keeping what it read past one (the
    start of a pipelined answer) for the next."""

    def __init__(self, port, timeout=30):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.data = b""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.sock.close()

    def send(self, data):
        self.sock.sendall(data)

    def _more(self):
        part = self.sock.recv(65536)
        if not part:
            raise ConnectionError("closed")
        self.data += part

    def response(self, timeout=30):
        """(status, headers, body); status 0 if the connection ended or went silent first."""
        self.sock.settimeout(timeout)
        try:
            while b"\r\n\r\n" not in self.data:
                self._more()
            head, self.data = self.data.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {k.lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:])}
            if headers.get("transfer-encoding") == "chunked":
                while b"0\r\n\r\n" not in self.data:
                    self._more()
                body, self.data = self.data.split(b"0\r\n\r\n", 1)
                return status, headers, body
            length = int(headers.get("content-length", "0"))
            while len(self.data) < length:
                self._more()
            body, self.data = self.data[:length], self.data[length:]
            return status, headers, body
        except (socket.timeout, ConnectionError, OSError):
            return 0, {}, self.data


def call(port, method, path, body=None, key=KEY, timeout=60, extra=""):
    with Conn(port, timeout) as c:
        c.send(request_bytes(method, path, body, key, extra))
        return c.response(timeout)


def metrics(port):
    status, _, body = call(port, "GET", "/metrics", key=None)
    if status != 200:
        fail(f"/metrics: {status}")
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def refused(port, reason):
    return metrics(port)[f'cpfill:http_refused_total{{reason="{reason}"}}']


def rss(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def sampling_rss(pid, action):
    """(action(), rank 0's peak RSS while it ran, sampled every 5 ms). Both run through
    serve_test.in_threads, so a failure of either (fail() included) fails the test."""
    done = threading.Event()
    peak = [rss(pid)]

    def role(name):
        if name == "sample":
            while not done.is_set():
                peak[0] = max(peak[0], rss(pid))
                time.sleep(0.005)
            return None
        try:
            return action()
        finally:
            done.set()
    result, _ = in_threads(role, ["act", "sample"])
    return result, peak[0]


def completion(max_tokens=2, stream=False, prompt=(1, 2, 3, 4)):
    return json.dumps({"prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": stream}).encode()


def check_auth(port):
    for path in ("/health", "/metrics"):
        status, _, _ = call(port, "GET", path, key=None)
        if status != 200:
            fail(f"{path} without a key: {status}")
    for key, extra in ((None, ""), ("wrong-key", ""), (None, f"Authorization: Basic {KEY}\r\n"),
                       (KEY + "x", ""), (KEY[:-1], "")):
        for method, path, body in (("GET", "/v1/models", None),
                                   ("POST", "/v1/completions", completion()),
                                   ("GET", "/v1/sessions", None), ("GET", "/no/route", None)):
            status, _, answer = call(port, method, path, body, key=key, extra=extra)
            error = json.loads(answer)["error"] if answer else {}
            if status != 401 or error.get("type") != "authentication_error":
                fail(f"{method} {path} with key {key!r}: {status} {answer[:200]}")
    status, _, answer = call(port, "POST", "/v1/completions", completion())
    if status != 200:
        fail(f"a completion with the key: {status} {answer[:300]}")
    # The scheme in any case, blanks around the key.
    status, _, _ = call(port, "GET", "/v1/models", key=None,
                        extra=f"authorization: bearer  {KEY} \r\n")
    if status != 200:
        fail(f"lower-case scheme: {status}")
    measured["unauthorized"] = refused(port, "unauthorized")


def check_kv_pull_key(cpfill, port, key_file):
    """`cpfill kv-pull` sends the key: refused by name without it, past the door with it (this
    server has no --kv-handoff, so the request itself is then refused for that)."""
    env = dict(os.environ)
    env.pop("CPFILL_API_KEY", None)
    base = [cpfill, "kv-pull", "--url", f"http://127.0.0.1:{port}", "--prompt-tokens", "8",
            "--timeout-s", "20"]
    for extra, says in (([], "HTTP 401"), (["--api-key-file", key_file], "--kv-handoff")):
        r = subprocess.run(base + extra, capture_output=True, text=True, env=env, timeout=60)
        if r.returncode != 2 or says not in r.stderr:
            fail(f"kv-pull {' '.join(extra) or 'without a key'}: exit {r.returncode}, expected 2 "
                 f"naming {says!r}:\n{r.stderr[-600:]}")


def check_pipelining(port):
    with Conn(port) as c:
        c.send(request_bytes("GET", "/health", key=None) +
               request_bytes("POST", "/v1/completions", completion()) +
               request_bytes("GET", "/v1/models"))
        answers = [c.response() for _ in range(3)]
    kinds = [b'"status"' in body and "health" or b"text_completion" in body and "completion" or
             b'"list"' in body and "models" for _, _, body in answers]
    if [a[0] for a in answers] != [200, 200, 200] or kinds != ["health", "completion", "models"]:
        fail(f"pipelined answers out of order or missing: {[(a[0], a[2][:60]) for a in answers]}")
    # A whole request and the start of the next in one write, the rest of it later.
    with Conn(port) as c:
        second = request_bytes("GET", "/v1/models")
        c.send(request_bytes("GET", "/health", key=None) + second[:20])
        first = c.response(timeout=5)
        time.sleep(0.3)
        c.send(second[20:])
        rest = c.response(timeout=5)
    if first[0] != 200 or rest[0] != 200 or b'"list"' not in rest[2]:
        fail(f"a pipelined head in two parts: {first[0]} {rest[0]} {rest[2][:80]}")
    # A refused request in the middle (its body too large, never sent): answered, then closed.
    with Conn(port) as c:
        c.send(request_bytes("GET", "/health", key=None) +
               (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Length: {MAX_BODY + 1}\r\n\r\n").encode() +
               request_bytes("GET", "/v1/models"))
        statuses = [c.response(timeout=5)[0] for _ in range(3)]
    if statuses != [200, 413, 0]:
        fail(f"pipelined with a refusal: {statuses} (want 200, 413, then the connection closed)")
    measured["pipelining"] = ("3 answered in order; a head split over writes answered; with a "
                              "refusal: 200, 413, then closed")


def check_bodies(port, pid):
    # A fixed length past the limit: 413 at once, before any of the body is sent.
    with Conn(port) as c:
        start = time.time()
        c.send((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Length: {2 << 30}\r\n\r\n").encode())
        status, headers, body = c.response(timeout=5)
        if status != 413 or "--max-body-bytes" not in body.decode():
            fail(f"a 2 GiB Content-Length: {status} {body[:200]}")
        measured["fixed_413_ms"] = round((time.time() - start) * 1e3, 1)
    # With Expect: 100-continue the refusal comes instead of "100 Continue".
    with Conn(port) as c:
        c.send((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Length: {MAX_BODY + 10}\r\nExpect: 100-continue\r\n\r\n").encode())
        status, _, _ = c.response(timeout=5)
        if status != 413:
            fail(f"Expect: 100-continue past the limit: {status}")
    # A head past 64 KiB: 431.
    with Conn(port) as c:
        try:
            c.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" +
                   b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(80)) + b"\r\n")
        except ConnectionError:
            pass
        status, _, _ = c.response(timeout=5)
        if status != 431:
            fail(f"a 80 KB head: {status}")
    # 1 GiB chunked, 1 MiB at a time, stopped by the answer.
    base = rss(pid)

    def send_chunked():
        chunk = b"%x\r\n" % (1 << 20) + b"1," * (1 << 19) + b"\r\n"
        sent = 0
        status = 0
        with Conn(port) as c:
            s = c.sock
            s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                       f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                       "Transfer-Encoding: chunked\r\n\r\n").encode())
            s.setblocking(False)
            for _ in range(1024 * 64):  # at most 1 GiB of 1 MiB chunks, sent in parts
                readable, writable, _ = select.select([s], [s], [], 10)
                if readable:
                    break
                if not writable:
                    fail("the server neither read the chunked body nor answered for 10 s")
                try:
                    sent += s.send(chunk[sent % len(chunk):])
                except BlockingIOError:
                    continue
                except ConnectionError:
                    break
                if sent >= 1024 * len(chunk):
                    break
            s.setblocking(True)
            status, _, body = c.response(timeout=10)
        return status, body, sent

    (status, body, sent), peak = sampling_rss(pid, send_chunked)
    if status != 413 or b"chunked body is larger" not in body:
        fail(f"1 GiB chunked body: {status} {body[:200]}")
    measured["chunked"] = {"sent_mib_before_413": round(sent / 2**20, 1),
                           "rss_base_mib": round(base / 2**20, 1),
                           "rss_peak_mib": round(peak / 2**20, 1)}
    if peak - base > RSS_PEAK_BOUND:
        fail(f"rank 0's RSS grew {(peak - base) >> 20} MiB during a chunked body (bound "
             f"{RSS_PEAK_BOUND >> 20})")
    # The pending budget: two declared bodies of 60 MiB fit 128 MiB, a third is 503.
    held = []
    for i in range(3):
        c = Conn(port)
        c.send((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Length: {60 << 20}\r\n\r\n[").encode())
        held.append(c)
        time.sleep(0.2)
    status, headers, body = held[2].response(timeout=5)
    if status != 503 or headers.get("retry-after") != "1" or b"--max-pending-bytes" not in body:
        fail(f"past --max-pending-bytes: {status} {headers} {body[:200]}")
    if metrics(port)["cpfill:http_pending_body_bytes"] != 2 * (60 << 20):
        fail("two 60 MiB bodies are not what the budget holds")
    for c in held:
        c.sock.close()
    deadline = time.time() + 5
    while metrics(port)["cpfill:http_pending_body_bytes"] != 0:
        if time.time() > deadline:
            fail("the budget was not given back when the clients left")
        time.sleep(0.05)


# Rank 0's growth while it reads and refuses a 60 MB body of token ids: the body itself (60 MB),
# cpp-httplib's copy as it reads (up to as much again), the ids parsed before the limit (a few
# hundred KB). A DOM took over 1 GB.
TOKEN_BODY_RSS_BOUND = 192 << 20


def check_token_id_body(port, pid):
    """A 60 MB body of 30M token ids: refused (413 naming --max-batch-tokens) as soon as the SAX
    parse passes the limit, rank 0's RSS sampled throughout."""
    ids = 30_000_000
    body = b'{"max_tokens": 1, "prompt": [' + b"1," * (ids - 1) + b"1]}"
    base = rss(pid)
    (status, _, answer), peak = sampling_rss(
        pid, lambda: call(port, "POST", "/v1/completions", body, timeout=120))
    if status != 413 or b"--max-batch-tokens" not in answer:
        fail(f"a 60 MB token-id body: {status} {answer[:300]}")
    measured["token_id_body"] = {"body_mib": round(len(body) / 2**20, 1),
                                 "rss_base_mib": round(base / 2**20, 1),
                                 "rss_peak_mib": round(peak / 2**20, 1)}
    if peak - base > TOKEN_BODY_RSS_BOUND:
        fail(f"rank 0's RSS grew {(peak - base) >> 20} MiB while a 60 MB token-id body was read "
             f"and refused (bound {TOKEN_BODY_RSS_BOUND >> 20})")


def check_memory_returns(port, pid):
    """Bursts of 16 concurrent 2 MiB bodies (prompts too long for a batch: parsed, refused): the
    first and the second each leave rank 0's RSS within 10% of where it started (worker threads
    and their arenas touched once: see RunServeCommand's mallopt)."""
    body = json.dumps({"prompt": list(range(1000)) * 400, "max_tokens": 1}).encode()

    def burst():
        trims = metrics(port)["cpfill:http_memory_trims_total"]
        statuses = []

        def client():
            statuses.append(call(port, "POST", "/v1/completions", body)[0])
        threads = [threading.Thread(target=client) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if statuses != [413] * 16:  # past --max-batch-tokens, refused while parsed
            fail(f"the burst's answers: {statuses}")
        deadline = time.time() + 5
        while metrics(port)["cpfill:http_memory_trims_total"] <= trims:
            if time.time() > deadline:
                fail("no malloc_trim within 5 s of the burst")
            time.sleep(0.1)
        return rss(pid)

    first_base = rss(pid)
    base = burst()
    after, peak = sampling_rss(pid, burst)
    measured["burst"] = {"bodies": "16 x %.1f MiB" % (len(body) / 2**20),
                         "rss_before_first_mib": round(first_base / 2**20, 1),
                         "rss_after_first_mib": round(base / 2**20, 1),
                         "rss_peak_second_mib": round(peak / 2**20, 1),
                         "rss_after_second_mib": round(after / 2**20, 1)}
    if base > first_base * 1.10:
        fail(f"RSS after the first burst {base >> 20} MiB, before it {first_base >> 20} MiB")
    if after > first_base * 1.10:
        fail(f"RSS after a second burst {after >> 20} MiB, before the first {first_base >> 20} MiB")


def check_connections(port):
    drips = []
    for i in range(DRIPS):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        drips.append(s)
    opened = time.time()
    worst = 0
    for _ in range(5):
        start = time.time()
        status, _, _ = call(port, "GET", "/health", key=None, timeout=5)
        worst = max(worst, time.time() - start)
        if status != 200:
            fail(f"/health with {DRIPS} dripping clients: {status}")
    if worst > 1:
        fail(f"/health took {worst:.2f} s with {DRIPS} dripping clients")
    start = time.time()
    status, _, _ = call(port, "POST", "/v1/completions", completion(), timeout=10)
    completion_s = time.time() - start
    if status != 200:
        fail(f"a completion with {DRIPS} dripping clients: {status}")
    for s in drips[:50]:  # a byte each
        s.sendall(b"X")
    # Past --max-connections: a 503 at once, before any request.
    extra, fast_503 = [], 0
    for i in range(MAX_CONNECTIONS - DRIPS + 20):
        extra.append(socket.create_connection(("127.0.0.1", port), timeout=10))
    waiting, deadline = set(extra), time.time() + 1  # a fast 503 comes within a second
    while waiting and time.time() < deadline:
        readable, _, _ = select.select(list(waiting), [], [], max(0, deadline - time.time()))
        for s in readable:
            waiting.discard(s)
            try:
                data = s.recv(4096)
            except ConnectionError:
                continue
            fast_503 += data.startswith(b"HTTP/1.1 503") and b"--max-connections" in data
    if fast_503 < 15:
        fail(f"only {fast_503} of {len(extra)} connections past --max-connections got a fast 503")
    for s in extra:
        s.close()
    checks_s = time.time() - opened
    if checks_s > HEADER_TIMEOUT_S - 0.5:
        fail(f"the checks took {checks_s:.1f} s, about the header timeout: the drips may be gone")
    # The drips: 408 (their head began) and closed at the header timeout.
    closed, answered_408 = 0, 0
    for s in drips:
        s.settimeout(HEADER_TIMEOUT_S + 3 - (time.time() - opened))
        try:
            data = s.recv(4096)
            answered_408 += data.startswith(b"HTTP/1.1 408")
            while data:
                data = s.recv(4096)
            closed += 1
        except (socket.timeout, ValueError):
            pass
        except ConnectionError:
            closed += 1
        s.close()
    if closed != DRIPS or answered_408 != DRIPS:
        fail(f"of {DRIPS} dripping clients {answered_408} got 408 and {closed} were closed")
    measured["drips"] = {"clients": DRIPS, "health_worst_ms": round(worst * 1e3, 1),
                         "completion_ms": round(completion_s * 1e3, 1),
                         "fast_503": f"{fast_503} of {len(extra)}", "checks_s": round(checks_s, 2),
                         "closed_after_s": round(time.time() - opened, 2)}


def check_hangups(port):
    base = metrics(port)
    socks = []
    for i in range(HANGUPS):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(request_bytes("POST", "/v1/completions",
                                completion(max_tokens=5000, stream=i % 3 == 0,
                                           prompt=[(i * 7 + j) % 1000 for j in range(16)])))
        socks.append(s)
    deadline = time.time() + 20
    while metrics(port)["cpfill:num_requests_running"] < 50:
        if time.time() > deadline:
            fail("the generations did not start")
        time.sleep(0.1)
    during = metrics(port)
    for s in socks:
        s.close()
    left = time.time()
    while True:
        m = metrics(port)
        if (m["cpfill:num_requests_running"] == 0 and m["cpfill:num_requests_waiting"] == 0 and
                m["cpfill:num_http_requests_open"] == 0 and
                m["cpfill:kv_cache_usage_ratio"] <= base["cpfill:kv_cache_usage_ratio"]):
            break
        if time.time() - left > 2:
            fail(f"2 s after {HANGUPS} clients hung up: running "
                 f"{m['cpfill:num_requests_running']}, waiting {m['cpfill:num_requests_waiting']},"
                 f" open {m['cpfill:num_http_requests_open']}, KV "
                 f"{m['cpfill:kv_cache_usage_ratio']} (baseline "
                 f"{base['cpfill:kv_cache_usage_ratio']})")
        time.sleep(0.02)
    measured["hangups"] = {"clients": HANGUPS,
                           "running_when_hung_up": during["cpfill:num_requests_running"],
                           "kv_usage_when_hung_up": round(during["cpfill:kv_cache_usage_ratio"], 4),
                           "back_to_baseline_ms": round((time.time() - left) * 1e3, 1)}


def check_drain(port, server, pid):
    answers = []

    def client(stream):
        answers.append((stream, call(port, "POST", "/v1/completions",
                                     completion(max_tokens=50000, stream=stream), timeout=30)))
    threads = [threading.Thread(target=client, args=(i == 0,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.time() + 20
    while metrics(port)["cpfill:num_requests_running"] < 3:
        if time.time() > deadline:
            fail("the drain's generations did not start")
        time.sleep(0.05)
    start = time.time()
    os.kill(pid, signal.SIGTERM)
    time.sleep(0.5)
    status, _, _ = call(port, "GET", "/health", key=None, timeout=5)
    if status != 503:
        fail(f"/health while draining: {status}")
    for t in threads:
        t.join(timeout=DRAIN_TIMEOUT_S + 10)
    answered_s = time.time() - start
    for stream, (status, _, body) in answers:
        text = body.decode(errors="replace")
        if stream and not (status == 200 and "drain deadline" in text and "[DONE]" in text):
            fail(f"a stream past the drain deadline: {status} {text[-300:]}")
        if not stream and not (status == 503 and "drain deadline" in text):
            fail(f"a completion past the drain deadline: {status} {text[:300]}")
    if len(answers) != 3:
        fail(f"{len(answers)} of 3 generations answered after the drain deadline")
    try:
        code = server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        fail("the server did not exit after its drain deadline")
    if code != 0:
        fail(f"the server exited {code} after SIGTERM")
    measured["drain"] = {"drain_timeout_s": DRAIN_TIMEOUT_S,
                         "answered_503_after_s": round(answered_s, 2),
                         "exited_after_s": round(time.time() - start, 2)}


def main():
    cpfill = os.path.abspath(sys.argv[1])
    tmp = tempfile.mkdtemp(prefix="cpfill-adversary-")
    port_file, pid_file = os.path.join(tmp, "port"), os.path.join(tmp, "pid")
    key_file = os.path.join(tmp, "key")
    with open(key_file, "w") as f:
        f.write(KEY + "\n")
    log = open(os.path.join(tmp, "serve.log"), "w+")
    env = dict(MPI_ENV)
    env.pop("CPFILL_API_KEY", None)
    server = subprocess.Popen(
        ["mpirun", "-np", "2", cpfill, "serve", "--model", "tiny", "--port", "0", "--port-file",
         port_file, "--pid-file", pid_file, "--backend", "cpu", "--threads", "1",
         "--kv-capacity-tokens", "65536", "--no-prefix-cache", "--timeout-s", "60",
         "--api-key-file", key_file, "--max-connections", str(MAX_CONNECTIONS),
         "--max-pending-bytes", str(MAX_PENDING), "--header-timeout-s", str(HEADER_TIMEOUT_S),
         "--drain-timeout-s", str(DRAIN_TIMEOUT_S)],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    started = time.time()
    try:
        port = wait_port(server, port_file, log=log)
        while not os.path.exists(pid_file) or not open(pid_file).read().strip():
            time.sleep(0.05)
        pid = int(open(pid_file).read())
        for check in (check_auth, check_pipelining):
            check(port)
        check_kv_pull_key(cpfill, port, key_file)
        check_bodies(port, pid)
        check_token_id_body(port, pid)
        check_memory_returns(port, pid)
        check_connections(port)
        check_hangups(port)
        m = metrics(port)
        measured["refused"] = {k.split('"')[1]: v for k, v in m.items()
                               if k.startswith("cpfill:http_refused_total")}
        for reason in ("unauthorized", "body_too_large", "header_too_large", "overloaded",
                       "too_many_connections", "timeout"):
            if measured["refused"][reason] < 1:
                fail(f"/metrics counted no refusal for {reason}")
        check_drain(port, server, pid)
    finally:
        if server.poll() is None:
            server.kill()
        log.seek(0)
        text = log.read()
        print("---- server log (last 15 lines) ----")
        print("\n".join(text.splitlines()[-15:]))
    if KEY in text:
        fail("the API key is in the server's log")
    measured["total_s"] = round(time.time() - started, 1)
    print("serve_adversary_test: PASS")
    print(json.dumps(measured, indent=1))


if __name__ == "__main__":
    main()
