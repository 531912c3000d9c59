#!/usr/bin/env python3
"""The official `openai` Python SDK against `cpfill serve` on SmolLM2 (CTest openai_sdk_smollm2).

    openai_client_test.py build/cpfill

Serves SmolLM2-135M-Instruct (tests/models/convert_smollm2.py; with its tokenizer) on 4 ranks,
TP1 x CP4 (its 3 KV heads allow TP 1 or 3), and drives it with an unmodified `openai.OpenAI`
client, as a user's program would:
  * `models.list()` names the model;
  * a greedy text completion of "The capital of France is" says Paris; `usage.prompt_tokens` is
    what `tokenizers` counts; logprobs=5 names 5 alternatives per token, the chosen one among them;
  * the same request streamed (`stream=True`): the chunks add up to the same text and the last
    one carries finish_reason;
  * a two-turn ChatML conversation through `extra_body={"session": ...}`: the second turn sends
    only its new text, reuses the first turn's KV (`usage.prompt_tokens_details.cached_tokens`)
    and answers exactly as one request with the whole conversation as token ids;
  * a prompt id outside the vocabulary raises `openai.BadRequestError` (400) naming the problem.
The server stops on SIGTERM to rank 0 and must exit 0. Exit 77 (SKIPPED) without the package
index (1 where CI=true), or when the venv lacks `openai` and cannot install it.
"""
import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "models"))
import convert_smollm2  # noqa: E402
from serve_test import fail, start_checkpoint_serve, stop_serve_cleanly  # noqa: E402

MODEL = None  # the id /v1/models gives (the checkpoint's path)
RANKS = 4


def import_openai():
    try:
        return convert_smollm2.ensure_module("openai", "openai>=1.0")
    except convert_smollm2.Skipped as e:
        ci = os.environ.get("CI", "").lower() == "true"
        print(f"{'FAIL' if ci else 'SKIPPED'}: the openai package is not installable: {e}")
        sys.exit(1 if ci else 77)


def start(cpfill, checkpoint, tmp):
    return start_checkpoint_serve(cpfill, checkpoint, tmp, RANKS, "--tp", "1", kv_tokens=8192)


def check_completion(client, tok):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                  logprobs=5)
    text = r.choices[0].text
    if "Paris" not in text:
        fail(f"{prompt!r} -> {text!r}: no Paris")
    if r.usage.prompt_tokens != len(tok.encode(prompt).ids):
        fail(f"usage.prompt_tokens {r.usage.prompt_tokens}, tokenizers: "
             f"{len(tok.encode(prompt).ids)}")
    lp = r.choices[0].logprobs
    if len(lp.tokens) != r.usage.completion_tokens or "".join(lp.tokens) != text:
        fail(f"logprobs tokens {lp.tokens} do not spell {text!r}")
    for token, top in zip(lp.tokens, lp.top_logprobs):
        if len(top) != 5 or token not in top:
            fail(f"top_logprobs {top} of {token!r}: not 5 alternatives with the chosen one")
    print(f"openai: completion {prompt!r} -> {text!r}, {r.usage.prompt_tokens} prompt tokens")
    return prompt, text


def check_stream(client, prompt, text):
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                            temperature=0, stream=True))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    if streamed != text:
        fail(f"streamed {streamed!r}, not the completion's {text!r}")
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    if finish[-1] not in ("stop", "length") or any(finish[:-1]):
        fail(f"finish_reason per chunk {finish}: only the last one should have it")
    print(f"openai: stream of {len(chunks)} chunks adds up to the same text")


def check_session(client, tok):
    turn1 = ("<|im_start|>user\nMy name is Ada and I live in Lisbon.<|im_end|>\n"
             "<|im_start|>assistant\n")
    turn2 = "<|im_end|>\n<|im_start|>user\nWhich city do I live in?<|im_end|>\n" \
            "<|im_start|>assistant\n"
    a = client.completions.create(model=MODEL, prompt=turn1, max_tokens=12, temperature=0,
                                  extra_body={"session": "ada"})
    b = client.completions.create(model=MODEL, prompt=turn2, max_tokens=12, temperature=0,
                                  extra_body={"session": "ada"})
    cached = b.usage.prompt_tokens_details.cached_tokens
    said = a.choices[0].model_extra["token_ids"]
    whole = tok.encode(turn1).ids + said + tok.encode(turn2).ids
    # The last token turn 1 generated has no KV yet: turn 2 prefills it with its own text.
    if cached != len(whole) - len(tok.encode(turn2).ids) - 1:
        fail(f"turn 2 reused {cached} cached tokens; turn 1 left "
             f"{len(whole) - len(tok.encode(turn2).ids) - 1} in the KV cache")
    one = client.completions.create(model=MODEL, prompt=whole, max_tokens=12, temperature=0)
    if one.choices[0].text != b.choices[0].text:
        fail(f"session turn 2 {b.choices[0].text!r}, the whole conversation at once "
             f"{one.choices[0].text!r}")
    print(f"openai: session turn 1 {a.choices[0].text!r}, turn 2 {b.choices[0].text!r} "
          f"({cached} tokens from turn 1's KV) as the whole conversation at once")


def check_refusal(client, openai):
    try:
        client.completions.create(model=MODEL, prompt=[1, 10 ** 7], max_tokens=1)
    except openai.BadRequestError as e:
        if "vocabulary" not in str(e):
            fail(f"400 without naming the vocabulary: {e}")
        print("openai: an id outside the vocabulary raises BadRequestError (400)")
        return
    fail("an id outside the vocabulary was answered")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cpfill")
    args = ap.parse_args()
    openai = import_openai()
    checkpoint = convert_smollm2.require_checkpoint()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json"))
    tmp = tempfile.mkdtemp(prefix="cpfill-openai-")
    server, log, port, pid_file = start(os.path.abspath(args.cpfill), checkpoint, tmp)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=300)
        global MODEL
        models = [m.id for m in client.models.list()]
        if models != [checkpoint]:
            fail(f"models.list(): {models}, expected [{checkpoint!r}]")
        MODEL = models[0]
        prompt, text = check_completion(client, tok)
        check_stream(client, prompt, text)
        check_session(client, tok)
        check_refusal(client, openai)
        stop_serve_cleanly(server, pid_file)
    finally:
        if server.poll() is None:
            server.kill()
        log.seek(0)
        print("---- server log (last 20 lines) ----")
        print("".join(log.readlines()[-20:]))
    print(f"PASS: openai {openai.__version__} against a {RANKS}-rank serve of SmolLM2")
    return 0


if __name__ == "__main__":
    sys.exit(main())
