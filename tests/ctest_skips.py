#!/usr/bin/env python3
"""Fails when a CTest skipped that must run here: CTest counts a skip as no failure.

    ctest --test-dir BUILD_DIR --output-junit /abs/path/junit.xml ...
    python3 tests/ctest_skips.py BUILD_DIR /abs/path/junit.xml

Reads the JUnit file ctest wrote and each test's labels (`ctest --show-only=json-v1`). A skipped
test (SKIP_RETURN_CODE or SKIP_REGULAR_EXPRESSION: a GPU missing, Slurm not installed, a UCX
transport not there, a CPU budget spent) is allowed only with one of the labels in ALLOWED: the
gpu and multigpu tests skip on CI's machine, which has no GPU. Any other skip means a check did
not run: this prints each such test with the last lines of its output and exits 1.
Exit 0: no such skip; 1: one or more; 2: the files could not be read.
"""
import json
import subprocess
import sys
import xml.etree.ElementTree as ET

# The labels of tests that skip legitimately on CI's machine: it has no GPU.
ALLOWED = {"gpu", "multigpu"}


def test_labels(build):
    out = subprocess.run(["ctest", "--test-dir", build, "--show-only=json-v1"], check=True,
                         capture_output=True, text=True).stdout
    labels = {}
    for test in json.loads(out)["tests"]:
        labels[test["name"]] = set()
        for prop in test.get("properties", []):
            if prop["name"] == "LABELS":
                labels[test["name"]] = set(prop["value"])
    return labels


def main():
    if len(sys.argv) != 3:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    build, junit = sys.argv[1:]
    try:
        cases = ET.parse(junit).getroot().iter("testcase")
        labels = test_labels(build)
    except (OSError, ET.ParseError, subprocess.CalledProcessError, ValueError) as e:
        print(f"ctest_skips: cannot read {junit} or the tests of {build}: {e}", file=sys.stderr)
        return 2
    allowed, refused = [], []
    for case in cases:
        skipped = case.find("skipped")
        if skipped is None:
            continue
        name = case.get("name")
        (allowed if labels.get(name, set()) & ALLOWED else refused).append(
            (name, skipped.get("message", ""), case.findtext("system-out") or ""))
    if allowed:
        print(f"ctest_skips: {len(allowed)} skipped as allowed without a GPU (labels "
              f"{', '.join(sorted(ALLOWED))}): {', '.join(n for n, _, _ in allowed)}")
    for name, why, out in refused:
        # ctest keeps only the first 1024 bytes of a test that did not fail: the lines naming a
        # skip if they are there, else what is left.
        lines = out.rstrip().splitlines()
        shown = [x for x in lines if "skip" in x.lower()][:8] or lines[-8:] or ["(no output)"]
        print(f"ctest_skips: FAIL: {name} skipped ({why}) but must run here; its output says:\n"
              + "\n".join("    " + x for x in shown) +
              f"\n  (all of it: ctest --test-dir {build} -R '^{name}$' -V)")
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
