#!/usr/bin/env bash
# End-to-end tests of the `cpfill` program, one per CTest: cli_test.sh NAME PATH/TO/cpfill
# Each checks exit codes and messages as a user sees them, under mpirun with several ranks.
set -u
name=$1
cpfill=$2
# The Python of the tests (CMake's CPFILL_PYTHON: launch/setup.sh's .venv, which has numpy).
py=${CPFILL_PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
mpi() { mpirun -np "$@"; }

fail() { echo "FAIL: $*"; exit 1; }

# signal_rank_mid_ring SIG NP RANK ARGS...: `cpfill attention ARGS` on NP ranks runs many times;
# once the runs go, world rank RANK gets SIG (STOP or KILL). The job must end within the
# deadline (3 s) + 5 s of the signal, naming RANK: a stopped rank by the others' census ("late:
# world rank(s) RANK."), a killed one by the launcher ("process rank RANK ... signal 9").
signal_rank_mid_ring() {
  local sig=$1 np=$2 rank=$3 victim="" job p took code named
  shift 3
  mpi "$np" "$cpfill" attention "$@" --repeat 1000000 --timeout-s 3 >"$tmp/out" 2>&1 &
  job=$!
  for _ in $(seq 600); do  # until the runs have started, then find world rank RANK's process
    if grep -q '^run 2/' "$tmp/out"; then
      for p in $(pgrep -f "cpfill attention"); do
        tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$rank" &&
          victim=$p
      done
    fi
    [ -n "$victim" ] && break
    sleep 0.1
  done
  [ -n "$victim" ] || { pkill -KILL -P $job; kill $job; fail "rank $rank never started its runs"; }
  if [ "$sig" = STOP ]; then
    named="late: world rank\(s\) $rank\."
  else
    named="process rank $rank .*signal 9"
  fi
  kill "-$sig" "$victim"
  start=$(date +%s)
  for _ in $(seq 400); do
    grep -Eq "$named" "$tmp/out" && break
    kill -0 $job 2>/dev/null || break
    sleep 0.1
  done
  took=$(( $(date +%s) - start ))
  kill -KILL "$victim" 2>/dev/null
  wait $job
  code=$?
  grep -v '^run ' "$tmp/out"
  [ $code -ne 0 ] || fail "a ${sig}ped rank must fail the job"
  grep -Eq "$named" "$tmp/out" || fail "the message does not name rank $rank (/$named/)"
  [ "$took" -le 8 ] || fail "took ${took} s to name the ${sig}ped rank (deadline 3 s + 5 s)"
}

# fault_in_merge KIND NP RANK: world rank RANK is killed (KIND=EXIT) or stops answering
# (KIND=STALL) after its last pass-Q ring step, while the others wait in the all-to-all merge.
# The job must end within the deadline (3 s) + 5 s of the first run's start, naming RANK.
fault_in_merge() {
  local kind=$1 np=$2 rank=$3 named code
  start=$(date +%s)
  env "CPFILL_TEST_${kind}_RANK=$rank" CPFILL_TEST_FAULT_AT=merge \
    mpirun -np "$np" -x "CPFILL_TEST_${kind}_RANK" -x CPFILL_TEST_FAULT_AT "$cpfill" attention \
    --seq-lens 4000 --heads 2 --kv-heads 1 --head-dim 16 --algo pass-q --backend cpu \
    --timeout-s 3 >"$tmp/out" 2>&1
  code=$?
  took=$(( $(date +%s) - start ))
  cat "$tmp/out"
  [ $code -ne 0 ] || fail "a fault in the merge must fail the job"
  if [ "$kind" = STALL ]; then
    grep -Eq "all-to-all.*did not complete within 3 s" "$tmp/out" ||
      fail "the deadline message does not name the merge's all-to-all"
    named="late: world rank\(s\) $rank\."
  else
    named="process rank $rank .*signal 9"
  fi
  grep -Eq "$named" "$tmp/out" || fail "the message does not name rank $rank (/$named/)"
  # Start-up (MPI, the grid, the plan) takes a few seconds on a loaded 2-core machine.
  [ "$took" -le 30 ] || fail "took ${took} s to end the job (deadline 3 s)"
}

# expect_exit CODE PATTERN -- command...: runs it, checks its exit code and that its output
# (stdout + stderr) matches PATTERN (grep -E).
expect_exit() {
  local want=$1 pattern=$2; shift 3
  "$@" >"$tmp/out" 2>&1
  local got=$?
  cat "$tmp/out"
  [ "$got" -eq "$want" ] || fail "exit code $got, expected $want: $*"
  grep -Eq -- "$pattern" "$tmp/out" || fail "output lacks /$pattern/: $*"
  echo "ok: exit $got, /$pattern/"
}

# expect_also PATTERN: the output of the last expect_exit matches PATTERN (grep -E) as well, for
# a run that must show two things (one alternation would pass on either).
expect_also() {
  grep -Eq -- "$1" "$tmp/out" || fail "output lacks /$1/"
  echo "ok: also /$1/"
}

case $name in
select_reproduces_alg1_alg5)
  # Llama-3-405B on CP4, Table 4's points: miss >= 12.5% -> pass-KV under Alg. 1 whatever C, BW.
  expect_exit 0 '"choice": *"pass-kv"' -- "$cpfill" select --heads 128 --kv-heads 8 --cp 4 \
    --tflops 800 --gbps 3 --new-tokens 25600 --cached-tokens 102400 --rule alg1
  # 2.5% miss on the paper's TCP cluster: T below eq. 2's threshold and miss below 12.5% -> pass-Q.
  expect_exit 0 '"choice": *"pass-q"' -- "$cpfill" select --heads 128 --kv-heads 8 --cp 4 \
    --tflops 800 --gbps 3 --new-tokens 3200 --cached-tokens 124800 --rule alg1
  expect_exit 0 '"miss_rate_threshold": *0\.125' -- "$cpfill" select --heads 128 --kv-heads 8 \
    --cp 4 --tflops 800 --gbps 3 --new-tokens 3200 --cached-tokens 124800 --rule alg1
  expect_exit 0 '"choice": *"pass-q"' -- "$cpfill" select --heads 128 --kv-heads 8 --cp 4 \
    --tflops 800 --gbps 3 --new-tokens 3200 --cached-tokens 124800 --rule alg5
  expect_exit 2 'not divisible by N_KV' -- "$cpfill" select --heads 128 --kv-heads 7 --cp 4 --tflops 800 \
    --gbps 3 --new-tokens 10
  expect_exit 2 'unknown flag --bogus' -- "$cpfill" select --bogus 1
  ;;
