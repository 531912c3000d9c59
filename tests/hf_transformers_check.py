#!/usr/bin/env python3
"""cpfill against Hugging Face transformers itself, on checkpoints that transformers wrote.

Builds small Llama-3-style models with transformers' LlamaConfig (GQA, llama3 RoPE scaling whose
original_max_position_embeddings is shorter than the longest prompt, tied and untied LM heads),
saves each with LlamaForCausalLM.save_pretrained (one bf16 and sharded with an index, one fp32 in
a single file), prefills them with `cpfill prefill --model DIR --tokens ... --save-logits ...`
without any conversion, and compares the last-position logits and first tokens with
transformers' own forward pass: an fp32 model on the CPU, loaded with from_pretrained from the
same directory, so it holds exactly the weights cpfill read. Then `cpfill generate` (greedy,
12 tokens) against transformers' greedy `generate` on the same model: the same tokens (on CUDA,
up to a near tie of the reference, after which the texts differ).

  hf_transformers_check.py PATH/TO/cpfill TMPDIR [--backend cpu|cuda|all] [--mpirun-np N]

--backend all runs the CPU backend, then the CUDA one where `nvidia-smi -L` finds a GPU.
Tolerances are relative to the largest reference logit: 2e-3 for the CPU backend (fp32), 5e-2
for the CUDA backend (bf16), which may also pick another first token where the reference's top
two logits are closer than twice the error measured (as `cpfill prefill --check` allows).
Exit 0: every case agrees; 1: a mismatch or a cpfill failure; 77 (CTest "skipped"): torch or
transformers is not installed, or --backend cuda where there is no GPU.
"""
import argparse
import json
import os
import random
import shutil
import struct
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_llama_reference import load_safetensors  # noqa: E402

try:
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
except Exception as e:  # ImportError, or a broken install that fails while importing
    print(f"SKIPPED: needs torch and transformers ({type(e).__name__}: {e})")
    sys.exit(77)

transformers.utils.logging.disable_progress_bar()  # save/load bars would bury the table

# Open MPI refuses to run as root and to oversubscribe small machines without these; the same
# as tests/cli_test.sh and CPFILL_MPI_TEST_ENV.
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
}

# Max |logit diff| / max(1, max |reference logit|). The CUDA backend rounds weights (an fp32
# checkpoint's too) and activations to bf16: it measured 2.7% on the fp32 case (H200, 333 tokens),
# where a wrong RoPE is off by more than 100%.
TOLERANCE = {"cpu": 2e-3, "cuda": 5e-2}

# Every case: head_dim 64, which both cpfill backends take (the CUDA attention kernel has 64 and
# 128); GQA 8/2; llama3 RoPE scaling with a short original context, so the scaled and smoothed
# frequency bands all differ from plain RoPE; 2 layers; intermediate size not 4 * hidden.
CASES = [
    {
        # head_dim given explicitly and 8 * 64 != hidden: q_proj is [512, 256].
        "name": "bf16-tied-sharded",
        "config": dict(vocab_size=1000, hidden_size=256, intermediate_size=688,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                       head_dim=64, max_position_embeddings=1024, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64},
                       rms_norm_eps=1e-5, tie_word_embeddings=True),
        "dtype": torch.bfloat16,
        "max_shard_size": "300KB",  # the 2 layers' tensors spread over several files
        "seed": 11,
        "prompt_lens": [1, 9, 61, 200],
    },
    {
        "name": "fp32-untied-single",
        "config": dict(vocab_size=768, hidden_size=512, intermediate_size=1408,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                       max_position_embeddings=2048, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 32},
                       rms_norm_eps=1e-5, tie_word_embeddings=False),
        "dtype": torch.float32,
        "max_shard_size": "10GB",  # one model.safetensors
        "seed": 12,
        "prompt_lens": [3, 40, 333],
    },
]


def major_version(module):
    return int(module.__version__.split(".")[0])


def build_checkpoint(case, directory):
    """Random init as transformers does it, larger than its default so that attention is far
    from uniform, with norm weights away from 1; then save_pretrained in the case's dtype."""
    torch.manual_seed(case["seed"])
    config = LlamaConfig(initializer_range=0.08, **case["config"])
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
    model = model.to(case["dtype"])
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory, safe_serialization=True,
                          max_shard_size=case["max_shard_size"])
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def load_reference(directory, saved):
    """transformers' fp32 CPU model from the directory, checked to hold the weights saved."""
    # transformers 5 calls the argument dtype (and loads the saved dtype by default); 4.x calls
    # it torch_dtype and would keep an unknown keyword as a config attribute.
    dtype_arg = "dtype" if major_version(transformers) >= 5 else "torch_dtype"
    model = LlamaForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                             **{dtype_arg: torch.float32})
    model = model.float().eval()
    loaded = model.state_dict()
    for name, value in saved.items():
        if not torch.equal(loaded[name], value):
            sys.exit(f"{directory}: from_pretrained's {name} differs from the model saved")
    return model


