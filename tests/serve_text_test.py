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
  * a stop string ends generation and cuts the text and logprobs before it, streamed or not
    alike (a stream never sends the stop string), and a session keeps the tokens generated;
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
    # Special tokens stay in the text: the checks compare with tokenizers' decode of every id.
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "skip_special_tokens": False, **fields}
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
    body = {"prompt": "Once upon a time", "max_tokens": 12, "logprobs": 4,
            "skip_special_tokens": False}
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


def streamed(port, body):
    """A streamed completion's chunks (one prompt), and the usage chunk."""
    events = stream(port, {"model": MODEL, "stream": True, "skip_special_tokens": False,
                           "stream_options": {"include_usage": True}, **body})
    if events[-1] != "[DONE]" or events[-2]["choices"]:
        fail(f"the stream did not end with a usage chunk and [DONE]: {events[-2:]}")
    return [e["choices"][0] for e in events[:-2]], events[-2]["usage"]


def check_stream_agrees(port, body, whole, stop=None):
    """Streamed, the same request adds up to the same choice: text (never holding `stop`, not
    even for a moment), token ids, logprobs, finish reason and usage."""
    chunks, usage = streamed(port, body)
    texts = [c["text"] for c in chunks]
    so_far = ["".join(texts[:k + 1]) for k in range(len(texts))]
    if so_far[-1] != whole["text"] or (stop and any(stop in t for t in so_far)):
        fail(f"stop {stop!r} streamed as {texts}, want {whole['text']!r} and never the stop")
    ids = [t for c in chunks for t in c["token_ids"]]
    if ids != whole["token_ids"] or usage["completion_tokens"] != len(ids):
        fail(f"streamed token ids {ids} (usage {usage}), in one answer {whole['token_ids']}")
    if chunks[-1]["finish_reason"] != whole["finish_reason"] or \
            any(c["finish_reason"] for c in chunks[:-1]):
        fail(f"streamed finish reasons {[c['finish_reason'] for c in chunks]}")
    for field in ("tokens", "token_ids", "token_logprobs", "text_offset"):
        got = [x for c in chunks for x in c["logprobs"][field]]
        if not same_logprobs(field, got, whole["logprobs"][field]):
            fail(f"streamed logprobs {field} {got}, in one answer {whole['logprobs'][field]}")


def same_logprobs(field, a, b):
    """Logprobs of two runs of one request: the same tokens, and log-probabilities equal up to
    rounding (each decode step places the new token's KV on a rank by the engine's step count,
    so two runs sum attention in another order)."""
    if field != "token_logprobs":
        return a == b
    return len(a) == len(b) and all(abs(x - y) < 1e-4 for x, y in zip(a, b))


def text_starts(tok, ids):
    """Where each token's text starts (in characters), by `tokenizers`: after the text of the
    tokens before it, or with the token before while that text ends in a split character."""
    starts = []
    for i in range(len(ids)):
        before = tok.decode(ids[:i], skip_special_tokens=False)
        starts.append(starts[-1] if before.endswith("\ufffd") else len(before))
    return starts