bad_input_flags)
  expect_exit 2 'negative' -- mpi 4 "$cpfill" attention --seq-lens 100,-1
  expect_exit 2 'unknown flag --sequence-lens' -- mpi 4 "$cpfill" attention --sequence-lens 100
  expect_exit 2 "--seq-lens: 'abc' is not an integer" -- mpi 4 "$cpfill" attention --seq-lens abc
  expect_exit 2 '--cached-lens has 1 entries but --seq-lens has 2' -- mpi 4 "$cpfill" attention \
    --seq-lens 100,200 --cached-lens 5
  expect_exit 2 'not a multiple of --kv-heads' -- mpi 4 "$cpfill" attention --seq-lens 100 \
    --heads 6 --kv-heads 4
  expect_exit 2 'unknown ring algorithm "pass-x" \(valid: pass-kv, pass-q, all-gather\)' -- \
    mpi 4 "$cpfill" attention --seq-lens 100 --algo pass-x
  expect_exit 2 'unknown command' -- "$cpfill" prefil
  expect_exit 2 "unknown backend 'gpu'" -- mpi 2 "$cpfill" attention --seq-lens 100 --backend gpu
  if ! nvidia-smi -L >/dev/null 2>&1; then
    expect_exit 2 'a rank sees no CUDA device' -- mpi 2 "$cpfill" attention --seq-lens 100 \
      --backend cuda
  fi
  # Hardening: a repeated flag, out-of-range and non-finite values, unwritable outputs.
  expect_exit 2 '--seq-lens given twice' -- mpi 2 "$cpfill" attention --seq-lens 100 --seq-lens 5
  expect_exit 2 '--timeout-s: -1 is negative; allowed \(0, 1000000\]' -- mpi 2 "$cpfill" attention \
    --seq-lens 100 --timeout-s -1
  expect_exit 2 '--timeout-s: 1e18 is out of range' -- mpi 2 "$cpfill" attention --seq-lens 100 \
    --timeout-s 1e18
  expect_exit 2 '--threads: -1 is negative; allowed \[0, 4096\]' -- mpi 2 "$cpfill" attention \
    --seq-lens 100 --threads -1
  expect_exit 2 "--tolerance: 'nan' is not a finite number" -- mpi 2 "$cpfill" attention \
    --seq-lens 100 --tolerance nan
  expect_exit 2 '--new-tokens: 3000000000 is out of range' -- "$cpfill" select --heads 8 \
    --kv-heads 1 --cp 4 --new-tokens 3000000000
  expect_exit 2 "--json: cannot write '/nonexistent-dir/x.json'" -- mpi 2 "$cpfill" attention \
    --seq-lens 100 --json /nonexistent-dir/x.json
  expect_exit 2 "--save: cannot write '/nonexistent-dir/x.safetensors'" -- mpi 2 "$cpfill" \
    attention --seq-lens 100 --save /nonexistent-dir/x.safetensors
  expect_exit 2 "--json: cannot write '/nonexistent-dir/x.json'" -- "$cpfill" env \
    --json /nonexistent-dir/x.json
  # More kernel threads than the host's cores can use are refused before any start (a thread
  # the system refuses would end the process inside the pool's constructor).
  expect_exit 2 '--threads 4096: more than 8 per core of this host' -- mpi 2 "$cpfill" attention \
    --seq-lens 100 --threads 4096
  # The KV hand-off's settings without --kv-handoff would be ignored: refused, naming the flag.
  for setting in "--kv-lease-s 5" "--kv-max-leases 4" "--kv-staging-tokens 0" \
    "--kv-handoff-staging" "--kv-handoff=false --kv-lease-s 5"; do
    flag=$(echo "$setting" | grep -o -- '--kv-[a-z-]*' | tail -1)
    # shellcheck disable=SC2086  # the setting is a flag and its value
    expect_exit 2 "$flag is a setting of --kv-handoff, which is off" -- \
      mpi 2 "$cpfill" serve --model tiny --backend cpu --port 0 $setting
    [ "$(grep -c 'cpfill: error' "$tmp/out")" -eq 1 ] || fail "the message should print once"
  done
  # One message, not one per rank.
  mpi 4 "$cpfill" attention --seq-lens 100,-1 >"$tmp/o" 2>&1
  [ "$(grep -c 'negative' "$tmp/o")" -eq 1 ] || fail "the message should print once"
  ;;
bad_input_config)
  expect_exit 2 'must both divide by --tp 2' -- mpi 4 "$cpfill" attention --seq-lens 100 \
    --heads 4 --kv-heads 1 --tp 2
  expect_exit 2 'does not divide the 2 ranks per node' -- mpi 4 "$cpfill" attention \
    --seq-lens 100 --heads 4 --kv-heads 4 --tp 4 --ranks-per-node 2
  expect_exit 2 'does not divide the 4 ranks on each host' -- mpi 4 "$cpfill" attention \
    --seq-lens 100 --ranks-per-node 3
  ;;
