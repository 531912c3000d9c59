#!/usr/bin/env python3
"""The embedding API end to end (standard library only):

    python3 tests/embed_test.py BUILD_DIR SOURCE_DIR [--python-example] [--built-example]

1. `cmake --install` BUILD_DIR into a temporary prefix, and builds the C99 example there with
   the C compiler (`cc -std=c99 -pedantic-errors`) against the installed cpfill.h and
   libcpfill.so only;
2. runs it (and with --python-example, the ctypes example against the installed library)
   under mpirun, 4 ranks as TP2 x CP2, CPU backend, the tiny preset;
   (--built-example, for the sanitized build: the example CMake built, which carries the
   sanitizer runtime, instead of 1);
3. checks each answer's first token against a one-shot `cpfill prefill` of the same tokens on
   one rank (a session's second turn: of the whole conversation), that the second turn reused
   the first turn's KV, and that a bad token was refused; the examples' generations (12 tokens
   after prompt 1, greedy and sampled with a seed, streamed as they come) against `cpfill
   generate` on one rank with the same sampling; the C example's cancelled generation (finish
   reason "abort", far fewer tokens than asked); and every bad generation param refused with a
   message naming it;
4. checks that libcpfill.so exports exactly the functions cpfill.h declares, each at its
   version node (the prefill API at CPFILL_0.1, so programs built against it keep running).
"""
import json
import os
import re
import subprocess
import sys
import tempfile

LENS = [300, 77, 1000]  # as in launch/embed/examples/prefill.{c,py}
TURN2 = 50
GENERATED = 12  # as in launch/embed/examples/prefill.c
VOCAB = 1024  # the tiny preset's
FLAGS = ["--model", "tiny", "--tp", "2", "--ranks-per-node", "2", "--backend", "cpu",
         "--threads", "1", "--kv-capacity-tokens", "8192", "--timeout-s", "60"]
sys.path.insert(0, os.path.dirname(__file__))
from serve_test import MPI_ENV as ENV, fail  # noqa: E402


