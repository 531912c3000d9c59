#!/usr/bin/env python3
"""NVIDIA's AIPerf, unmodified, against `cpfill serve` on SmolLM2 (CTest aiperf_smoke_smollm2).

    aiperf_smoke_test.py build/cpfill

Serves SmolLM2-135M-Instruct (tests/models/convert_smollm2.py) on 2 ranks, TP1 x CP2, with an
API key, and runs two short, bounded `aiperf profile` runs on the completions endpoint, streamed,
greedy, with the checkpoint's directory as AIPerf's tokenizer (offline; AIPerf counts tokens
itself from the streamed text):
  1. synthetic: 20 prompts of 48 +- 8 tokens (AIPerf's own text), 12 output tokens, 4 at once,
     with a goodput objective on TTFT;
  2. EOS: 6 ChatML questions (a custom single_turn file) that the model answers and ends with
     its EOS token `<|im_end|>` within 32 tokens.
Per run it checks: every request succeeded (AIPerf's count, no error records); per request, the
streamed token ids add up to the server's usage.completion_tokens, AIPerf's usage column equals
it, and AIPerf's own count (re-tokenized text) equals it - the EOS token when the answer ended
with one: its text is skipped (skip_special_tokens), so it shows in no text, as in vLLM -, and no
special token's text leaks into a stream (the old off-by-one); AIPerf's input length equals
usage.prompt_tokens; TTFT, ITL and goodput present in the summary. Run 2 must end at least one
answer with EOS. The server stops on SIGTERM to rank 0 and must exit 0.
Timings are printed, never checked. Exit 77 (SKIPPED) where `aiperf` is not installed beside
this Python (launch/setup.sh installs it with CPFILL_AIPERF=1) or SmolLM2 is not available;
1 for either where CI=true.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "models"))
import convert_smollm2  # noqa: E402
from serve_test import fail, start_checkpoint_serve, stop_serve_cleanly  # noqa: E402

RANKS = 2
API_KEY = "aiperf-smoke-key"
AIPERF_TIMEOUT_S = 420  # per run; a run on 2 busy cores took about 60 s
SPECIAL_TEXTS = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")
QUESTIONS = ["What is the capital of France?", "Name one primary colour.", "Say hello.",
             "What is 2 + 2?", "Which planet is closest to the sun?", "Give one word for happy."]


def find_aiperf():
    path = os.path.join(os.path.dirname(sys.executable), "aiperf")
    if os.access(path, os.X_OK):
        return path
    ci = os.environ.get("CI", "").lower() == "true"
    print(f"{'FAIL' if ci else 'SKIPPED'}: no {path}: install it with "
          "`CPFILL_AIPERF=1 bash launch/setup.sh` (or `.venv/bin/pip install aiperf`)")
    sys.exit(1 if ci else 77)


def start(cpfill, checkpoint, tmp):
    key_file = os.path.join(tmp, "key")
    with open(key_file, "w") as f:
        f.write(API_KEY + "\n")
    return start_checkpoint_serve(cpfill, checkpoint, tmp, RANKS, "--tp", "1", "--api-key-file",
                                  key_file, kv_tokens=8192)


def profile(aiperf, tag, port, checkpoint, out, n, extra):
    """One `aiperf profile` run into out/tag; its summary JSON."""
    artifacts = os.path.join(out, tag)
    cmd = [aiperf, "profile", "--model", checkpoint, "--tokenizer", checkpoint,
           "--endpoint-type", "completions", "--streaming", "--url", f"http://127.0.0.1:{port}",
           "--api-key", API_KEY, "--request-count", str(n), "--random-seed", "1",
           "--use-legacy-max-tokens", "--extra-inputs", "temperature:0",
           "--request-timeout-seconds", "180", "--export-level", "raw",
           "--artifact-dir", artifacts, "--ui-type", "none", "--no-gpu-telemetry",
           "--workers-max", "2", "--record-processors", "1"] + extra
    # A local tokenizer directory loads without the network; AIPerf 0.13 under HF_HUB_OFFLINE=1
    # takes the path for a hub name instead and fails ("Repo id must be in the form ..."), so the
    # variable is dropped here.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    began = time.time()
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env, timeout=AIPERF_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        fail(f"aiperf {tag}: no end within {AIPERF_TIMEOUT_S} s:\n{(e.stdout or '')[-3000:]}")
    if r.returncode != 0:
        fail(f"aiperf {tag} exited {r.returncode}:\n{r.stdout[-4000:]}")
    print(f"aiperf {tag}: {time.time() - began:.1f} s")
    return json.load(open(os.path.join(artifacts, "profile_export_aiperf.json"))), artifacts


def stream_of(raw):
    """(token ids, text, finish_reason, usage) from one raw record's SSE chunks."""
    ids, text, finish, usage = [], "", None, None
    for response in raw["responses"]:
        for packet in response.get("packets", []):
            if packet.get("name") != "data" or packet.get("value") == "[DONE]":
                continue
            chunk = json.loads(packet["value"])
            for choice in chunk.get("choices", []):
                ids += choice.get("token_ids") or []
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    return ids, text, finish, usage


