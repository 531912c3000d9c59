#!/usr/bin/env python3
"""`cpfill serve` with text prompts: a checkpoint with a tokenizer (needs the `tokenizers`
package, from launch/setup.sh's .venv).

    python3 tests/serve_text_test.py build/cpfill

Exports the tiny preset as a checkpoint, trains a Llama-3-style tokenizer for it with
`tokenizers` (as tests/tokenizer_check.py does, a vocabulary the tiny model holds) and saves it
beside the weights, serves it on 2 ranks (CP2, CPU backend), and asserts that
  * /v1/models says the server takes text;
  * a text prompt is answered exactly as the token ids `tokenizers` encodes it to (BOS first):
    same first token, same prompt_tokens; choices[].text is `tokenizers`' decode of that token;
  * a stop string ends generation and cuts the text before it, streamed or not;
  * a batch of texts and a session of text turns work; texts with non-ASCII, emoji, special
    tokens and whitespace runs are among them;
  * a body with invalid UTF-8 inside the prompt gets a 400 naming the problem, and the server
    goes on; SIGTERM ends it with exit 0.
"""
import json
import os
import random
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from serve_test import MPI_ENV, fail, http, rank_pid, wait_port  # noqa: E402
from serve_generate_test import stream  # noqa: E402
import tokenizer_check as tc  # noqa: E402

TINY_VOCAB = 1024
TEXTS = 30


def make_checkpoint(cpfill, tmp, env):
    ckpt = os.path.join(tmp, "ckpt")
    r = subprocess.run([cpfill, "export", "--model", "tiny", "--out", ckpt], env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"export: {r.stderr}")
    # Room for Llama 3's 256 added tokens (and two more) inside the tiny model's vocabulary.
    rng = random.Random(3)
    trained = tc.train(rng, vocab_size=TINY_VOCAB - len(tc.SPECIAL) - 2)
    tok = tc.save(ckpt, tc.llama3_shape(trained))
    if tok.get_vocab_size(with_added_tokens=True) > TINY_VOCAB:
        fail(f"the trained tokenizer has {tok.get_vocab_size()} ids, more than {TINY_VOCAB}")
    return ckpt, tok


def start(cpfill, ckpt, tmp, env):
    port_file = os.path.join(tmp, "port")
    log = open(os.path.join(tmp, "serve.log"), "w+")
    server = subprocess.Popen(
        ["mpirun", "-np", "2", cpfill, "serve", "--model", ckpt, "--port", "0", "--port-file",
         port_file, "--backend", "cpu", "--threads", "1", "--kv-capacity-tokens", "16384",
         "--timeout-s", "60"], stdout=log, stderr=subprocess.STDOUT, env=env)
    return server, wait_port(server, port_file, seconds=120, log=log), log


def complete(port, prompt, session=None, **fields):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, **fields}
    if session:
        body["session"] = session
    status, text = http(port, "POST", "/v1/completions", body)
    if status != 200:
        fail(f"{prompt!r}: {status} {text}")
    return json.loads(text)


def check_text_equals_ids(port, tok, text):
    ids = tok.encode(text).ids
    by_text, by_ids = complete(port, text), complete(port, ids)
    first = by_text["choices"][0]["token_ids"][0]
    if first != by_ids["choices"][0]["token_ids"][0]:
        fail(f"{text!r}: first token {first} by text, "
             f"{by_ids['choices'][0]['token_ids'][0]} by the ids tokenizers gives")
    if by_text["usage"]["prompt_tokens"] != len(ids):
        fail(f"{text!r}: {by_text['usage']['prompt_tokens']} prompt tokens, tokenizers: {len(ids)}")
    want = tok.decode([first], skip_special_tokens=False)
    if by_text["choices"][0]["text"] != want:
        fail(f"{text!r}: text {by_text['choices'][0]['text']!r}, tokenizers decodes {want!r}")


def check_logprobs_name_tokens(port, tok):
    """With a tokenizer, logprobs name tokens by their text, as OpenAI clients read them, and
    text_offset points into the choice's text alike whether streamed or not (a character split
    over byte tokens counts once)."""
    body = {"prompt": "Once upon a time", "max_tokens": 12, "logprobs": 4}
    choice = complete(port, **body)["choices"][0]
    lp = choice["logprobs"]
    names = [tok.decode([i], skip_special_tokens=False) for i in choice["token_ids"]]
    if lp["tokens"] != names or lp["token_ids"] != choice["token_ids"]:
        fail(f"logprobs tokens {lp['tokens']} / {lp['token_ids']}, generated {names}")
    for name, top in zip(names, lp["top_logprobs"]):
        if not 1 <= len(top) <= 4 or name not in top:  # greedy: the chosen token is the top one
            fail(f"top_logprobs {top} lack the chosen token {name!r}")
    offsets = lp["text_offset"]
    if offsets[0] != 0 or offsets != sorted(offsets) or offsets[-1] > len(choice["text"]):
        fail(f"text_offset {offsets} for the text {choice['text']!r}")
    streamed = [e["choices"][0]["logprobs"]["text_offset"][0]
                for e in stream(port, {"model": MODEL, "temperature": 0, "stream": True, **body})
                if e != "[DONE]" and e.get("choices")]
    if streamed != offsets:
        fail(f"text_offset streamed {streamed}, in one answer {offsets}")


