#!/usr/bin/env python3
"""Tables (Markdown) and plots (PNG) of the GPU scripts' runs.

  summarize.py scaling RUNS_DIR OUT_DIR   # cp_scaling.sh: runs/cp{N}-{T}[-{net}].json
  summarize.py table4 REPORT.json OUT_DIR # selector_calibration.sh: `cpfill calibrate --json`
  summarize.py regression OUT_DIR         # regression.sh: the short before/after table
  summarize.py serve OUT_DIR              # serve_load.sh: serve under load vs one-shot prefills
  summarize.py aiperf-line RUN_DIR        # serve_load.sh: one line on an `aiperf profile` run
"""
import glob
import json
import os
import re
import sys


def scaling(runs_dir, out_dir):
    rows = {}
    for path in glob.glob(os.path.join(runs_dir, "cp*.json")):
        m = re.match(r"cp(\d+)-(\d+)(?:-(\w+))?\.json", os.path.basename(path))
        if not m:
            continue
        cp, tokens, net = int(m.group(1)), int(m.group(2)), m.group(3) or "-"
        r = json.load(open(path))
        last = r["runs"][-1]
        steps = last["steps"]
        xfer = max((s["transfer_ms"] for s in steps), default=0)
        comp = sum(s["compute_ms"] for s in steps) / max(1, len(steps))
        wait = sum(s["exposed_wait_ms"] for s in steps)
        rows[(tokens, cp, net)] = dict(ms=r["median_slowest_rank_total_ms"], xfer=xfer, comp=comp,
                                       wait=wait, bytes=max((s["exchange_bytes"] for s in steps),
                                                            default=0))
    lines = ["| tokens | CP | link | time ms | speedup | efficiency | exchange MiB/step | "
             "transfer ms/step (max) | compute ms/step (mean) | exposed wait ms (sum) |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (tokens, cp, net) in sorted(rows):
        r = rows[(tokens, cp, net)]
        base = rows.get((tokens, 1, "-"))
        sp = base["ms"] / r["ms"] if base else float("nan")
        lines.append(f"| {tokens} | {cp} | {net if cp > 1 else 'none'} | {r['ms']:.2f} | "
                     f"{sp:.2f} | {100 * sp / cp:.1f}% | {r['bytes'] / 2**20:.1f} | "
                     f"{r['xfer']:.2f} | {r['comp']:.2f} | {r['wait']:.2f} |")
    table = "\n".join(lines)
    open(os.path.join(out_dir, "scaling.md"), "w").write(table + "\n")
    print(table)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib missing: no plot)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for tokens in sorted({k[0] for k in rows}):
        for net, style in (("nvlink", "-o"), ("shm", "--s"), ("sockets", ":^")):
            xs, sp = [1], [1.0]
            base = rows.get((tokens, 1, "-"))
            for cp in (2, 4, 8):
                if base and (tokens, cp, net) in rows:
                    xs.append(cp)
                    sp.append(base["ms"] / rows[(tokens, cp, net)]["ms"])
            if len(xs) > 1:
                axes[0].plot(xs, sp, style, label=f"{tokens // 1024}K {net}")
                axes[1].plot(xs, [100 * s / x for s, x in zip(sp, xs)], style,
                             label=f"{tokens // 1024}K {net}")
    top = max([k[1] for k in rows] + [2])
    axes[0].plot([1, top], [1, top], "k-", lw=0.5, label="linear")
    axes[0].set(xlabel="CP ranks (GPUs)", ylabel="speedup over CP1",
                title="pass-KV full prefill, 16 q : 1 kv heads, d128")
    axes[1].set(xlabel="CP ranks (GPUs)", ylabel="parallel efficiency %", ylim=(50, 105))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_xticks([1, 2, 4, 8][: 1 + sum(1 for c in (2, 4, 8) if c <= top)])
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "scaling.png"), dpi=110)


