#!/usr/bin/env python3
"""An independent Llama forward pass, as Hugging Face's LlamaForCausalLM computes it, in numpy
float64, to check cpfill's prefill against something that shares none of its code.

Reads a Hugging Face checkpoint directory (config.json + model.safetensors, F32 or BF16), runs
every prompt of a tokens JSON (a list of lists of ids) from position 0, and compares the
last-position logits and first tokens with a `cpfill prefill --save-logits` file.

  hf_llama_reference.py CHECKPOINT_DIR TOKENS.json LOGITS.safetensors [--tolerance 2e-3]
Exit 0 when every logit agrees within the tolerance and every first token is the same.
"""
import argparse
import json
import math
import struct
import sys

import numpy as np


def load_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        raw = blob[base + begin:base + end]
        if info["dtype"] == "F32":
            a = np.frombuffer(raw, dtype="<f4").astype(np.float64)
        elif info["dtype"] == "BF16":
            a = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
            a = a.astype(np.float64)
        elif info["dtype"] == "F8_E4M3":
            a = np.frombuffer(raw, dtype=np.uint8)  # codes; tests/fp8_reference.py decodes
        elif info["dtype"] == "I32":
            a = np.frombuffer(raw, dtype="<i4")
        else:
            sys.exit(f"{path}: {name}: dtype {info['dtype']} not handled")
        out[name] = a.reshape(info["shape"])
    return out


def inv_freq(cfg, dim):
    # transformers' default and llama3 rope init (modeling_rope_utils).
    # transformers 5 writes both under "rope_parameters"; earlier versions at the top level.
    rp = cfg.get("rope_parameters")
    base = rp.get("rope_theta", cfg.get("rope_theta")) if rp else cfg.get("rope_theta", 10000.0)
    freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    rs = rp if rp else cfg.get("rope_scaling")
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / freq
        scaled = np.where(wavelen > low_wavelen, freq / factor, freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        freq = np.where(medium, smoothed, scaled)
    return freq


def rms_norm(x, w, eps):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def rotate_half(x):
    d = x.shape[-1] // 2
    return np.concatenate([-x[..., d:], x[..., :d]], axis=-1)


def forward_last_logits(cfg, w, tokens, linear=None):
    return forward_logits(cfg, w, tokens, len(tokens) - 1, linear)[-1]


def forward_logits(cfg, w, tokens, first=0, linear=None):
    """Logits [positions, vocab] of a sequence run from position 0, for positions `first` on
    (teacher-forced decoding compares each step's). `linear(h, name)` computes a projection
    (default h @ w[name].T; tests/fp8_reference.py passes row-wise FP8)."""
    if linear is None:
        def linear(h, name):
            return h @ w[name].T
    d_model = cfg["hidden_size"]
    n_h = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads", n_h)
    hd = cfg.get("head_dim") or d_model // n_h
    eps = cfg["rms_norm_eps"]
    t = len(tokens)
    x = w["model.embed_tokens.weight"][np.array(tokens)]
    pos = np.arange(t, dtype=np.float64)
    freqs = np.outer(pos, inv_freq(cfg, hd))
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
    mask = np.triu(np.full((t, t), -np.inf), k=1)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (linear(h, p + "self_attn.q_proj.weight")).reshape(t, n_h, hd)
        k = (linear(h, p + "self_attn.k_proj.weight")).reshape(t, n_kv, hd)
        v = (linear(h, p + "self_attn.v_proj.weight")).reshape(t, n_kv, hd)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        group = n_h // n_kv
        k = np.repeat(k, group, axis=1)
        v = np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd) + mask
        scores -= scores.max(-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(t, n_h * hd)
        x = x + linear(attn, p + "self_attn.o_proj.weight")
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = linear(h, p + "mlp.gate_proj.weight")
        up = linear(h, p + "mlp.up_proj.weight")
        x = x + linear((gate / (1 + np.exp(-gate))) * up, p + "mlp.down_proj.weight")
    last = rms_norm(x[first:], w["model.norm.weight"], eps)
    head = w.get("lm_head.weight")
    if head is None or cfg.get("tie_word_embeddings"):
        head = w["model.embed_tokens.weight"]
    return last @ head.T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("tokens")
    ap.add_argument("logits")
    ap.add_argument("--tolerance", type=float, default=2e-3)
    args = ap.parse_args()
    cfg = json.load(open(f"{args.checkpoint}/config.json"))
    weights = load_safetensors(f"{args.checkpoint}/model.safetensors")
    prompts = json.load(open(args.tokens))
    got = load_safetensors(args.logits)
    worst, mismatches = 0.0, 0
    for s, tokens in enumerate(prompts):
        ref = forward_last_logits(cfg, weights, tokens)
        worst = max(worst, float(np.abs(got["logits"][s] - ref).max()))
        mismatches += int(got["first_tokens"][s]) != int(ref.argmax())
    ok = worst <= args.tolerance and mismatches == 0
    print(f"hf reference: {len(prompts)} prompt(s), max |logits - ref| = {worst:.3g}, "
          f"first-token mismatches {mismatches} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
