#!/usr/bin/env python3
"""decode_ab.sh's table: BM_Decode's time per shape under each knob setting (µs, and x the
floor measured in the same process), then ncu's median kernel times per shape and kernel.
  decode_ab_report.py DIR LABEL=ENV ...
"""
import collections
import csv
import json
import os
import re
import statistics
import sys


def runs(path):
    out = {}
    for b in json.load(open(path))["benchmarks"]:
        if b.get("run_type") != "aggregate" and "floor_us" in b:
            out[b["name"].replace("BM_Decode/", "").replace("/manual_time", "")] = b
    return out


def bench_table(folder, labels):
    tables = {}
    for label in labels:
        try:
            tables[label] = runs(os.path.join(folder, f"bench_{label}.json"))
        except (OSError, ValueError, KeyError):
            tables[label] = {}
    names = list(next((t for t in tables.values() if t), {}).keys())
    print("| shape | floor us | " + " | ".join(labels) + " |")
    print("|---|---:|" + "---:|" * len(labels))
    for name in names:
        floor = next(t[name]["floor_us"] for t in tables.values() if name in t)
        cells = [f"{t[name]['real_time']:.1f} ({t[name]['real_time'] / floor:.2f})"
                 if name in t else "-" for t in tables.values()]
        print(f"| {name} | {floor:.1f} | " + " | ".join(cells) + " |")


# ncu's units, to µs and MB.
UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
         "byte": 1e-6, "Kbyte": 1e-3, "KB": 1e-3, "MB": 1.0, "GB": 1e3,
         "Mbyte": 1.0, "Gbyte": 1e3}


def ncu_table(path, shape):
    """Kernel rows of ncu's CSV, grouped by kernel and grid (the grid tells the shapes apart)."""
    if not os.path.exists(path):
        return
    lines = open(path).read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        return
    groups = collections.OrderedDict()
    for row in csv.DictReader(lines[start:]):
        found = re.search(r"(\w+Kernel)\b", row["Kernel Name"])
        name = found.group(1) if found else row["Kernel Name"][:40]
        key = (row["Grid Size"], name)
        scale = UNITS.get(row["Metric Unit"], 1.0)
        groups.setdefault(key, collections.defaultdict(list))[row["Metric Name"]].append(
            float(row["Metric Value"].replace(",", "")) * scale)
    for (grid, name), m in groups.items():
        t = statistics.median(m["gpu__time_duration.sum"])
        mb = statistics.median(m.get("dram__bytes_read.sum", [0]))
        pct = statistics.median(m.get("dram__throughput.avg.pct_of_peak_sustained_elapsed", [0]))
        extra = "".join(f" {k.split('__', 1)[1]}={statistics.median(v):.4g}" for k, v in m.items()
                        if k not in ("gpu__time_duration.sum", "dram__bytes_read.sum",
                                     "dram__throughput.avg.pct_of_peak_sustained_elapsed"))
        print(f"| {shape} | {name} | {grid} | {t:.1f} | {mb:.1f} | {pct:.0f} |{extra}")


if __name__ == "__main__":
    folder, variants = sys.argv[1], sys.argv[2:]
    bench_table(folder, [v.split("=", 1)[0] for v in variants])
    ncu = os.path.join(folder, "ncu")
    print("\n| shape | kernel | grid | µs (median) | DRAM read MB | DRAM % of peak |")
    print("|---|---|---|---:|---:|---:|")
    i = 1
    while os.path.exists(os.path.join(ncu, f"{i}.name")):
        shape = open(os.path.join(ncu, f"{i}.name")).read().strip()
        ncu_table(os.path.join(ncu, f"{i}.csv"),
                  shape.replace("BM_Decode/", "").replace("/manual_time", ""))
        i += 1