def table4(report_path, out_dir):
    r = json.load(open(report_path))
    pts = r["points"]
    lines = [f"C = {r['tflops']:.1f} TFLOP/s, BW = {r['gbps']:.2f} GB/s per rank; fit h = "
             f"{r['a']:.3f} ln T + {r['b']:.3f} ln(T/(T+P)) + {r['c']:.3f}", "",
             "| P | T | miss | pass-KV ms | pass-Q ms | faster | Alg. 1 | Alg. 5 | fitted |",
             "|---:|---:|---:|---:|---:|---|---|---|---|"]
    for p in pts:
        t, c = p["new_tokens"], p["cached_tokens"]
        faster = "pass-kv" if p["pass_kv_ms"] <= p["pass_q_ms"] else "pass-q"
        lines.append(f"| {c} | {t} | {100 * t / (t + c):.2f}% | {p['pass_kv_ms']:.2f} | "
                     f"{p['pass_q_ms']:.2f} | {faster} | {p['choice_alg1']} | "
                     f"{p['choice_alg5']} | {p['choice_fitted']} |")
    lines.append("")
    for total, per_rule in r["regret"].items():
        where = "whole grid" if total == "all" else f"T + P = {total}"
        lines.append(f"- regret on the {where}: " + ", ".join(
            f"{k} {100 * v:.2f}%" for k, v in per_rule.items()))
    table = "\n".join(lines)
    open(os.path.join(out_dir, "table4.md"), "w").write(table + "\n")
    print(table)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for total in sorted({p["new_tokens"] + p["cached_tokens"] for p in pts}):
        sel = [p for p in pts if p["new_tokens"] + p["cached_tokens"] == total]
        miss = [100 * p["new_tokens"] / total for p in sel]
        ratio = [p["pass_q_ms"] / p["pass_kv_ms"] for p in sel]
        ax.plot(miss, ratio, "-o", label=f"T + P = {total // 1024}K")
    ax.axhline(1, color="k", lw=0.5)
    ax.set_xscale("log")
    ax.set(xlabel="KV cache miss rate T/(T+P), %", ylabel="pass-Q time / pass-KV time",
           title="pass-KV vs pass-Q (above 1: pass-KV faster)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "table4.png"), dpi=110)


def json_lines(path):
    """The JSON lines a peer printed into its log (none if the log is missing)."""
    if not os.path.exists(path):
        return []
    return [json.loads(l) for l in open(path) if l.startswith("{")]


def kernel_rows(out_dir):
    """The d128 shapes of the kernel grid from 8K to 32K and the mixed batch, against cuDNN."""
    from report import tflops
    ours_path = os.path.join(out_dir, "cpfill_cuda.json")
    if not os.path.exists(ours_path):
        return []
    ours = {b["name"]: tflops(b) for b in json.load(open(ours_path))["benchmarks"]}
    peer_path = os.path.join(out_dir, "sdpa_peer.json")
    cudnn = {e["name"]: e.get("tflops") for e in
             (json.load(open(peer_path)) if os.path.exists(peer_path) else [])
             if e["backend"] == "cudnn"}
    rows = []
    for name, tf in ours.items():
        m = re.match(r"BM_Attention/(heads:(\d+)/kv_heads:(\d+)/dim:128/tokens:(8192|16384|32768)"
                     r"/causal:(\d))/manual_time", name)
        if not m:
            continue
        cu = cudnn.get(m.group(1))
        what = (f"kernel {m.group(2)}:{m.group(3)} {'causal' if m.group(5) == '1' else 'non-causal'}"
                f" {int(m.group(4)) // 1024}K, TFLOP/s")
        rows.append((what, f"{tf:.0f}", "cuDNN", f"{cu:.0f}" if cu else "n/a",
                     f"{tf / cu:.3f}" if cu else "n/a"))
    for heads, kv in ((16, 1), (32, 8)):
        mixed = ours.get(f"BM_AttentionMixed/heads:{heads}/kv_heads:{kv}/mixed:1/manual_time")
        one = ours.get(f"BM_AttentionMixed/heads:{heads}/kv_heads:{kv}/mixed:0/manual_time")
        if mixed and one:
            rows.append((f"kernel {heads}:{kv} mixed batch (12 sequences, 16K), TFLOP/s", f"{mixed:.0f}", "one sequence",
                         f"{one:.0f}", f"{mixed / one:.3f}"))
    return rows


def model_rows(out_dir):
    """The 2-layer 8B prefill (TTFT) against transformers; ratio = the peer's time / cpfill's."""
    peer = {e["tokens"]: e.get("ms") for e in json_lines(os.path.join(out_dir, "hf_peer.log"))}
    rows = []
    for path in sorted(glob.glob(os.path.join(out_dir, "cp1-2l-*.json")),
                       key=lambda p: int(re.findall(r"\d+", os.path.basename(p))[-1])):
        r = json.load(open(path))
        tokens = r["sequences"][0]["tokens"]
        ms, theirs = r["ttft_ms"], peer.get(tokens)
        rows.append((f"8B 2 layers {tokens // 1024}K, TTFT ms (median of 3)", f"{ms:.1f}", "transformers",
                     f"{theirs:.1f}" if theirs else "n/a", f"{theirs / ms:.3f}" if theirs else "n/a"))
    return rows


def ring_rows(out_dir):
    """The 128K ring (median of the runs, slowest rank) against PyTorch CP; ratio = cpfill / peer."""
    rows = []
    for path in sorted(glob.glob(os.path.join(out_dir, "cpfill-cp*-*.json"))):
        m = re.match(r"cpfill-cp(\d+)-(\w+)\.json", os.path.basename(path))
        cp, net = int(m.group(1)), m.group(2)
        ms = json.load(open(path))["median_slowest_rank_total_ms"]
        log = "torch-cp1.log" if cp == 1 else f"torch-cp{cp}-{net}.log"
        theirs = [e["ms"] for e in json_lines(os.path.join(out_dir, log))]
        peer = theirs[-1] if theirs else None
        rows.append((f"ring CP{cp} {net} 128K, ms (median of 5)", f"{ms:.2f}", "PyTorch CP",
                     f"{peer:.2f}" if peer else "n/a", f"{ms / peer:.3f}" if peer else "n/a"))
    return rows


def regression(out_dir):
    rows = kernel_rows(out_dir) + model_rows(out_dir) + ring_rows(out_dir)
    print("| measurement | cpfill | peer | peer's | ratio |")
    print("|---|---:|---|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("\nratio: kernel cpfill / cuDNN (mixed: mixed / one sequence), 8B the peer's time / "
          "cpfill's (above 1: cpfill faster), ring cpfill / peer (below 1: cpfill faster)")


def oneshot_ms(out_dir):
    """{length: TTFT ms} of serve_load.sh's one-shot prefills (median of --repeat)."""
    out = {}
    for path in glob.glob(os.path.join(out_dir, "oneshot-*.json")):
        r = json.load(open(path))
        out[r["sequences"][0]["tokens"]] = r["ttft_ms"]
    return out


def aiperf_report(run_dir):
    """An `aiperf profile` run's folder (serve_load.sh) as serve_load.py's report: the fields of
    "summary" and "per_request" that the serve tables read. AIPerf knows no server-side prefill
    time, so prefill_ms and the client overhead over it stay empty (serve_load.py keeps those)."""
    s = json.load(open(os.path.join(run_dir, "profile_export_aiperf.json")))
    records = [json.loads(line) for line in open(os.path.join(run_dir, "profile_export.jsonl"))]
    records = [r for r in records if r["metadata"].get("benchmark_phase", "profiling") == "profiling"]
    ok = [r for r in records if not r.get("error")]
    failed = len(records) - len(ok)
    by_status = {}
    for r in records:
        if r.get("error"):
            code = str(r["error"].get("code", "error"))
            by_status[code] = by_status.get(code, 0) + 1
    prompt = [int(r["metrics"]["input_sequence_length"]["value"]) for r in ok
              if "input_sequence_length" in r["metrics"]]
    duration = (s.get("benchmark_duration") or {}).get("avg")
    ttft = s.get("time_to_first_token") or {}
    good = (s.get("good_request_count") or {}).get("avg")
    return {"summary": {
        "requests": {"sent": len(records), "ok": len(ok), "failed": failed,
                     "failures_by_status": by_status},
        "ttft_ms": {k: ttft[k] for k in ("p50", "p90", "p99") if k in ttft} or None,
        "prefill_ms": None, "overhead_ms": None, "overhead_vs_server_ttft_ms": None,
        "duration_s": duration, "prompt_tokens_ok": sum(prompt),
        "prompt_token_throughput": sum(prompt) / duration if duration else None,
        "request_throughput": (s.get("request_throughput") or {}).get("avg"),
        "good_requests": good},
        "per_request": [{"status": 200, "prompt_tokens": n} for n in prompt],
        "metrics": {"delta": {}}}


def load_runs(out_dir, prefix):
    """[(tokens or None, report)] of the load runs named PREFIX*: serve_load.py's JSON files or
    AIPerf's folders (serve_load.sh), in order of the length in the name."""
    runs = []
    for path in glob.glob(os.path.join(out_dir, prefix + "*")):
        name = os.path.basename(path)
        if os.path.isdir(path) and os.path.exists(os.path.join(path, "profile_export_aiperf.json")):
            report = aiperf_report(path)
        elif name.endswith(".json") and not name.endswith(".inputs.json"):
            report = json.load(open(path))
        else:
            continue
        digits = re.findall(r"\d+", name)
        runs.append((int(digits[-1]) if digits else None, report))
    return sorted(runs, key=lambda r: r[0] or 0)


def aiperf_line(run_dir):
    """One line on an AIPerf run: ok/sent, TTFT p50/p99, throughput (serve_load.sh's notes)."""
    try:
        s = aiperf_report(run_dir)["summary"]
    except (OSError, ValueError, KeyError) as e:
        print(f"no AIPerf result ({e})")
        return
    t = s["ttft_ms"] or {}
    print(f"requests {s['requests']['ok']}/{s['requests']['sent']} ok; TTFT p50 "
          f"{t.get('p50', float('nan')):.1f} ms, p99 {t.get('p99', float('nan')):.1f} ms; "
          f"{s['prompt_token_throughput'] or 0:.0f} prompt tok/s"
          + (f"; good {s['good_requests']:.0f}" if s["good_requests"] is not None else ""))


def serve_low(out_dir, oneshot):
    """Low load, per length: the client's TTFT against the one-shot prefill of the same prompt
    (target: p50 - one-shot <= 2 ms + 1% of the one-shot time)."""
    rows = []
    for tokens, r in load_runs(out_dir, "low-"):
        s = r["summary"]
        ttft, prefill, over = s["ttft_ms"] or {}, s["prefill_ms"] or {}, s["overhead_ms"] or {}
        one = oneshot.get(tokens)
        gap = ttft["p50"] - one if one and ttft else None
        allowed = 2.0 + 0.01 * one if one else None
        rows.append({"tokens": tokens, "ok": s["requests"]["ok"], "sent": s["requests"]["sent"],
                     "ttft_p50_ms": ttft.get("p50"), "ttft_p99_ms": ttft.get("p99"),
                     "server_prefill_p50_ms": prefill.get("p50"), "oneshot_ms": one,
                     "ttft_p50_minus_oneshot_ms": gap, "allowed_ms": allowed,
                     "met": None if gap is None else gap <= allowed,
                     "client_minus_prefill_p50_ms": over.get("p50"),
                     "client_minus_prefill_p99_ms": over.get("p99")})
    return rows


def ok_per_batch(delta):
    """Prompts the engine answered per fused batch over a run, from the /metrics deltas."""
    batches = delta.get("cpfill:batches_total")
    return delta.get('cpfill:requests_total{status="ok"}', 0) / batches if batches else None


def serve_saturation(out_dir, oneshot):
    """Saturation: prompt tokens/s against the same requests' one-shot prefills back to back
    (target: >= 0.95x)."""
    runs = load_runs(out_dir, "saturation")
    if not runs:
        return None
    r = runs[0][1]
    s, ok = r["summary"], [q for q in r["per_request"] if q["status"] == 200]
    missing = sorted({q["prompt_tokens"] for q in ok} - set(oneshot))
    ref_s = sum(oneshot.get(q["prompt_tokens"], 0.0) for q in ok) / 1e3
    ref = s["prompt_tokens_ok"] / ref_s if ref_s > 0 and not missing else None
    ratio = s["prompt_token_throughput"] / ref if ref and s["prompt_token_throughput"] else None
    return {"ok": s["requests"]["ok"], "sent": s["requests"]["sent"],
            "duration_s": s["duration_s"], "prompt_tokens": s["prompt_tokens_ok"],
            "tokens_per_s": s["prompt_token_throughput"], "oneshot_tokens_per_s": ref,
            "ratio": ratio, "met": None if ratio is None else ratio >= 0.95,
            "lengths_without_oneshot": missing,
            "prompts_per_batch": ok_per_batch(r["metrics"]["delta"]),
            "ttft_p50_ms": (s["ttft_ms"] or {}).get("p50"),
            "ttft_p99_ms": (s["ttft_ms"] or {}).get("p99"),
            "client_minus_server_ttft_p50_ms": (s["overhead_vs_server_ttft_ms"] or {}).get("p50")}


def serve_failures(out_dir):
    """{run: failures_by_status} of every load run with a failed request (target: none)."""
    out = {}
    for prefix in ("low-", "saturation"):
        for tokens, r in load_runs(out_dir, prefix):
            if isinstance(r, dict) and "summary" in r and r["summary"]["requests"]["failed"]:
                out[f"{prefix}{tokens or ''}"] = r["summary"]["requests"]["failures_by_status"]
    return out


def serve(out_dir):
    def f(x, d=1):
        return "n/a" if x is None else f"{x:.{d}f}"
    oneshot = oneshot_ms(out_dir)
    low, sat, failures = serve_low(out_dir, oneshot), serve_saturation(out_dir, oneshot), \
        serve_failures(out_dir)
    lines = ["| tokens | ok/sent | client TTFT p50 / p99 ms | server prefill p50 | one-shot | "
             "TTFT p50 - one-shot | allowed (2 ms + 1%) | met | client - prefill p50 / p99 |",
             "|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in low:
        lines.append(f"| {r['tokens']} | {r['ok']}/{r['sent']} | {f(r['ttft_p50_ms'])} / "
                     f"{f(r['ttft_p99_ms'])} | {f(r['server_prefill_p50_ms'])} | "
                     f"{f(r['oneshot_ms'])} | {f(r['ttft_p50_minus_oneshot_ms'], 2)} | "
                     f"{f(r['allowed_ms'], 2)} | {r['met']} | "
                     f"{f(r['client_minus_prefill_p50_ms'], 2)} / "
                     f"{f(r['client_minus_prefill_p99_ms'], 2)} |")
    if sat:
        lines += ["", "| saturation | ok/sent | prompt tok/s | one-shots back to back | ratio | "
                  "met (>= 0.95) | prompts/batch | TTFT p50 / p99 ms |",
                  "|---|---:|---:|---:|---:|---|---:|---:|",
                  f"| rate inf | {sat['ok']}/{sat['sent']} | {f(sat['tokens_per_s'], 0)} | "
                  f"{f(sat['oneshot_tokens_per_s'], 0)} | {f(sat['ratio'], 3)} | {sat['met']} | "
                  f"{f(sat['prompts_per_batch'], 2)} | {f(sat['ttft_p50_ms'], 0)} / "
                  f"{f(sat['ttft_p99_ms'], 0)} |"]
    lines += ["", f"failed requests: {failures or 'none'}"]
    print("\n".join(lines))
    with open(os.path.join(out_dir, "compare.json"), "w") as out:
        json.dump({"oneshot_ms": oneshot, "low_load": low, "saturation": sat,
                   "failures": failures}, out, indent=1)


if __name__ == "__main__":
    {"scaling": scaling, "table4": table4, "regression": regression,
     "serve": serve, "aiperf-line": aiperf_line}[sys.argv[1]](*sys.argv[2:])
