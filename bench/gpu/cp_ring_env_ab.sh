#!/usr/bin/env bash
# The device ring under environment variants, alternated: each round runs every variant once
# (`cpfill attention`, pass-KV, 128K tokens, --repeat 8, a trace), ROUNDS rounds (default 2), so
# a drift of the clocks falls on all of them alike. For knobs of the exchange beside the attention
# kernel (the Hopper kernel work: CP4's middle-step exchanges ending with their step's kernel).
#   CP=4 bash bench/gpu/cp_ring_env_ab.sh default priority:CPFILL_COMMUNICATION_PRIORITY=high \
#     sms16:CPFILL_COMMUNICATION_SMS=16
# A variant is NAME or NAME:VAR=VALUE[,VAR=VALUE...]. summary.txt: each run's times, and per
# variant the median run and each step's attention and exchange span (ms, rank 0's trace).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
cp=${CP:-4} rounds=${ROUNDS:-2}
[ $# -gt 0 ] || { echo "usage: CP=N bash $0 NAME[:VAR=VALUE,...]..." >&2; exit 2; }
new_summary
gpu_info
for round in $(seq "$rounds"); do
  for variant in "$@"; do
    name=${variant%%:*} envs=""
    [ "$name" != "$variant" ] && envs=${variant#*:}
    file=$out/$name-$round
    (  # mpirun hands its environment to the ranks it starts on this host
      [ -n "$envs" ] && export ${envs//,/ }
      ring nvlink "$cp" "$file" --seq-lens 131072 --algo pass-kv --repeat 8 \
        --trace "$file.trace.json"
    )
    note "$name ($round) [${envs:-no change}]: $(run_times "$file.log")"
  done
done
python3 bench/gpu/trace_steps.py "$out" "$@" | tee -a "$summary"
