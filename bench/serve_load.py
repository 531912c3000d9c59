#!/usr/bin/env python3
"""Load generator for `cpfill serve`, in the manner of `vllm bench serve` (standard library only,
so it runs on a GPU host that has nothing but python3).

    python3 bench/serve_load.py --url http://127.0.0.1:8000 --num-requests 64 --rate 2 \\
        --lengths choice:4096,32768,131072 --goodput-ttft-ms 15000 --json load.json

Requests arrive at --rate per second (gaps drawn from a gamma distribution of shape --burstiness:
1 is a Poisson process, below 1 burstier; --rate inf sends them all at once), at most
--max-concurrency in flight. Each is a prefill-only completion (max_tokens 1) of random token ids
in [0, --vocab) whose count comes from --lengths:

    fixed:N                       every prompt N tokens
    uniform:LO:HI                 uniform integers in [LO, HI]
    choice:4096,32768,131072      one of the list, each equally likely
    lognormal:MEDIAN:SIGMA:LO:HI  MEDIAN * exp(SIGMA * N(0, 1)), clipped to [LO, HI]

--sessions K:T makes the K*T requests K conversations of T turns: request i is turn i // K of
session i % K, sends only the turn's new tokens, and waits for the session's previous turn. The
sessions are deleted at the end.

Everything drawn (lengths, gaps, token ids) comes from --seed, so a run repeats; the schedule is
kept on a monotonic clock. The tool waits for GET /health (--health-timeout-s), reads the model's
name from GET /v1/models, snapshots /metrics before and after, and prints progress to stderr
every second. The summary (a table on stdout; with --json, the same as JSON with every request's
record) has requests sent/ok/failed (by HTTP status, with an example message), duration, request,
prompt-token and good throughput, TTFT and queue-time percentiles, the client overhead (client
TTFT minus the server's own prefill time: what "TTFT minus one-shot prefill <= 2 ms + 1%" is
about), per-length rows when there are few lengths, the /metrics deltas, and the command line.

Exit status: 0 when it ran (failed requests are reported, not fatal), 1 when the server never
answered /health or /v1/models, 2 for bad arguments.
"""
import argparse
import http.client
import json
import math
import os
import random
import shlex
import sys
import threading
import time
import urllib.parse

# Per-request fields of the response's "cpfill" object (launch/http/http_api.cc, Timing()).
SERVER_KEYS = ("queue_ms", "ttft_ms", "prefill_ms", "batch_requests", "phases_ms", "algorithm",
               "recomputed_session")
# The target the overhead is checked against: client TTFT - prefill <= 2 ms + 1% of prefill.
OVERHEAD_MS, OVERHEAD_SHARE = 2.0, 0.01
# Per-length rows: exact lengths when the run has at most this many, else power-of-two bins.
MAX_LENGTH_ROWS = 8


# ---- arguments -------------------------------------------------------------------------------