check_full_prefill)
  for algo in pass-kv pass-q all-gather; do
    expect_exit 0 'check: .*PASS' -- mpi 4 "$cpfill" attention --seq-lens 1031,257,1,0 \
      --heads 4 --kv-heads 2 --head-dim 32 --algo $algo --check
  done
  # TP2 x CP2 on emulated nodes of 2 ranks: the grid is the one asked for, and the check passes.
  expect_exit 0 'check: .*PASS' -- mpi 4 "$cpfill" attention --seq-lens 600,90 --heads 4 \
    --kv-heads 2 --head-dim 32 --tp 2 --ranks-per-node 2 --check
  expect_also 'grid: world 4 = 2 node\(s\) x 2 rank\(s\); TP2 x CP2 '
  ;;
check_partial_prefill)
  for algo in pass-kv pass-q all-gather; do
    expect_exit 0 'check: .*PASS' -- mpi 4 "$cpfill" attention --seq-lens 301,17,5 \
      --cached-lens 900,33,0 --heads 8 --kv-heads 1 --head-dim 64 --algo $algo --check
  done
  # The selector's decisions, not its wording: 8 new tokens after 8000 cached (0.1% miss, below
  # the CPU backend's eq. 2 threshold of ~23 tokens at CP3) runs pass-Q, a full prefill runs
  # pass-KV; both checked against one rank.
  expect_exit 0 'check: .*PASS' -- mpi 3 "$cpfill" attention --seq-lens 8 \
    --cached-lens 8000 --heads 8 --kv-heads 1 --head-dim 64 --check --json "$tmp/partial.json"
  expect_exit 0 'check: .*PASS' -- mpi 3 "$cpfill" attention --seq-lens 4000 \
    --heads 8 --kv-heads 1 --head-dim 64 --check --json "$tmp/full.json"
  "$py" - "$tmp/partial.json" "$tmp/full.json" <<'PY' || fail "the selector's decision"
import json, sys
for path, want in zip(sys.argv[1:], ("pass-q", "pass-kv")):
    r = json.load(open(path))
    got = (r["algorithm"], r["algorithm_source"], r["selection"]["choice"], r["check"]["pass"])
    assert got == (want, "selector", want, True), (path, got)
    print("selector ok:", path, want)
PY
  # Per-request selection: the full prefill runs pass-KV and each short follow-up pass-Q, in the
  # same batch (two rings; the interleaved order makes three), checked against one rank.
  expect_exit 0 'check: .*PASS' -- mpi 3 "$cpfill" attention --seq-lens 4000,8,8 \
    --cached-lens 0,8000,8000 --heads 8 --kv-heads 1 --head-dim 64 --check --json "$tmp/mixed.json"
  expect_also 'algorithm: pass-kv,pass-q,pass-q \(each sequence.s own, chosen by the selector\); 2 rings'
  expect_exit 0 'check: .*PASS' -- mpi 3 "$cpfill" attention --seq-lens 8,4000,8 \
    --cached-lens 8000,0,8000 --heads 8 --kv-heads 1 --head-dim 64 --check
  expect_also '; 3 rings, one per run'
  "$py" - "$tmp/mixed.json" <<'PY' || fail "per-sequence selection"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["algorithm"] == "pass-kv,pass-q,pass-q" and r["rings"] == 2, (r["algorithm"], r["rings"])
seqs = r["sequences"]
assert [s["algorithm"] for s in seqs] == ["pass-kv", "pass-q", "pass-q"], seqs
assert [s["selection"]["choice"] for s in seqs] == ["pass-kv", "pass-q", "pass-q"], seqs
assert all(s["selection"]["reason"] for s in seqs), seqs
rings = {s["algorithm"] for s in r["runs"][0]["steps"]}
assert rings == {"pass-kv", "pass-q"}, rings
print("per-sequence ok:", r["algorithm"])
PY
  ;;
save_is_readable_outside)
  expect_exit 0 'saved q, k, v, o, lse' -- mpi 4 "$cpfill" attention --seq-lens 37,9 \
    --cached-lens 0,6 --heads 2 --kv-heads 1 --head-dim 8 --algo pass-q --save "$tmp/a.safetensors"
  expect_exit 0 '-> OK$' -- "$py" "$here/verify_saved_attention.py" "$tmp/a.safetensors"
  ;;
json_report)
  # A knob set in the environment (no effect on the CPU backend) is recorded as set.
  expect_exit 0 'check: .*PASS' -- env CPFILL_HOPPER_MAX_CTAS=5 mpirun -np 2 -x CPFILL_HOPPER_MAX_CTAS \
    "$cpfill" attention --seq-lens 300,20 --heads 4 --kv-heads 1 \
    --head-dim 16 --repeat 2 --check --json "$tmp/r.json"
  "$py" - "$tmp/r.json" <<'PY' || fail "JSON report incomplete"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["check"]["pass"] is True, r["check"]
assert len(r["runs"]) == 2 and r["runs"][0]["steps"], r["runs"]
assert r["selection"]["choice"] in ("pass-kv", "pass-q"), r["selection"]
k = r["knobs"]
assert k["CPFILL_HOPPER_MAX_CTAS"] == "5" and k["CPFILL_ATTENTION_KERNEL"] == "auto", k
assert k["OMPI_COMM_WORLD_LOCAL_SIZE"] == "2", k  # set by mpirun: ranks on this host
# Every rank's steps, not rank 0's alone: its own ring position, its own step sources.
ranks = r["ranks"]
assert [x["world_rank"] for x in ranks] == [0, 1] and [x["cp_rank"] for x in ranks] == [0, 1], ranks
for x in ranks:
    sources = [s["source_cp_rank"] for s in x["steps"]]
    assert len(sources) == 2 and sources[0] == x["cp_rank"], (x["cp_rank"], sources)
