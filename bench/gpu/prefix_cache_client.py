#!/usr/bin/env python3
"""Client of bench/gpu/prefix_cache.sh: the prefix cache end to end against a running
`cpfill serve` (standard library only).

  document: a DOC-token document and QUESTIONS questions of 32 tokens about it. The first
    question is asked alone (it prefills the document), the rest at once from as many threads.
    Per question: TTFT as the server measured it (queue + prefill), cached tokens, the first
    token and its logprob; the wall time of the whole set.
  one batch: QUESTIONS - 1 other questions about the same document as one request (a list of
    prompts), so that they are prefilled in one batch however fast the server is: its wall time
    and the questions' TTFTs.
  one at a time: 8 more questions, each sent after the last one's answer (no sharing in a
    batch: what a lone question costs).
  samples: N completions of 128 tokens (ignore_eos, temperature 1, seed 1) of one PROMPT-token
    prompt, as one request with "n"; wall time and completion tokens per second.

    python3 prefix_cache_client.py PORT OUT.json DOC QUESTIONS PROMPT N
"""
import json
import sys
import threading
import time
import urllib.request


def post(port, body):
    r = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                               data=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(r, timeout=3000))


def ask(port, prompt):
    start = time.time()
    r = post(port, {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1})
    c, p = r["choices"][0], r["cpfill"]["prompts"][0]
    return {"ttft_ms": p["ttft_ms"], "client_ms": (time.time() - start) * 1e3,
            "cached": r["usage"]["prompt_tokens_details"]["cached_tokens"],
            "token": c["token_ids"][0], "logprob": c["logprobs"]["token_logprobs"][0]}


def document(port, doc_tokens, questions):
    doc = [(i * 7919 + 13) % 120000 for i in range(doc_tokens)]
    prompts = [doc + [(q * 1009 + i * 31) % 120000 for i in range(32)] for q in range(questions)]
    start = time.time()
    answers = [ask(port, prompts[0])] + [None] * (questions - 1)

    def one(q):
        answers[q] = ask(port, prompts[q])
    threads = [threading.Thread(target=one, args=(q,)) for q in range(1, questions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rest = sorted(a["ttft_ms"] for a in answers[1:]) or [0]
    return {"doc_tokens": doc_tokens, "questions": questions, "total_s": time.time() - start,
            "first_ttft_ms": answers[0]["ttft_ms"], "rest_median_ttft_ms": rest[len(rest) // 2],
            "rest_max_ttft_ms": rest[-1], "answers": answers}


def one_batch(port, doc_tokens, questions):
    doc = [(i * 7919 + 13) % 120000 for i in range(doc_tokens)]
    prompts = [doc + [(q * 2003 + i * 17 + 5) % 120000 for i in range(32)]
               for q in range(questions - 1)]
    start = time.time()
    r = post(port, {"prompt": prompts, "max_tokens": 1, "temperature": 0})
    wall = time.time() - start
    ttfts = sorted(p["ttft_ms"] for p in r["cpfill"]["prompts"])
    return {"questions": len(prompts), "wall_s": wall, "median_ttft_ms": ttfts[len(ttfts) // 2],
            "max_ttft_ms": ttfts[-1],
            "cached": r["usage"]["prompt_tokens_details"]["cached_tokens"]}


def one_at_a_time(port, doc_tokens, count=8):
    doc = [(i * 7919 + 13) % 120000 for i in range(doc_tokens)]
    ttfts = sorted(ask(port, doc + [(q * 4001 + i * 23 + 9) % 120000 for i in range(32)])["ttft_ms"]
                   for q in range(count))
    return {"questions": count, "median_ttft_ms": ttfts[count // 2], "min_ttft_ms": ttfts[0]}


def samples(port, prompt_tokens, n):
    prompt = [(i * 104729 + 7) % 120000 for i in range(prompt_tokens)]
    start = time.time()
    r = post(port, {"prompt": prompt, "max_tokens": 128, "ignore_eos": True, "temperature": 1.0,
                    "seed": 1, "n": n})
    wall = time.time() - start
    tokens = r["usage"]["completion_tokens"]
    return {"prompt_tokens": prompt_tokens, "n": n, "wall_s": wall, "completion_tokens": tokens,
            "tokens_per_s": tokens / wall,
            "cached": [p.get("cached_tokens") for p in r["cpfill"]["prompts"]][:4]}


def main():
    port, out, doc, questions, prompt, n = sys.argv[1:]
    result = {"document": document(port, int(doc), int(questions))}
    print(json.dumps({k: v for k, v in result["document"].items() if k != "answers"}), flush=True)
    if int(questions) > 1:
        result["one_batch"] = one_batch(port, int(doc), int(questions))
        print(json.dumps(result["one_batch"]), flush=True)
    result["one_at_a_time"] = one_at_a_time(port, int(doc))
    print(json.dumps(result["one_at_a_time"]), flush=True)
    result["samples"] = samples(port, int(prompt), int(n))
    print(json.dumps(result["samples"]), flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
