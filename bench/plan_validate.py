#!/usr/bin/env python3
"""Predicts every recorded GPU ring and model run with `cpfill plan` and prints the error per run.

Each prediction uses a device profile and a link profile made from the *same call* as the run it
predicts (no other data): the CP1 runs of a scaling call give the attention (and GEMM) rates, the
ring's measured transfer rate gives the link, `cpfill calibrate`'s measured C and BW give the
Table 4 profile. The runs used to make a profile are listed but left out of the error statistics.

    bench/plan_validate.py [--cpfill build-plan/cpfill] [--json out.json]

Needs the raw JSON of bench/results (raw.tar.xz folders are unpacked into a temporary folder).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
H200_MEMORY_GBPS = 4000  # the merge kernel's 3.96-4.19 TB/s on an H200 (bench/RESULTS.md)


def pairs(t):
    return t * (t + 1) / 2


class Planner:
    def __init__(self, cpfill, tmp):
        self.cpfill, self.tmp, self.n = cpfill, tmp, 0

    def write(self, obj):
        self.n += 1
        path = os.path.join(self.tmp, "profile-%d.json" % self.n)
        json.dump(obj, open(path, "w"))
        return path

    def predict(self, device, links, args):
        dev, lnk = self.write(device), self.write(links)
        out = os.path.join(self.tmp, "plan-%d.json" % self.n)
        cmd = [self.cpfill, "plan", "--device-profile", dev, "--link-profile", lnk, "--json", out] + args
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.load(open(out))["plans"][0]["ranked"][0]


def one_link(name, gbps, latency_us=10):
    return {"links": {name: {"gbps": gbps, "latency_us": latency_us}}, "intra_node": name,
            "inter_node": name}


def attention_device(points, launch_us=0):
    return {"backend": "cuda", "elem_bytes": 2, "memory_gbps": H200_MEMORY_GBPS,
            "attention_launch_us": launch_us,
            "attention": [{"pairs_per_head": p, "tflops": t} for p, t in points]}


def rate(heads, head_dim, t, ms):
    return 4 * head_dim * heads * pairs(t) / (ms * 1e-3) / 1e12


def attention_args(heads, kv, cp, lens, cached=None, algo="pass-kv"):
    a = ["--heads", str(heads), "--kv-heads", str(kv), "--head-dim", "128", "--prompt-lens",
         ",".join(map(str, lens)), "--gpus-per-node", str(cp), "--nodes", "1", "--tp", "1",
         "--cp", str(cp), "--algo", algo]
    if cached:
        a += ["--cached-lens", ",".join(map(str, cached))]
    return a


def h200x2_cp_scaling(planner):
    """CP1 -> CP2 on NVLink, SHM and sockets, 32K-512K (scaling.md of the call)."""
    folder = "2026-11-21-h200x2-cp-scaling"
    rows = []
    for line in open(os.path.join(RESULTS, folder, "scaling.md")):
        c = [x.strip() for x in line.strip().strip("|").split("|")]
        if len(c) >= 9 and c[0].isdigit():
            rows.append({"t": int(c[0]), "cp": int(c[1]), "link": c[2], "ms": float(c[3]),
                         "mib": float(c[6]), "transfer_ms": float(c[7])})
    cp1 = [r for r in rows if r["cp"] == 1]
    device = attention_device([(pairs(r["t"]), rate(16, 128, r["t"], r["ms"])) for r in cp1])
    big = max(r["t"] for r in rows)
    out = [dict(group="h200x2 CP scaling", run="CP1 %dK" % (r["t"] // 1024), measured=r["ms"],
                predicted=None, profile=True) for r in cp1]
    for r in rows:
        if r["cp"] == 1:
            continue
        link_run = [x for x in rows if x["t"] == big and x["link"] == r["link"]][0]
        gbps = link_run["mib"] * 2**20 / (link_run["transfer_ms"] * 1e-3) / 1e9
        p = planner.predict(device, one_link(r["link"], gbps), attention_args(16, 1, 2, [r["t"]]))
        out.append(dict(group="h200x2 CP scaling", run="CP2 %dK %s" % (r["t"] // 1024, r["link"]),
                        measured=r["ms"], predicted=p["ttft_ms"]))
    return out


def unpack(folder, tmp):
    dest = os.path.join(tmp, folder)
    if not os.path.isdir(dest):
        with tarfile.open(os.path.join(RESULTS, folder, "raw.tar.xz")) as t:
            t.extractall(dest)
    return dest


def median_transfer(run):
    """The run's ring link: its exchange bytes over its median transfer time (GB/s)."""
    rates = [s["exchange_bytes"] / (s["transfer_ms"] * 1e-3) / 1e9
             for r in run["runs"] for s in r["steps"] if s["exchange_bytes"] and s["transfer_ms"] > 0]
    return statistics.median(rates)


