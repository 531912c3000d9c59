#!/usr/bin/env python3
"""The peer for generation: Hugging Face transformers' LlamaForCausalLM.generate (SDPA attention,
bf16, random weights, greedy, its default dynamic KV cache) on one GPU, on the Llama-3-8B
geometry cut to N layers. For each context length: the time of generate(max_new_tokens=1) (the
prefill) and of generate(max_new_tokens=N, min_new_tokens=N), both the median of 3 after a
warm-up; time per output token = (t_N - t_1) / (N - 1). Prints one JSON line per length.

  hf_generate_peer.py --layers 32 --lens 32768,131072 --new-tokens 64
"""
import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

GEOMETRY = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, vocab_size=128256)


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--lens", default="32768,131072")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    cfg = LlamaConfig(**GEOMETRY, num_hidden_layers=args.layers, max_position_embeddings=131072 + 1024,
                      rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192},
                      attn_implementation="sdpa", eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    n = args.new_tokens
    for length in [int(x) for x in args.lens.split(",")]:
        ids = torch.randint(0, cfg.vocab_size, (1, length), device="cuda")
        entry = {"peer": "transformers.generate", "layers": args.layers, "context": length,
                 "new_tokens": n}
        try:
            def gen(k):
                return lambda: model.generate(ids, max_new_tokens=k, min_new_tokens=k,
                                              do_sample=False, eos_token_id=None)
            with torch.no_grad():
                gen(2)()  # warm-up
                one = sorted(timed(gen(1)) for _ in range(3))[1]
                many = sorted(timed(gen(n)) for _ in range(3))[1]
            entry.update(prefill_ms=one * 1e3, generate_ms=many * 1e3,
                         tpot_ms=(many - one) / (n - 1) * 1e3)
        except Exception as e:  # out of memory at long lengths: recorded, not hidden
            entry["error"] = str(e).splitlines()[0][:160]
            torch.cuda.empty_cache()
        print(json.dumps(entry), flush=True)


if __name__ == "__main__":
    main()