def stop_picks(tok, full):
    """Two stop strings from a generated text, each found nowhere before its place: one where a
    token starts (the tokens from there on lie past the cut), the shortest such piece of 4
    characters or more; and 4 characters anywhere (likely across tokens, mid-token)."""
    text = full["text"]

    def fits(at, k):
        piece = text[at:at + k]
        return at + k <= len(text) and piece.strip() and "\ufffd" not in piece and \
            text.find(piece) == at
    starts = sorted(set(text_starts(tok, full["token_ids"])))
    at_token = [(at, text[at:at + k], True) for at in starts if at >= len(text) // 3
                for k in range(4, 33) if fits(at, k)]
    anywhere = [(at, text[at:at + 4], False) for at in range(len(text) // 3, len(text))
                if fits(at, 4) and at not in starts]
    if not at_token or not anywhere:
        fail(f"no stop strings to pick from the sampled text {text!r}")
    return [at_token[0], anywhere[0]]


def check_stop_strings(port, tok):
    """A stop string ends generation where the text first holds it: the text ends just before it
    (after it with include_stop_str_in_output), finish_reason "stop", fewer tokens than asked
    (the token ids and usage: every token generated, the one that completed the match too), the
    logprobs only of the tokens the text covers; streamed, the same, and no chunk ever sends the
    stop string; a session keeps the tokens generated up to the stop."""
    # Sampled with a seed: a tiny random model's greedy text repeats itself, sampling does not.
    body = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "temperature": 1.0,
            "seed": 11, "logprobs": 2}
    full = complete(port, **body)["choices"][0]
    picks = stop_picks(tok, full)
    generated = [check_stop(port, tok, body, full, *pick) for pick in picks]
    absent = complete(port, stop="<<never>>", **body)["choices"][0]
    if absent["text"] != full["text"] or absent["finish_reason"] != "length" or not all(
            same_logprobs(f, absent["logprobs"][f], full["logprobs"][f])
            for f in ("tokens", "token_ids", "token_logprobs", "text_offset")):
        fail(f"a stop string never generated changed the answer: {absent}")
    check_stream_agrees(port, dict(body, stop="<<never>>"), absent, "<<never>>")
    # The session holds the prompt and the n tokens generated; the last one's KV comes with the
    # next turn.
    turn1 = complete(port, stop=picks[-1][1], session="stopped", **body)
    turn2 = complete(port, " and then", session="stopped")
    cached = turn2["usage"]["prompt_tokens_details"]["cached_tokens"]
    if cached != turn1["usage"]["prompt_tokens"] + generated[-1] - 1:
        fail(f"after a stop string the session reused {cached} tokens, want "
             f"{turn1['usage']['prompt_tokens']} + {generated[-1]} - 1")
    print(f"a stop string not generated changed nothing; the session kept the {generated[-1]} "
          "tokens generated up to its stop string")


def check_stop(port, tok, body, full, at, stop, at_token_start):
    """One stop string at character `at` of the full run's text; the tokens it generated."""
    text = full["text"]
    answer = complete(port, stop=[stop, "<<never>>"], **body)
    got = answer["choices"][0]
    n = len(got["token_ids"])
    if got["text"] != text[:at] or got["finish_reason"] != "stop" or n >= len(full["token_ids"]):
        fail(f"stop {stop!r} in {text!r}: text {got['text']!r}, {got['finish_reason']}, {n} tokens")
    if got["token_ids"] != full["token_ids"][:n] or answer["usage"]["completion_tokens"] != n:
        fail(f"stop {stop!r}: tokens {got['token_ids']} ({answer['usage']}) are not the full "
             f"run's first {n}")
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    if stop in decode(got["token_ids"][:-1]) or stop not in decode(got["token_ids"]):
        fail(f"stop {stop!r}: generation did not end at the token that completed it")
    # logprobs: of the tokens whose text starts before the cut, at their offsets.
    starts = text_starts(tok, got["token_ids"])
    covered = sum(1 for x in starts if x < len(got["text"]))
    lp = got["logprobs"]
    if (at_token_start and covered >= n) or lp["token_ids"] != got["token_ids"][:covered] or \
            lp["text_offset"] != starts[:covered] or \
            not same_logprobs("token_logprobs", lp["token_logprobs"],
                              full["logprobs"]["token_logprobs"][:covered]):
        fail(f"stop {stop!r}: logprobs {lp} for the text {got['text']!r}, want the first "
             f"{covered} tokens at {starts[:covered]}")
    check_stream_agrees(port, dict(body, stop=stop), got, stop)
    kept = complete(port, stop=stop, include_stop_str_in_output=True, **body)["choices"][0]
    if kept["text"] != text[:at + len(stop)] or kept["token_ids"] != got["token_ids"]:
        fail(f"include_stop_str_in_output: {kept['text']!r}, want {text[:at + len(stop)]!r}")
    check_stream_agrees(port, dict(body, stop=stop, include_stop_str_in_output=True), kept)
    print(f"stop {stop!r} at character {at} of {len(text)}: {n} tokens, logprobs of {covered}; "
          "streamed alike, never sent")
    return n


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
    check_stop_strings(port, tok)
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
        os.kill(rank_pid(0, server.pid), signal.SIGTERM)
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
