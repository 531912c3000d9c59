#!/usr/bin/env python3
"""The decode table: cpfill's BM_Decode (Google Benchmark JSON, decode kernel on and, optionally,
off) beside decode_peer.py's peers from the same call. Times in microseconds; GB/s is K+V bytes
read per second; the floor is K+V bytes at the device copy bandwidth (bytes read + written per
second of a 1 GiB device-to-device copy) measured in the same process.
  decode_report.py CPFILL_JSON PEER_JSON [NODECODE_JSON]
"""
import json
import sys


def decode_runs(path):
    runs = {}
    for b in json.load(open(path))["benchmarks"]:
        if b.get("run_type") == "aggregate" or not b["name"].startswith("BM_Decode/"):
            continue
        runs[b["name"].split("/", 1)[1].replace("/manual_time", "")] = b
    return runs


def main(cpfill_path, peer_path, nodecode_path=None):
    runs = decode_runs(cpfill_path)
    try:
        off = decode_runs(nodecode_path) if nodecode_path else {}
    except (OSError, ValueError, KeyError):  # the knob-off run did not finish: its column is "-"
        off = {}
    peers, copy = {}, None
    for e in json.load(open(peer_path)):
        if "copy_GBps" in e:
            copy = e["copy_GBps"]
        elif "name" in e:
            peers[(e["name"], e["peer"])] = f"{e['us']:.1f}" if "us" in e else "error"
    first = next(iter(runs.values()), {})
    print(f"copy bandwidth (read + written): cpfill {first.get('copy_GBps', 0):.0f} GB/s, "
          f"torch {copy or 0:.0f} GB/s")
    print("| context | batch | heads | K+V MB | cpfill us | GB/s | floor us | x floor | "
          "cuDNN us | SDPA default us | FA3 us | prefill kernel us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, b in runs.items():
        f = dict(kv.split(":") for kv in name.split("/"))
        us, floor = b["real_time"], b["floor_us"]
        prefill = f"{off[name]['real_time']:.1f}" if name in off else "-"
        print(f"| {int(f['context']) // 1024}K | {f['batch']} | {f['heads']}:{f['kv_heads']} | "
              f"{b['kv_MB']:.0f} | {us:.1f} | {b['GBps']:.0f} | {floor:.1f} | "
              f"{us / floor:.2f} | {peers.get((name, 'sdpa-cudnn'), '-')} | "
              f"{peers.get((name, 'sdpa-default'), '-')} | {peers.get((name, 'fa3'), '-')} | "
              f"{prefill} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
