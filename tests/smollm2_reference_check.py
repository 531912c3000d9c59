#!/usr/bin/env python3
"""SmolLM2-135M-Instruct on cpfill against an independent fp64 reference (CTest smollm2_reference).

    smollm2_reference_check.py build/cpfill WORKDIR [--layouts 1,2kv,4q] [--decode-tokens 32]

The real pretrained model (tests/models/convert_smollm2.py: the GGUF of the package index
dequantized to fp32) runs on cpfill's CPU backend (fp32) in several TP x CP layouts, and the numpy
float64 Llama of tests/hf_llama_reference.py, which shares no code with cpfill, checks it:

  prefill  `cpfill prefill --save-logits` of two prose prompts (fused in one batch): every
           last-position logit, and the first token;
  decode   `cpfill serve` (no tokenizer in the directory: token ids only) generates greedily
           from each prompt (both in flight together) with logprobs 20; teacher-forced, the
           reference runs the prompt and the tokens cpfill chose, and at every step the chosen
           token must be the reference's argmax and each of the 21 log-probabilities cpfill
           reports (chosen and top 20) must equal the reference's log-softmax.

Tolerances (absolute): logits 2e-4, log-probabilities 1e-4, for fp32 against fp64 through 30
layers on logits of magnitude up to about 30. Measured worst differences are 4.5e-5 (logits) and
2.6e-5 (log-probabilities) (bench/results/2026-12-07-cpu-smollm2); the bounds are about 4x that,
far below what a real error gives (a wrong RoPE pair, a head on the wrong rank, a stale KV block
each move logits by 0.1 or more). A greedy step may differ from the
reference argmax only at a near tie (top two within twice the bound); none occurs in these prompts.

Layouts (ranks: TP x CP, prefill algorithm): 1: 1x1; 2kv: 1x2 pass-KV; 3tp: 3x1 (SmolLM2 has 9
heads and 3 KV heads: one KV head per rank); 4q: 1x4 pass-Q; 4kv: 1x4 pass-KV; and, with
--layouts only, 2q: 1x2 pass-Q. Decode is ring pass-Q over the CP ranks in every layout.

Without a tokenizer cpfill still runs token ids: the decode server above has none, and answers a
text prompt 400 saying no tokenizer is loaded; a tokenizer.json cpfill cannot read (a WordPiece
one) leaves `generate --tokens` running (a warning naming the file) and `generate --text`
refused (exit 2, the reason given).

Exit 0: every layout agrees; 1: a mismatch; 77: SKIPPED, the package index is unreachable
(exit 1 instead where CI=true).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "models"))
import convert_smollm2  # noqa: E402
import hf_llama_reference as ref  # noqa: E402
from serve_test import MPI_ENV, http, start_checkpoint_serve, stop_serve  # noqa: E402

PREFILL_TOLERANCE = 2e-4  # max |logit - fp64 logit|
LOGPROB_TOLERANCE = 1e-4  # max |logprob - fp64 log-softmax|
TOP_K = 20

PROMPTS = [
    "The old lighthouse keeper climbed the spiral stairs every evening, one hundred and twelve "
    "steps, counting them aloud as his father had done before him. At the top he trimmed the "
    "wick, polished the great lens until it shone, and watched the ships pass on the grey water. "
    "His daughter, who lived in the village below, brought him bread and news on Sundays. "
    "One night in November a storm came in from the west, and the lamp",
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light into "
    "chemical energy. In the chloroplasts, chlorophyll absorbs mostly red and blue light, and the "
    "energy splits water into oxygen, protons and electrons. The electrons pass along a chain of "
    "proteins in the thylakoid membrane, pumping protons that drive ATP synthase. In the second "
    "stage, the Calvin cycle, the enzyme RuBisCO fixes carbon dioxide from the air into "
    "three-carbon sugars, using the ATP and NADPH made by the light reactions. Because RuBisCO "
    "also reacts with oxygen, many plants in hot climates have evolved C4 or CAM pathways that",
]

# name: (ranks, tp, prefill algorithm)
LAYOUTS = {"1": (1, 1, "auto"), "2kv": (2, 1, "pass-kv"), "3tp": (3, 3, "auto"),
           "4q": (4, 1, "pass-q"), "4kv": (4, 1, "pass-kv"), "2q": (2, 1, "pass-q")}
DEFAULT_LAYOUTS = "1,2kv,3tp,4q,4kv"  # 2q: --layouts


def fail_soft(problems, msg):
    print(f"MISMATCH: {msg}", flush=True)
    problems.append(msg)


def mpirun(ranks, argv):
    return ["mpirun", "-np", str(ranks)] + argv


def ids_only_checkpoint(checkpoint, workdir):
    """The checkpoint without its tokenizer (links to the same files): serve then names tokens
    "token_id:N" in logprobs, exact ids to compare, and runs without a tokenizer."""
    d = os.path.join(workdir, "ids-only")
    os.makedirs(d, exist_ok=True)
    for name in ["config.json", "generation_config.json", "model.safetensors"]:
        link = os.path.join(d, name)
        if not os.path.lexists(link):
            os.symlink(os.path.join(checkpoint, name), link)
    return d


def prefill(cpfill, model, tokens_file, workdir, name, ranks, tp, algo):
    out = os.path.join(workdir, f"logits-{name}.safetensors")
    argv = mpirun(ranks, [cpfill, "prefill", "--model", model, "--tokens", tokens_file, "--tp",
                          str(tp), "--algo", algo, "--backend", "cpu", "--save-logits", out,
                          "--timeout-s", "120"])
    done = subprocess.run(argv, env=MPI_ENV, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return None, f"{' '.join(argv)}: exit {done.returncode}\n{done.stdout}{done.stderr}"
    return ref.load_safetensors(out), ""


def check_prefill(got, prompts, last_logits, name, problems):
    worst = 0.0
    for s, want in enumerate(last_logits):
        diff = float(np.abs(got["logits"][s] - want).max())
        worst = max(worst, diff)
        if int(got["first_tokens"][s]) != int(want.argmax()):
            fail_soft(problems, f"{name} prefill prompt {s}: first token "
                      f"{int(got['first_tokens'][s])}, reference {int(want.argmax())}")
    if worst > PREFILL_TOLERANCE:
        fail_soft(problems, f"{name} prefill: max |logits - fp64| {worst:.3g} > "
                  f"{PREFILL_TOLERANCE:g}")
    return worst


def check_text_refused(port, problems):
    status, body = http(port, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 1})
    if status != 400 or "no tokenizer is loaded" not in body:
        fail_soft(problems, f"a text prompt without a tokenizer: {status} {body}")


def check_unreadable_tokenizer(cpfill, ids_only, tokens_file, workdir, problems):
    """A checkpoint whose tokenizer.json cpfill cannot read: token ids run, text is refused."""
    d = os.path.join(workdir, "wordpiece-tokenizer")
    os.makedirs(d, exist_ok=True)
    for name in os.listdir(ids_only):
        if not os.path.lexists(os.path.join(d, name)):
            os.symlink(os.path.realpath(os.path.join(ids_only, name)), os.path.join(d, name))
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump({"version": "1.0", "model": {"type": "WordPiece", "vocab": {"a": 0}}}, f)
    base = [cpfill, "generate", "--model", d, "--max-tokens", "2", "--backend", "cpu"]
    ids = subprocess.run(base + ["--tokens", tokens_file], capture_output=True, text=True,
                         timeout=300)
    if ids.returncode != 0 or "warning: no tokenizer, token ids only" not in ids.stderr:
        fail_soft(problems, f"generate --tokens with an unreadable tokenizer.json: exit "
                  f"{ids.returncode}\n{ids.stderr}")
    text = subprocess.run(base + ["--text", "Hello"], capture_output=True, text=True, timeout=300)
    if text.returncode != 2 or "WordPiece" not in text.stderr:
        fail_soft(problems, f"generate --text with an unreadable tokenizer.json: exit "
                  f"{text.returncode}, want 2 naming the reason\n{text.stderr}")


def generate(port, prompts, max_tokens):
    """Both prompts in one request: decoded together, one batch."""
    status, body = http(port, "POST", "/v1/completions",
                        {"prompt": prompts, "max_tokens": max_tokens, "temperature": 0,
                         "logprobs": TOP_K}, timeout=600)
    if status != 200:
        return None, f"/v1/completions: {status} {body}"
    choices = sorted(json.loads(body)["choices"], key=lambda c: c["index"])
    return [c["logprobs"] for c in choices], ""


def check_decode(lp, prompt, reference, name, s, problems):
    """One sequence's steps against the reference's log-softmax at the same positions."""
    tokens = lp["token_ids"]
    logits = reference(prompt, tokens)  # [len(tokens), vocab]: step i chooses tokens[i]
    top = logits.max(-1, keepdims=True)
    logsm = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    worst = 0.0
    for i, token in enumerate(tokens):
        want = logsm[i]
        pairs = [(token, lp["token_logprobs"][i])]
        pairs += [(int(k.split(":")[1]), v) for k, v in lp["top_logprobs"][i].items()]
        worst = max(worst, max(abs(v - want[t]) for t, v in pairs))
        top2 = np.sort(want)[-2:]
        if token != int(want.argmax()) and top2[1] - top2[0] > 2 * LOGPROB_TOLERANCE:
            fail_soft(problems, f"{name} decode prompt {s} step {i}: token {token}, reference "
                      f"argmax {int(want.argmax())}")
        if len(lp["top_logprobs"][i]) != TOP_K:
            fail_soft(problems, f"{name} decode prompt {s} step {i}: "
                      f"{len(lp['top_logprobs'][i])} top logprobs, asked {TOP_K}")
    if worst > LOGPROB_TOLERANCE:
        fail_soft(problems, f"{name} decode prompt {s}: max |logprob - fp64| {worst:.3g} > "
                  f"{LOGPROB_TOLERANCE:g}")
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cpfill")
    ap.add_argument("workdir")
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS)
    ap.add_argument("--decode-tokens", type=int, default=32)
    args = ap.parse_args()
    cpfill = os.path.abspath(args.cpfill)
    checkpoint = convert_smollm2.require_checkpoint()
    os.makedirs(args.workdir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="smollm2-", dir=args.workdir)

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in PROMPTS]
    tokens_file = os.path.join(workdir, "prompts.json")
    with open(tokens_file, "w") as f:
        json.dump(prompts, f)
    cfg = json.load(open(os.path.join(checkpoint, "config.json")))
    weights = ref.load_safetensors(os.path.join(checkpoint, "model.safetensors"))
    start = time.time()
    last_logits = [ref.forward_last_logits(cfg, weights, p) for p in prompts]
    cache = {}

    def reference(prompt, tokens):
        key = (tuple(prompt), tuple(tokens))
        if key not in cache:
            cache[key] = ref.forward_logits(cfg, weights, prompt + tokens[:-1], len(prompt) - 1)
        return cache[key]
    print(f"smollm2_reference: prompts of {[len(p) for p in prompts]} tokens; fp64 reference "
          f"prefill in {time.time() - start:.1f} s", flush=True)

    model = ids_only_checkpoint(checkpoint, workdir)
    problems, lps = [], None
    print(f"{'layout':<6} {'ranks':>5} {'TP':>3} {'CP':>3} {'prefill':<8} "
          f"{'prefill max|d|':>15} {'decode max|d|':>14} {'steps':>6} {'s':>5}")
    for name in args.layouts.split(","):
        ranks, tp, algo = LAYOUTS[name]
        t0 = time.time()
        got, err = prefill(cpfill, model, tokens_file, workdir, name, ranks, tp, algo)
        if got is None:
            fail_soft(problems, err)
            continue
        prefill_worst = check_prefill(got, prompts, last_logits, name, problems)
        server, log, port, pid_file = start_checkpoint_serve(
            cpfill, model, workdir, ranks, "--tp", str(tp), "--algo", algo)
        try:
            lps, err = generate(port, prompts, args.decode_tokens)
            check_text_refused(port, problems)
        finally:
            stop_serve(server, pid_file)
            log.close()
        if lps is None:
            with open(os.path.join(workdir, "serve.log")) as f:
                fail_soft(problems, f"{name}: {err}\n{f.read()}")
            continue
        decode_worst = max(check_decode(lp, p, reference, name, s, problems)
                           for s, (lp, p) in enumerate(zip(lps, prompts)))
        steps = sum(len(lp["token_ids"]) for lp in lps)
        print(f"{name:<6} {ranks:>5} {tp:>3} {ranks // tp:>3} {algo:<8} {prefill_worst:>15.3g} "
              f"{decode_worst:>14.3g} {steps:>6} {time.time() - t0:>5.1f}", flush=True)
    check_unreadable_tokenizer(cpfill, model, tokens_file, workdir, problems)
    texts = [tok.decode(lp["token_ids"]) for lp in lps] if lps else []
    for p, t in zip(PROMPTS, texts):
        print(f"  ...{p[-40:]!r} -> {t!r}")
    verdict = "OK" if not problems else f"FAIL ({len(problems)} mismatches)"
    print(f"smollm2_reference: tolerances prefill {PREFILL_TOLERANCE:g}, logprobs "
          f"{LOGPROB_TOLERANCE:g} -> {verdict}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