class LengthSpec:
    """A prompt-length distribution parsed from SPEC; draw(rng) gives one length in tokens."""

    def __init__(self, spec):
        self.spec = spec
        kind, _, rest = spec.partition(":")
        parts = rest.split(":") if rest else []
        parse = {"fixed": self._fixed, "uniform": self._uniform, "choice": self._choice,
                 "lognormal": self._lognormal}.get(kind)
        if parse is None:
            raise ValueError(f"unknown kind '{kind}' (fixed, uniform, choice, lognormal)")
        parse(parts)

    @staticmethod
    def _ints(values, what):
        try:
            out = [int(v) for v in values]
        except ValueError:
            raise ValueError(f"{what} must be integers, got {':'.join(values)}") from None
        if any(v < 1 for v in out):
            raise ValueError(f"{what} must be at least 1 token")
        return out

    def _fixed(self, parts):
        if len(parts) != 1:
            raise ValueError("fixed:N takes one length")
        (n,) = self._ints(parts, "fixed:N")
        self.lo = self.hi = n
        self.draw = lambda rng: n

    def _uniform(self, parts):
        if len(parts) != 2:
            raise ValueError("uniform:LO:HI takes two lengths")
        self.lo, self.hi = self._ints(parts, "uniform:LO:HI")
        if self.lo > self.hi:
            raise ValueError(f"uniform: LO {self.lo} > HI {self.hi}")
        self.draw = lambda rng: rng.randint(self.lo, self.hi)

    def _choice(self, parts):
        if len(parts) != 1 or not parts[0]:
            raise ValueError("choice:A,B,... takes a comma-separated list")
        values = self._ints(parts[0].split(","), "choice lengths")
        self.lo, self.hi = min(values), max(values)
        self.draw = lambda rng: rng.choice(values)

    def _lognormal(self, parts):
        if len(parts) != 4:
            raise ValueError("lognormal:MEDIAN:SIGMA:LO:HI takes four numbers")
        try:
            median, sigma = float(parts[0]), float(parts[1])
        except ValueError:
            raise ValueError("lognormal: MEDIAN and SIGMA must be numbers") from None
        if not (median > 0 and sigma >= 0 and math.isfinite(median * sigma)):
            raise ValueError("lognormal: MEDIAN must be > 0 and SIGMA >= 0")
        self.lo, self.hi = self._ints(parts[2:], "lognormal LO:HI")
        if self.lo > self.hi:
            raise ValueError(f"lognormal: LO {self.lo} > HI {self.hi}")
        self.draw = lambda rng: min(self.hi, max(self.lo, round(
            median * math.exp(sigma * rng.gauss(0.0, 1.0)))))


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="serve_load.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--num-requests", type=int, metavar="N",
                    help="requests to send (with --sessions: K*T)")
    ap.add_argument("--rate", type=float, required=True, metavar="R",
                    help="mean arrivals per second; inf sends every request at once")
    ap.add_argument("--burstiness", type=float, default=1.0, metavar="K",
                    help="gamma shape of the gaps: 1 = Poisson, < 1 burstier, > 1 more even [1]")
    ap.add_argument("--lengths", required=True, type=length_spec, metavar="SPEC",
                    help="prompt lengths (see above)")
    ap.add_argument("--max-concurrency", type=int, metavar="C",
                    help="requests in flight at most (default: no cap)")
    ap.add_argument("--seed", type=int, default=0, metavar="S",
                    help="seed of lengths, gaps and token ids [0]")
    ap.add_argument("--goodput-ttft-ms", type=float, metavar="MS",
                    help="TTFT SLO for goodput, ms (default: no goodput)")
    ap.add_argument("--sessions", type=sessions_spec, metavar="K:T",
                    help="K sessions of T turns (see above)")
    ap.add_argument("--vocab", type=int, metavar="V",
                    help="token ids are drawn from [0, V); at most the served model's "
                         "vocabulary [the vocab_size /v1/models reports]")
    ap.add_argument("--warmup", type=int, default=0, metavar="N",
                    help="requests sent one at a time before the run, not counted [0]")
    ap.add_argument("--api-key", default=os.environ.get("CPFILL_API_KEY"), metavar="KEY",
                    help="sent as 'Authorization: Bearer KEY' (default: $CPFILL_API_KEY, as the "
                         "server reads it)")
    ap.add_argument("--json", metavar="FILE",
                    help="write the summary and every request's record here")
    ap.add_argument("--aiperf-inputs", metavar="FILE",
                    help="send nothing: write the drawn requests (token-id prompts, streamed) as "
                         "an AIPerf inputs_json dataset (`aiperf profile --input-file FILE "
                         "--custom-dataset-type inputs_json`; a session's turns are one "
                         "conversation) and exit; bench/gpu/serve_load.sh uses it")
    ap.add_argument("--timeout-s", type=float, default=1800, metavar="S",
                    help="per request, seconds [1800]")
    ap.add_argument("--health-timeout-s", type=float, default=600, metavar="S",
                    help="how long to wait for GET /health to answer 200 [600]")
    args = ap.parse_args(argv)
    check_args(ap, args)
    return args


def length_spec(text):
    try:
        return LengthSpec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"'{text}': {e}")


def sessions_spec(text):
    try:
        k, t = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not K:T (two integers)") from None
    if k < 1 or t < 1:
        raise argparse.ArgumentTypeError(f"'{text}': K and T must be at least 1")
    return k, t


