#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/*_fuzz.cc) with clang, ASan and UBSan, seeds each with
# a small valid input, and runs both at once for a bounded time. Any crash, sanitizer report,
# leak or timeout fails with libFuzzer's report and the input that caused it (saved under
# BUILD/crashes).
#
#   bash tests/fuzz/run_libfuzzer.sh [BUILD_DIR=build-fuzz] [SECONDS_PER_TARGET=45]
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-fuzz}
seconds=${2:-45}
command -v clang++ >/dev/null ||
  { echo "run_libfuzzer: clang++ is missing (launch/setup.sh installs clang)" >&2; exit 1; }

if [ ! -f "$build/build.ninja" ]; then
  mkdir -p "$build"
  cmake -S . -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=Debug \
    -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" -DCPFILL_CUDA=OFF -DCPFILL_BUILD_TESTS=OFF \
    -DCPFILL_BUILD_BENCH=OFF -DCPFILL_FUZZERS=ON \
    -DCPFILL_SANITIZE=fuzzer-no-link,address,undefined >"$build/configure.log" 2>&1 ||
    { cat "$build/configure.log"; echo "run_libfuzzer: configuring $build failed" >&2; exit 1; }
fi
cmake --build "$build" --target fuzz_safetensors fuzz_model_config

# Seeds: a valid two-tensor safetensors file and the tiny preset's config.json as export writes
# them (a real header and a real config; the fuzzer mutates from there).
seeds=$build/seeds
rm -rf "$seeds" "$build/crashes"
mkdir -p "$seeds/safetensors" "$seeds/model_config" "$build/crashes"
python3 - "$seeds" <<'PY'
import json, struct, sys
seeds = sys.argv[1]
header = {"__metadata__": {"format": "pt"},
          "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
          "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]}}
h = json.dumps(header).encode()
h += b" " * (-len(h) % 8)
open(f"{seeds}/safetensors/two_tensors", "wb").write(struct.pack("<Q", len(h)) + h + bytes(22))
config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "vocab_size": 256, "rms_norm_eps": 1e-5,
          "rope_theta": 500000.0, "hidden_act": "silu", "max_position_embeddings": 4096,
          "tie_word_embeddings": False,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
open(f"{seeds}/model_config/llama", "w").write(json.dumps(config))
PY

# Both targets at once, one core each (each libFuzzer process is single-threaded): the stage
# takes the time of one.
fuzz() {  # fuzz TARGET: exit status of its bounded run; log in $build/fuzz_TARGET.log
  "$build/tests/fuzz/fuzz_$1" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -max_len=4096 -print_final_stats=1 -artifact_prefix="$build/crashes/$1-" \
    "$build/corpus/$1" "$seeds/$1" 2>"$build/fuzz_$1.log"
}
targets=(safetensors model_config)
pids=()
for target in "${targets[@]}"; do
  echo "run_libfuzzer: fuzz_$target for $seconds s"
  mkdir -p "$build/corpus/$target"
  fuzz "$target" &
  pids+=($!)
done
status=0
for i in "${!targets[@]}"; do
  target=${targets[$i]}
  if ! wait "${pids[$i]}"; then
    tail -60 "$build/fuzz_$target.log"
    echo "run_libfuzzer: fuzz_$target FAILED; reproducer(s): $(ls "$build/crashes")" >&2
    status=1
  else
    echo -n "run_libfuzzer: fuzz_$target: "
    grep -E "^stat::number_of_executed_units|^stat::new_units_added" "$build/fuzz_$target.log" |
      tr '\n' ' '
    echo
  fi
done
exit $status
