#!/usr/bin/env python3
"""Row-wise FP8 (fbgemm_fp8) in numpy, written from the format's definition and sharing no code
with cpfill, checks cpfill's CPU backend:

  1. weights: `cpfill export --quantize fp8-rowwise:all` of the tiny preset against numpy's
     quantization of the same preset's fp32 export: every E4M3 code and every scale identical.
  2. logits: `cpfill prefill --backend cpu --save-logits` of the FP8 checkpoint (TP2 x CP2 and one
     rank) against hf_llama_reference.py's float64 Llama whose projections quantize activations
     per token (in fp32, as the runtime does) and sum E4M3 products in float64.
  3. with --smollm2 (the CTest fixture's checkpoint, tests/models/convert_smollm2.py): the real
     checkpoint quantized at load (`--quantize fp8-rowwise`), logits against the same reference.

  fp8_reference.py CPFILL WORKDIR [--smollm2]
Exit 0 when all agree, 1 on a mismatch, 77 (skip) without numpy.
"""
import argparse
import json
import os
import subprocess
import sys

try:
    import numpy as np
except ImportError:
    print("SKIPPED: numpy missing")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_llama_reference as ref  # noqa: E402

E4M3_MAX = np.float32(448.0)
MIN_ROW_MAX = np.float32(1e-12)
# The runtime's activations are fp32, the reference's float64: where x / scale lies within fp32
# rounding of a tie between two E4M3 values, the two may pick different codes (one quantum, up to
# 1/8 of the value) and every later layer differs. A prompt whose reference meets no such near-tie
# (|x / scale - tie| < 5e-7 |x / scale|: 4 fp32 ulps) must agree within fp32 rounding (STRICT, logits ~1.5);
# one that meets some is held to a loose bound, relative to the logits' scale, that flipped codes
# explain: a 1-ulp perturbation of the reference's own activations moves tiny's 61-token prompt
# 0.014 (scale 1.4) and SmolLM2's prompts 0.7-1.0 (scale 24-28, 30 layers); its first token must
# still agree unless the reference's top two are closer than that bound.
STRICT_TOLERANCE = 1e-5
FLIP_TOLERANCE = 0.08  # times max |logit|
NEAR_TIE = 5e-7
PROJECTIONS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def e4m3_table():
    """The 256 codes' values from the bit layout (sign, 4-bit exponent bias 7, 3-bit mantissa;
    S.1111.111 NaN)."""
    v = np.empty(256, dtype=np.float64)
    for c in range(256):
        e, m = (c >> 3) & 0xF, c & 7
        mag = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        v[c] = np.nan if (c & 0x7F) == 0x7F else (-mag if c & 0x80 else mag)
    return v


DECODE = e4m3_table()
# The non-negative finite codes 0x00..0x7e are increasing in value.
POSITIVE = DECODE[:0x7F]


def encode(x):
    """float32 array -> E4M3 codes: nearest value, ties to the even code, saturating at 448."""
    x = np.asarray(x, dtype=np.float64)  # exact: x is float32
    a = np.minimum(np.abs(x), 448.0)
    hi = np.clip(np.searchsorted(POSITIVE, a, side="left"), 0, 0x7E)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - POSITIVE[lo], POSITIVE[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    code = np.where(np.signbit(x), code | 0x80, code)
    return np.where(np.isnan(x), np.where(np.signbit(x), 0xFF, 0x7F), code).astype(np.uint8)


def quantize_rows(m, ub=None):
    """Row-wise scale (fp32: max(min(max|row|, ub), 1e-12) / 448) and codes of m / scale (fp32)."""
    m = np.asarray(m, dtype=np.float32)
    amax = np.abs(m).max(axis=-1)
    if ub is not None:
        amax = np.minimum(amax, np.float32(ub))
    scale = (np.maximum(amax, MIN_ROW_MAX) / E4M3_MAX).astype(np.float32)
    return encode((m / scale[:, None]).astype(np.float32)), scale


TIES = (POSITIVE[:-1] + POSITIVE[1:]) / 2


def count_near_ties(h, x_scale):
    v = np.abs(h / x_scale[:, None].astype(np.float64))
    i = np.clip(np.searchsorted(TIES, v), 1, len(TIES) - 1)
    gap = np.minimum(np.abs(v - TIES[i - 1]), np.abs(v - TIES[i]))
    return int((gap < NEAR_TIE * np.maximum(v, 1e-30)).sum())


def fp8_linear_factory(weights, ub, tp=1, stats=None):
    """linear(h, name) for hf_llama_reference: FP8 projections where `weights` has codes. With
    tp > 1 a row-parallel projection's (o, down) input is split in tp column blocks, each
    quantized with its own per-token scale, as each TP rank quantizes the slice it holds."""
    def linear(h, name):
        w = weights[name]
        if w.dtype != np.uint8:
            return h @ w.T
        module = name[: -len(".weight")]
        w_scale = np.asarray(weights[module + ".weight_scale"], dtype=np.float32).reshape(-1)
        parts = tp if module.endswith(("o_proj", "down_proj")) else 1
        cols = h.shape[1] // parts
        y = 0
        for r in range(parts):
            hr, wr = h[:, r * cols:(r + 1) * cols], w[:, r * cols:(r + 1) * cols]
            xq, x_scale = quantize_rows(hr.astype(np.float32), ub)
            if stats is not None:
                stats["near_ties"] += count_near_ties(hr, x_scale)
            acc = DECODE[xq] @ DECODE[wr].T  # exact products, float64 sums
            y = y + acc * (x_scale[:, None] * w_scale[None, :]).astype(np.float32)
        return y
    return linear


def run(argv):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv)}: exit {done.returncode}\n{done.stdout}{done.stderr}")
    return done.stdout