assert ranks[0]["steps"][1]["source_cp_rank"] != ranks[1]["steps"][1]["source_cp_rank"], ranks
print("json ok:", r["algorithm"], r["median_slowest_rank_total_ms"], "ms")
PY
  # --trace: every rank's last run as a timeline, TP2 x CP2 pass-Q on two emulated nodes.
  expect_exit 0 'wrote the timeline' -- mpi 4 "$cpfill" attention --seq-lens 300,20 \
    --cached-lens 0,100 --heads 4 --kv-heads 2 --head-dim 16 --tp 2 --ranks-per-node 2 \
    --algo pass-q --trace "$tmp/t.json"
  "$py" - "$tmp/t.json" <<'PY' || fail "trace incomplete"
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
assert names[3] == "rank 3 (node 1, TP rank 1, CP rank 1)", names
for pid in range(4):
    spans = {e["name"]: e for e in events if e["ph"] == "X" and e["pid"] == pid}
    want = {"pack", "step 0 attention", "step 0 exchange", "step 0 wait", "step 1 attention",
            "all-to-all", "merge"}
    assert want <= set(spans), (pid, sorted(spans))
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in spans.values()), spans
    assert spans["step 0 exchange"]["tid"] == spans["all-to-all"]["tid"] != spans["merge"]["tid"]
    # In order on the compute lane: the pack, the steps, the merge after the all-to-all.
    assert spans["pack"]["ts"] <= spans["step 0 attention"]["ts"] < spans["step 1 attention"]["ts"]
    assert spans["merge"]["ts"] >= spans["all-to-all"]["ts"] + spans["all-to-all"]["dur"] - 1
print("trace ok:", len(events), "events")
PY
  ;;
dead_rank_ends_job)
  # Rank 2 dies before the ring: the job must end, non-zero, well before the CTest timeout.
  start=$(date +%s)
  CPFILL_TEST_EXIT_RANK=2 mpi 4 -x CPFILL_TEST_EXIT_RANK "$cpfill" attention --seq-lens 4000 \
    --heads 2 --kv-heads 1 --head-dim 16 --timeout-s 20 >"$tmp/out" 2>&1
  code=$?
  cat "$tmp/out"
  [ $code -ne 0 ] || fail "a dead rank must fail the job"
  [ $(( $(date +%s) - start )) -lt 120 ] || fail "took too long to notice the dead rank"
  ;;
stalled_rank_ends_job)
  # Rank 1 stops answering: the others' deadline fires and the job ends with the reason.
  start=$(date +%s)
  CPFILL_TEST_STALL_RANK=1 mpi 4 -x CPFILL_TEST_STALL_RANK "$cpfill" attention --seq-lens 4000 \
    --heads 2 --kv-heads 1 --head-dim 16 --timeout-s 3 >"$tmp/out" 2>&1
  code=$?
  cat "$tmp/out"
  [ $code -ne 0 ] || fail "a stalled rank must fail the job"
  grep -Eq 'did not complete within 3 s' "$tmp/out" || fail "no deadline message"
  # The others wait at the world barrier before the timed runs; rank 1 never arrives.
  grep -Eq 'world rank [023]: barrier on world \(rank [023] of 4\) did not complete within 3 s' \
    "$tmp/out" || fail "message lacks the operation"
  grep -Eq 'late: world rank\(s\) 1\.' "$tmp/out" || fail "the message does not name rank 1"
  [ $(( $(date +%s) - start )) -lt 90 ] || fail "took too long to notice the stalled rank"
  ;;
stopped_rank_named)
  # SIGSTOP world rank 2 in the middle of the ring: every other rank's deadline fires, the census
  # names rank 2 as not answering, and the job ends within --timeout-s + 5 s of the stop.
  signal_rank_mid_ring STOP 4 2 --backend cpu --seq-lens 4000 --heads 2 --kv-heads 1 --head-dim 16
  ;;
killed_rank_named)
  # SIGKILL world rank 1 in the middle of the ring: the launcher ends the job, naming rank 1.
  signal_rank_mid_ring KILL 4 1 --backend cpu --seq-lens 4000 --heads 2 --kv-heads 1 --head-dim 16
  ;;
stalled_rank_in_merge)
  fault_in_merge STALL 4 1
  ;;
killed_rank_in_merge)
  fault_in_merge EXIT 4 3
  ;;
multigpu_stopped_rank_named)
  # The same on the NCCL path: two GPUs, world rank 1 stopped, then killed, while the device
  # ring runs.
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c GPU)
  if [ "$gpus" -lt 2 ]; then echo "SKIPPED: needs 2 GPUs, this machine has $gpus"; exit 77; fi
  signal_rank_mid_ring STOP 2 1 --backend cuda --seq-lens 65536 --heads 16 --kv-heads 1 \
    --head-dim 128
  signal_rank_mid_ring KILL 2 0 --backend cuda --seq-lens 65536 --heads 16 --kv-heads 1 \
    --head-dim 128
  ;;
calibrate_writes_fit)
  expect_exit 0 'wrote' -- mpi 2 "$cpfill" calibrate --heads 2 --kv-heads 1 --head-dim 16 \
    --context-lens 512 --miss-rates 0.02,0.05,0.1,0.2,0.5,1 --repeat 1 --compute-tokens 256 \
    --bandwidth-bytes 1000000 --out "$tmp/fit.json" --json "$tmp/cal.json"
  "$py" -c "import json; k=json.load(open('$tmp/cal.json'))['knobs']; assert k['CPFILL_HOPPER_SCHEDULE'] == 'dynamic', k" ||
    fail "calibrate JSON lacks the knobs"
  # --fit selects with the calibrated coefficients, not the paper's.
  expect_exit 0 '"rule": *"fitted".*"coefficients_source": *"cpfill calibrate' -- "$cpfill" \
    select --heads 2 --kv-heads 1 --cp 2 --new-tokens 100 --cached-tokens 1000 --fit "$tmp/fit.json"
  # The fit records its ring and the regret on held-out lengths.
  "$py" -c "import json
