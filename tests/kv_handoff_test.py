#!/usr/bin/env python3
"""The KV hand-off end to end (standard library and ctypes only):

    python3 tests/kv_handoff_test.py build/cpfill build/lib/libcpfill.so [--transports tcp,sm]
        [--skip-c-api]

For each UCX transport set (tcp: UCX_TLS=tcp over UCX_NET_DEVICES=lo; sm: UCX_TLS=sm,self), given
to the server's ranks and to every puller alike, starts `cpfill serve --kv-handoff` under mpirun
(TP2 x CP2 on 4 ranks, CPU backend, the tiny preset's first 2 layers, leases of 3 s) and checks:
  1. `cpfill kv-pull` verified against a one-rank prefill: TP1 contiguous alone, then three
     pullers at once on different prompts (TP1 contiguous; decode TP2 ranks 0 and 1, paged with
     blocks of 16 and 48 tokens);
  2. after released pulls no lease holds and the KV cache usage is back where it was;
  3. a puller that dies mid-transfer (--exit-mid-pull, exit 3): its lease holds until it expires,
     then the expired counter counts it and the usage is back;
  4. a handle pulled twice (--no-release --handle-out, then --handle-in, which releases), then
     a third time: exit 3, "lease no longer holds" (a stale handle);
  5. forged and truncated handles: bad JSON, a changed compat_hash, a block outside the pool are
     bad input (exit 2); another request's blocks, another rank's transport or another engine's
     id fail the lease record's digest (exit 3, nothing read); a changed lease_nonce on a live
     lease fails its lease check (exit 3) and
     leaves the genuine lease pullable; a changed engine_id pulls but its release is ignored (the
     server logs it) until DELETE /v1/kv/{id} ends the lease; DELETE again and a renew of an
     unknown lease are 404; a renew of a live one is 200 with lease_s;
  6. completions with do_remote_decode that cannot be handed off are refused with a 400 naming
     why (max_tokens 5, a session, two prompts, stream, a non-boolean);
  7. the C API (libcpfill.so through ctypes, in a child process so that each pass's UCX
     environment is its own and a hang cannot outlive its timeout): a live handle parsed, pulled
     TP1 contiguous into poisoned memory byte-equal to `kv-pull --dump` of the same handle, pulled
     as decode TP2 ranks 0 and 1 into paged pools with shuffled block tables and reassembled
     equal too (nothing written outside the table's rows), garbage refused with
     CPFILL_INVALID_ARGUMENT and a message, then released (--skip-c-api leaves this out: a
     sanitized libcpfill.so cannot be loaded into Python);
  8. /health is still 200; SIGTERM to rank 0 ends every rank (exit 0); a pull of a handle of the
     stopped server fails with exit 3 within its --timeout-s 5 plus a margin.
The staged pass (tcp) copies each hand-off into a small host staging pool first, as a GPU server
does where UCX cannot read GPU memory, and adds a hand-off the pool cannot take (exit 2). Last, a
one-rank server's KV must equal a one-rank prefill's bit for bit (same thread count).
"""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_test import MPI_ENV, fail, http, wait_port  # noqa: E402

LAYERS = 2
LEASE_S = 5  # short for the expiry scenario; a loaded 2-core CI machine once needed more than 3
PULL_TIMEOUT_S = 30     # kv-pull's --timeout-s for pulls expected to succeed
DEAD_TIMEOUT_S = 5      # kv-pull's --timeout-s against the stopped server
PROCESS_TIMEOUT_S = 120  # any child process of the test
TRANSPORTS = {"tcp": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"},
              "sm": {"UCX_TLS": "sm,self"},
              "staged": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}}
# The staged pass copies each hand-off into a host staging pool first (what a GPU server does
# with a UCX that cannot read GPU memory), a small one: 1024 tokens per rank.
STAGING_TOKENS = 1024
SERVER_FLAGS = {"staged": ["--kv-handoff-staging", "--kv-staging-tokens", str(STAGING_TOKENS)]}

# cpfill.h's status codes used here.
CPFILL_OK = 0
CPFILL_INVALID_ARGUMENT = 1


# ---- the server and its metrics -------------------------------------------------------------

