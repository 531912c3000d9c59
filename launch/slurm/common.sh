# shellcheck shell=bash
# Sourced by the cpfill-*.sbatch job scripts: checks the cluster, chooses the layout, prints it,
# and starts the ranks with srun. One rank per GPU; TP inside a node, CP across nodes.
#
#   cpfill_slurm_run attention "$@"     # the job script's flags go to `cpfill attention`
#
# Environment (all optional on a GPU cluster):
#   CPFILL                path of the program (default: build/cpfill of this checkout)
#   CPFILL_TP             tensor-parallel size (default: the largest divisor of the model's KV
#                         heads that divides the ranks of a node); --tp among the flags wins
#   CPFILL_BACKEND        cpu | cuda (default: cuda when the job has GPUs, else cpu); --backend wins
#   TASKS_PER_NODE        ranks per node (default: --ntasks-per-node if given to sbatch, else the
#                         GPUs per node); set it for the CPU backend on nodes without GPUs
#   CPFILL_RANKS_PER_NODE cut each host into emulated nodes of this many ranks (tests; read by
#                         cpfill itself too)
# Errors in the set-up print one line naming the remedy and exit 2, as cpfill does on bad input.

cpfill_slurm_fail() {
  echo "cpfill-slurm: error: $*" >&2
  exit 2
}

