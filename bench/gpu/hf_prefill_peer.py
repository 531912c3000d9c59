#!/usr/bin/env python3
"""The peer for whole-model prefill: Hugging Face transformers' LlamaForCausalLM (SDPA attention,
bf16, random weights) on one GPU, on the geometry of a cpfill preset cut to N layers. Times one
forward pass of each prompt length (CUDA events, median of 3 after a warm-up) and prints JSON.

  hf_prefill_peer.py --layers 2 --lens 8192,32768 [--model llama3-8b]
"""
import argparse
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

GEOMETRY = {
    "llama3-8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lens", default="8192,32768")
    args = ap.parse_args()
    cfg = LlamaConfig(**GEOMETRY[args.model], num_hidden_layers=args.layers,
                      max_position_embeddings=131072, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192},
                      torch_dtype="bfloat16", attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).cuda().eval()
    for n in [int(x) for x in args.lens.split(",")]:
        ids = torch.randint(0, cfg.vocab_size, (1, n), device="cuda")
        entry = {"peer": "transformers", "model": args.model, "layers": args.layers, "tokens": n}
        try:
            with torch.no_grad():
                model(ids, logits_to_keep=1)  # warm-up
                times = []
                for _ in range(3):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    model(ids, logits_to_keep=1)
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b))
            entry["ms"] = sorted(times)[1]
        except Exception as e:  # out of memory at long lengths: recorded, not hidden
            entry["error"] = str(e).splitlines()[0][:160]
            torch.cuda.empty_cache()
        print(json.dumps(entry), flush=True)


if __name__ == "__main__":
    main()
