#!/usr/bin/env python3
"""/v1/chat/completions of `cpfill serve --chat-template-renderer` on SmolLM2 (CTest
serve_chat_smollm2).

    serve_chat_test.py build/cpfill WORKDIR

Serves SmolLM2-135M-Instruct (tests/models/convert_smollm2.py) on 2 ranks (TP1 x CP2) with
launch/http/render_chat.py as the renderer, behind a wrapper that crashes on a message "CRASH"
and hangs on "HANG", and checks with the unmodified `openai` SDK:
  * chat.completions.create, greedy: "What is the capital of France?" is answered with Paris, as
    a chat.completion whose message is the assistant's; usage.prompt_tokens is the count of the
    template rendered directly with jinja2 and tokenized by `tokenizers` (no special tokens
    added), and /tokenize of the same messages gives exactly those ids;
  * the same streamed with include_usage: a first chunk naming the role, content chunks adding up
    to the same answer, a finish_reason, a last chunk with usage and no choices;
  * logprobs=True, top_logprobs=3: one entry per token, spelling the answer, 3 alternatives each;
  * content as a list of text parts answers as the plain string does;
  * a renderer that crashes, or hangs past --chat-render-timeout-s, is answered 503 JSON, and
    the next request (a fresh renderer) is answered 200; malformed messages 400.
(Without --chat-template-renderer the route is 404 naming /v1/completions: serve_openai_surface.)
Exit 77 (SKIPPED) without the package index (1 where CI=true).
"""
import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "models"))
import convert_smollm2  # noqa: E402
from serve_test import fail, http, start_checkpoint_serve, stop_serve  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

# The renderer under test, wrapped: "CRASH" kills it, "HANG" outlives the server's deadline.
WRAPPER = """import json, os, sys, time
sys.path.insert(0, {http_dir!r})
import render_chat
template, specials = render_chat.load_template({model!r})
for line in sys.stdin:
    request = json.loads(line)
    said = " ".join(m["content"] for m in request["messages"])
    if "CRASH" in said:
        os._exit(3)
    if "HANG" in said:
        time.sleep(60)
    print(json.dumps({{"prompt": render_chat.render(template, specials, request)}}), flush=True)
"""


def direct_render(checkpoint, messages):
    """The template as jinja2 renders it with nothing of render_chat.py's set-up."""
    import jinja2
    config = json.load(open(os.path.join(checkpoint, "tokenizer_config.json")))
    return jinja2.Template(config["chat_template"]).render(
        messages=messages, add_generation_prompt=True, bos_token=config["bos_token"],
        eos_token=config["eos_token"])


def start(cpfill, checkpoint, tmp):
    wrapper = os.path.join(tmp, "renderer.py")
    with open(wrapper, "w") as f:
        f.write(WRAPPER.format(http_dir=os.path.join(ROOT, "launch", "http"), model=checkpoint))
    return start_checkpoint_serve(cpfill, checkpoint, tmp, 2, "--tp", "1",
                                  "--chat-template-renderer", f"{sys.executable} {wrapper}",
                                  "--chat-render-timeout-s", "2")


def check_plain(client, model, tok, rendered):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16,
                                       temperature=0)
    answer = r.choices[0].message.content
    if r.object != "chat.completion" or r.choices[0].message.role != "assistant":
        fail(f"not a chat.completion from the assistant: {r}")
    if "Paris" not in answer:
        fail(f"{QUESTION[0]['content']!r} -> {answer!r}: no Paris")
    expected = len(tok.encode(rendered, add_special_tokens=False).ids)
    if r.usage.prompt_tokens != expected:
        fail(f"usage.prompt_tokens {r.usage.prompt_tokens}, the template rendered directly: "
             f"{expected}")
    if r.choices[0].finish_reason not in ("stop", "length"):
        fail(f"finish_reason {r.choices[0].finish_reason}")
    print(f"chat: {answer!r} ({r.usage.prompt_tokens} prompt tokens, "
          f"{r.usage.completion_tokens} generated, {r.choices[0].finish_reason})")
    return answer