def check_weights(cpfill, work):
    f32, fp8 = os.path.join(work, "tiny-f32"), os.path.join(work, "tiny-fp8")
    run([cpfill, "export", "--model", "tiny", "--out", f32])
    run([cpfill, "export", "--model", "tiny", "--out", fp8, "--quantize", "fp8-rowwise:all"])
    a = ref.load_safetensors(os.path.join(f32, "model.safetensors"))
    b = ref.load_safetensors(os.path.join(fp8, "model.safetensors"))
    cfg = json.load(open(os.path.join(fp8, "config.json")))
    assert cfg["quantization_config"]["quant_method"] == "fbgemm_fp8", cfg
    bad = 0
    for layer in range(cfg["num_hidden_layers"]):
        for proj in PROJECTIONS:
            name = f"model.layers.{layer}.{proj}"
            codes, scale = quantize_rows(a[name + ".weight"])
            bad += int((codes != b[name + ".weight"]).sum())
            bad += int((scale != b[name + ".weight_scale"].reshape(-1).astype(np.float32)).sum())
    print(f"weights: {cfg['num_hidden_layers'] * len(PROJECTIONS)} projections, "
          f"{bad} codes or scales differ from numpy's -> {'OK' if bad == 0 else 'MISMATCH'}")
    return fp8, bad == 0


def check_logits(cpfill, work, model, prompts, layouts, extra, label, strict=True):
    """`strict`: prompts without near-ties agree within fp32 rounding. Off for SmolLM2: over 30
    layers the fp32 activations drift more than the near-tie window from float64, so a code may
    flip anywhere ([1] agrees to 4e-5, [504] differs by 0.18 of 25)."""
    cfg = json.load(open(os.path.join(model, "config.json")))
    weights = ref.load_safetensors(os.path.join(model, "model.safetensors"))
    ub = cfg.get("quantization_config", {}).get("activation_scale_ub", 1200.0)
    if "--quantize" in extra:  # quantize the float checkpoint as the runtime does at load
        for layer in range(cfg["num_hidden_layers"]):
            for proj in PROJECTIONS if extra[-1] == "fp8-rowwise:all" else PROJECTIONS[4:]:
                name = f"model.layers.{layer}.{proj}"
                codes, scale = quantize_rows(weights[name + ".weight"].astype(np.float32))
                weights[name + ".weight"], weights[name + ".weight_scale"] = codes, scale
    tokens = os.path.join(work, f"tokens-{label}.json")
    json.dump(prompts, open(tokens, "w"))
    ok = True
    for ranks, tp in layouts:
        want, ties = [], []
        for p in prompts:
            stats = {"near_ties": 0}
            want.append(ref.forward_last_logits(cfg, weights, p,
                                                fp8_linear_factory(weights, ub, tp, stats)))
            ties.append(stats["near_ties"])
        out = os.path.join(work, f"logits-{label}-{ranks}-{tp}.safetensors")
        argv = [cpfill, "prefill", "--model", model, "--tokens", tokens, "--tp", str(tp),
                "--backend", "cpu", "--save-logits", out] + extra
        run((["mpirun", "-np", str(ranks)] if ranks > 1 else []) + argv)
        got = ref.load_safetensors(out)
        for s, w in enumerate(want):
            diff = float(np.abs(got["logits"][s] - w).max())
            exact = strict and ties[s] == 0
            tol = STRICT_TOLERANCE if exact else FLIP_TOLERANCE * float(np.abs(w).max())
            top2 = np.sort(w)[-2:]
            first_ok = int(got["first_tokens"][s]) == int(w.argmax()) or (
                not exact and top2[1] - top2[0] < tol)
            good = diff <= tol and first_ok
            ok &= good
            print(f"{label} {ranks} rank(s) tp {tp} prompt {s} ({len(prompts[s])} tokens, "
                  f"{ties[s]} near-ties): max |logits - fp64 FP8 ref| = {diff:.3g} "
                  f"(tolerance {tol:.3g}), first token {int(got['first_tokens'][s])} "
                  f"(reference {int(w.argmax())}) -> {'OK' if good else 'MISMATCH'}")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cpfill")
    ap.add_argument("workdir")
    ap.add_argument("--smollm2", action="store_true",
                    help="also SmolLM2-135M (the smollm2 fixture's checkpoint), quantized at load")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    assert all(encode(np.float32(DECODE[c]))[()] == c for c in range(256) if c & 0x7F != 0x7F)
    fp8, ok = check_weights(args.cpfill, args.workdir)
    prompts = [[(i * 37 + 5) % 1024 for i in range(61)], [(i * 11) % 1024 for i in range(9)], [7],
               [(i * 53 + 2) % 1024 for i in range(17)], [(i * 29 + 3) % 1024 for i in range(5)],
               [3, 999], [500, 1, 77]]
    ok &= check_logits(args.cpfill, args.workdir, fp8, prompts, [(1, 1), (4, 2)], [], "tiny")
    if args.smollm2:
        sys.path.insert(0, os.path.join(HERE, "models"))
        import convert_smollm2  # noqa: E402
        checkpoint = convert_smollm2.require_checkpoint()
        smol = [[1, 504, 3458, 282, 314, 1345, 28, 2362, 5134, 469, 253, 1789, 30],
                [(i * 97 + 13) % 49152 for i in range(40)], [1], [504], [2362, 5134]]
        ok &= check_logits(args.cpfill, args.workdir, checkpoint, smol, [(1, 1)],
                           ["--quantize", "fp8-rowwise"], "smollm2", strict=False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
