#!/usr/bin/env python3
"""Client of bench/gpu/prefix_decode.sh: n samples of one prompt against a running
`cpfill serve` (standard library only). Per prompt length: the prompt once (it fills the prefix
cache), then for each n one request of n completions of 128 tokens (ignore_eos, temperature 1,
seed 1), whose choices fork the cached prompt and decode together; wall time and completion
tokens per second. One JSON list to OUT, a line per run on stdout.

    python3 prefix_decode_client.py PORT OUT.json PROMPTS NS    (PROMPTS, NS: comma lists)
"""
import json
import sys
import time

from prefix_cache_client import post


def run(port, prompt_tokens, n):
    prompt = [(i * 104729 + 7 + prompt_tokens) % 120000 for i in range(prompt_tokens)]
    post(port, {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    start = time.time()
    r = post(port, {"prompt": prompt, "max_tokens": 128, "ignore_eos": True, "temperature": 1.0,
                    "seed": 1, "n": n})
    wall = time.time() - start
    tokens = r["usage"]["completion_tokens"]
    first = r["cpfill"]["prompts"][0]  # every choice ran the same steps
    steps = tokens // n - 1
    return {"prompt_tokens": prompt_tokens, "n": n, "wall_s": wall, "completion_tokens": tokens,
            "tokens_per_s": tokens / wall,
            "cached_tokens": r["usage"]["prompt_tokens_details"]["cached_tokens"],
            "step_ms": first["decode_ms"] / steps,
            "step_phases_ms": {k: v / steps for k, v in first["decode_step_phases_ms"].items()}}


def main():
    port, out, prompts, ns = sys.argv[1:]
    results = []
    for p in [int(x) for x in prompts.split(",")]:
        for n in [int(x) for x in ns.split(",")]:
            results.append(run(port, p, n))
            print(json.dumps(results[-1]), flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
