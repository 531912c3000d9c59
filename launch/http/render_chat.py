#!/usr/bin/env python3
"""The chat template renderer of `cpfill serve --chat-template-renderer` (chat_renderer.h).

    serve ... --chat-template-renderer "python3 launch/http/render_chat.py --model-dir DIR"

Reads the checkpoint's tokenizer_config.json (its `chat_template`, a string or a list of named
templates of which "default" is used, and its special tokens) and renders as transformers'
`apply_chat_template` does: jinja2's ImmutableSandboxedEnvironment with trim_blocks and
lstrip_blocks, the loopcontrols extension, `raise_exception`, `strftime_now` and a `tojson`
that keeps non-ASCII text. One JSON line in per request, one out:
    {"messages": [...], "add_generation_prompt": true}  ->  {"prompt": "..."} or {"error": "..."}
A template error is an {"error"} answer (the server answers 400); anything else that goes wrong
ends the process (the server answers 503 and starts another). Exits at the end of its input.
"""
import argparse
import datetime
import json
import os
import sys

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def load_template(model_dir):
    with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    if not isinstance(template, str):
        sys.exit(f"render_chat.py: {model_dir}/tokenizer_config.json has no chat_template")

    def token(name):
        value = config.get(name)
        return value.get("content", "") if isinstance(value, dict) else (value or "")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False,
                                                                    indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    specials = {name: token(name) for name in
                ("bos_token", "eos_token", "unk_token", "pad_token")}
    return env.from_string(template), specials


def render(template, specials, request):
    return template.render(messages=request["messages"],
                           add_generation_prompt=bool(request.get("add_generation_prompt", True)),
                           **specials)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, help="the checkpoint's directory")
    template, specials = load_template(parser.parse_args().model_dir)
    # The server speaks UTF-8 whatever the locale: under a non-UTF-8 one (LANG=en_US.ISO-8859-1)
    # any non-Latin message would raise UnicodeEncodeError, kill this process and answer 503.
    sys.stdin.reconfigure(encoding="utf-8")
    sys.stdout.reconfigure(encoding="utf-8")
    for line in sys.stdin:
        try:
            answer = {"prompt": render(template, specials, json.loads(line))}
        except jinja2.exceptions.TemplateError as e:
            answer = {"error": str(e)}
        sys.stdout.write(json.dumps(answer, ensure_ascii=False) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
