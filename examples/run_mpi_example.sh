#!/usr/bin/env bash
# Runs an MPI example under mpirun on 3 ranks, each its own node (the suite's check that it keeps
# working). Open MPI gets the flags docs/mpi.md explains; exits 77 (skip) without mpirun.
set -euo pipefail
command -v mpirun >/dev/null || exit 77
flags=()
if mpirun --version 2>&1 | grep -q "Open MPI"; then
  flags=(--mca pml ob1 --oversubscribe)
  [ "$(id -u)" -eq 0 ] && flags+=(--allow-run-as-root)
fi
FORKPOOL_MPI_NODE_PER_RANK=1 exec mpirun "${flags[@]}" -n 3 "$@"