def check_stop_strings(port):
    """A stop string ends generation where the text first holds it: the text ends just before it
    (after it with include_stop_str_in_output), finish_reason "stop", fewer tokens than asked;
    streamed chunks add up to the same text and none holds the stop string."""
    # Sampled with a seed: a tiny random model's greedy text repeats itself, sampling does not.
    body = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "temperature": 1.0,
            "seed": 11}
    full = complete(port, **body)["choices"][0]
    text = full["text"]
    picks = [(at, text[at:at + 4]) for at in range(len(text) // 3, len(text) - 4)
             if text[at:at + 4].strip() and text.find(text[at:at + 4]) == at]
    if not picks:
        fail(f"no stop string to pick from the greedy text {text!r}")
    at, stop = picks[0]
    got = complete(port, stop=[stop, "<<never>>"], **body)["choices"][0]
    n = len(got["token_ids"])
    if got["text"] != text[:at] or got["finish_reason"] != "stop" or n >= len(full["token_ids"]):
        fail(f"stop {stop!r} in {text!r}: text {got['text']!r}, {got['finish_reason']}, {n} tokens")
    if got["token_ids"] != full["token_ids"][:n]:
        fail(f"stop {stop!r}: tokens {got['token_ids']} are not the full run's first {n}")
    events = [e for e in stream(port, {"model": MODEL, "temperature": 0, "stream": True,
                                       "stop": stop, **body})
              if e != "[DONE]" and e.get("choices")]
    chunks = [e["choices"][0]["text"] for e in events]
    if "".join(chunks) != text[:at] or events[-1]["choices"][0]["finish_reason"] != "stop" or \
            any(stop in c for c in chunks):
        fail(f"stop {stop!r} streamed as {chunks}, want {text[:at]!r} then finish_reason stop")
    kept = complete(port, stop=stop, include_stop_str_in_output=True, **body)["choices"][0]
    if kept["text"] != text[:at + len(stop)]:
        fail(f"include_stop_str_in_output: {kept['text']!r}, want {text[:at + len(stop)]!r}")
    absent = complete(port, stop="<<never>>", **body)["choices"][0]
    if absent["text"] != text or absent["finish_reason"] != "length":
        fail(f"a stop string never generated changed the answer: {absent}")
    print(f"stop strings ok: {stop!r} at character {at} of {len(text)}, {n} tokens")


def run(port, tok):
    status, body = http(port, "GET", "/v1/models")
    if status != 200 or not json.loads(body)["data"][0].get("text_prompts"):
        fail(f"/v1/models does not offer text prompts: {body}")
    rng = random.Random(7)
    texts = [t for t in tc.EDGE_CASES if t][:TEXTS] + [tc.random_text(rng) for _ in range(TEXTS)]
    texts.append(f"{tc.SPECIAL[0]}Hello{tc.SPECIAL[9]} world")
    for text in texts:
        check_text_equals_ids(port, tok, text)
    check_logprobs_name_tokens(port, tok)
    check_stop_strings(port)
    batch = complete(port, texts[:4])
    for text, choice in zip(texts[:4], batch["choices"]):
        single = complete(port, text)["choices"][0]["token_ids"][0]
        if choice["token_ids"][0] != single:
            fail(f"batch of texts: {text!r} answered {choice['token_ids'][0]}, alone {single}")
    turn1 = complete(port, "Once upon a time", session="story")
    turn2 = complete(port, " there was a tokenizer.", session="story")
    cached = turn2["usage"]["prompt_tokens_details"]["cached_tokens"]
    if cached != turn1["usage"]["prompt_tokens"]:
        fail(f"the second text turn reused {cached} tokens, the first had "
             f"{turn1['usage']['prompt_tokens']}")
    bad = b'{"prompt": "caf\xe9", "max_tokens": 1}'  # Latin-1, not UTF-8
    status, body = http(port, "POST", "/v1/completions", bad)
    if status != 400 or "UTF-8" not in body:
        fail(f"invalid UTF-8 in the prompt: {status} {body}")
    check_text_equals_ids(port, tok, "after the bad request")
    print(f"{len(texts)} texts (and the same as token ids) answered alike; a batch of texts, a "
          f"session of text turns, invalid UTF-8 refused: {body}")


def main():
    global MODEL
    cpfill = os.path.abspath(sys.argv[1])
    env = MPI_ENV
    tmp = tempfile.mkdtemp(prefix="cpfill-serve-text-")
    ckpt, tok = make_checkpoint(cpfill, tmp, env)
    MODEL = ckpt
    server, port, log = start(cpfill, ckpt, tmp, env)
    try:
        run(port, tok)
        os.kill(rank_pid(0), signal.SIGTERM)
        if server.wait(timeout=60) != 0:
            fail(f"the server exited {server.returncode} after SIGTERM")
    finally:
        if server.poll() is None:
            server.kill()
            log.seek(0)
            print(log.read()[-3000:])
    print("PASS: serve_text_prompts")


if __name__ == "__main__":
    main()
