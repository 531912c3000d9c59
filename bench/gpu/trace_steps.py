"""Per variant of cp_ring_env_ab.sh: the median run (first run, a warm-up, left out) and rank 0's
step spans from each round's trace, in ms.

    python3 bench/gpu/trace_steps.py OUT_DIR NAME[:ENV] ...
"""
import glob
import json
import re
import statistics
import sys


def run_times(log_path):
    with open(log_path) as f:
        times = [float(m) for m in re.findall(r"run \d+/\d+: ([0-9.]+) ms", f.read())]
    return times[1:] or times


def step_spans(trace_path):
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    spans = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") == 0 and e["name"].startswith("step "):
            spans[e["name"]] = e["dur"] / 1000.0
    return spans


def main(out, variants):
    for variant in variants:
        name = variant.split(":", 1)[0]
        times = []
        for log in sorted(glob.glob(f"{out}/{name}-*.log")):
            times += run_times(log)
        if not times:
            print(f"{name}: no runs")
            continue
        print(f"{name}: median {statistics.median(times):.2f} ms over {len(times)} runs "
              f"(min {min(times):.2f}, max {max(times):.2f})")
        for trace in sorted(glob.glob(f"{out}/{name}-*.trace.json")):
            spans = step_spans(trace)
            cells = [f"{k.replace('step ', 's')} {v:.2f}" for k, v in sorted(spans.items())
                     if k.endswith(("attention", "exchange"))]
            print(f"  {trace.rsplit('/', 1)[-1]}: " + ", ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