f = json.load(open('$tmp/fit.json'))['made_on']
assert f == {'backend': 'cpu', 'cp_size': 2, 'tp_size': 1, 'num_nodes': 1,
             'link': 'mpi within a node'}, f
h = json.load(open('$tmp/cal.json'))['regret_held_out']
assert h['points'] == 3 and set(h) >= {'alg1', 'alg5', 'fitted', 'fit'}, h" ||
    fail "the fit lacks its ring, or calibrate's JSON the held-out regret"
  # Made on CP2: refused on a CP4 ring or at --tp 2 (each difference named), used with
  # --fit-rescale (the boundary moved, and said so).
  expect_exit 2 'calibrated on another ring: CP 2 \(the fit\) vs 4 \(this run\); nodes 1 \(the fit\) vs 2' \
    -- mpi 4 "$cpfill" attention --seq-lens 64 --heads 2 --kv-heads 1 --head-dim 16 \
    --ranks-per-node 2 --fit "$tmp/fit.json"
  expect_exit 2 'TP 1 \(the fit\) vs 2 \(this run\)' -- mpi 2 "$cpfill" attention --seq-lens 64 \
    --heads 2 --kv-heads 2 --head-dim 16 --tp 2 --fit "$tmp/fit.json"
  expect_exit 0 'selector \(fitted, .*rescaled to CP4' -- mpi 4 "$cpfill" attention --seq-lens 64 \
    --heads 2 --kv-heads 1 --head-dim 16 --ranks-per-node 2 --fit "$tmp/fit.json" --fit-rescale
  expect_exit 2 'calibrated at CP 2, not --cp 4' -- "$cpfill" select --heads 2 --kv-heads 1 \
    --cp 4 --new-tokens 100 --fit "$tmp/fit.json"
  ;;
cuda_backend_check)
  # The CUDA kernel inside the host ring (2 ranks may share one GPU), and the device ring on one
  # GPU, against one rank on bf16-rounded inputs.
  if ! nvidia-smi -L >/dev/null 2>&1; then echo "SKIPPED: no GPU on this machine"; exit 77; fi
  for algo in pass-kv pass-q all-gather; do
    expect_exit 0 'check: .*PASS' -- mpi 2 "$cpfill" attention --backend cuda-staged \
      --algo $algo --seq-lens 1031,257,1 --cached-lens 0,300,5 --heads 16 --kv-heads 1 \
      --head-dim 128 --check
    expect_exit 0 'check: .*PASS' -- mpi 1 "$cpfill" attention --backend cuda --algo $algo \
      --seq-lens 1031,257,1 --cached-lens 0,300,5 --heads 16 --kv-heads 1 --head-dim 128 --check
  done
  # The whole model on the GPU (bf16, cuBLASLt) against the fp32 CPU model; --repeat runs the
  # same model three times, so the kept workspace and ring scratch are reused.
  expect_exit 0 'check: .*PASS' -- mpi 1 "$cpfill" prefill --backend cuda --model tiny \
    --prompt-lens 700,33,1 --repeat 2 --check --json "$tmp/g.json"
  "$py" -c "import json; assert json.load(open('$tmp/g.json'))['backend'] == 'cuda'" ||
    fail "prefill JSON names the backend"
  # Greedy generation on the GPU (decode steps on the split-KV kernel) against one rank in fp32,
  # teacher-forced on the same tokens.
  expect_exit 0 'check: .*PASS' -- mpi 1 "$cpfill" generate --backend cuda --model tiny \
    --prompt-lens 700,33,1 --max-tokens 24 --check
  ;;
memory_checked_first)
  # Weights, KV and activations too large for this machine are refused with the numbers and a
  # remedy (exit 2 on every rank), before anything is allocated: no bad_alloc, no signal.
  expect_exit 2 'weights of llama3-405b .* need .* GiB .* free .*--tp' -- "$cpfill" export \
    --model llama3-405b --out "$tmp/x"
  [ ! -e "$tmp/x" ] || fail "export wrote something after refusing"
  expect_exit 2 'weights of llama3-405b .* need' -- mpi 2 "$cpfill" prefill --model llama3-405b \
    --prompt-lens 10
  # The KV cache a batch needs, refused before it is mapped, naming the flags that make it fit.
  expect_exit 2 'the KV cache \(.* tokens per rank\) need .* GiB .* free on rank [01] of 2; lower --kv-capacity-tokens' \
    -- mpi 2 "$cpfill" prefill --model tiny --prompt-lens 100000000
  # The attention batch and a calibration step: host buffers counted from the plan, refused.
  expect_exit 2 "the batch's host buffers need .* GiB .* free on rank 0 of 2" -- mpi 2 "$cpfill" \
    attention --seq-lens 2147483647 --heads 2 --kv-heads 1 --head-dim 16
  expect_exit 2 "the batch's host buffers need .*; lower --context-lens" -- "$cpfill" calibrate \
    --compute-tokens 2147483647
  ;;