def h200x4_cp_scaling(planner, tmp):
    """CP1 -> CP4 on NVLink and sockets, 128K and 512K (the call's raw JSON)."""
    d = os.path.join(unpack("2026-11-21-h200x4-cp-scaling", tmp), "runs")
    runs = {f[:-5]: json.load(open(os.path.join(d, f))) for f in os.listdir(d) if f.endswith(".json")}
    cp1 = {int(k.split("-")[1]): v for k, v in runs.items() if k.startswith("cp1-")}
    device = attention_device([(pairs(t), rate(16, 128, t, v["median_slowest_rank_total_ms"]))
                               for t, v in cp1.items()])
    out = [dict(group="h200x4 CP scaling", run="CP1 %dK" % (t // 1024),
                measured=v["median_slowest_rank_total_ms"], predicted=None, profile=True)
           for t, v in sorted(cp1.items())]
    for name, v in sorted(runs.items()):
        if not name.startswith("cp4-"):
            continue
        _, t, link = name.split("-")
        p = planner.predict(device, one_link(link, median_transfer(v)),
                            attention_args(16, 1, 4, [int(t)]))
        out.append(dict(group="h200x4 CP scaling", run="CP4 %dK %s" % (int(t) // 1024, link),
                        measured=v["median_slowest_rank_total_ms"], predicted=p["ttft_ms"]))
    return out


def table4(planner, folder, cp):
    """pass-KV and pass-Q at every (T, P) of a `cpfill calibrate` grid, from its own C and BW."""
    d = json.load(open(os.path.join(RESULTS, folder, "table4-sockets.json")))
    # calibrate's C: a causal square of 16384 tokens (its GPU default), all ranks at once.
    device = attention_device([(pairs(16384), d["tflops"])])
    links = one_link("sockets", d["gbps"])
    out = []
    for pt in d["points"]:
        t, p = pt["new_tokens"], pt["cached_tokens"]
        for algo, key in (("pass-kv", "pass_kv_ms"), ("pass-q", "pass_q_ms")):
            pr = planner.predict(device, links, attention_args(16, 1, cp, [t], [p], algo))
            out.append(dict(group="Table 4 CP%d sockets" % cp,
                            run="T=%d P=%d %s" % (t, p, algo), measured=pt[key],
                            predicted=pr["ttft_ms"], miss=t / (t + p)))
    return out


def model_cp_scaling(planner, tmp):
    """Llama-3-8B, 32 layers: CP1's phases give the GEMM and attention rates; CP2, CP4 predicted."""
    d = unpack("2026-11-21-h200x4-model-cp-scaling", tmp)
    runs = {f[:-5]: json.load(open(os.path.join(d, f))) for f in os.listdir(d) if f.endswith(".json")}
    layers, heads, width = 32, 32, 4096
    w_layer = (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336)
    att, gemm = [], []
    for name, r in runs.items():
        if r["cp"] != 1:
            continue
        t = r["sequences"][0]["tokens"]
        att.append((pairs(t), 4 * 128 * heads * pairs(t) * layers / (r["attention_ms"] * 1e-3) / 1e12))
        gemm.append((t, 2 * t * w_layer * layers / (r["gemm_ms"] * 1e-3) / 1e12))
    device = attention_device(att)
    device["gemm"] = [{"rows": r, "tflops": x} for r, x in gemm]
    links = one_link("nvlink", 107, 10)  # the 4 x H200 ring's NVLink rate (h200x4 CP scaling)
    out = []
    for name, r in sorted(runs.items()):
        t = r["sequences"][0]["tokens"]
        label = "CP%d TP%d %dK" % (r["cp"], r["tp"], t // 1024)
        if r["cp"] == 1:
            out.append(dict(group="8B model CP scaling", run=label, measured=r["ttft_ms"],
                            predicted=None, profile=True))
            continue
        gpus = r["cp"] * r["tp"]
        p = planner.predict(device, links, ["--model", "llama3-8b", "--prompt-lens", str(t),
                                            "--gpus-per-node", str(gpus), "--nodes", "1",
                                            "--tp", str(r["tp"]), "--cp", str(r["cp"])])
        out.append(dict(group="8B model CP scaling", run=label, measured=r["ttft_ms"],
                        predicted=p["ttft_ms"]))
    return out


def report(rows):
    print("| group | run | measured ms | predicted ms | error |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        if r.get("profile"):
            print("| %s | %s | %.2f | (profile) | - |" % (r["group"], r["run"], r["measured"]))
            continue
        r["error"] = r["predicted"] / r["measured"] - 1
        print("| %s | %s | %.2f | %.2f | %+.1f%% |" % (r["group"], r["run"], r["measured"],
                                                     r["predicted"], 100 * r["error"]))
    print()
    print("| group | runs | median abs error | worst |")
    print("|---|---:|---:|---|")
    groups = {}
    for r in rows:
        if "error" in r:
            groups.setdefault(r["group"], []).append(r)
    groups["all"] = [r for r in rows if "error" in r]
    for g, rs in groups.items():
        worst = max(rs, key=lambda r: abs(r["error"]))
        print("| %s | %d | %.1f%% | %+.1f%% (%s) |" % (g, len(rs), 100 * statistics.median(
            abs(r["error"]) for r in rs), 100 * worst["error"], worst["run"]))


# ---- the paper's 405B figures (§4.2, Tables 4, 6, 7, App. A) from an H100 profile ----------------

PLAN = os.path.join(ROOT, "bench", "plan")
PAPER_128K = {1: 42010, 2: 21042, 4: 10950, 8: 5850, 16: 3800}  # ms: Tables 6-7, §4.2.1, §4.2.3
PAPER_TABLE4 = [  # P, T, pass-KV ms, pass-Q ms (CP4, P + T = 128000)
    (126720, 1280, 1023.39, 898.71), (124800, 3200, 1110.18, 1046.43),
    (123840, 4160, 1298.92, 1280.1), (121600, 6400, 1305.56, 1302.01),
    (115200, 12800, 2080.67, 2205.27), (102400, 25600, 3353.02, 3617.02),
    (89600, 38400, 4629.23, 4922.52), (64000, 64000, 6845.21, 7367.99),
    (0, 128000, 11462.15, 12360.57)]


def run_plan(cpfill, args):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        subprocess.run([cpfill, "plan", "--json", out] + args, check=True, stdout=subprocess.DEVNULL)
        return json.load(open(out))


def plan405(cpfill, device, links, args):
    return run_plan(cpfill, ["--model", "llama3-405b", "--gpus-per-node", "8", "--tp", "8",
                             "--device-profile", os.path.join(PLAN, device),
                             "--link-profile", os.path.join(PLAN, links)] + args)


def paper(cpfill):
    profiles = [("h100-fp8ffn.json", "cpfill's H100 kernel"), ("h100-paper-fa3.json", "the paper's FA3 rate")]
    print("### 405B full prefill, TP8 x CP N on GTT (links-paper-gtt.json)\n")
    print("| context | nodes | paper s | " + " | ".join("%s s (diff)" % n for _, n in profiles) + " |")
    print("|---|---:|---:|" + "---:|" * len(profiles))
    for tokens, nodes, ref in [(131072, n, PAPER_128K[n]) for n in (1, 2, 4, 8, 16)] + [(1048576, 16, 77000), (1048576, 8, None)]:
        cells = []
        for dev, _ in profiles:
            p = plan405(cpfill, dev, "links-paper-gtt.json", ["--prompt-lens", str(tokens), "--nodes", str(nodes)])
            t = p["plans"][0]["ranked"][0]["ttft_ms"]
            cells.append("%.2f" % (t / 1e3) + (" (%+.0f%%)" % (100 * (t / ref - 1)) if ref else ""))
        print("| %dK | %d | %s | %s |" % (tokens // 1024, nodes, "%.2f" % (ref / 1e3) if ref else "-", " | ".join(cells)))
    # Parallel efficiency of 1M on 16 nodes: the model's 1-node time over 16 x its 16-node time, and
    # App. A's: achieved FLOP/s per GPU (4.9e18 FLOP over TTFT and 128 GPUs) over the kernel's rate.
    print()
    for dev, name in profiles:
        one = plan405(cpfill, dev, "links-paper-gtt.json", ["--prompt-lens", "1048576", "--nodes", "1"])
        sixteen = plan405(cpfill, dev, "links-paper-gtt.json", ["--prompt-lens", "1048576", "--nodes", "16"])
        t1 = one["plans"][0]["ranked"][0]["ttft_ms"]
        t16 = sixteen["plans"][0]["ranked"][0]["ttft_ms"]
        print("- %s: 1M on 16 nodes %.1f s; parallel efficiency against one node %.1f%%; "
              "App. A's FLOP/s per GPU %.0f TFLOP/s (paper: 77 s, 93%%, 502 TFLOP/s)" % (
                  name, t16 / 1e3, 100 * t1 / (16 * t16), 4.9e18 / (t16 / 1e3) / 128 / 1e12))
    print("\n### Table 4: 405B, CP4 on GTT, P + T = 128000, TTFT ms\n")
    print("| miss | paper pass-KV | paper pass-Q | paper faster | model pass-KV | model pass-Q | model faster | Alg. 5 picks |")
    print("|---:|---:|---:|---|---:|---:|---|---|")
    for pc, tn, kv, q in PAPER_TABLE4:
        got = {}
        for algo in ("pass-kv", "pass-q", "auto"):
            p = plan405(cpfill, "h100-fp8ffn.json", "links-paper-gtt.json",
                        ["--prompt-lens", str(tn), "--cached-lens", str(pc), "--nodes", "4", "--algo", algo])
            r = p["plans"][0]["ranked"][0]
            got[algo] = (r["ttft_ms"], r["requests"][0]["algorithm"])
        print("| %.2f%% | %.0f | %.0f | %s | %.0f | %.0f | %s | %s |" % (
            100 * tn / 128000, kv, q, "pass-kv" if kv <= q else "pass-q", got["pass-kv"][0],
            got["pass-q"][0], "pass-kv" if got["pass-kv"][0] <= got["pass-q"][0] else "pass-q",
            got["auto"][1]))


def beyond(cpfill):
    print("\n### Best TP x CP per node count (--search, h100-fp8ffn.json for 405B, h100.json otherwise, GTT links)\n")
    print("| model | context | nodes | best | TTFT s | runner-up | TTFT s |")
    print("|---|---:|---:|---|---:|---|---:|")
    for model, dev in (("llama3-8b", "h100.json"), ("llama3-70b", "h100.json"), ("llama3-405b", "h100-fp8ffn.json")):
        for tokens in (131072, 1048576):
            d = run_plan(cpfill, ["--model", model, "--prompt-lens", str(tokens),
                                  "--gpus-per-node", "8", "--nodes", "1..16", "--search",
                                  "--device-profile", os.path.join(PLAN, dev), "--link-profile",
                                  os.path.join(PLAN, "links-paper-gtt.json")])
            for pl in d["plans"]:
                fits = [r for r in pl["ranked"] if r["memory_per_gpu"]["fits"]]
                if not fits:
                    print("| %s | %dK | %d | does not fit | - | - | - |" % (model, tokens // 1024, pl["nodes"]))
                    continue
                a = fits[0]
                b = fits[1] if len(fits) > 1 else None
                print("| %s | %dK | %d | TP%d x CP%d | %.2f | %s | %s |" % (
                    model, tokens // 1024, pl["nodes"], a["tp"], a["cp"], a["ttft_ms"] / 1e3,
                    "TP%d x CP%d" % (b["tp"], b["cp"]) if b else "-", "%.2f" % (b["ttft_ms"] / 1e3) if b else "-"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpfill", default=os.path.join(ROOT, "build-plan", "cpfill"))
    ap.add_argument("--json", help="write every row as JSON")
    ap.add_argument("--paper", action="store_true", help="also the paper's 405B figures and --search tables")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        planner = Planner(a.cpfill, tmp)
        rows = (h200x2_cp_scaling(planner) + h200x4_cp_scaling(planner, tmp) +
                table4(planner, "2026-11-21-h200x2-selector-table4", 2) +
                table4(planner, "2026-11-21-h200x4-selector-table4", 4) +
                model_cp_scaling(planner, tmp))
    report(rows)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)
    if a.paper:
        print()
        paper(a.cpfill)
        beyond(a.cpfill)


if __name__ == "__main__":
    main()
