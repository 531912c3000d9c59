#!/usr/bin/env bash
# mpirun with what a single host needs: allowed as root (containers, CI) and oversubscribed, so
# four ranks run on a two-core machine. Everything else passes through:
#   launch/mpirun.sh -np 4 build/cpfill attention --seq-lens 32768,8192,1024 --check
set -euo pipefail
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
exec mpirun "$@"