def check_args(ap, args):
    """The cross-field rules argparse cannot express; ap.error exits with status 2."""
    url = urllib.parse.urlsplit(args.url)
    if url.scheme != "http" or not url.hostname:
        ap.error(f"--url {args.url}: expected http://HOST:PORT")
    if args.sessions:
        k, t = args.sessions
        if args.num_requests not in (None, k * t):
            ap.error(f"--num-requests {args.num_requests} contradicts --sessions {k}:{t} "
                     f"({k * t} requests); give one of them")
        args.num_requests = k * t
    if args.num_requests is None or args.num_requests < 1:
        ap.error("--num-requests must be at least 1 (or give --sessions K:T)")
    if not args.rate > 0:
        ap.error(f"--rate {args.rate}: must be > 0 (inf: all at once)")
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        ap.error(f"--burstiness {args.burstiness}: must be a finite number > 0")
    for name in ("max_concurrency", "vocab"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.goodput_ttft_ms is not None and not args.goodput_ttft_ms > 0:
        ap.error("--goodput-ttft-ms must be > 0")
    if args.warmup < 0 or not args.timeout_s > 0 or not args.health_timeout_s > 0:
        ap.error("--warmup must be >= 0, --timeout-s and --health-timeout-s > 0")


# ---- the plan: every request drawn before the clock starts ---------------------------------------

def arrival_offsets(n, rate, burstiness, rng):
    """Seconds from the start at which each request arrives. Gamma gaps of shape k and scale
    1/(rate*k) have mean 1/rate whatever k is, so --burstiness changes the spread, not the load."""
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def completion_body(model, tokens, session):
    body = {"model": model, "prompt": tokens, "max_tokens": 1, "temperature": 0}
    if session:
        body["session"] = session
    return json.dumps(body, separators=(",", ":")).encode()


def make_plan(args, model, run_id):
    """One dict per request, in arrival order. Bodies are encoded here, ahead of the clock, so a
    128K-token prompt costs the run nothing but its send. Each stream has its own seeded RNG, so
    the token ids of request i do not depend on how many lengths were drawn before it."""
    lengths_rng = random.Random(f"{args.seed}:lengths")
    arrivals = arrival_offsets(args.num_requests, args.rate, args.burstiness,
                               random.Random(f"{args.seed}:arrivals"))
    k = args.sessions[0] if args.sessions else 0
    plan = []
    for i, at in enumerate(arrivals):
        n = args.lengths.draw(lengths_rng)
        tokens = random.Random(f"{args.seed}:tokens:{i}").choices(range(args.vocab), k=n)
        session = f"load-{run_id}-{i % k}" if k else ""
        plan.append({"index": i, "arrival_s": at, "tokens": n, "session": session,
                     "turn": i // k if k else 0, "after": i - k if k and i >= k else None,
                     "body": completion_body(model, tokens, session)})
    return plan


def write_aiperf_inputs(args, model, run_id):
    """The plan as AIPerf's inputs_json: {"data": [{"session_id", "payloads": [body, ...]}]}.
    AIPerf synthesizes text prompts only (its lengths normal around a mean); a model served
    without a tokenizer (the synthetic presets) takes token ids, which AIPerf sends verbatim from
    here. Arrivals, concurrency and goodput stay AIPerf's (its flags)."""
    sessions = {}
    for p in make_plan(args, model, run_id):
        body = json.loads(p["body"])
        body.update(stream=True, stream_options={"include_usage": True})
        key = p["session"] or f"request-{p['index']}"
        sessions.setdefault(key, []).append(body)
    with open(args.aiperf_inputs, "w") as f:
        json.dump({"data": [{"session_id": k, "payloads": v} for k, v in sessions.items()]}, f)
    print(f"serve_load: {args.num_requests} requests ({len(sessions)} conversations) written to "
          f"{args.aiperf_inputs}", file=sys.stderr)
    return 0


def warmup_bodies(args, model):
    rng = random.Random(f"{args.seed}:warmup")
    out = []
    for _ in range(args.warmup):
        n = args.lengths.draw(rng)
        out.append((n, completion_body(model, rng.choices(range(args.vocab), k=n), "")))
    return out


# ---- HTTP ------------------------------------------------------------------------------------

class Server:
    """The server's address; one connection per call (a request's timing includes its connect,
    as a client's would)."""

    def __init__(self, url, timeout_s, api_key=None):
        u = urllib.parse.urlsplit(url)
        self.host, self.port, self.timeout_s = u.hostname, u.port or 80, timeout_s
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def call(self, method, path, body=None, timeout_s=None):
        """(status, text). Connection errors and timeouts raise OSError."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s or self.timeout_s)
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, path, body=body, headers={**headers, **self.auth})
            resp = conn.getresponse()
            return resp.status, resp.read().decode("utf-8", "replace")
        finally:
            conn.close()


def wait_healthy(server, timeout_s):
    """Polls GET /health until 200 or the deadline; the last answer or error for the message."""
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while True:
        try:
            status, text = server.call("GET", "/health", timeout_s=10)
            if status == 200:
                return None
            last = f"HTTP {status} {text[:200]}"
        except (OSError, http.client.HTTPException) as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            return last
        time.sleep(0.5)


def served_model(server):
    """(model id, max_model_len, vocab_size or None) from /v1/models."""
    status, text = server.call("GET", "/v1/models", timeout_s=30)
    if status != 200:
        raise OSError(f"GET /v1/models: HTTP {status} {text[:200]}")
    model = json.loads(text)["data"][0]
    return model["id"], model.get("max_model_len"), model.get("vocab_size")


def read_metrics(server):
    """{series: value} and {family: type} from the Prometheus text of /metrics; ({}, {}) when it
    cannot be read (the run still counts, only the cross-check is lost)."""
    try:
        status, text = server.call("GET", "/metrics", timeout_s=30)
    except (OSError, http.client.HTTPException):
        return {}, {}
    values, types = {}, {}
    for line in text.splitlines() if status == 200 else []:
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(maxsplit=3)
            types[family] = kind
        elif line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            values[series] = float(value)
    return values, types


def metrics_delta(before, after, types):
    """after - before for counters and the _count/_sum of histograms (gauges are not summed)."""
    def family(series):
        name = series.split("{")[0]
        for suffix in ("_count", "_sum"):
            if name.endswith(suffix) and types.get(name[:-len(suffix)]) == "histogram":
                return name[:-len(suffix)]
        return name
    return {s: v - before.get(s, 0.0) for s, v in after.items()
            if types.get(family(s)) == "counter" or
            (types.get(family(s)) == "histogram" and not s.split("{")[0].endswith("_bucket"))}


# ---- one request -------------------------------------------------------------------------------

def send_completion(server, body):
    """Sends one completion; returns the client-side record fields. The client TTFT is the whole
    exchange: with max_tokens 1 the answer is the first token."""
    rec = {"status": 0, "error": None}
    start = time.perf_counter()
    try:
        status, text = server.call("POST", "/v1/completions", body=body)
    except (OSError, http.client.HTTPException) as e:
        status, text = 0, None
        rec["error"] = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    rec.update(status=status, start=start, end=end, ttft_ms=(end - start) * 1e3)
    if text is not None:
        parse_answer(status, text, rec)
    return rec


def parse_answer(status, text, rec):
    """Fills rec from a response: the server's own timings on success, its message on failure."""
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if status != 200:
        message = answer.get("error", {}).get("message") if isinstance(answer, dict) else None
        rec["error"] = message or text[:300]
        return
    try:
        timing = answer["cpfill"]["prompts"][0]
        rec["server"] = {k: timing[k] for k in SERVER_KEYS if k in timing}
        rec["usage_prompt_tokens"] = answer["usage"]["prompt_tokens"]
        rec["cached_tokens"] = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        rec["first_token"] = answer["choices"][0]["token_ids"][0]
    except (KeyError, IndexError, TypeError):
        rec["status"] = -1  # a 200 without the fields is a failure of the server, not the client
        rec["error"] = f"HTTP 200 but the answer lacks usage/cpfill fields: {text[:300]}"


# ---- the run -----------------------------------------------------------------------------------

class Run:
    """Dispatches the plan on its schedule and collects records; thread-safe counters feed the
    progress line."""

    def __init__(self, server, plan, max_concurrency):
        self.server, self.plan = server, plan
        # A turn waits at most this long for the previous one, which its own timeout ends first.
        self.turn_wait_s = server.timeout_s + 60
        self.records = [None] * len(plan)
        self.done_events = [threading.Event() for _ in plan]
        self.slots = threading.Semaphore(max_concurrency) if max_concurrency else None
        self.lock = threading.Lock()
        self.sent = self.done = self.failed = 0
        self.t0 = None

    def worker(self, item):
        """Waits for the session's previous turn (a turn extends what that one left in the KV
        cache), sends, records, and frees its slot."""
        try:
            if item["after"] is not None:
                self.done_events[item["after"]].wait(self.turn_wait_s)
            rec = {k: item[k] for k in ("index", "session", "turn", "arrival_s")}
            rec["prompt_tokens"] = item["tokens"]
            rec.update(send_completion(self.server, item["body"]))
            rec.update(start_s=rec.pop("start") - self.t0, end_s=rec.pop("end") - self.t0)
            self.records[item["index"]] = rec
            with self.lock:
                self.done += 1
                self.failed += rec["status"] != 200
        finally:
            self.done_events[item["index"]].set()
            if self.slots:
                self.slots.release()

    def dispatch(self):
        """Starts each request's thread at its arrival time (or when a slot frees, with
        --max-concurrency); returns the threads. Ctrl-C stops sending; what was sent finishes."""
        threads = []
        try:
            for item in self.plan:
                delay = self.t0 + item["arrival_s"] - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                if self.slots:
                    self.slots.acquire()
                t = threading.Thread(target=self.worker, args=(item,), daemon=True)
                t.start()
                threads.append(t)
                with self.lock:
                    self.sent += 1
        except KeyboardInterrupt:
            print("serve_load: interrupted; waiting for the requests in flight", file=sys.stderr)
        return threads

    def progress(self, stop):
        """A line on stderr every second until stop is set."""
        while not stop.wait(1.0):
            with self.lock:
                sent, done, failed = self.sent, self.done, self.failed
            print(f"serve_load: {time.perf_counter() - self.t0:7.1f} s  sent {sent}/"
                  f"{len(self.plan)}  done {done}  failed {failed}  in flight {sent - done}",
                  file=sys.stderr, flush=True)

    def execute(self):
        stop = threading.Event()
        reporter = threading.Thread(target=self.progress, args=(stop,), daemon=True)
        self.t0 = time.perf_counter()
        reporter.start()
        threads = self.dispatch()
        for t in threads:
            t.join(self.turn_wait_s)  # the request's own timeout ends it first
        stop.set()
        reporter.join()
        return [r for r in self.records if r is not None]


def run_warmup(server, bodies):
    """Sent one at a time before the measured run (first use of a length allocates workspace and
    picks kernels); returns their TTFTs and statuses for the record."""
    out = []
    for n, body in bodies:
        rec = send_completion(server, body)
        out.append({"prompt_tokens": n, "status": rec["status"], "ttft_ms": rec["ttft_ms"],
                    "error": rec["error"]})
        print(f"serve_load: warm-up {len(out)}/{len(bodies)}: {n} tokens, HTTP {rec['status']}, "
              f"{rec['ttft_ms']:.1f} ms", file=sys.stderr, flush=True)
    return out


def delete_sessions(server, plan):
    """Frees the run's sessions' KV on the server (best effort: a session may have been evicted)."""
    for name in sorted({item["session"] for item in plan if item["session"]}):
        try:
            server.call("DELETE", f"/v1/sessions/{urllib.parse.quote(name)}", timeout_s=60)
        except (OSError, http.client.HTTPException):
            pass


# ---- the summary -------------------------------------------------------------------------------

def percentile(sorted_values, q):
    """Linear interpolation between the closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def stats(values):
    """mean, p50, p90, p99, min, max of a list; None when empty."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    out = {"count": len(v), "mean": sum(v) / len(v)}
    out.update({f"p{q}": percentile(v, q) for q in (50, 90, 99)})
    out.update(min=v[0], max=v[-1])
    return out


def server_field(rec, key):
    return rec.get("server", {}).get(key)


def overhead_ms(rec, key="prefill_ms"):
    """Client TTFT minus one of the server's times for the same request."""
    t = server_field(rec, key)
    return None if t is None else rec["ttft_ms"] - t


def within_target(rec):
    o, prefill = overhead_ms(rec), server_field(rec, "prefill_ms")
    return o is not None and o <= OVERHEAD_MS + OVERHEAD_SHARE * prefill


def latency_block(ok):
    """The per-request latency distributions the summary and the per-length rows share."""
    return {
        "ttft_ms": stats(r["ttft_ms"] for r in ok),
        "server_ttft_ms": stats(server_field(r, "ttft_ms") for r in ok),
        "queue_ms": stats(server_field(r, "queue_ms") for r in ok),
        "prefill_ms": stats(server_field(r, "prefill_ms") for r in ok),
        "overhead_ms": stats(overhead_ms(r) for r in ok),
        "overhead_vs_server_ttft_ms": stats(overhead_ms(r, "ttft_ms") for r in ok),
        "batch_requests": stats(server_field(r, "batch_requests") for r in ok),
        "overhead_within_target": sum(within_target(r) for r in ok),
    }


def failure_class(status):
    return {0: "no response", -1: "bad answer"}.get(status, f"HTTP {status}")


def failures_by_status(failed):
    """{"HTTP 503": {"count", "example"}, ...}: one message per class is enough to see why."""
    out = {}
    for r in failed:
        entry = out.setdefault(failure_class(r["status"]), {"count": 0, "example": r["error"]})
        entry["count"] += 1
    return out


def summarize(args, records, sent_at, duration_s):
    ok = [r for r in records if r["status"] == 200]
    failed = [r for r in records if r["status"] != 200]
    tokens = sum(r["prompt_tokens"] for r in ok)
    good = None
    if args.goodput_ttft_ms is not None:
        good = sum(r["ttft_ms"] <= args.goodput_ttft_ms for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    out = {
        "requests": {"planned": args.num_requests, "sent": len(records), "ok": len(ok),
                     "failed": len(failed), "failures_by_status": failures_by_status(failed)},
        "started_at": sent_at,
        "duration_s": duration_s,
        "request_throughput": per_s(len(ok)),
        "prompt_token_throughput": per_s(tokens),
        "prompt_tokens_ok": tokens,
        "cached_tokens_ok": sum(r.get("cached_tokens", 0) for r in ok),
        "goodput": None if good is None else per_s(good),
        "goodput_requests": good,
        "start_delay_ms": stats((r["start_s"] - r["arrival_s"]) * 1e3 for r in records),
    }
    out.update(latency_block(ok))
    groups = length_groups(ok)
    if len(groups) > 1:
        out["by_length"] = {label: latency_block(rs) for label, rs in groups}
    return out


def length_groups(ok):
    """[(label, records)] by prompt length: exact lengths when there are few (a choice: spec),
    else power-of-two bins "2049-4096", so a uniform spec still shows how overhead scales."""
    exact = sorted({r["prompt_tokens"] for r in ok})
    if len(exact) <= MAX_LENGTH_ROWS:
        return [(str(n), [r for r in ok if r["prompt_tokens"] == n]) for n in exact]
    def top(n):
        return 1 << (n - 1).bit_length()
    bins = sorted({top(r["prompt_tokens"]) for r in ok})
    return [(f"{b // 2 + 1}-{b}", [r for r in ok if top(r["prompt_tokens"]) == b]) for b in bins]


def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def latency_rows(s):
    names = [("TTFT (client)", "ttft_ms"), ("TTFT (server)", "server_ttft_ms"),
             ("queue (server)", "queue_ms"), ("prefill (server)", "prefill_ms"),
             ("client - prefill", "overhead_ms"), ("client - server TTFT",
                                                   "overhead_vs_server_ttft_ms")]
    lines = [f"{'ms':<22}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}"]
    for label, key in names:
        d = s.get(key) or {}
        lines.append(f"{label:<22}" + "".join(f"{fmt(d.get(q), 2):>10}"
                                              for q in ("mean", "p50", "p90", "p99", "max")))
    return lines


def length_rows(by_length):
    lines = [f"{'tokens':>12}{'ok':>5}{'TTFT p50':>11}{'p99':>10}{'prefill p50':>13}"
             f"{'overhead p50':>14}{'p99':>9}{'in target':>11}"]
    for n, b in by_length.items():
        t, p, o = b["ttft_ms"], b["prefill_ms"] or {}, b["overhead_ms"] or {}
        lines.append(f"{n:>12}{t['count']:>5}{fmt(t['p50']):>11}{fmt(t['p99']):>10}"
                     f"{fmt(p.get('p50')):>13}{fmt(o.get('p50'), 2):>14}{fmt(o.get('p99'), 2):>9}"
                     f"{b['overhead_within_target']:>8}/{t['count']}")
    return lines


def metrics_line(delta):
    if not delta:
        return "server /metrics: not read"
    def d(name, status=None):
        return int(delta.get(name if status is None else f'{name}{{status="{status}"}}', 0))
    requests = "cpfill:requests_total"
    ok, batches = d(requests, "ok"), d("cpfill:batches_total")
    return (f"server /metrics delta: ok {ok}, failed {d(requests, 'failed')}, "
            f"4xx {d(requests, 'http_4xx')}, 5xx {d(requests, 'http_5xx')}; prompt tokens "
            f"{d('cpfill:prompt_tokens_total')}, cached {d('cpfill:cached_tokens_total')}; "
            f"batches {batches}" + (f" ({ok / batches:.2f} prompts/batch)" if batches else ""))


def print_table(report):
    s, c = report["summary"], report["config"]
    req = s["requests"]
    lines = [f"== cpfill serve load: {report['model']} at {c['url']}, rate {c['rate']}/s, "
             f"lengths {c['lengths']}, concurrency {c['max_concurrency'] or 'unbounded'}",
             f"requests      planned {req['planned']}  sent {req['sent']}  ok {req['ok']}  "
             f"failed {req['failed']}"]
    for status, f in req["failures_by_status"].items():
        lines.append(f"  {status}: {f['count']}, e.g. {str(f['example'])[:150]}")
    lines += [f"duration      {s['duration_s']:.2f} s",
              f"throughput    {fmt(s['request_throughput'], 3)} req/s, "
              f"{fmt(s['prompt_token_throughput'], 0)} prompt tok/s"]
    if c["goodput_ttft_ms"] is not None:
        lines.append(f"goodput       {fmt(s['goodput'], 3)} req/s ({s['goodput_requests']} with "
                     f"TTFT <= {c['goodput_ttft_ms']} ms)")
    lines += latency_rows(s)
    lines.append(f"client - prefill <= {OVERHEAD_MS} ms + {OVERHEAD_SHARE:.0%} of prefill: "
                 f"{s['overhead_within_target']}/{req['ok']}")
    if "by_length" in s:
        lines += length_rows(s["by_length"])
    lines.append(metrics_line(report["metrics"]["delta"]))
    print("\n".join(lines), flush=True)


# ---- main --------------------------------------------------------------------------------------

def config_of(args):
    c = {k: v for k, v in vars(args).items() if k not in ("lengths", "sessions")}
    c["lengths"] = args.lengths.spec
    c["sessions"] = None if not args.sessions else {"count": args.sessions[0],
                                                    "turns": args.sessions[1]}
    c["rate"] = "inf" if math.isinf(args.rate) else args.rate  # JSON has no inf
    return c


def connect(args):
    """The server once healthy, its model and context length; exits 1 when it never is."""
    server = Server(args.url, args.timeout_s, args.api_key)
    problem = wait_healthy(server, args.health_timeout_s)
    try:
        if problem:
            raise OSError(f"GET /health did not answer 200 in {args.health_timeout_s:g} s: "
                          f"{problem}")
        model, max_len, vocab = served_model(server)
    except (OSError, ValueError, KeyError, IndexError, http.client.HTTPException) as e:
        print(f"serve_load: {args.url}: {e}", file=sys.stderr)
        sys.exit(1)
    if args.vocab is None:
        args.vocab = vocab or 128000
    if max_len and args.lengths.hi > max_len:
        print(f"serve_load: warning: --lengths reaches {args.lengths.hi} tokens, past the "
              f"model's max_model_len {max_len}; those requests will fail", file=sys.stderr)
    return server, model, max_len


def main(argv):
    args = parse_args(argv)
    server, model, max_len = connect(args)
    run_id = f"{args.seed}-{os.getpid()}"
    if args.aiperf_inputs:
        return write_aiperf_inputs(args, model, run_id)
    warmup = run_warmup(server, warmup_bodies(args, model))
    print(f"serve_load: drawing {args.num_requests} prompts", file=sys.stderr, flush=True)
    plan = make_plan(args, model, run_id)
    before, types = read_metrics(server)
    sent_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    run = Run(server, plan, args.max_concurrency)
    records = run.execute()
    duration_s = max((r["end_s"] for r in records), default=0.0)
    after, types_after = read_metrics(server)
    delete_sessions(server, plan)
    report = {
        "command": [os.path.basename(sys.executable), sys.argv[0]] + argv,
        "command_line": shlex.join([os.path.basename(sys.executable), sys.argv[0]] + argv),
        "model": model, "max_model_len": max_len, "config": config_of(args),
        "summary": summarize(args, records, sent_at, duration_s),
        "warmup": warmup,
        "metrics": {"before": before, "after": after,
                    "delta": metrics_delta(before, after, {**types, **types_after})},
        "per_request": sorted(records, key=lambda r: r["index"]),
    }
    print_table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
