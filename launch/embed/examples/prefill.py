#!/usr/bin/env python3
"""A Python serving stack's view of cpfill: libcpfill.so through ctypes (standard library only).

    mpirun -np 4 python3 launch/embed/examples/prefill.py build/lib/libcpfill.so \\
        --model tiny --tp 2 --backend cpu

Every rank creates the engine; rank 0 submits the same prompts as the C example (prompt i has
LENS[i] tokens, token j = (i * 7919 + j * 31) % vocab) from several threads at once, as an
asyncio or threaded server would, plus a two-turn session; it prints one line per answer and
the top-5 logits of the first prompt. Then it generates after prompt 1 from two threads at once,
greedy and sampled with a seed, each streaming its tokens as they come (while a third thread
waits for the greedy one to finish), and has bad generation params refused:
    greedy: tokens <ids> finish length reads <k>
    sampled: tokens <ids> finish length reads <k>
    bad params refused: <message naming the field>
The other ranks run the worker loop until rank 0 shuts the engine down. Exits 0 when everything
behaved as documented.
"""
import concurrent.futures
import ctypes
import sys

LENS = [300, 77, 1000]
TURN2 = 50
GENERATED = 12
OK, INVALID_ARGUMENT, NOT_READY = 0, 1, 6


class Result(ctypes.Structure):
    _fields_ = [("first_token", ctypes.c_int32), ("logits", ctypes.POINTER(ctypes.c_float)),
                ("vocab_size", ctypes.c_int64), ("prompt_tokens", ctypes.c_int64),
                ("cached_tokens", ctypes.c_int64), ("recomputed", ctypes.c_int),
                ("batch_requests", ctypes.c_int), ("queue_s", ctypes.c_double),
                ("prefill_s", ctypes.c_double), ("algorithm", ctypes.c_char_p)]


class GenerateParams(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("max_tokens", ctypes.c_int32),
                ("temperature", ctypes.c_double), ("top_k", ctypes.c_int32),
                ("top_p", ctypes.c_double), ("seed", ctypes.c_uint64), ("ignore_eos", ctypes.c_int),
                ("stop_token_ids", ctypes.POINTER(ctypes.c_int32)),
                ("num_stop_token_ids", ctypes.c_size_t), ("sparq_r", ctypes.c_int32),
                ("sparq_k", ctypes.c_int32), ("sparq_l", ctypes.c_int32)]


class CpfillError(RuntimeError):
    def __init__(self, lib, code, what):
        super().__init__(f"{what}: status {code}: {lib.cpfill_last_error().decode()}")
        self.code = code


