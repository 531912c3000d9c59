#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run) and as the README's second command gives it:
#   1. launch/setup.sh (packages, build/), then the CTests of build/ that drive the program from
#      outside (label e2e: the CLI, the server, the Slurm scripts, the embedding examples), the
#      CLI fuzz suite (label fuzz), the gpu and multigpu tests, which skip with a message where
#      there is no GPU, the CPU tests of CUDA-only code (label cuda: the next build has none),
#      and the two-rank runs of the mpi tests (label np2: their code runs again, on more ranks,
#      in the next build, where they took about a third of its time);
#   2. build-asan: the same sources under AddressSanitizer + UndefinedBehaviorSanitizer (CPU
#      only, clang: it compiled them in 0.6x gcc's time and ran the tests faster), running the
#      GoogleTest unit and mpi tests but the np2 runs, and the e2e tests labelled sanitize (the
#      server, bad input): any finding fails;
#   3. build-fuzz: the libFuzzer targets of the safetensors and config.json readers, each for
#      FUZZ_SECONDS (default 45) from a valid seed: any crash or sanitizer report fails.
# A skipped CTest fails its stage too (tests/ctest_skips.py) unless it is labelled gpu or
# multigpu: CTest reports skips as no failure, and anything else skipping here (UCX, Slurm) is a
# check that did not run.
# Each stage says where it failed; later stages do not run after a failure. Each test runs once,
# in the build where it finds the most (CI's time: the two builds and both test sets doubled it),
# and its binary is built only there (build/ skips the unit tests' binaries);
# `bash launch/setup.sh` then `ctest --test-dir build` still builds and runs every test of the
# optimized build.
set -euo pipefail
cd "$(dirname "$0")/.."
stage() { echo; echo "=== run_all: $* ==="; }

# Builds what the selected tests run (SELECTIONS: "LABELS[,EXCLUDED]" words, as ctest -L/-LE),
# plus the targets after them (tests/stage_targets.py): a test binary is compiled only in the
# build that runs it.
build_stage() {
  local dir=$1 selections=$2; shift 2
  local targets sel args=()
  # A tree changed since the last configure regenerates first, so the test list is current.
  ninja -C "$dir" build.ninja >/dev/null ||
    { echo "run_all: regenerating $dir failed" >&2; exit 1; }
  for sel in $selections; do args+=(--tests "$sel"); done
  targets=$(python3 tests/stage_targets.py "$dir" "${args[@]}" --also "$@") ||
    { echo "run_all: listing the targets of $dir's tests failed" >&2; exit 1; }
  # shellcheck disable=SC2086  # one target per word
  cmake --build "$dir" -j "${JOBS:-$(nproc)}" --target $targets ||
    { echo "run_all: building $dir failed" >&2; exit 1; }
}

# ctest over DIR with the given arguments, then fails on a skip outside the gpu and multigpu
# labels (tests/ctest_skips.py reads the JUnit file ctest writes).
run_ctest() {
  local dir=$1; shift
  local junit
  junit="$(cd "$dir" && pwd)/ctest-junit.xml"
  rm -f "$junit"
  ctest --test-dir "$dir" --output-junit "$junit" "$@"
  python3 tests/ctest_skips.py "$dir" "$junit" ||
    { echo "run_all: $dir: a test skipped that must run here (tests/ctest_skips.py above)" >&2
      exit 1; }
}

stage "1/3 build and ctest (build/)"
# The README's first command without its build (configure only), then the program, the
# embedding library and its example, the benchmarks (so they keep compiling), and the binaries
# of this stage's tests; the unit tests' binaries are built in build-asan, where they run.
stage1_labels='e2e|fuzz|gpu|multigpu|cuda|np2'
# AIPerf (label aiperf; its install is 0.9 GB and 2 minutes) runs when the HTTP layer changed
# against the last commit (or is uncommitted), or with CPFILL_AIPERF=1; CPFILL_AIPERF=0 leaves it out.
aiperf_paths=(launch/http launch/commands/serve.cc tests/aiperf_smoke_test.py)
if [ -z "${CPFILL_AIPERF:-}" ]; then
  CPFILL_AIPERF=0
  git diff --quiet HEAD~1 -- "${aiperf_paths[@]}" 2>/dev/null || CPFILL_AIPERF=1
fi
export CPFILL_AIPERF
aiperf_out=(); [ "$CPFILL_AIPERF" = 1 ] || aiperf_out=(-LE aiperf)
echo "run_all: the AIPerf test $([ "$CPFILL_AIPERF" = 1 ] && echo runs || echo 'is left out')"
BUILD_TARGETS=none bash launch/setup.sh
build_stage build "$stage1_labels" cpfill cpfill_shared embed_example_c bench/all
run_ctest build -L "$stage1_labels" "${aiperf_out[@]}" --output-on-failure -j 2

stage "2/3 ASan + UBSan (build-asan/): unit and mpi GoogleTests (np2: stage 1), the server and bad input"
asan=${ASAN_BUILD_DIR:-build-asan}
if [ ! -f "$asan/build.ninja" ]; then
  # -O1: ASan's reports stay exact and the kernels stay fast enough for the mpi tests. clang for
  # C too: with gcc as the C compiler CMake names the precompiled headers after gcc's.
  launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cmake -S . -B "$asan" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
      -DCPFILL_CUDA=OFF -DCPFILL_BUILD_BENCH=OFF \
      -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" \
      -DCPFILL_SANITIZE=address,undefined "${launcher[@]}" ||
    { echo "run_all: configuring the sanitized build ($asan) failed; see cmake above" >&2
      exit 1; }
fi
build_stage "$asan" 'unit|mpi,e2e|np2 sanitize'
run_ctest "$asan" -L 'unit|mpi' -LE 'e2e|np2' --output-on-failure -j 2
run_ctest "$asan" -L sanitize --output-on-failure -j 2

stage "3/3 libFuzzer (build-fuzz/): safetensors and config.json readers"
bash tests/fuzz/run_libfuzzer.sh "${FUZZ_BUILD_DIR:-build-fuzz}" "${FUZZ_SECONDS:-45}"
stage "all stages passed"
