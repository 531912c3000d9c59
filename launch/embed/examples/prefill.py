#!/usr/bin/env python3
"""A Python serving stack's view of cpfill: libcpfill.so through ctypes (standard library only).

    mpirun -np 4 python3 launch/embed/examples/prefill.py build/lib/libcpfill.so \\
        --model tiny --tp 2 --backend cpu

Every rank creates the engine; rank 0 submits the same prompts as the C example (prompt i has
LENS[i] tokens, token j = (i * 7919 + j * 31) % vocab) from several threads at once, as an
asyncio or threaded server would, plus a two-turn session; it prints one line per answer and
the top-5 logits of the first prompt. The other ranks run the worker loop until rank 0 shuts
the engine down. Exits 0 when everything behaved as documented.
"""
import ctypes
import sys
import threading

LENS = [300, 77, 1000]
TURN2 = 50
OK, INVALID_ARGUMENT, NOT_READY = 0, 1, 6


class Result(ctypes.Structure):
    _fields_ = [("first_token", ctypes.c_int32), ("logits", ctypes.POINTER(ctypes.c_float)),
                ("vocab_size", ctypes.c_int64), ("prompt_tokens", ctypes.c_int64),
                ("cached_tokens", ctypes.c_int64), ("recomputed", ctypes.c_int),
                ("batch_requests", ctypes.c_int), ("queue_s", ctypes.c_double),
                ("prefill_s", ctypes.c_double), ("algorithm", ctypes.c_char_p)]


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


def prompt(i, n, vocab):
    return [(i * 7919 + j * 31) % vocab for j in range(n)]


def serve(engine):
    answers = [None] * len(LENS)

    def one(i):
        answers[i] = engine.prefill(prompt(i, LENS[i], engine.vocab))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(LENS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
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