def reference_logits(model, prompts):
    out = []
    with torch.no_grad():
        for tokens in prompts:
            logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
            out.append(logits.double())
    return torch.stack(out)


def read_safetensors(path):
    """name -> tensor, for the F32 and I32 tensors `cpfill prefill --save-logits` writes (the
    numpy reader of hf_llama_reference.py, beside this file)."""
    return {name: torch.from_numpy(np.array(a)) for name, a in load_safetensors(path).items()}


def describe_checkpoint(directory):
    """config.json and every safetensors header's tensor names, dtypes and shapes."""
    lines = [f"--- {directory}/config.json:", open(os.path.join(directory, "config.json")).read()]
    for file_name in sorted(os.listdir(directory)):
        if not file_name.endswith(".safetensors"):
            continue
        with open(os.path.join(directory, file_name), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        lines.append(f"--- {file_name}: metadata {header.pop('__metadata__', None)}")
        for name, info in header.items():
            lines.append(f"    {name}: {info['dtype']} {info['shape']}")
    return "\n".join(lines)


def run_cpfill(args, backend, directory, tokens_file, logits_file):
    command = [args.cpfill, "prefill", "--model", directory, "--tokens", tokens_file,
               "--save-logits", logits_file, "--backend", backend]
    if args.mpirun_np > 1:
        command = ["mpirun", "-np", str(args.mpirun_np), "--allow-run-as-root",
                   "--oversubscribe"] + command
    env = dict(os.environ, **MPI_ENV)
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        return None, f"{' '.join(command)}: timed out after {e.timeout} s"
    output = done.stdout + done.stderr
    if done.returncode != 0:
        return None, f"{' '.join(command)}: exit {done.returncode}\n{output}"
    return read_safetensors(logits_file), output


def compare(case, backend, prompts, ref, got):
    """Prints one row per prompt; returns the case's verdict."""
    logits = got["logits"].double()
    first = got["first_tokens"].long()
    scale = max(1.0, float(ref.abs().max()))
    diff = (logits - ref).abs().max(dim=1).values
    worst = float(diff.max()) if not torch.isnan(diff).any() else float("inf")
    allowed = TOLERANCE[backend] * scale
    logits_ok = worst <= allowed
    ok = logits_ok
    for s, tokens in enumerate(prompts):
        top2 = torch.topk(ref[s], 2).values
        want = int(ref[s].argmax())
        # Only where the logits agree within the tolerance may bf16 flip a close top two.
        near_tie = logits_ok and float(top2[0] - top2[1]) <= 2 * worst
        token_ok = int(first[s]) == want or (backend == "cuda" and near_tie)
        ok = ok and token_ok
        mark = "" if int(first[s]) == want else (" near tie" if token_ok else " MISMATCH")
        print(f"  {case['name']:<20} {backend:<5} {len(tokens):>6} {float(diff[s]):>11.3g} "
              f"{int(first[s]):>7} {want:>7}{mark}")
    print(f"  -> {case['name']} on {backend}: max |logits - transformers| = {worst:.3g}, "
          f"allowed {allowed:.3g} ({TOLERANCE[backend]:g} x logit scale {scale:.3g}): "
          f"{'PASS' if ok else 'FAIL'}")
    return ok


NEW_TOKENS = 12


def reference_generation(model, prompt):
    """transformers' greedy generate (fp32 CPU, stops at the checkpoint's EOS as cpfill does):
    the tokens and the logits each was chosen from."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        # The mask given: without one, generate masks every token equal to the pad id.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [score[0].double() for score in out.scores]


def run_generate(args, backend, directory, tokens_file, json_file):
    command = [args.cpfill, "generate", "--model", directory, "--tokens", tokens_file,
               "--max-tokens", str(NEW_TOKENS), "--temperature", "0", "--backend", backend,
               "--json", json_file]
    if args.mpirun_np > 1:
        command = ["mpirun", "-np", str(args.mpirun_np), "--allow-run-as-root",
                   "--oversubscribe"] + command
    done = subprocess.run(command, env=dict(os.environ, **MPI_ENV), capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        return None, f"{' '.join(command)}: exit {done.returncode}\n{done.stdout}{done.stderr}"
    return [s["tokens"] for s in json.load(open(json_file))["sequences"]], ""


def compare_generation(case, backend, model, prompts, got, prefill_error):
    """cpfill's greedy tokens against transformers' generate: equal, or (CUDA) equal up to a
    near tie of the reference, after which the two continue different texts."""
    ok = True
    for prompt, tokens in zip(prompts, got):
        want, scores = reference_generation(model, prompt)
        same = 0
        while same < min(len(want), len(tokens)) and want[same] == tokens[same]:
            same += 1
        verdict = "equal" if tokens == want else "MISMATCH"
        if tokens != want and backend == "cuda" and same < min(len(want), len(tokens)):
            top2 = torch.topk(scores[same], 2).values
            if float(top2[0] - top2[1]) <= 2 * prefill_error:
                verdict = f"near tie at token {same}"
        ok = ok and verdict != "MISMATCH"
        print(f"  {case['name']:<20} {backend:<5} {len(prompt):>6}  generate {len(tokens)} "
              f"tokens, {same} as transformers: {verdict}")
    return ok


def gpu_present():
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cpfill")
    ap.add_argument("tmpdir")
    ap.add_argument("--backend", choices=["cpu", "cuda", "all"], default="cpu")
    ap.add_argument("--mpirun-np", type=int, default=1)
    args = ap.parse_args()
    args.cpfill = os.path.abspath(args.cpfill)

    backends = ["cpu"] if args.backend in ("cpu", "all") else []
    if args.backend in ("cuda", "all"):
        if gpu_present():
            backends.append("cuda")
        elif args.backend == "cuda":
            print("SKIPPED: --backend cuda and nvidia-smi finds no GPU")
            return 77
        else:
            print("no GPU (nvidia-smi -L failed): the CUDA backend is not checked")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; "
          f"cpfill {args.cpfill} on {args.mpirun_np} rank(s), backends {', '.join(backends)}")

    os.makedirs(args.tmpdir, exist_ok=True)
    failures = []
    for case in CASES:
        directory = os.path.join(args.tmpdir, case["name"])
        saved = build_checkpoint(case, directory)
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        print(f"\n{case['name']}: saved by transformers in {len(files)} safetensors file(s)"
              f"{' with model.safetensors.index.json' if len(files) > 1 else ''}")
        rng = random.Random(case["seed"])
        vocab = case["config"]["vocab_size"]
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in case["prompt_lens"]]
        tokens_file = os.path.join(args.tmpdir, f"{case['name']}.tokens.json")
        with open(tokens_file, "w") as f:
            json.dump(prompts, f)
        ref_model = load_reference(directory, saved)
        ref = reference_logits(ref_model, prompts)

        print(f"  {'case':<20} {'backend':<5} {'tokens':>6} {'max |diff|':>11} "
              f"{'cpfill':>7} {'hf':>7}   (first tokens)")
        case_failures = []
        for backend in backends:
            logits_file = os.path.join(args.tmpdir, f"{case['name']}.{backend}.logits.safetensors")
            got, output = run_cpfill(args, backend, directory, tokens_file, logits_file)
            if got is None:
                print(f"  -> {case['name']} on {backend}: cpfill failed on a checkpoint written "
                      f"by transformers:\n{output}")
                case_failures.append(f"{case['name']}/{backend} (cpfill failed)")
            elif not compare(case, backend, prompts, ref, got):
                case_failures.append(f"{case['name']}/{backend}")
            else:
                prefill_error = float((got["logits"].double() - ref).abs().max())
                gen_file = os.path.join(args.tmpdir, f"{case['name']}.{backend}.generate.json")
                tokens, output = run_generate(args, backend, directory, tokens_file, gen_file)
                if tokens is None:
                    print(f"  -> {case['name']} on {backend}: cpfill generate failed:\n{output}")
                    case_failures.append(f"{case['name']}/{backend} (generate failed)")
                elif not compare_generation(case, backend, ref_model, prompts, tokens,
                                            prefill_error):
                    case_failures.append(f"{case['name']}/{backend} (generate)")
        if case_failures:  # what transformers wrote, for whoever fixes the loader
            print(describe_checkpoint(directory))
        failures += case_failures

    print()
    if failures:
        print(f"hf transformers check: MISMATCH in {', '.join(failures)} (files kept in "
              f"{args.tmpdir})")
        return 1
    for case in CASES:  # only what this run wrote: TMPDIR may hold other things
        shutil.rmtree(os.path.join(args.tmpdir, case["name"]), ignore_errors=True)
        for name in os.listdir(args.tmpdir):
            if name.startswith(case["name"] + "."):
                os.remove(os.path.join(args.tmpdir, name))
    print(f"hf transformers check: {len(CASES)} checkpoint(s) x {len(backends)} backend(s) OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