multigpu_device_ring)
  # The device ring over NCCL on 2 and (where there are 4) 4 GPUs: every algorithm, full and
  # partial prefill, uneven fused batches, TP x CP; against one rank on bf16-rounded inputs.
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c GPU)
  if [ "$gpus" -lt 2 ]; then echo "SKIPPED: needs 2 GPUs, this machine has $gpus"; exit 77; fi
  for np in 2 $([ "$gpus" -ge 4 ] && echo 4); do
    for algo in pass-kv pass-q all-gather; do
      expect_exit 0 'check: .*PASS' -- mpi $np "$cpfill" attention --backend cuda --algo $algo \
        --seq-lens 4099,1031,17,1,0 --heads 16 --kv-heads 1 --head-dim 128 --check
      expect_exit 0 'check: .*PASS' -- mpi $np "$cpfill" attention --backend cuda --algo $algo \
        --seq-lens 301,17,5 --cached-lens 9000,33,0 --heads 32 --kv-heads 8 --head-dim 128 --check
    done
  done
  # Per-request selection on the device ring: the full prefill on pass-KV, the follow-ups after
  # long cached contexts on pass-Q (CUDA's default C and BW), two rings; the trace's spans are
  # timed by CUDA events and name both rings.
  expect_exit 0 'check: .*PASS' -- mpi 2 "$cpfill" attention --backend cuda \
    --seq-lens 4000,8,8 --cached-lens 0,8000,8000 --heads 16 --kv-heads 1 --head-dim 128 \
    --check --trace "$tmp/mixed-trace.json"
  expect_also 'algorithm: pass-kv,pass-q,pass-q .*; 2 rings'
  "$py" - "$tmp/mixed-trace.json" <<'PY' || fail "device trace of a mixed batch"
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
names = {e["name"] for e in events if e.get("ph") == "X"}
assert any(n.startswith("pass-kv step") for n in names), sorted(names)
assert any(n.startswith("pass-q ") and "all-to-all" in n for n in names), sorted(names)
assert all(e["dur"] >= 0 for e in events if e.get("ph") == "X"), "negative span"
print("device trace ok:", len(names), "span names")
PY
  # The whole model: CP2, and TP2 (NCCL all-reduce) on two GPUs.
  expect_exit 0 'check: .*PASS' -- mpi 2 "$cpfill" prefill --backend cuda --model tiny \
    --prompt-lens 1500,77 --check
  expect_exit 0 'check: .*PASS' -- mpi 2 "$cpfill" prefill --backend cuda --model tiny --tp 2 \
    --prompt-lens 1500,77 --algo pass-q --check
  # Decode on two GPUs: batched ring pass-Q (Alg. 4) over NCCL, each rank's K/V read in place
  # from its cache blocks; then TP2. Greedy, against one fp32 rank teacher-forced.
  expect_exit 0 'check: .*PASS' -- mpi 2 "$cpfill" generate --backend cuda --model tiny \
    --prompt-lens 700,33,1 --max-tokens 24 --check
  expect_exit 0 'check: .*PASS' -- mpi 2 "$cpfill" generate --backend cuda --model tiny --tp 2 \
    --prompt-lens 700,33 --max-tokens 16 --check
  if [ "$gpus" -ge 4 ]; then
    expect_exit 0 'check: .*PASS' -- mpi 4 "$cpfill" attention --backend cuda --tp 2 \
      --ranks-per-node 2 --seq-lens 8000,300 --cached-lens 0,5000 --heads 16 --kv-heads 2 \
      --head-dim 64 --check
  fi
  ;;
prefill_check)
  # The README-level job of the model issue: TP2 x CP2 on the tiny preset equals one rank; its
  # timeline (--trace) has every rank's layers, GEMMs on the compute lane, all-reduces on the
  # exchange lane.
  expect_exit 0 'check: .*PASS' -- mpi 4 "$cpfill" prefill --model tiny --tp 2 \
    --ranks-per-node 2 --prompt-lens 700,33,1 --check --trace "$tmp/prefill-trace.json"
  "$py" - "$tmp/prefill-trace.json" <<'PY' || fail "prefill trace"
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
spans = [(e["pid"], lanes[(e["pid"], e["tid"])], e["name"]) for e in events if e.get("ph") == "X"]
assert sorted({p for p, _, _ in spans}) == [0, 1, 2, 3], spans[:5]
for rank in range(4):
    mine = {(lane, name) for p, lane, name in spans if p == rank}
    for want in [("compute", "embedding"), ("compute", "layer 0 qkv"), ("compute", "layer 3 down"),
                 ("compute", "layer 2 attention ring"), ("exchange", "layer 1 all-reduce")]:
        assert want in mine, (rank, want, sorted(mine)[:8])
assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events if e.get("ph") == "X")
print("prefill trace ok:", len(spans), "spans")
PY
  expect_exit 0 'check: .*PASS' -- mpi 4 "$cpfill" prefill --model tiny --prompt-lens 1000 \
    --algo pass-q --check --json "$tmp/p.json"
  "$py" -c "import json,sys; r=json.load(open('$tmp/p.json')); assert r['check']['pass']; assert r['knobs']['CPFILL_TEST_EXIT_RANK'] == '-1'" ||
    fail "prefill JSON"
  ;;
generate_check)
  # Decode: greedy generation on TP2 x CP2 and on CP4 (pass-Q decode steps) equals one
  # rank teacher-forced on the same tokens; the JSON report says so.
  expect_exit 0 'check: .*0 not the reference.*PASS' -- mpi 4 "$cpfill" generate --model tiny \
    --tp 2 --ranks-per-node 2 --backend cpu --prompt-lens 300,77,1000 --max-tokens 12 --check
  expect_exit 0 'check: .*PASS' -- mpi 4 "$cpfill" generate --model tiny --backend cpu \
    --prompt-lens 129,2 --max-tokens 20 --check --json "$tmp/g.json"
  "$py" -c "import json; r=json.load(open('$tmp/g.json')); assert r['check']['pass'] and r['check']['tokens'] == 40; assert all(len(s['tokens']) == 20 and s['finish_reason'] == 'length' for s in r['sequences'])" ||
    fail "generate JSON"
  ;;