# cpfill_flag NAME ARGS...: prints the value of --NAME (as "--NAME V" or "--NAME=V") among ARGS;
# status 1 when absent.
cpfill_flag() {
  local name=$1
  shift
  while (($#)); do
    case $1 in
      "--$name") [[ $# -ge 2 ]] && { printf '%s\n' "$2"; return 0; } ;;
      "--$name="*) printf '%s\n' "${1#*=}"; return 0 ;;
    esac
    shift
  done
  return 1
}

cpfill_gcd() {
  local a=$1 b=$2 t
  while ((b)); do t=$((a % b)); a=$b; b=$t; done
  echo "$a"
}

# Open MPI's ranks find each other through Slurm's PMIx plugin; without it every rank starts as
# a world of one (singletons), each running the whole job alone.
cpfill_slurm_require_pmix() {
  command -v srun >/dev/null || cpfill_slurm_fail "srun is not on PATH (run this with sbatch)"
  local plugins listed
  plugins=$(srun --mpi=list 2>&1) ||
    cpfill_slurm_fail "'srun --mpi=list' failed: $(tail -n 1 <<<"$plugins")"
  if ! grep -qw 'pmix' <<<"$plugins"; then
    listed=$(grep -E '^[[:space:]]+[a-z_0-9]+$' <<<"$plugins" | tr -d '[:blank:]' |
      paste -sd' ') || true
    cpfill_slurm_fail "this Slurm has no PMIx MPI plugin, which Open MPI needs to start the" \
      "ranks as one job ('srun --mpi=list' lists: ${listed:-nothing}). Install it (Debian and" \
      "Ubuntu: slurm-wlm-basic-plugins with libpmix-dev on every node; from source: Slurm" \
      "configured --with-pmix) or ask the cluster's administrators"
  fi
}

# GPUs per node the job asked for: --gpus-per-node (SLURM_GPUS_PER_NODE, maybe "type:N"), else
# what the node gave (SLURM_GPUS_ON_NODE: --gres=gpu:N, or every GPU of an --exclusive node),
# else CUDA_VISIBLE_DEVICES. 0 when none.
cpfill_slurm_gpus_per_node() {
  local n=${SLURM_GPUS_PER_NODE:-}
  n=${n##*:}
  if [[ $n =~ ^[0-9]+$ ]] && ((n > 0)); then echo "$n"; return; fi
  n=${SLURM_GPUS_ON_NODE:-}
  if [[ $n =~ ^[0-9]+$ ]] && ((n > 0)); then echo "$n"; return; fi
  # Only a list of device numbers counts (some Slurm versions set "NoDevFiles").
  if [[ ${CUDA_VISIBLE_DEVICES:-} =~ ^[0-9]+(,[0-9]+)*$ ]]; then
    tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .
    return
  fi
  echo 0
}

# The model's KV heads, for the TP choice: attention's --kv-heads (default: what `cpfill
# attention --help` says); a checkpoint's config.json; the presets' (runtime/model/model_config.cc).
# Prints nothing when it cannot tell (cpfill then refuses the model itself).
cpfill_slurm_kv_heads() {
  local command=$1 model
  shift
  if [[ $command == attention ]]; then
    cpfill_flag kv-heads "$@" ||
      "$CPFILL" attention --help 2>&1 | sed -n 's/^ *--kv-heads .*\[\([0-9]*\)\].*/\1/p'
    return 0
  fi
  model=$(cpfill_flag model "$@") || return 0
  if [[ -f $model/config.json ]]; then
    python3 -c 'import json, sys
c = json.load(open(sys.argv[1]))
print(c.get("num_key_value_heads") or c.get("num_attention_heads") or "")' "$model/config.json" \
      2>/dev/null || true
    return 0
  fi
  case $model in
    tiny) echo 4 ;;
    llama3-8b | llama3-70b | llama3-405b) echo 8 ;;
  esac
}

# cpfill_slurm_run COMMAND ARGS...: everything, then srun replaces this shell.
cpfill_slurm_run() {
  local command=$1
  shift
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  CPFILL=${CPFILL:-$root/build/cpfill}
  [[ -x $CPFILL ]] || cpfill_slurm_fail "no program at $CPFILL: build it (bash launch/setup.sh)" \
    "or set CPFILL to its path"
  [[ -n ${SLURM_JOB_ID:-} ]] || cpfill_slurm_fail "not inside a Slurm job: submit this with sbatch"
  cpfill_slurm_require_pmix

  local nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}} gpus tasks
  gpus=$(cpfill_slurm_gpus_per_node)
  tasks=${TASKS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-$gpus}}
  if [[ ! $tasks =~ ^[0-9]+$ ]] || ((tasks < 1)); then
    cpfill_slurm_fail "no GPUs in this job and no TASKS_PER_NODE: ask for GPUs" \
      "(sbatch --gpus-per-node=8), or for the CPU backend set TASKS_PER_NODE=N CPFILL_BACKEND=cpu"
  fi

  # Extra flags for cpfill; one the user gave wins (cpfill refuses a flag given twice).
  local extra=() backend tp kv_heads node_ranks why
  backend=$(cpfill_flag backend "$@") || {
    backend=${CPFILL_BACKEND:-}
    [[ -n $backend ]] || { if ((gpus > 0)); then backend=cuda; else backend=cpu; fi; }
    extra+=(--backend "$backend")
  }
  # The ranks of one (emulated) node, which a TP group must divide.
  node_ranks=$(cpfill_flag ranks-per-node "$@") || node_ranks=${CPFILL_RANKS_PER_NODE:-0}
  [[ $node_ranks =~ ^[0-9]+$ ]] ||
    cpfill_slurm_fail "--ranks-per-node: '$node_ranks' is not a count"
  ((node_ranks > 0)) || node_ranks=$tasks
  if tp=$(cpfill_flag tp "$@"); then
    why="given (--tp)"
  elif [[ -n ${CPFILL_TP:-} ]]; then
    tp=$CPFILL_TP why="given (CPFILL_TP)"
    extra+=(--tp "$tp")
  else
    kv_heads=$(cpfill_slurm_kv_heads "$command" "$@")
    if [[ $kv_heads =~ ^[0-9]+$ ]] && ((kv_heads > 0)); then
      tp=$(cpfill_gcd "$kv_heads" "$node_ranks")
      why="the largest divisor of the $kv_heads KV head(s) that divides the $node_ranks"
      why+=" rank(s) of a node"
    else
      tp=1 why="the model's KV heads are unknown here"
    fi
    extra+=(--tp "$tp")
  fi
  if [[ ! $tp =~ ^[0-9]+$ ]] || ((tp < 1)); then
    cpfill_slurm_fail "TP '$tp' is not a positive count"
  fi
  ((node_ranks % tp == 0)) ||
    cpfill_slurm_fail "TP$tp does not divide the $node_ranks rank(s) of a node: choose a TP" \
      "that does (CPFILL_TP or --tp), or change --gpus-per-node / TASKS_PER_NODE"
  local world=$((nodes * tasks))
  ((world % node_ranks == 0)) ||
    cpfill_slurm_fail "$world rank(s) do not make whole nodes of $node_ranks (--ranks-per-node)"

  # CPU binding: each rank its share of the node's CPUs, bound to whole cores when the share
  # holds a core's hardware threads, to threads when smaller. None when ranks outnumber CPUs
  # (--overcommit; any binding would warn and stack ranks) or when Slurm cannot bind (TaskPlugin
  # task/none: srun would warn that it lacks support).
  local cpus=${SLURM_CPUS_ON_NODE:-0} per_task threads_per_core task_plugin binding
  # --ntasks too: an sbatch -n in the environment would otherwise override --ntasks-per-node.
  local srun_flags=(--mpi=pmix --nodes="$nodes" --ntasks="$world" --ntasks-per-node="$tasks"
                    --kill-on-bad-exit=1)
  task_plugin=$(scontrol show config 2>/dev/null | sed -n 's/^TaskPlugin *= *//p') || true
  threads_per_core=$(scontrol show node "${SLURMD_NODENAME:-$(hostname -s)}" 2>/dev/null |
    grep -Eo 'ThreadsPerCore=[0-9]+' | cut -d= -f2) || true
  threads_per_core=${threads_per_core:-1}
  per_task=$((cpus / tasks))
  local can_bind=0
  # --cpu-bind is task/affinity's (task/cgroup alone confines, it does not bind).
  [[ $task_plugin == *affinity* ]] && can_bind=1
  if ((per_task < 1)); then
    binding="none: $tasks ranks on $cpus CPU(s) of a node"
    srun_flags+=(--overcommit)
    ((can_bind)) && srun_flags+=(--cpu-bind=none)
  else
    srun_flags+=(--cpus-per-task="$per_task")
    if ((!can_bind)); then
      binding="none: TaskPlugin ${task_plugin:-unknown} cannot bind; $per_task CPU(s) per rank"
    elif ((per_task >= threads_per_core)); then
      binding="cores, $per_task CPU(s) per rank"
      srun_flags+=(--cpu-bind=cores)
    else
      binding="threads, $per_task CPU(s) per rank"
      srun_flags+=(--cpu-bind=threads)
    fi
  fi

  local layout="TP$tp x CP$((world / tp))"
  if ((node_ranks != tasks)); then
    layout+=" ($world ranks in emulated nodes of $node_ranks)"
  fi
  echo "cpfill-slurm: cpfill $command on $nodes node(s) x $tasks rank(s), $backend backend: $layout"
  echo "cpfill-slurm: TP$tp: $why"
  echo "cpfill-slurm: nodes: $(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd' ')"
  echo "cpfill-slurm: $gpus GPU(s) per node; CPU binding: $binding"
  # ${a[@]+...}: an empty array under set -u fails on bash before 4.4.
  echo "cpfill-slurm: srun ${srun_flags[*]} $CPFILL $command ${extra[*]+${extra[*]}} $*"
  exec srun "${srun_flags[@]}" "$CPFILL" "$command" ${extra[@]+"${extra[@]}"} "$@"
}