class Server:
    """`cpfill serve --kv-handoff` under mpirun with one pass's UCX environment."""

    def __init__(self, cpfill, tmp, env, extra_flags=(), np=4, tp=2, prefix_cache=False):
        self.port_file = os.path.join(tmp, "port")
        self.pid_file = os.path.join(tmp, "pid")
        self.log_path = os.path.join(tmp, "serve.log")
        self.log = open(self.log_path, "w+")
        forward = []
        for name in sorted(k for k in env if k.startswith("UCX_")):
            forward += ["-x", name]
        self.proc = subprocess.Popen(
            ["mpirun", "--oversubscribe", "-np", str(np)] + forward +
            [cpfill, "serve", "--model", "tiny", "--layers", str(LAYERS), "--tp", str(tp),
             "--host", "127.0.0.1", "--port", "0", "--port-file", self.port_file,
             "--pid-file", self.pid_file, "--kv-handoff", "--kv-lease-s", str(LEASE_S),
             "--kv-capacity-tokens", "4096", "--backend", "cpu", "--threads", "1",
             # The prefix cache would keep the prompts' KV after their leases end; most passes
             # check that a lease's KV is freed (usage back at 0).
             "--timeout-s", "60"] + ([] if prefix_cache else ["--no-prefix-cache"]) +
            list(extra_flags),
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.port = None
        self.staged = "--kv-handoff-staging" in extra_flags

    def wait_listening(self):
        self.port = wait_port(self.proc, self.port_file, seconds=120, log=self.log)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def log_text(self):
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def metrics(self):
        status, text = http(self.port, "GET", "/metrics", timeout=30)
        if status != 200:
            fail(f"/metrics: {status} {text[:300]}")
        values = {}
        for line in text.splitlines():
            if line.startswith(("cpfill:kv_", "cpfill:prefix_cache_")):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        for name in ("cpfill:kv_leases", "cpfill:kv_leased_tokens", "cpfill:kv_cache_usage_ratio",
                     "cpfill:kv_staging_usage_ratio",
                     'cpfill:kv_leases_ended_total{reason="released"}',
                     'cpfill:kv_leases_ended_total{reason="expired"}'):
            if name not in values:
                fail(f"/metrics lacks {name}:\n{text[-1500:]}")
        return values

    def leases(self):
        return self.metrics()["cpfill:kv_leases"]

    def wait_metrics(self, what, ok, seconds):
        """Polls /metrics until ok(values); fails naming `what` and the last values."""
        deadline = time.time() + seconds
        while True:
            values = self.metrics()
            if ok(values):
                return values
            if time.time() > deadline:
                fail(f"{what} within {seconds} s; /metrics: " +
                     ", ".join(f"{k} {v:g}" for k, v in sorted(values.items())))
            time.sleep(0.1)

    def wait_idle(self, usage, what, seconds=10):
        """No lease holds and rank 0's KV usage is `usage` again (the blocks are freed, and the
        lease words revoked, with the engine's next command)."""
        return self.wait_metrics(
            what + ": no lease and the KV usage back at " + f"{usage:g}",
            lambda m: m["cpfill:kv_leases"] == 0 and m["cpfill:kv_cache_usage_ratio"] == usage
            and m["cpfill:kv_staging_usage_ratio"] == 0,
            seconds)

    def renew(self, request_id, nonce):
        status, body = http(self.port, "POST", f"/v1/kv/{request_id}/renew?nonce={nonce}", b"",
                            timeout=30)
        if status != 200:
            fail(f"renew of live lease {request_id}: {status} {body}")
        return json.loads(body)

    def stop(self):
        """SIGTERM to rank 0 (its --pid-file): drains, every rank exits; mpirun's exit code."""
        pid = int(open(self.pid_file).read())
        os.kill(pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            fail("SIGTERM to rank 0 did not stop the server within 60 s")

    def rank0_pid(self):
        """Rank 0's pid from --pid-file while that process is still our `cpfill serve`."""
        try:
            pid = int(open(self.pid_file).read())
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return pid if b"serve" in f.read().split(b"\0") else None
        except (OSError, ValueError):
            return None

    def kill(self):
        """Ends the job whatever its state: SIGTERM to rank 0 (a drain), then to mpirun (which
        kills the ranks), then SIGKILL."""
        if self.proc.poll() is None:
            pid = self.rank0_pid()
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            for stop in (None, self.proc.terminate, self.proc.kill):
                if stop is not None:
                    stop()
                try:
                    self.proc.wait(timeout=20)
                    break
                except subprocess.TimeoutExpired:
                    pass
        self.log.close()


# ---- kv-pull ----------------------------------------------------------------------------------

class Pull:
    def __init__(self, args, rc, out, err, seconds):
        self.args, self.rc, self.out, self.err, self.seconds = args, rc, out, err, seconds

    def describe(self):
        return (f"`cpfill kv-pull {' '.join(self.args)}` exited {self.rc} after "
                f"{self.seconds:.1f} s\nstdout:\n{self.out[-1500:]}\nstderr:\n{self.err[-1500:]}")


class Puller:
    def __init__(self, cpfill, env):
        self.cpfill, self.env = cpfill, env

    def start(self, args):
        return subprocess.Popen([self.cpfill, "kv-pull"] + args, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=self.env), time.time()

    @staticmethod
    def finish(args, started):
        proc, t0 = started
        try:
            out, err = proc.communicate(timeout=PROCESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            fail(f"`cpfill kv-pull {' '.join(args)}` still ran after {PROCESS_TIMEOUT_S} s:\n"
                 f"{err[-1500:]}")
        return Pull(args, proc.returncode, out, err, time.time() - t0)

    def run(self, args):
        return self.finish(args, self.start(args))

    def verified(self, args, what):
        """A pull with --model that must exit 0 and print its PASS verdict."""
        p = self.run(args)
        if p.rc != 0 or "pull 1/1 of " not in p.out or ": PASS" not in p.out:
            fail(f"{what}: expected exit 0, pulled and verified (PASS):\n{p.describe()}")
        return p

    def expect(self, args, rc, what, stderr_has=None):
        p = self.run(args)
        if p.rc != rc:
            fail(f"{what}: expected exit {rc}:\n{p.describe()}")
        if stderr_has is not None and stderr_has not in p.err:
            fail(f"{what}: stderr lacks \"{stderr_has}\":\n{p.describe()}")
        return p


def verify_flags(seed, tokens):
    return ["--prompt-tokens", str(tokens), "--prompt-seed", str(seed), "--model", "tiny",
            "--layers", str(LAYERS), "--timeout-s", str(PULL_TIMEOUT_S)]


def released(m):
    return m['cpfill:kv_leases_ended_total{reason="released"}']


def expired(m):
    return m['cpfill:kv_leases_ended_total{reason="expired"}']


def read_handle(path):
    with open(path) as f:
        return json.load(f)


def write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f)
    return path


# ---- the scenarios ----------------------------------------------------------------------------

def scenario_pulls(server, puller):
    """1 and 2: verified pulls, alone and three at once; every lease released and freed."""
    before = server.metrics()
    usage = before["cpfill:kv_cache_usage_ratio"]
    p = puller.verified(["--url", server.url] + verify_flags(1, 300), "TP1 contiguous pull")
    concurrent = [
        verify_flags(2, 300) + ["--layout", "contiguous"],
        verify_flags(3, 211) + ["--decode-tp", "2", "--decode-tp-rank", "0", "--layout", "paged",
                                "--dst-block-tokens", "16"],
        verify_flags(4, 517) + ["--decode-tp", "2", "--decode-tp-rank", "1", "--layout", "paged",
                                "--dst-block-tokens", "48"],
    ]
    concurrent = [["--url", server.url] + a for a in concurrent]
    started = [puller.start(a) for a in concurrent]
    pulls = [Puller.finish(a, s) for a, s in zip(concurrent, started)]
    for q in pulls:
        if q.rc != 0 or ": PASS" not in q.out:
            fail(f"one of three concurrent pulls:\n{q.describe()}")
    print(f"  1. pulls verified against one rank: TP1 contiguous ({p.seconds:.1f} s), then three "
          f"at once (TP1 contiguous, TP2 rank 0 paged/16, TP2 rank 1 paged/48)")
    after = server.wait_idle(usage, "after four released pulls")
    if released(after) - released(before) != 4:
        fail(f"released leases counted {released(after) - released(before):g}, expected 4")
    print(f"  2. after the released pulls: kv_leases 0, usage back to {usage:g}, released +4")
    return usage


def scenario_dies_mid_pull(server, puller, usage):
    """3: a puller that exits after its first prefill rank: the lease holds until it expires."""
    before = server.metrics()
    p = puller.expect(["--url", server.url, "--prompt-tokens", "300", "--prompt-seed", "5",
                       "--exit-mid-pull", "--timeout-s", str(PULL_TIMEOUT_S)], 3,
                      "a puller exiting mid-transfer", stderr_has="--exit-mid-pull")
    held = server.metrics()
    if held["cpfill:kv_leases"] != 1 or held["cpfill:kv_leased_tokens"] != 300:
        fail(f"after a puller died mid-transfer: kv_leases {held['cpfill:kv_leases']:g}, "
             f"kv_leased_tokens {held['cpfill:kv_leased_tokens']:g}; expected 1 and 300")
    # A staged lease holds staging blocks, its KV cache blocks are free at once.
    in_use = ("cpfill:kv_staging_usage_ratio" if server.staged else "cpfill:kv_cache_usage_ratio")
    if held[in_use] <= (0 if server.staged else usage):
        fail(f"a held lease shows no KV in use ({in_use} {held[in_use]:g})")
    if server.staged and held["cpfill:kv_cache_usage_ratio"] != usage:
        fail(f"a staged lease still holds KV cache blocks "
             f"(usage {held['cpfill:kv_cache_usage_ratio']:g}, before {usage:g})")
    t0 = time.time()
    after = server.wait_idle(usage, "a dead puller's lease expiring", seconds=LEASE_S + 10)
    if expired(after) != expired(before) + 1:
        fail(f"expired leases {expired(before):g} -> {expired(after):g}; expected +1")
    if released(after) != released(before):
        fail("an expired lease was counted as released")
    print(f"  3. a puller died mid-transfer (exit 3): lease held, expired {time.time() - t0:.1f} s "
          f"later, expired +1, usage back to {usage:g}")


def scenario_second_puller(server, puller, tmp, usage):
    """4: one handle pulled by two pullers in turn, then once more (stale)."""
    h = os.path.join(tmp, "twice.json")
    puller.verified(["--url", server.url] + verify_flags(6, 300) +
                    ["--no-release", "--handle-out", h], "a pull without release")
    request_id, nonce = read_handle(h)["request_id"], read_handle(h)["lease_nonce"]
    if server.leases() != 1:
        fail("a pull with --no-release left no lease")
    server.renew(request_id, nonce)  # the second pull must find it live on a slow machine too
    p = puller.run(["--handle-in", h, "--timeout-s", str(PULL_TIMEOUT_S)])
    if p.rc != 0 or "pull 1/1 of " not in p.out:
        fail(f"the second puller of a live handle:\n{p.describe()}")
    server.wait_idle(usage, "after the second puller's release")
    puller.expect(["--handle-in", h, "--timeout-s", str(PULL_TIMEOUT_S)], 3,
                  "a third pull of a released handle", stderr_has="lease no longer holds")
    print("  4. one handle pulled twice (the second releases), then refused as stale (exit 3)")


def scenario_forged(server, puller, tmp, usage):
    """5: forged and truncated copies of a live handle; DELETE and renew."""
    h = os.path.join(tmp, "genuine.json")
    p = puller.run(["--url", server.url, "--prompt-tokens", "300", "--prompt-seed", "7",
                    "--no-release", "--handle-out", h, "--timeout-s", str(PULL_TIMEOUT_S)])
    if p.rc != 0:
        fail(f"a pull without release:\n{p.describe()}")
    genuine_text = open(h).read()
    genuine = json.loads(genuine_text)
    request_id, nonce = genuine["request_id"], genuine["lease_nonce"]

    renewed = server.renew(request_id, nonce)
    if renewed.get("renewed") != request_id or renewed.get("lease_s") != LEASE_S:
        fail(f"renew of a live lease: {renewed}; expected renewed {request_id}, lease_s {LEASE_S}")

    def forged(name, change):
        v = json.loads(genuine_text)
        change(v)
        return write_json(os.path.join(tmp, name + ".json"), v)

    truncated = os.path.join(tmp, "truncated.json")
    with open(truncated, "w") as f:
        f.write(genuine_text[:len(genuine_text) // 2])
    hash_flipped = "0" * 16 if genuine["compat_hash"] != "0" * 16 else "1" * 16
    bad_hash = forged("hash", lambda v: v.update(compat_hash=hash_flipped))

    def block_outside(v):
        v["ranks"][1]["blocks"][0] = v["ranks"][1]["pool"]["num_blocks"]

    bad_block = forged("block", block_outside)
    for path, what, says in [(truncated, "a truncated handle", "json"),
                             (bad_hash, "a changed compat_hash", "compat_hash"),
                             (bad_block, "a block id outside the pool", "outside the pool")]:
        puller.expect(["--handle-in", path, "--no-release", "--timeout-s", str(PULL_TIMEOUT_S)],
                      2, what, stderr_has=says)

    before = server.metrics()
    server.renew(request_id, nonce)
    other_nonce = nonce[:-1] + ("0" if nonce[-1] != "0" else "1")  # well formed, another value
    bad_nonce = forged("nonce", lambda v: v.update(lease_nonce=other_nonce))
    puller.expect(["--handle-in", bad_nonce, "--timeout-s", str(PULL_TIMEOUT_S)], 3,
                  "a changed lease_nonce on a live lease", stderr_has="lease no longer holds")
    if server.leases() != 1:
        fail("a forged nonce's pull changed the number of leases")
    server.renew(request_id, nonce)
    p = puller.run(["--handle-in", h, "--no-release", "--timeout-s", str(PULL_TIMEOUT_S)])
    if p.rc != 0:
        fail(f"the genuine handle after a forged nonce's attempt:\n{p.describe()}")

    # Edited handles of the live lease: each prefill rank's lease record holds the digest of its
    # own part, so another request's blocks (valid ids inside the pool), another rank's transport
    # copied in, or another engine's id are refused before anything is read (exit 3).
    def other_blocks(v):
        blocks, n = v["ranks"][1]["blocks"], v["ranks"][1]["pool"]["num_blocks"]
        blocks[0] = next(b for b in range(n) if b not in blocks)

    def copied_transport(v):
        v["ranks"][1]["ucx"] = dict(v["ranks"][0]["ucx"])

    for name, change, what in [
            ("blocks", other_blocks, "another request's blocks"),
            ("transport", copied_transport, "rank 0's transport copied into rank 1"),
            ("engine", lambda v: v.update(engine_id="cpfill-0000000000000bad"),
             "another engine's id")]:
        server.renew(request_id, nonce)
        puller.expect(["--handle-in", forged(name, change), "--no-release",
                       "--timeout-s", str(PULL_TIMEOUT_S)], 3, what,
                      stderr_has="published another digest")
        if server.leases() != 1:
            fail(f"a pull of an edited handle ({what}) changed the number of leases")

    # Another engine's release is ignored (logged): the lease holds until DELETE with the nonce.
    server.renew(request_id, nonce)
    bad_engine = forged("engine", lambda v: v.update(engine_id="cpfill-0000000000000bad"))
    p = puller.run(["--handle-in", bad_engine, "--release-only", "--timeout-s",
                    str(PULL_TIMEOUT_S)])
    if p.rc != 0:
        fail(f"--release-only of a handle with another engine_id:\n{p.describe()}")
    deadline = time.time() + 5
    while "KV release ignored" not in server.log_text():
        if time.time() > deadline:
            fail("the server's log does not mention the ignored release of another engine's "
                 "handle (the log is below)")
        time.sleep(0.1)
    m = server.metrics()
    if m["cpfill:kv_leases"] != 1 or released(m) != released(before) or \
            expired(m) != expired(before):
        fail(f"another engine's release: kv_leases {m['cpfill:kv_leases']:g} (expected 1), "
             f"released {released(before):g} -> {released(m):g}, expired {expired(before):g} -> "
             f"{expired(m):g} (both expected unchanged)")

    for query, want in [("", 400), (f"?nonce={other_nonce}", 404)]:  # only a holder may
        status, body = http(server.port, "DELETE", f"/v1/kv/{request_id}{query}")
        if status != want:
            fail(f"DELETE /v1/kv/{request_id}{query}: {status} {body}; expected {want}")
    if server.leases() != 1:
        fail("a DELETE without the lease's nonce ended the lease")
    status, body = http(server.port, "DELETE", f"/v1/kv/{request_id}?nonce={nonce}")
    if status != 200 or json.loads(body).get("released") != request_id:
        fail(f"DELETE /v1/kv/{request_id} of a live lease: {status} {body}")
    m = server.wait_idle(usage, f"after DELETE /v1/kv/{request_id}")
    if released(m) != released(before) + 1:
        fail(f"DELETE not counted as a release ({released(before):g} -> {released(m):g})")
    for method, path in [("DELETE", f"/v1/kv/{request_id}?nonce={nonce}"),
                         ("POST", f"/v1/kv/nope/renew?nonce={nonce}")]:
        status, body = http(server.port, method, path, b"" if method == "POST" else None)
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = None
        if status != 404 or not message:
            fail(f"{method} {path}: {status} {body}; expected 404 with a JSON error")
    print("  5. forged handles: truncated, compat_hash, block refused (exit 2); a forged nonce "
          "fails its lease check (exit 3), the genuine lease still pulls; another request's "
          "blocks, a copied transport, another engine_id refused by the lease record's digest "
          "(exit 3, nothing read); another engine_id's "
          "release ignored (logged) until DELETE with the nonce (without: 400, another: 404; then 200, "
          "then 404); renew 200 / unknown 404")


def scenario_refusals(server):
    """6: do_remote_decode requests that cannot be handed off."""
    remote = {"do_remote_decode": True}
    cases = [
        ({"prompt": [1, 2, 3], "max_tokens": 5, "kv_transfer_params": remote}, "max_tokens"),
        ({"prompt": [1, 2, 3], "session": "s1", "kv_transfer_params": remote}, "session"),
        ({"prompt": [[1, 2, 3], [4, 5]], "kv_transfer_params": remote}, "one prompt"),
        ({"prompt": [1, 2, 3], "stream": True, "kv_transfer_params": remote}, "stream"),
        ({"prompt": [1, 2, 3], "kv_transfer_params": {"do_remote_decode": "yes"}}, "boolean"),
    ]
    before = server.leases()
    for body, says in cases:
        status, text = http(server.port, "POST", "/v1/completions", body)
        try:
            message = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = ""
        if status != 400 or says not in message:
            fail(f"{json.dumps(body)}: {status} {text[:300]}; expected 400 with an error naming "
                 f"\"{says}\"")
    if server.leases() != before:
        fail("a refused hand-off left a lease")
    print("  6. do_remote_decode refused with 400: max_tokens 5, session, two prompts, stream, "
          "non-boolean")


def scenario_c_api(server, puller, tmp, lib, usage, env):
    """7: a live handle pulled through libcpfill.so (the child process below)."""
    h = os.path.join(tmp, "capi.json")
    ref = os.path.join(tmp, "capi_ref.bin")
    puller.verified(["--url", server.url] + verify_flags(8, 300) +
                    ["--no-release", "--handle-out", h, "--dump", ref],
                    "the C API's handle (kv-pull --dump)")
    layout = read_handle(h)["layout"]
    want = 2 * layout["num_layers"] * layout["tokens"] * layout["kv_heads"] * layout["head_dim"] * 4
    if os.path.getsize(ref) != want:
        fail(f"--dump wrote {os.path.getsize(ref)} bytes; expected {want}")
    child = [sys.executable, os.path.abspath(__file__), "--capi", lib, h, ref, str(server.port)]
    try:
        r = subprocess.run(child, capture_output=True, text=True, env=env,
                           timeout=PROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        fail(f"the C API child ran past {PROCESS_TIMEOUT_S} s:\n{e.stdout}\n{e.stderr}")
    if r.returncode != 0 or "capi: OK" not in r.stdout:
        fail(f"the C API child exited {r.returncode}:\nstdout:\n{r.stdout[-3000:]}\n"
             f"stderr:\n{r.stderr[-3000:]}")
    server.wait_idle(usage, "after cpfill_kv_release")
    print("  7. C API: parse, layout, TP1 contiguous equal to --dump byte for byte, TP2 ranks 0 "
          "and 1 paged (shuffled tables) reassembled equal, garbage refused, release")


def scenario_server_gone(server, puller, tmp):
    """8: the server survived everything; stopped, its handles fail cleanly."""
    status, body = http(server.port, "GET", "/health")
    if status != 200:
        fail(f"/health after the scenarios: {status} {body}")
    h = os.path.join(tmp, "orphan.json")
    p = puller.run(["--url", server.url, "--prompt-tokens", "300", "--prompt-seed", "9",
                    "--no-release", "--handle-out", h, "--timeout-s", str(PULL_TIMEOUT_S)])
    if p.rc != 0:
        fail(f"a pull before stopping the server:\n{p.describe()}")
    code = server.stop()
    if code != 0:
        fail(f"the server exited {code} after SIGTERM to rank 0 (a lease held)")
    p = puller.expect(["--handle-in", h, "--timeout-s", str(DEAD_TIMEOUT_S)], 3,
                      "a pull from a stopped server")
    if p.seconds > DEAD_TIMEOUT_S + 3:
        fail(f"a pull from a stopped server took {p.seconds:.1f} s (--timeout-s "
             f"{DEAD_TIMEOUT_S}):\n{p.describe()}")
    print(f"  8. /health 200 after everything; SIGTERM: every rank exited 0; a pull from the "
          f"stopped server: exit 3 after {p.seconds:.1f} s")


def scenario_staging_full(server, puller, usage):
    """Staged pass: a prompt the staging pool cannot take is refused by name (the KV cache could)
    and nothing stays held."""
    p = puller.run(["--url", server.url, "--prompt-tokens", str(3 * STAGING_TOKENS),
                    "--prompt-seed", "77", "--timeout-s", str(PULL_TIMEOUT_S)])
    if p.rc != 2 or "staging pool is full" not in p.err:
        fail(f"a hand-off larger than the staging pool: expected exit 2 naming the staging "
             f"pool:\n{p.describe()}")
    server.wait_idle(usage, "after the refused staging")
    print("  +. a hand-off larger than the staging pool: refused by name (exit 2), nothing held")


def run_pass(cpfill, lib, name, tmp, c_api):
    env = {k: v for k, v in MPI_ENV.items() if not k.startswith("UCX_")}
    env.update(TRANSPORTS[name])
    print(f"pass {name}: " + " ".join(f"{k}={v}" for k, v in TRANSPORTS[name].items()),
          flush=True)
    t0 = time.time()
    server = Server(cpfill, tmp, env, SERVER_FLAGS.get(name, []))
    try:
        server.wait_listening()
        puller = Puller(cpfill, env)
        usage = scenario_pulls(server, puller)
        scenario_dies_mid_pull(server, puller, usage)
        scenario_second_puller(server, puller, tmp, usage)
        scenario_forged(server, puller, tmp, usage)
        scenario_refusals(server)
        if name == "staged":
            scenario_staging_full(server, puller, usage)
        if c_api:
            scenario_c_api(server, puller, tmp, lib, usage, env)
        else:
            print("  7. C API: left out (--skip-c-api)")
        scenario_server_gone(server, puller, tmp)
    except SystemExit:
        print(f"---- server log ({server.log_path}, last 40 lines) ----")
        print("".join(server.log_text().splitlines(keepends=True)[-40:]), flush=True)
        raise
    finally:
        server.kill()
    print(f"pass {name}: ok in {time.time() - t0:.1f} s", flush=True)


def run_bit_exact_pass(cpfill, tmp):
    """A one-rank server (one thread): its KV pulled equals a one-thread one-rank prefill bit for
    bit (the CPU kernels' rounding depends only on the ranks and threads)."""
    env = {k: v for k, v in MPI_ENV.items() if not k.startswith("UCX_")}
    env.update(TRANSPORTS["tcp"])
    print("pass one-rank: bit-exact against a one-rank prefill", flush=True)
    server = Server(cpfill, tmp, env, np=1, tp=1)
    try:
        server.wait_listening()
        p = Puller(cpfill, env).run(["--url", server.url, "--prompt-tokens", "300",
                                     "--prompt-seed", "11", "--model", "tiny", "--layers",
                                     str(LAYERS), "--reference-threads", "1", "--bit-exact",
                                     "--timeout-s", str(PULL_TIMEOUT_S)])
        if p.rc != 0 or " 0 of " not in p.out or ": PASS" not in p.out:
            fail(f"a one-rank server's KV, bit for bit:\n{p.describe()}")
    finally:
        server.kill()
    print("  the pulled KV equals the one-rank prefill's bit for bit", flush=True)


def run_prefix_cache_pass(cpfill, tmp):
    """With the prefix cache on: the same prompt published twice, the second forked from the
    first's cached KV (its rows keep the first prefill's layout over the ring), and a prompt that
    shares its first 256 tokens; every pull verified against one rank."""
    env = {k: v for k, v in MPI_ENV.items() if not k.startswith("UCX_")}
    env.update(TRANSPORTS["tcp"])
    print("pass prefix-cache: hand-offs of forked KV", flush=True)
    server = Server(cpfill, tmp, env, prefix_cache=True)
    try:
        server.wait_listening()
        puller = Puller(cpfill, env)
        for what in ("first", "cached"):
            puller.verified(["--url", server.url] + verify_flags(6, 300), f"the {what} pull")
        hits = server.metrics()["cpfill:prefix_cache_hits_total"]
        if hits < 1:
            fail(f"the second publish of one prompt did not reuse its KV (hits {hits:g})")
    finally:
        server.kill()
    print(f"  pulls of a prompt's KV, then of its cached fork, verified ({hits:g} hit)", flush=True)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--capi":
        return capi_child(*sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("cpfill")
    ap.add_argument("libcpfill")
    ap.add_argument("--transports", default="tcp,sm,staged",
                    help="comma-separated passes, of " + ", ".join(TRANSPORTS))
    ap.add_argument("--skip-c-api", action="store_true",
                    help="leave out the ctypes part (a sanitized libcpfill.so)")
    args = ap.parse_args()
    cpfill = os.path.abspath(args.cpfill)
    lib = os.path.abspath(args.libcpfill)
    for name in args.transports.split(","):
        if name not in TRANSPORTS:
            fail(f"--transports: unknown {name!r}")
        tmp = tempfile.mkdtemp(prefix=f"cpfill-kv-handoff-{name}-")
        run_pass(cpfill, lib, name, tmp, not args.skip_c_api)
        shutil.rmtree(tmp, ignore_errors=True)  # kept (named in the log) when a pass fails
    tmp = tempfile.mkdtemp(prefix="cpfill-kv-handoff-prefix-")
    run_prefix_cache_pass(cpfill, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix="cpfill-kv-handoff-one-rank-")
    run_bit_exact_pass(cpfill, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    print("PASS: serve_kv_handoff")


# ---- the C API child: libcpfill.so through ctypes -------------------------------------------

def capi_child(lib_path, handle_path, ref_path, port):
    import ctypes

    class Layout(ctypes.Structure):  # cpfill_kv_layout
        _fields_ = [("num_layers", ctypes.c_int32), ("kv_heads", ctypes.c_int32),
                    ("head_dim", ctypes.c_int32), ("dtype_bytes", ctypes.c_int32),
                    ("tokens", ctypes.c_int64),
                    ("tp_size", ctypes.c_int32), ("cp_size", ctypes.c_int32),
                    ("block_tokens", ctypes.c_int32)]

    class Destination(ctypes.Structure):  # cpfill_kv_destination
        _fields_ = [("struct_size", ctypes.c_size_t),
                    ("tp_size", ctypes.c_int32), ("tp_rank", ctypes.c_int32),
                    ("paged", ctypes.c_int32),
                    ("capacity_tokens", ctypes.c_int64),
                    ("k_offset_bytes", ctypes.c_int64), ("v_offset_bytes", ctypes.c_int64),
                    ("block_tokens", ctypes.c_int32),
                    ("num_blocks", ctypes.c_int64), ("block_stride_bytes", ctypes.c_int64),
                    ("layer_stride_bytes", ctypes.c_int64),
                    ("block_table", ctypes.POINTER(ctypes.c_int32)),
                    ("block_table_len", ctypes.c_size_t),
                    ("base", ctypes.c_void_p),
                    ("bytes", ctypes.c_size_t)]

    class PullStats(ctypes.Structure):  # cpfill_kv_pull_stats
        _fields_ = [("bytes", ctypes.c_int64), ("gets", ctypes.c_int64),
                    ("source_ranks", ctypes.c_int32), ("seconds", ctypes.c_double)]

    c = ctypes.CDLL(lib_path)
    vp = ctypes.c_void_p
    c.cpfill_last_error.restype = ctypes.c_char_p
    c.cpfill_last_error.argtypes = []
    c.cpfill_kv_handle_parse.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(vp)]
    c.cpfill_kv_handle_layout.argtypes = [vp, ctypes.POINTER(Layout)]
    c.cpfill_kv_handle_request_id.restype = ctypes.c_char_p
    c.cpfill_kv_handle_request_id.argtypes = [vp]
    c.cpfill_kv_handle_free.argtypes = [vp]
    c.cpfill_kv_handle_free.restype = None
    c.cpfill_kv_puller_create.argtypes = [ctypes.c_char_p, ctypes.POINTER(vp)]
    c.cpfill_kv_puller_destroy.argtypes = [vp]
    c.cpfill_kv_puller_destroy.restype = None
    c.cpfill_kv_destination_init.argtypes = [ctypes.POINTER(Destination)]
    c.cpfill_kv_destination_init.restype = None
    c.cpfill_kv_pull.argtypes = [vp, vp, ctypes.POINTER(Destination), ctypes.c_double,
                                 ctypes.POINTER(PullStats)]
    c.cpfill_kv_release.argtypes = [vp, vp, ctypes.c_double]
    for f in (c.cpfill_kv_handle_parse, c.cpfill_kv_handle_layout, c.cpfill_kv_puller_create,
              c.cpfill_kv_pull, c.cpfill_kv_release):
        f.restype = ctypes.c_int

    def check(code, what, want=CPFILL_OK):
        if code != want:
            err = c.cpfill_last_error()
            fail(f"capi: {what}: status {code}, expected {want}: "
                 f"{err.decode(errors='replace') if err else '(no message)'}")

    text = open(handle_path, "rb").read()
    ref = open(ref_path, "rb").read()
    expected = json.loads(text)
    request_id, nonce = expected["request_id"], expected["lease_nonce"]

    def renew():  # each pull starts with a fresh lease of LEASE_S, on a slow machine too
        status, body = http(int(port), "POST", f"/v1/kv/{request_id}/renew?nonce={nonce}", b"",
                            timeout=30)
        if status != 200:
            fail(f"capi: renew {request_id}: {status} {body}")

    handle = vp()
    check(c.cpfill_kv_handle_parse(text, len(text), ctypes.byref(handle)), "cpfill_kv_handle_parse")
    layout = Layout()
    check(c.cpfill_kv_handle_layout(handle, ctypes.byref(layout)), "cpfill_kv_handle_layout")
    want = expected["layout"]
    got = {"num_layers": layout.num_layers, "kv_heads": layout.kv_heads,
           "head_dim": layout.head_dim, "tokens": layout.tokens, "tp_size": layout.tp_size,
           "cp_size": layout.cp_size, "block_tokens": layout.block_tokens}
    if any(got[k] != want[k] for k in got) or layout.dtype_bytes != 4 or want["dtype"] != "float32":
        fail(f"capi: cpfill_kv_handle_layout {got}, dtype_bytes {layout.dtype_bytes}; the handle "
             f"says {want}")
    if c.cpfill_kv_handle_request_id(handle).decode() != request_id:
        fail(f"capi: cpfill_kv_handle_request_id {c.cpfill_kv_handle_request_id(handle)!r}")
    L, H, D, T = layout.num_layers, layout.kv_heads, layout.head_dim, layout.tokens
    k_bytes = L * T * H * D * 4
    if len(ref) != 2 * k_bytes:
        fail(f"capi: the reference has {len(ref)} bytes, expected {2 * k_bytes}")

    puller = vp()
    check(c.cpfill_kv_puller_create(b"kv_handoff_test capi", ctypes.byref(puller)),
          "cpfill_kv_puller_create")

    def pull(d, buf, what):
        stats = PullStats()
        renew()
        ctypes.memset(buf, 0xFF, len(buf))  # poisoned: NaN floats
        check(c.cpfill_kv_pull(puller, handle, ctypes.byref(d), 30.0, ctypes.byref(stats)),
              f"cpfill_kv_pull ({what})")
        return stats

    # TP1 contiguous: the buffer is --dump's layout exactly.
    d = Destination()
    c.cpfill_kv_destination_init(ctypes.byref(d))
    if d.struct_size != ctypes.sizeof(Destination) or d.tp_size != 1 or d.paged != 0:
        fail(f"capi: cpfill_kv_destination_init: struct_size {d.struct_size} (ctypes "
             f"{ctypes.sizeof(Destination)}), tp_size {d.tp_size}, paged {d.paged}")
    buf = (ctypes.c_char * (2 * k_bytes))()
    d.base = ctypes.cast(buf, vp)
    d.bytes = 2 * k_bytes
    d.v_offset_bytes = k_bytes
    stats = pull(d, buf, "TP1 contiguous")
    if stats.bytes != 2 * k_bytes or stats.source_ranks != layout.tp_size * layout.cp_size:
        fail(f"capi: TP1 stats: {stats.bytes} bytes from {stats.source_ranks} ranks; expected "
             f"{2 * k_bytes} from {layout.tp_size * layout.cp_size}")
    if buf.raw != ref:
        first = next(i for i in range(len(ref)) if buf.raw[i] != ref[i])
        fail(f"capi: TP1 contiguous differs from kv-pull --dump, first at byte {first}")
    # One byte short: refused by name before anything is read.
    d.bytes = 2 * k_bytes - 1
    check(c.cpfill_kv_pull(puller, handle, ctypes.byref(d), 30.0, None),
          "cpfill_kv_pull into a destination one byte short", want=CPFILL_INVALID_ARGUMENT)

    # Decode TP2, paged, shuffled block tables with spare blocks and padded block strides.
    rng = random.Random(20)
    heads = H // 2
    row = heads * D * 4
    whole = bytearray(b"\xFF" * len(ref))
    for tp_rank, block_tokens in [(0, 16), (1, 48)]:
        need = (T + block_tokens - 1) // block_tokens
        num_blocks = need + 5
        table = rng.sample(range(num_blocks), need)
        table_c = (ctypes.c_int32 * need)(*table)
        block_stride = block_tokens * row + 64
        layer_stride = num_blocks * block_stride
        pool_bytes = 2 * L * layer_stride
        pbuf = (ctypes.c_char * pool_bytes)()
        d = Destination()
        c.cpfill_kv_destination_init(ctypes.byref(d))
        d.tp_size, d.tp_rank, d.paged = 2, tp_rank, 1
        d.block_tokens = block_tokens
        d.num_blocks, d.block_stride_bytes, d.layer_stride_bytes = \
            num_blocks, block_stride, layer_stride
        d.k_offset_bytes, d.v_offset_bytes = 0, L * layer_stride
        d.block_table = ctypes.cast(table_c, ctypes.POINTER(ctypes.c_int32))
        d.block_table_len = need
        d.base = ctypes.cast(pbuf, vp)
        d.bytes = pool_bytes
        stats = pull(d, pbuf, f"TP2 rank {tp_rank} paged")
        if stats.bytes != 2 * L * T * row:
            fail(f"capi: TP2 rank {tp_rank}: {stats.bytes} bytes, expected {2 * L * T * row}")
        raw = pbuf.raw
        untouched = bytearray(raw)
        for kind in range(2):
            for layer in range(L):
                base = (d.v_offset_bytes if kind else 0) + layer * layer_stride
                for t in range(T):
                    src = base + table[t // block_tokens] * block_stride + (t % block_tokens) * row
                    dst = (((kind * L + layer) * T + t) * H + tp_rank * heads) * D * 4
                    whole[dst:dst + row] = raw[src:src + row]
                    untouched[src:src + row] = b"\xFF" * row
        if untouched != b"\xFF" * pool_bytes:
            first = next(i for i in range(pool_bytes) if untouched[i] != 0xFF)
            fail(f"capi: TP2 rank {tp_rank} paged wrote outside its table's rows (byte {first})")
    if bytes(whole) != ref:
        first = next(i for i in range(len(ref)) if whole[i] != ref[i])
        fail(f"capi: TP2 ranks 0 and 1 reassembled differ from kv-pull --dump, first at byte "
             f"{first}")

    # Garbage is refused with a message.
    bad = vp()
    garbage = b"{\"version\": \"cpfill.kv.v2\", \x00\xff not json"
    check(c.cpfill_kv_handle_parse(garbage, len(garbage), ctypes.byref(bad)),
          "cpfill_kv_handle_parse of garbage", want=CPFILL_INVALID_ARGUMENT)
    message = c.cpfill_last_error()
    if not message:
        fail("capi: cpfill_last_error is empty after a refused parse")
    if bad.value:
        fail("capi: a refused parse returned a handle")

    renew()
    check(c.cpfill_kv_release(puller, handle, 5.0), "cpfill_kv_release")
    c.cpfill_kv_handle_free(handle)
    c.cpfill_kv_puller_destroy(puller)
    print(f"capi: OK (garbage refused: {message.decode(errors='replace')[:120]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