def run(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300, **kw)
    if r.returncode != 0:
        fail(f"exit {r.returncode}: {' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r.stdout


def prompt(i, n):
    return [(i * 7919 + j * 31) % VOCAB for j in range(n)]


def install_and_build(build, prefix):
    run(["cmake", "--install", build, "--prefix", prefix])
    for f in ("include/cpfill.h", "lib/libcpfill.so", "bin/cpfill"):
        if not os.path.exists(os.path.join(prefix, f)):
            fail(f"cmake --install left no {f}")
    exe = os.path.join(prefix, "prefill_example")
    src = os.path.join(SOURCE, "launch/embed/examples/prefill.c")
    run(["cc", "-std=c99", "-pedantic-errors", "-Wall", "-Werror", src, "-I", f"{prefix}/include",
         f"-L{prefix}/lib", "-lcpfill", f"-Wl,-rpath,{prefix}/lib", "-o", exe])
    return exe


def one_shot_first_tokens(cpfill, tmp):
    """First tokens of a one-shot prefill of every prompt and of the session's conversation."""
    seqs = [prompt(i, n) for i, n in enumerate(LENS)]
    seqs.append(prompt(0, LENS[0]) + prompt(1, TURN2))
    tokens = os.path.join(tmp, "tokens.json")
    json.dump(seqs, open(tokens, "w"))
    report = os.path.join(tmp, "report.json")
    run([cpfill, "prefill", "--model", "tiny", "--tokens", tokens, "--backend", "cpu",
         "--json", report])
    return [s["first_token"] for s in json.load(open(report))["sequences"]]


SAMPLED = ["--temperature", "0.9", "--top-k", "50", "--top-p", "0.95", "--sample-seed", "7"]
# What the examples' bad generation params are refused with, in their order.
BAD_PARAMS = ["struct_size is 0", "max_tokens is 0", "max_tokens is -1", "top_p is 1.5",
              "top_p is 0", "temperature is -1", "top_k is -1", "stop_token_ids is NULL",
              "sparq_r is 65", "sparq_k is -1", "sparq_l is -1"]
# The functions of the first ABI (CPFILL_0.1): they must never move.
ABI_0_1 = {"cpfill_version", "cpfill_last_error", "cpfill_engine_create", "cpfill_engine_rank",
           "cpfill_engine_size", "cpfill_engine_vocab_size", "cpfill_engine_run", "cpfill_submit",
           "cpfill_request_poll", "cpfill_request_wait", "cpfill_request_result",
           "cpfill_request_free", "cpfill_session_end", "cpfill_engine_shutdown",
           "cpfill_engine_destroy"}


def one_shot_generations(cpfill, tmp):
    """Tokens after prompt 1 from `cpfill generate` on one rank (the examples' prompt): greedy,
    and sampled as the examples sample."""
    tokens = os.path.join(tmp, "gen-tokens.json")
    json.dump([prompt(1, LENS[1])], open(tokens, "w"))
    out = {}
    for label, flags in (("greedy", []), ("sampled", SAMPLED)):
        report = os.path.join(tmp, f"gen-{label}.json")
        run([cpfill, "generate", "--model", "tiny", "--tokens", tokens, "--backend", "cpu",
             "--max-tokens", str(GENERATED), "--ignore-eos", "--json", report] + flags)
        out[label] = json.load(open(report))["sequences"][0]["tokens"]
    return out


def check_generation(output, want, label, cancelled):
    for run_label, tokens in want.items():
        m = re.search(rf"^{run_label}: tokens ([\d ]+) finish (\S+) reads (\d+)$", output, re.M)
        if not m:
            fail(f"{label}: no {run_label} generation line:\n{output}")
        got = [int(t) for t in m.group(1).split()]
        if got != tokens or m.group(2) != "length":
            fail(f"{label}: {run_label}: generated {got} ({m.group(2)}), "
                 f"cpfill generate on one rank: {tokens}")
        if not 1 <= int(m.group(3)) <= GENERATED:
            fail(f"{label}: {run_label}: read in {m.group(3)} waits, not 1 .. {GENERATED}")
        print(f"{label}: {run_label}: {len(got)} tokens equal one rank's, read in {m.group(3)} "
              "waits")
    if cancelled:
        m = re.search(r"^cancel: tokens (\d+) of (\d+) finish (\S+)$", output, re.M)
        if not m or m.group(3) != "abort" or not 3 <= int(m.group(1)) < int(m.group(2)) // 10:
            fail(f"{label}: the cancelled generation: {m.group(0) if m else output}")
        print(f"{label}: cancelled after {m.group(1)} of {m.group(2)} tokens")
    refused = re.findall(r"^bad params refused: (.*)$", output, re.M)
    if len(refused) != len(BAD_PARAMS) or any(
            want not in got or not got.startswith("cpfill_submit_generate: ")
            for want, got in zip(BAD_PARAMS, refused)):
        fail(f"{label}: bad generation params: {refused}, want messages naming {BAD_PARAMS}")


def check_exports(lib, header):
    """libcpfill.so's dynamic symbols: the functions cpfill.h declares, each at a CPFILL_ version,
    the first ABI's at CPFILL_0.1; nothing else (the C++ inside stays private)."""
    declared = set(re.findall(r"^[A-Za-z][\w ]*\** ?(cpfill_\w+)\(", open(header).read(), re.M))
    exported = {}
    for line in subprocess.run(["objdump", "-T", lib], capture_output=True, text=True,
                               check=True).stdout.splitlines():
        f = line.split()
        if len(f) >= 6 and f[1] == "g" and "*UND*" not in line and "*ABS*" not in line:
            if f[-2].startswith("(CPFILL_"):  # an older version kept for old programs (.symver)
                continue
            exported[f[-1]] = f[-2]
    if set(exported) != declared:
        fail(f"{lib} exports {sorted(set(exported) - declared)} beyond cpfill.h and lacks "
             f"{sorted(declared - set(exported))}")
    moved = {name: v for name, v in exported.items() if name in ABI_0_1 and v != "CPFILL_0.1"}
    unversioned = {name: v for name, v in exported.items() if not v.startswith("CPFILL_")}
    if not ABI_0_1 <= declared or moved or unversioned:
        fail(f"symbol versions: moved from CPFILL_0.1 {moved}, unversioned {unversioned}, "
             f"missing {sorted(ABI_0_1 - declared)}")
    print(f"{lib}: {len(exported)} functions, the {len(ABI_0_1)} of CPFILL_0.1 unmoved, "
          f"{sorted(set(exported.values()))}")


# A program built against CPFILL_0.2's cpfill.h: its cpfill_generate_params is 72 bytes (LP64)
# and its init binds to the CPFILL_0.2 version, which must write no more than that.
OLD_INIT_C = r"""
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
typedef struct {
  size_t struct_size; int32_t max_tokens; double temperature; int32_t top_k; double top_p;
  uint64_t seed; int ignore_eos; const int32_t* stop_token_ids; size_t num_stop_token_ids;
} params_0_2;
void cpfill_generate_params_init(params_0_2* p);
__asm__(".symver cpfill_generate_params_init, cpfill_generate_params_init@CPFILL_0.2");
int main(void) {
  struct { params_0_2 p; unsigned char guard[32]; } s;
  memset(&s, 0xab, sizeof s);
  cpfill_generate_params_init(&s.p);
  for (size_t i = 0; i < sizeof s.guard; ++i) {
    if (s.guard[i] != 0xab) { printf("old init wrote past the 0.2 struct\n"); return 1; }
  }
  printf("old init: struct_size %zu max_tokens %d\n", s.p.struct_size, (int)s.p.max_tokens);
  return s.p.struct_size == sizeof(params_0_2) && s.p.max_tokens == 16 ? 0 : 1;
}
"""


def check_old_init(lib, tmp):
    """cpfill_generate_params grew in CPFILL_0.4: a CPFILL_0.2 program's init stays in bounds."""
    src, exe = os.path.join(tmp, "old_init.c"), os.path.join(tmp, "old_init")
    open(src, "w").write(OLD_INIT_C)
    libdir = os.path.dirname(lib)
    run(["cc", "-std=c99", "-Wall", "-Werror", src, f"-L{libdir}", "-lcpfill",
         f"-Wl,-rpath,{libdir}", "-o", exe])
    print(run([exe]).strip())


def check(output, want, label):
    got = {m.group(1): (int(m.group(2)), m.group(3))
           for m in re.finditer(r"^(prompt \d|session turn \d): first_token (\d+)(.*)$", output, re.M)}
    names = [f"prompt {i}" for i in range(len(LENS))] + ["session turn 1", "session turn 2"]
    expected = want[:len(LENS)] + [want[0], want[len(LENS)]]
    for name, w in zip(names, expected):
        if name not in got:
            fail(f"{label}: no answer for {name}:\n{output}")
        if got[name][0] != w:
            fail(f"{label}: {name}: first token {got[name][0]}, one-shot prefill {w}")
    if f"cached_tokens {LENS[0]}" not in got["session turn 2"][1]:
        fail(f"{label}: the second turn did not reuse the first turn's KV: {got['session turn 2']}")
    if "refused as expected" not in output:
        fail(f"{label}: the bad token was not refused:\n{output}")
    print(f"{label}: {len(names)} answers equal one-shot prefills; the session reused its KV")


def main():
    global SOURCE
    build, SOURCE = sys.argv[1], sys.argv[2]
    tmp = tempfile.mkdtemp(prefix="cpfill-embed-")
    prefix = os.path.join(tmp, "prefix")
    if "--built-example" in sys.argv:
        exe = os.path.join(build, "examples/embed_example_c")
        want = one_shot_first_tokens(os.path.join(build, "cpfill"), tmp)
    else:
        exe = install_and_build(build, prefix)
        want = one_shot_first_tokens(os.path.join(prefix, "bin/cpfill"), tmp)
    cpfill = os.path.join(build, "cpfill") if "--built-example" in sys.argv else \
        os.path.join(prefix, "bin/cpfill")
    out = run(["mpirun", "-np", "4", exe] + FLAGS)
    check(out, want, "C example")
    generations = one_shot_generations(cpfill, tmp)
    check_generation(out, generations, "C example", cancelled=True)
    lib = os.path.join(build, "lib/libcpfill.so") if "--built-example" in sys.argv else \
        os.path.join(prefix, "lib/libcpfill.so")
    check_exports(lib, os.path.join(SOURCE, "launch/embed/cpfill.h"))
    check_old_init(lib, tmp)
    if "--python-example" in sys.argv:
        py = os.path.join(SOURCE, "launch/embed/examples/prefill.py")
        out = run(["mpirun", "-np", "4", sys.executable, py, f"{prefix}/lib/libcpfill.so"] + FLAGS)
        check(out, want, "Python ctypes example")
        check_generation(out, generations, "Python ctypes example", cancelled=False)
    print("PASS")


if __name__ == "__main__":
    main()
