#!/usr/bin/env bash
# A refactor's A/B in ONE device call: two carried builds (bench/gpu/build-carry.sh at each
# commit, copied to two folders), alternated 3 times so drift hits both alike:
#   - prefill of the Llama-3-8B geometry cut to 2 layers at 8K and 32K (median of --repeat 5);
#   - decode: `generate` of the same model, 64 tokens after an 8K prompt, batch 1 and 16 (TPOT).
#   bash bench/gpu/refactor_ab.sh .gpu-carry-before .gpu-carry-after
# Raw logs and JSON under $OUT; a table (median over the rounds of each build) printed last.
# BACKEND=cpu MODEL=tiny try it without a GPU.
set -uo pipefail
a=$PWD/${1:?usage: refactor_ab.sh CARRY_A CARRY_B}
b=$PWD/${2:?usage: refactor_ab.sh CARRY_A CARRY_B}
out=${OUT:-/tmp/cpfill-out}
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee "$out/gpu.txt"
run() {  # run BUILD_DIR TAG ARGS...: one cpfill command of the 8B geometry, 2 layers
  local dir=$1 tag=$2
  shift 2
  LD_LIBRARY_PATH=$dir/lib timeout 240 "$dir/cpfill" "$@" --backend "${BACKEND:-cuda}" \
    --model "${MODEL:-llama3-8b}" --layers 2 --json "$out/$tag.json" > "$out/$tag.log" 2>&1 ||
    echo "$tag: rc $?" >&2
}
for round in 1 2 3; do
  for side in a b; do
    dir=$a && [ $side = b ] && dir=$b
    for t in ${PREFILL_LENS:-8192 32768}; do run "$dir" "$side-prefill$t-r$round" prefill --prompt-lens $t --repeat 5; done
    run "$dir" "$side-decode1-r$round" generate --prompt-lens ${DECODE_LEN:-8192} --max-tokens 64 --ignore-eos
    run "$dir" "$side-decode16-r$round" generate \
      --prompt-lens $(python3 -c "print(','.join(['${DECODE_LEN:-8192}']*16))") --max-tokens 64 --ignore-eos
  done
done
python3 - "$out" ${PREFILL_LENS:-8192 32768} <<'PY'
import glob, json, os, re, statistics, sys
out = sys.argv[1]
def ttft(tag):
    j = json.load(open(f"{out}/{tag}.json"))
    s = json.dumps(j)
    m = re.search(r'"ttft_s": ([0-9.e-]+)', s) or re.search(r'"ttft_ms": ([0-9.e-]+)', s)
    return float(m.group(1)) * (1000 if 'ttft_s' in m.group(0) else 1)
def tpot(tag):
    s = json.dumps(json.load(open(f"{out}/{tag}.json")))
    v = [float(x) for x in re.findall(r'"tpot_ms": ([0-9.e-]+)', s)]
    return statistics.median(v)
rows = []
figures = [(f"prefill {t} TTFT ms", lambda s, r, t=t: ttft(f"{s}-prefill{t}-r{r}"))
           for t in sys.argv[2:]]
for name, f in figures + [("decode b1 TPOT ms", lambda s, r: tpot(f"{s}-decode1-r{r}")),
                ("decode b16 TPOT ms", lambda s, r: tpot(f"{s}-decode16-r{r}"))]:
    try:
        va = [f("a", r) for r in (1, 2, 3)]; vb = [f("b", r) for r in (1, 2, 3)]
    except Exception as e:
        rows.append(f"| {name} | error: {e} | | |"); continue
    ma, mb = statistics.median(va), statistics.median(vb)
    rows.append(f"| {name} | {ma:.3f} ({' '.join(f'{x:.2f}' for x in va)}) | "
                f"{mb:.3f} ({' '.join(f'{x:.2f}' for x in vb)}) | {mb / ma:.3f} |")
table = "| figure | A: median (rounds) | B: median (rounds) | B/A |\n|---|---|---|---|\n" + "\n".join(rows)
open(f"{out}/refactor_ab.md", "w").write(table + "\n")
print(table)
PY
