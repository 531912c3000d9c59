#!/usr/bin/env python3
"""The build targets a test stage needs: what its CTests run, and nothing else.

    python3 tests/stage_targets.py BUILD_DIR --tests LABELS[,EXCLUDED] ... [--also TARGET ...]

Prints one ninja target per line: every file of BUILD_DIR that a selected test names in its
command or environment (test binaries, cpfill, libcpfill.so) and is a ninja output, plus the
--also targets that exist in that build. Each --tests selects as `ctest -L LABELS -LE EXCLUDED`
would; several add up. tests/run_all.sh builds these instead of everything, so
a unit test's binary is compiled only in the build that runs it (build-asan), not twice.
"""
import argparse
import json
import os
import re
import subprocess
import sys


def ninja_outputs(build):
    out = subprocess.run(["ninja", "-C", build, "-t", "targets", "all"], check=True,
                         capture_output=True, text=True).stdout
    return {line.split(":", 1)[0] for line in out.splitlines() if ":" in line}


# ctest leaves a test's command out of its JSON while the command's file is not built yet, so
# the commands come from the CTestTestfile.cmake lines CMake writes: add_test([=[name]=] "a" ...).
ADD_TEST = re.compile(r'^add_test\(\[=\[(.+?)\]=\] (.*)\)$')


def test_commands(build):
    commands = {}
    for root, _, files in os.walk(build):
        if "CTestTestfile.cmake" in files:
            with open(os.path.join(root, "CTestTestfile.cmake")) as f:
                for line in f:
                    m = ADD_TEST.match(line.strip())
                    if m:
                        commands[m.group(1)] = re.findall(r'"([^"]*)"', m.group(2))
    return commands


def test_words(build, labels, exclude):
    cmd = ["ctest", "--test-dir", build, "-L", labels, "--show-only=json-v1"]
    if exclude:
        cmd += ["-LE", exclude]
    tests = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    commands = test_commands(build)
    for test in tests.get("tests", []):
        if test["name"] not in commands:
            sys.exit(f"stage_targets: no add_test line for {test['name']} under {build}")
        yield from commands[test["name"]]
        for prop in test.get("properties", []):
            if prop.get("name") == "ENVIRONMENT":
                yield from (v.split("=", 1)[-1] for v in prop.get("value", []))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build")
    ap.add_argument("--tests", action="append", required=True, metavar="LABELS[,EXCLUDED]")
    ap.add_argument("--also", nargs="*", default=[])
    args = ap.parse_args()
    build = os.path.realpath(args.build)
    outputs = ninja_outputs(build)
    targets = set()
    for selection in args.tests:
        labels, _, exclude = selection.partition(",")
        for word in test_words(build, labels, exclude):
            path = os.path.realpath(word) if os.path.isabs(word) else ""
            rel = os.path.relpath(path, build) if path.startswith(build + os.sep) else ""
            if rel in outputs:
                targets.add(rel)
    targets.update(t for t in args.also if t in outputs)
    if not targets:
        sys.exit(f"stage_targets: no test of {build} selected by {args.tests} names a target")
    print("\n".join(sorted(targets)))


if __name__ == "__main__":
    main()