def load(path):
    # RTLD_GLOBAL: Open MPI loads its components as plugins that need libmpi's symbols.
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    P = ctypes.c_void_p
    sigs = {
        "cpfill_last_error": (ctypes.c_char_p, []),
        "cpfill_engine_create": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), P,
                                                ctypes.POINTER(P)]),
        "cpfill_engine_rank": (ctypes.c_int, [P]),
        "cpfill_engine_vocab_size": (ctypes.c_int64, [P]),
        "cpfill_engine_run": (ctypes.c_int, [P]),
        "cpfill_submit": (ctypes.c_int, [P, ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t,
                                         ctypes.c_char_p, ctypes.POINTER(P)]),
        "cpfill_generate_params_init": (None, [ctypes.POINTER(GenerateParams)]),
        "cpfill_submit_generate": (ctypes.c_int, [P, ctypes.POINTER(ctypes.c_int32),
                                                  ctypes.c_size_t, ctypes.c_char_p,
                                                  ctypes.POINTER(GenerateParams),
                                                  ctypes.POINTER(P)]),
        "cpfill_request_tokens": (ctypes.c_int, [P, ctypes.c_size_t,
                                                 ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t,
                                                 ctypes.POINTER(ctypes.c_size_t),
                                                 ctypes.POINTER(ctypes.c_int)]),
        "cpfill_request_wait_tokens": (ctypes.c_int, [P, ctypes.c_size_t, ctypes.c_double]),
        "cpfill_request_finish_reason": (ctypes.c_char_p, [P]),
        "cpfill_request_wait": (ctypes.c_int, [P, ctypes.c_double]),
        "cpfill_request_result": (ctypes.c_int, [P, ctypes.POINTER(Result)]),
        "cpfill_request_free": (None, [P]),
        "cpfill_session_end": (ctypes.c_int, [P, ctypes.c_char_p]),
        "cpfill_engine_shutdown": (ctypes.c_int, [P]),
        "cpfill_engine_destroy": (None, [P]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


class Engine:
    """The engine on this rank; prefill() is rank 0's, thread-safe."""

    def __init__(self, lib, flags):
        self.lib = lib
        argv = (ctypes.c_char_p * len(flags))(*[f.encode() for f in flags])
        self.handle = ctypes.c_void_p()
        self.check(lib.cpfill_engine_create(len(flags), argv, None, ctypes.byref(self.handle)),
                   "create")
        self.rank = lib.cpfill_engine_rank(self.handle)
        self.vocab = lib.cpfill_engine_vocab_size(self.handle)

    def check(self, code, what):
        if code != OK:
            raise CpfillError(self.lib, code, what)

    def prefill(self, tokens, session=None):
        """Submits and waits; returns (first_token, prompt, cached, top-5 logits)."""
        ids = (ctypes.c_int32 * len(tokens))(*tokens)
        req = ctypes.c_void_p()
        self.check(self.lib.cpfill_submit(self.handle, ids, len(tokens),
                                          session.encode() if session else None,
                                          ctypes.byref(req)), "submit")
        try:
            self.check(self.lib.cpfill_request_wait(req, -1.0), "wait")
            res = Result()
            self.check(self.lib.cpfill_request_result(req, ctypes.byref(res)), "result")
            logits = res.logits[:res.vocab_size]
            top5 = sorted(range(len(logits)), key=lambda t: -logits[t])[:5]
            return res.first_token, res.prompt_tokens, res.cached_tokens, top5
        finally:
            self.lib.cpfill_request_free(req)


    def params(self, **fields):
        """cpfill_generate_params: the library's defaults, then `fields`."""
        p = GenerateParams()
        self.lib.cpfill_generate_params_init(ctypes.byref(p))
        for name, value in fields.items():
            setattr(p, name, value)
        return p

    def submit_generate(self, tokens, params, session=None):
        ids = (ctypes.c_int32 * len(tokens))(*tokens)
        req = ctypes.c_void_p()
        self.check(self.lib.cpfill_submit_generate(self.handle, ids, len(tokens),
                                                   session.encode() if session else None,
                                                   ctypes.byref(params), ctypes.byref(req)),
                   "submit_generate")
        return req

    def stream(self, req, on_tokens, capacity=64):
        """Calls on_tokens(new_ids) as tokens come; returns the finish reason. Each wait returns
        on a new token (or the end), and only the new ids are copied out."""
        buf = (ctypes.c_int32 * capacity)()
        have, count, done = 0, ctypes.c_size_t(), ctypes.c_int(0)
        while not done.value:
            self.check(self.lib.cpfill_request_wait_tokens(req, have + 1, 60.0), "wait_tokens")
            while True:  # more may have come than the buffer holds
                self.check(self.lib.cpfill_request_tokens(req, have, buf, capacity,
                                                          ctypes.byref(count), ctypes.byref(done)),
                           "tokens")
                new = buf[:min(count.value - have, capacity)]
                if new:
                    on_tokens(new)
                have += len(new)
                if have == count.value:
                    break
        reason = self.lib.cpfill_request_finish_reason(req)
        return reason.decode() if reason else None


def prompt(i, n, vocab):
    return [(i * 7919 + j * 31) % vocab for j in range(n)]


def in_threads(function, args):
    """[function(a) for a in args], each call on a thread of its own; waits for all of them. The
    first exception, in the order of `args`, is raised again here (a threading.Thread would only
    print it, and the example would go on as if the call had worked)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(args)) as pool:
        futures = [pool.submit(function, a) for a in args]
    return [f.result() for f in futures]


def serve(engine):
    answers = in_threads(lambda i: engine.prefill(prompt(i, LENS[i], engine.vocab)),
                         list(range(len(LENS))))
    for i, (tok, n, cached, top5) in enumerate(answers):
        print(f"prompt {i}: first_token {tok} prompt_tokens {n} cached_tokens {cached} "
              f"top5 {top5}", flush=True)
    for turn, ids in ((1, prompt(0, LENS[0], engine.vocab)), (2, prompt(1, TURN2, engine.vocab))):
        tok, n, cached, _ = engine.prefill(ids, session="chat")
        print(f"session turn {turn}: first_token {tok} prompt_tokens {n} cached_tokens {cached}",
              flush=True)
    try:
        engine.prefill([1, engine.vocab])
        print("a token outside the vocabulary was not refused", file=sys.stderr)
        return False
    except CpfillError as e:
        print(f"refused as expected: {e}", flush=True)
        if e.code != INVALID_ARGUMENT:
            return False
    engine.check(engine.lib.cpfill_session_end(engine.handle, b"chat"), "session end")
    return generate(engine) and refuse_bad_params(engine) and sparq_at_large_k(engine)


def generate(engine):
    """Two generations after prompt 1 at once, each streamed on its own thread; a third thread
    waits for the greedy one while it streams (calls on one request may overlap)."""
    runs = {"greedy": engine.params(max_tokens=GENERATED, temperature=0.0, ignore_eos=1),
            "sampled": engine.params(max_tokens=GENERATED, temperature=0.9, top_k=50, top_p=0.95,
                                     seed=7, ignore_eos=1)}
    reqs = {label: engine.submit_generate(prompt(1, LENS[1], engine.vocab), p)
            for label, p in runs.items()}

    def consume(label):
        if label == "wait":
            engine.check(engine.lib.cpfill_request_wait(reqs["greedy"], -1.0), "wait")
            return None
        pieces = []
        reason = engine.stream(reqs[label], pieces.append)
        ids = [t for piece in pieces for t in piece]
        return f"{label}: tokens {' '.join(map(str, ids))} finish {reason} reads {len(pieces)}"

    try:
        lines = in_threads(consume, list(runs) + ["wait"])  # a thread's CpfillError raised here
    finally:
        for req in reqs.values():
            engine.lib.cpfill_request_free(req)
    for line in lines[:len(runs)]:
        print(line, flush=True)
    return True


def refuse_bad_params(engine):
    """Each bad field is refused at once with CPFILL_INVALID_ARGUMENT, the message naming it."""
    bad = [GenerateParams(),  # never initialized: struct_size 0
           engine.params(max_tokens=0), engine.params(max_tokens=-1), engine.params(top_p=1.5),
           engine.params(top_p=0.0), engine.params(temperature=-1.0), engine.params(top_k=-1),
           engine.params(num_stop_token_ids=2),  # with stop_token_ids NULL
           engine.params(sparq_r=65, sparq_k=16),  # the tiny preset's head_dim is 64
           engine.params(sparq_r=8, sparq_k=-1), engine.params(sparq_r=8, sparq_k=16, sparq_l=-1)]
    ok = True
    for p in bad:
        try:
            engine.lib.cpfill_request_free(engine.submit_generate([1, 2, 3, 4], p))
            print("example: bad generation params were not refused", file=sys.stderr)
            ok = False
        except CpfillError as e:
            print(f"bad params refused: {engine.lib.cpfill_last_error().decode()}", flush=True)
            ok = ok and e.code == INVALID_ARGUMENT
    return ok


def sparq_at_large_k(engine):
    """SparQ decode (sparq_k > 0) whose k covers the whole sequence attends to every position:
    its greedy tokens equal dense decode's."""
    prompt = [(j * 31 + 5) % 1024 for j in range(200)]
    runs = []
    for sparq in ({}, {"sparq_r": 8, "sparq_k": 4096, "sparq_l": 4}):
        p = engine.params(max_tokens=8, temperature=0.0, ignore_eos=1, **sparq)
        req = engine.submit_generate(prompt, p)
        got = []
        engine.stream(req, got.extend)
        engine.lib.cpfill_request_free(req)
        runs.append(got)
    if runs[0] != runs[1] or len(runs[0]) != 8:
        print(f"example: sparq at k 4096 {runs[1]} differs from dense {runs[0]}", file=sys.stderr)
        return False
    print(f"sparq at k >= S: {len(runs[1])} tokens equal dense", flush=True)
    return True


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    lib = load(sys.argv[1])
    try:
        engine = Engine(lib, sys.argv[2:])
    except CpfillError as e:
        print(f"example: {e}", file=sys.stderr)
        return 2
    ok = True
    try:
        if engine.rank == 0:
            ok = serve(engine)
            engine.check(lib.cpfill_engine_shutdown(engine.handle), "shutdown")
        else:
            engine.check(lib.cpfill_engine_run(engine.handle), "run")
    except CpfillError as e:
        print(f"example: {e}", file=sys.stderr)
        ok = False
    lib.cpfill_engine_destroy(engine.handle)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