def check_run(tag, summary, artifacts, n, eos_id):
    """The checks of the docstring on one run; the number of answers that ended with EOS."""
    if summary.get("was_cancelled") or summary.get("error_summary"):
        fail(f"{tag}: cancelled or errors: {summary.get('error_summary')}")
    count = (summary.get("request_count") or {}).get("avg")
    if count != n or (summary.get("error_request_count") or {}).get("avg"):
        fail(f"{tag}: request_count {count}, error_request_count "
             f"{summary.get('error_request_count')}; expected {n} and none")
    for metric in ("time_to_first_token", "inter_token_latency", "request_throughput"):
        if not (summary.get(metric) or {}).get("avg"):
            fail(f"{tag}: no {metric} in the summary: {summary.get(metric)}")
    records = {}
    for line in open(os.path.join(artifacts, "profile_export.jsonl")):
        r = json.loads(line)
        if r.get("error"):
            fail(f"{tag}: a failed request: {r['error']}")
        records[r["metadata"]["x_request_id"]] = r["metrics"]
    raws = [json.loads(line) for line in open(os.path.join(artifacts, "profile_export_raw.jsonl"))]
    if len(records) != n or len(raws) != n:
        fail(f"{tag}: {len(records)} records and {len(raws)} raw records, expected {n}")
    ended_eos = 0
    for raw in raws:
        rid = raw["metadata"]["x_request_id"]
        m = {k: v.get("value") for k, v in records[rid].items() if isinstance(v, dict)}
        ids, text, finish, usage = stream_of(raw)
        if raw.get("status") != 200 or not usage:
            fail(f"{tag} {rid}: status {raw.get('status')}, usage {usage}")
        if usage["completion_tokens"] != len(ids):
            fail(f"{tag} {rid}: usage.completion_tokens {usage['completion_tokens']}, "
                 f"{len(ids)} token ids streamed")
        leaked = [s for s in SPECIAL_TEXTS if s in text]
        if leaked:
            fail(f"{tag} {rid}: special token text {leaked} in the streamed text {text!r}")
        eos = finish == "stop" and ids and ids[-1] == eos_id
        ended_eos += bool(eos)
        want = {"usage_completion_tokens": usage["completion_tokens"],
                "output_sequence_length": usage["completion_tokens"] - (1 if eos else 0),
                "usage_prompt_tokens": usage["prompt_tokens"],
                "input_sequence_length": usage["prompt_tokens"]}
        got = {k: m.get(k) for k in want}
        if got != want:
            fail(f"{tag} {rid}: AIPerf's counts {got}, the server's {want} "
                 f"(finish {finish}, last id {ids[-1:]}, text {text!r})")
    good = (summary.get("good_request_count") or {}).get("avg")
    ttft, itl = summary["time_to_first_token"], summary["inter_token_latency"]
    print(f"aiperf {tag}: {n}/{n} ok, {ended_eos} ended with EOS; TTFT p50 {ttft['p50']:.0f} ms, "
          f"ITL p50 {itl['p50']:.0f} ms, {summary['request_throughput']['avg']:.2f} req/s"
          + (f", good requests {good:.0f}" if good is not None else ""))
    return ended_eos, good


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cpfill")
    args = ap.parse_args()
    aiperf = find_aiperf()
    checkpoint = convert_smollm2.require_checkpoint()
    eos_id = json.load(open(os.path.join(checkpoint, "config.json")))["eos_token_id"]
    eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
    tmp = tempfile.mkdtemp(prefix="cpfill-aiperf-")
    questions = os.path.join(tmp, "chatml.jsonl")
    with open(questions, "w") as f:
        for q in QUESTIONS:
            text = f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
            f.write(json.dumps({"text": text, "output_length": 32}) + "\n")
    server, log, port, pid_file = start(os.path.abspath(args.cpfill), checkpoint, tmp)
    try:
        n = 20
        summary, artifacts = profile(aiperf, "synthetic", port, checkpoint, tmp, n, [
            "--concurrency", "4", "--synthetic-input-tokens-mean", "48",
            "--synthetic-input-tokens-stddev", "8", "--output-tokens-mean", "12",
            "--output-tokens-stddev", "0", "--goodput", "time_to_first_token:600000"])
        _, good = check_run("synthetic", summary, artifacts, n, eos_id)
        if good is None:
            fail("synthetic: no good_request_count with --goodput")
        summary, artifacts = profile(aiperf, "eos", port, checkpoint, tmp, len(QUESTIONS), [
            "--concurrency", "3", "--input-file", questions, "--custom-dataset-type",
            "single_turn", "--dataset-sampling-strategy", "sequential"])
        ended_eos, _ = check_run("eos", summary, artifacts, len(QUESTIONS), eos_id)
        if ended_eos == 0:
            fail("eos: no answer ended with the EOS token; the EOS count went unchecked")
        stop_serve_cleanly(server, pid_file)
    finally:
        if server.poll() is None:
            server.kill()
        log.seek(0)
        print("---- server log (last 10 lines) ----")
        print("".join(log.readlines()[-10:]))
    version = subprocess.run([aiperf, "--version"], stdout=subprocess.PIPE, text=True).stdout
    print(f"PASS: aiperf {version.strip()} against a {RANKS}-rank serve of SmolLM2 ({tmp})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
