#!/usr/bin/env bash
# Runs a GPU test binary under compute-sanitizer (memcheck, then racecheck); exit 77 (CTest:
# skipped) when there is no GPU or no compute-sanitizer, with the reason.
set -u
bin=$1; shift
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ -z "$san" ]; then echo "SKIPPED: compute-sanitizer not found"; exit 77; fi
if ! nvidia-smi -L >/dev/null 2>&1; then echo "SKIPPED: no GPU on this machine"; exit 77; fi
"$san" --tool memcheck --error-exitcode 1 "$bin" "$@" || exit 1
"$san" --tool racecheck --error-exitcode 1 "$bin" "$@" || exit 1
echo "compute-sanitizer: memcheck and racecheck clean"