generate_bad_input)
  expect_exit 2 'exactly one of --prompt-lens, --tokens and --text' -- mpi 2 "$cpfill" generate \
    --model tiny --backend cpu
  expect_exit 2 'greedy generations: --temperature 0' -- mpi 2 "$cpfill" generate --model tiny \
    --backend cpu --prompt-lens 5 --temperature 0.7 --check
  expect_exit 2 '--text needs the model.s tokenizer' -- mpi 2 "$cpfill" generate --model tiny \
    --backend cpu --text hello
  expect_exit 2 'max-tokens' -- mpi 2 "$cpfill" generate --model tiny --backend cpu \
    --prompt-lens 5 --max-tokens 0
  expect_exit 2 'batch-invariant: the CUDA backend' -- mpi 2 "$cpfill" generate --model tiny \
    --backend cuda --prompt-lens 5 --batch-invariant
  # SparQ decode's r,k[,l] against the model's head dim (tiny: 64), naming the flag.
  expect_exit 2 '--sparq 65,16: sparq.r = 65 must be in 1..64' -- mpi 2 "$cpfill" generate \
    --model tiny --backend cpu --prompt-lens 5 --sparq 65,16
  expect_exit 2 '--sparq 8,16,-1: sparq.l = -1 must be >= 0' -- mpi 2 "$cpfill" generate \
    --model tiny --backend cpu --prompt-lens 5 --sparq 8,16,-1
  expect_exit 2 "--sparq 8.5,16: '8.5' is not an integer" -- mpi 2 "$cpfill" generate \
    --model tiny --backend cpu --prompt-lens 5 --sparq 8.5,16
  # The batch is queued at once: more prompts than --max-queue are refused up front, on every
  # rank alike (not an abort once the engine refuses them on rank 0).
  expect_exit 2 '--max-queue 1: the queue holds fewer than the 3 prompts' -- mpi 2 "$cpfill" \
    generate --model tiny --backend cpu --prompt-lens 5,6,7 --max-queue 1
  printf '[[1, 2], [3], [4, 5]]' > "$tmp/three.json"
  expect_exit 2 '--max-queue 2: the queue holds fewer than the 3 prompts' -- mpi 2 "$cpfill" \
    generate --model tiny --backend cpu --tokens "$tmp/three.json" --max-queue 2
  # All the free memory for the KV cache would leave none for the threads started after it.
  expect_exit 2 '--kv-memory-fraction: 1 is out of range; allowed \(0, 0\.9\]' -- mpi 2 \
    "$cpfill" generate --model tiny --backend cpu --prompt-lens 5 --kv-memory-fraction 1
  expect_exit 2 '--kv-memory-fraction: 1 is out of range' -- "$cpfill" serve --model tiny \
    --backend cpu --port 0 --kv-memory-fraction 1
  # Threads the system will not start (here: 4096 HTTP threads' stacks past ulimit -v) are
  # tried once the KV cache holds its memory and refused, naming the flag, not an abort.
  expect_exit 2 'world rank 0: the engine.s 8 sampling threads and the command.s 4[0-9]{3} \(--http-threads' \
    -- bash -c "ulimit -v 6000000; exec timeout 120 \"$cpfill\" serve --model tiny --layers 1 \
    --backend cpu --threads 1 --port 0 --http-threads 4096"
  expect_also 'lower --kv-memory-fraction or --kv-capacity-tokens, or --http-threads'
  ;;
prefill_matches_hf_reference)
  # A Hugging Face checkpoint directory (written by `cpfill export`), prefilled with TP2 x CP2
  # and with pass-Q on CP4, against an independent numpy Llama (HF's computation, float64).
  "$py" -c "import numpy" 2>/dev/null || { echo "SKIPPED: numpy missing (launch/setup.sh installs it)"; exit 77; }
  expect_exit 0 'saved tiny' -- "$cpfill" export --model tiny --out "$tmp/ck"
  "$py" -c "import json; json.dump([[(i*37+5)%1024 for i in range(61)], [(i*11)%1024 for i in range(9)], [7]], open('$tmp/tok.json','w'))"
  expect_exit 0 'saved logits' -- mpi 4 "$cpfill" prefill --model "$tmp/ck" --tp 2 \
    --ranks-per-node 2 --tokens "$tmp/tok.json" --save-logits "$tmp/lg.safetensors"
  expect_exit 0 '-> OK$' -- "$py" "$here/hf_llama_reference.py" "$tmp/ck" "$tmp/tok.json" \
    "$tmp/lg.safetensors"
  expect_exit 0 'saved tiny' -- "$cpfill" export --model tiny --out "$tmp/ck16" --bf16 --seed 3
  expect_exit 0 'saved logits' -- mpi 4 "$cpfill" prefill --model "$tmp/ck16" --algo pass-q \
    --tokens "$tmp/tok.json" --save-logits "$tmp/lg16.safetensors"
  expect_exit 0 '-> OK$' -- "$py" "$here/hf_llama_reference.py" "$tmp/ck16" "$tmp/tok.json" \
    "$tmp/lg16.safetensors"
  ;;