def check_tokenize(port, tok, rendered):
    status, text = http(port, "POST", "/tokenize", {"messages": QUESTION})
    want = tok.encode(rendered, add_special_tokens=False).ids
    if status != 200 or json.loads(text)["tokens"] != want:
        fail(f"/tokenize of the messages: {status} {text[:300]}, tokenizers: {want}")


def check_stream(client, model, answer):
    chunks = list(client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    if not chunks or chunks[0].choices[0].delta.role != "assistant":
        fail(f"the first chunk does not name the role: {chunks[:1]}")
    if any(c.object != "chat.completion.chunk" for c in chunks):
        fail("a chunk is not a chat.completion.chunk")
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason]
    if content != answer or len(finishes) != 1:
        fail(f"stream: {content!r}, finish reasons {finishes}; whole: {answer!r}")
    if chunks[-1].choices or chunks[-1].usage is None or chunks[-1].usage.completion_tokens < 1:
        fail(f"the last chunk is not the usage alone: {chunks[-1]}")
    print(f"chat stream: {len(chunks)} chunks add up to the answer; usage {chunks[-1].usage}")


def check_logprobs(client, model, answer):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16,
                                       temperature=0, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    # Every generated token has an entry, the closing <|im_end|> too (as completions' logprobs
    # do), though the text leaves it out (skip_special_tokens).
    spelled = "".join(e.token for e in entries)
    if spelled not in (answer, answer + "<|im_end|>") or len(entries) != r.usage.completion_tokens:
        fail(f"logprobs tokens {[e.token for e in entries]} do not spell {answer!r}")
    for e in entries:
        if len(e.top_logprobs) != 3 or e.logprob > 0 or bytes(e.bytes).decode(
                errors="replace") != e.token:
            fail(f"logprob entry {e}")
    parts = client.chat.completions.create(
        model=model, max_tokens=16, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION[0]["content"]}]}])
    if parts.choices[0].message.content != answer:
        fail(f"content as parts: {parts.choices[0].message.content!r}, as a string: {answer!r}")


def check_renderer_failures(port):
    body = {"messages": QUESTION, "max_tokens": 2, "temperature": 0}
    for word in ("CRASH", "HANG"):
        started = time.time()
        status, text = http(port, "POST", "/v1/chat/completions",
                            {**body, "messages": [{"role": "user", "content": word}]})
        if status != 503 or "renderer" not in json.loads(text)["error"]["message"]:
            fail(f"a renderer that gets {word}: {status} {text}")
        status, text = http(port, "POST", "/v1/chat/completions", body)
        if status != 200:
            fail(f"after the renderer's {word}, the next request: {status} {text}")
        print(f"renderer {word}: 503 in {time.time() - started:.1f} s, then 200 (restarted)")
    for bad in ([], [{"role": "user"}], [{"role": "user", "content": [{"type": "image_url"}]}]):
        status, text = http(port, "POST", "/v1/chat/completions", {**body, "messages": bad})
        if status != 400 or "messages" not in text:
            fail(f"messages {bad}: {status} {text}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cpfill")
    ap.add_argument("workdir")
    args = ap.parse_args()
    checkpoint = convert_smollm2.require_checkpoint()
    openai = convert_smollm2.ensure_module("openai", "openai>=1.0")
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json"))
    rendered = direct_render(checkpoint, QUESTION)
    os.makedirs(args.workdir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="chat-", dir=args.workdir)
    server, log, port, pid_file = start(os.path.abspath(args.cpfill), checkpoint, tmp)
    ok = False
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        answer = check_plain(client, model, tok, rendered)
        check_tokenize(port, tok, rendered)
        check_stream(client, model, answer)
        check_logprobs(client, model, answer)
        check_renderer_failures(port)
        ok = True
    finally:
        code = stop_serve(server, pid_file)
        if not ok or code != 0:
            log.seek(0)
            print(log.read()[-4000:])
        log.close()
    if code != 0:
        fail(f"the server exited {code}")
    print("serve_chat: PASS")


if __name__ == "__main__":
    main()