prefill_bad_input)
  expect_exit 2 "neither a preset" -- mpi 2 "$cpfill" prefill --model nosuchmodel --prompt-lens 5
  expect_exit 2 'num_attention_heads \(8\) is not divisible by the tensor-parallel size \(3\)' -- \
    mpi 3 "$cpfill" prefill --model tiny --tp 3 \
    --prompt-lens 5 --layers 1
  printf '[[1, 2, 999999]]' > "$tmp/t.json"
  expect_exit 2 'outside the vocabulary' -- mpi 2 "$cpfill" prefill --model tiny --tokens "$tmp/t.json"
  printf '[[1, 2,' > "$tmp/bad.json"
  expect_exit 2 'bad\.json: json: line 1, column 8: syntax error' -- mpi 2 "$cpfill" prefill \
    --model tiny --tokens "$tmp/bad.json"
  printf '[[1, 2.5]]' > "$tmp/f.json"
  expect_exit 2 'holds 2.5, which is not an integer token id' -- mpi 2 "$cpfill" prefill \
    --model tiny --tokens "$tmp/f.json"
  expect_exit 2 'KV cache' -- mpi 2 "$cpfill" prefill --model tiny --prompt-lens 5000 \
    --kv-capacity-tokens 100
  expect_exit 2 '--layers 99: the model has only 4 layers' -- mpi 2 "$cpfill" prefill --model tiny \
    --prompt-lens 5 --layers 99
  expect_exit 2 "--save-logits: cannot write '/nonexistent-dir/l.safetensors'" -- mpi 2 "$cpfill" \
    prefill --model tiny --prompt-lens 5 --save-logits /nonexistent-dir/l.safetensors
  mkdir -p "$tmp/ckpt" && printf '{"model_type": "llama", "hidden_act": "gelu"}' > "$tmp/ckpt/config.json"
  expect_exit 2 '"hidden_act" is "gelu"' -- mpi 2 "$cpfill" prefill --model "$tmp/ckpt" --prompt-lens 5
  mkdir -p "$tmp/ckpt" && printf '{"model_type": "llama", "hidden_size": 64}' > "$tmp/ckpt/config.json"
  expect_exit 2 'num_attention_heads' -- mpi 2 "$cpfill" prefill --model "$tmp/ckpt" --prompt-lens 5
  # Duplicate keys: which value would win is refused, not guessed.
  printf '{"model_type": "llama", "hidden_size": 64, "hidden_size": 128}' > "$tmp/ckpt/config.json"
  expect_exit 2 'config.json: json: object key "hidden_size" appears twice' -- mpi 2 "$cpfill" \
    prefill --model "$tmp/ckpt" --prompt-lens 5
  # Another model, a null activation, a token id outside the vocabulary, a dtype that is no
  # dtype: each refused naming the key, from an otherwise good checkpoint.
  expect_exit 0 'saved tiny' -- "$cpfill" export --model tiny --layers 1 --out "$tmp/good"
  for edit in 'c["architectures"] = ["MistralForCausalLM"]' 'c["hidden_act"] = None' \
    'c["bos_token_id"] = -7' 'c["torch_dtype"] = 5'; do
    rm -rf "$tmp/edited" && cp -r "$tmp/good" "$tmp/edited"
    "$py" -c "import json; p='$tmp/edited/config.json'; c=json.load(open(p)); $edit; json.dump(c, open(p, 'w'))"
    key=$(echo "$edit" | sed 's/^c\["\([a-z_]*\)"\].*/\1/')
    expect_exit 2 "$key" -- mpi 2 "$cpfill" prefill --model "$tmp/edited" --prompt-lens 5
  done
  # A device as config.json is refused unread (it would be read without end).
  rm -f "$tmp/edited/config.json" && ln -s /dev/urandom "$tmp/edited/config.json"
  expect_exit 2 'config.json: not a regular file' -- mpi 2 "$cpfill" prefill --model \
    "$tmp/edited" --prompt-lens 5
  ;;
env_lists_knobs)
  # cuBLASLt is opened by the first GEMM, not linked: its start-up (0.14 s, 210 MiB) is not paid
  # by every process (runtime/model/cuda/cublaslt_library.h).
  if ldd "$cpfill" | grep -q libcublasLt; then fail "cpfill links libcublasLt"; fi
  expect_exit 0 'CPFILL_HOPPER_MAX_CTAS=0  \(default; int, default 0, allowed 0\.\.1000000\)' -- \
    "$cpfill" env
  expect_exit 0 'CPFILL_HOPPER_MAX_CTAS=7  \(set in the environment' -- \
    env CPFILL_HOPPER_MAX_CTAS=7 "$cpfill" env --json "$tmp/env.json"
  "$py" - "$tmp/env.json" <<'PY' || fail "env JSON"
import json, sys
r = json.load(open(sys.argv[1]))
v = {x["name"]: x for x in r["variables"]}
m = v["CPFILL_HOPPER_MAX_CTAS"]
assert (m["default"], m["value"], m["set"], m["type"]) == ("0", "7", True, "int"), m
assert v["CPFILL_HOPPER_SCHEDULE"]["allowed"] == "dynamic|static" and m["why"], v
assert r["knobs"]["CPFILL_HOPPER_MAX_CTAS"] == "7", r["knobs"]
PY
  # A malformed knob is bad input for every command: exit 2 naming the variable, once.
  expect_exit 2 "CPFILL_HOPPER_MAX_CTAS='abc' is not valid: allowed 0\.\.1000000" -- \
    env CPFILL_HOPPER_MAX_CTAS=abc "$cpfill" select --heads 16 --kv-heads 1 --cp 4 --new-tokens 10
  expect_exit 2 "CPFILL_HOPPER_MAX_CTAS='abc'" -- env CPFILL_HOPPER_MAX_CTAS=abc "$cpfill" env
  expect_exit 2 "CPFILL_HOPPER_SCHEDULE='fifo' is not valid: allowed dynamic\|static" -- \
    env CPFILL_HOPPER_SCHEDULE=fifo mpirun -np 2 -x CPFILL_HOPPER_SCHEDULE "$cpfill" attention \
    --seq-lens 100
  [ "$(grep -c 'CPFILL_HOPPER_SCHEDULE' "$tmp/out")" -eq 1 ] || fail "the message should print once"
  expect_exit 2 "CPFILL_RANKS_PER_NODE='-3'" -- env CPFILL_RANKS_PER_NODE=-3 mpirun -np 2 \
    -x CPFILL_RANKS_PER_NODE "$cpfill" prefill --model tiny --prompt-lens 5
  # Values are taken exactly as written: a blank around a number is refused, not skipped.
  expect_exit 2 "CPFILL_ATTENTION_VARIANT=' 3' is not valid: allowed 0\.\.3" -- \
    env "CPFILL_ATTENTION_VARIANT= 3" "$cpfill" select --heads 16 --kv-heads 1 --cp 4 \
    --new-tokens 10
  expect_exit 2 "CPFILL_HOPPER_PINGPONG='1 '" -- env "CPFILL_HOPPER_PINGPONG=1 " "$cpfill" env
  ;;
*)
  fail "unknown test $name"
  ;;
esac
echo "PASS: $name"
