#!/usr/bin/env bash
# Runs every benchmark and the Python peers in one go (this machine is noisy: compare within a
# run; each benchmark is repeated and its median kept) and prints the ratios the issues name.
# Usage: bench/run_all.sh BUILD_DIR
set -euo pipefail
build=${1:-build-release}
out=${BENCH_OUT:-$build/bench-results}
anchors="$(cd "$(dirname "$0")/.." && pwd)/../shared/anchors"
mkdir -p "$out"
for b in loop ipc pool tensor queue; do
  echo "== ${b}_bench (io_uring)" >&2
  FORKPOOL_BACKEND=io_uring "$build/bench/${b}_bench" --benchmark_min_time=0.3 \
    --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
    --benchmark_out="$out/$b.json" --benchmark_out_format=json >&2
done
if [ -x "$build/bench/torch_bench" ]; then
  echo "== torch_bench (io_uring)" >&2
  FORKPOOL_BACKEND=io_uring "$build/bench/torch_bench" --benchmark_min_time=0.3 \
    --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
    --benchmark_out="$out/torch.json" --benchmark_out_format=json >&2
fi
if [ -x "$build/examples/torch_hogwild" ]; then
  echo "== hogwild: 1 process on all the data, then 2 on halves (examples/torch_hogwild)" >&2
  { "$build/examples/torch_hogwild" 1 40000 && "$build/examples/torch_hogwild" 2 20000; } | tee "$out/hogwild.txt" >&2
fi
echo "== loop_bench (epoll)" >&2
FORKPOOL_BACKEND=epoll "$build/bench/loop_bench" --benchmark_min_time=0.3 --benchmark_filter=Loop \
  --benchmark_out="$out/loop_epoll.json" --benchmark_out_format=json >&2
if [ -d "$anchors" ]; then
  echo "== Python peers" >&2
  (cd "$anchors" && /usr/bin/python3 py_pool.py) | tee "$out/py_pool.txt" >&2
  /usr/bin/python3 "$(dirname "$0")/py_start.py" | tee "$out/py_start.txt" >&2
  /usr/bin/python3 "$(dirname "$0")/py_overlap.py" | tee "$out/py_overlap.txt" >&2
  if /usr/bin/python3 -c "import torch" 2>/dev/null; then
    (cd "$anchors" && /usr/bin/python3 py_torch.py) | tee "$out/py_torch.txt" >&2
    (cd "$anchors" && /usr/bin/python3 py_dataloader.py) | tee "$out/py_dataloader.txt" >&2
    /usr/bin/python3 "$(dirname "$0")/py_dataloader_collated.py" | tee "$out/py_dataloader_collated.txt" >&2
  fi
  /usr/bin/python3 "$(dirname "$0")/py_queue.py" | tee "$out/py_queue.txt" >&2
  if command -v gcc >/dev/null; then
    gcc -O2 -o "$out/fill" "$anchors/fill.c" && "$out/fill" | tee "$out/fill.txt" >&2
  fi
  if [ -f /usr/include/torch/csrc/api/include/torch/torch.h ]; then
    echo "== libtorch's thread DataLoader" >&2
    g++ -std=c++17 -O2 "$anchors/libtorch_dataloader.cpp" -o "$out/libtorch_dataloader" \
      -I/usr/include/torch/csrc/api/include -ltorch -ltorch_cpu -lc10 -pthread \
      && "$out/libtorch_dataloader" | tee "$out/libtorch_dataloader.txt" >&2
  fi
  if [ -x "$anchors/latency/run.sh" ] || [ -f "$anchors/latency/run.sh" ]; then
    echo "== latency anchors (socket, futex, spinning, iceoryx)" >&2
    bash "$anchors/latency/run.sh" "$out/latency" | tee "$out/latency.txt" >&2
  fi
fi
if [ -d "$build/python/forkpool" ]; then
  echo "== forkpool for Python against CPython's and torch's pools, DataLoader, Executor" >&2
  PYTHONPATH="$build/python" /usr/bin/python3 "$(dirname "$0")/python_pool.py" "$build/bench/pool_bench" \
    | tee "$out/python_pool.txt" >&2
  PYTHONPATH="$build/python" /usr/bin/python3 "$(dirname "$0")/python_data.py" | tee "$out/python_data.txt" >&2
fi
if [ -x "$build/bench/mpi_bench" ] && command -v mpirun >/dev/null; then
  echo "== mpi_bench and mpi4py.futures (3 ranks, each its own node)" >&2
  mpi_flags=()
  if mpirun --version 2>&1 | grep -q "Open MPI"; then
    mpi_flags=(--mca pml ob1 --oversubscribe)
    [ "$(id -u)" -eq 0 ] && mpi_flags+=(--allow-run-as-root)
  fi
  FORKPOOL_MPI_NODE_PER_RANK=1 FORKPOOL_BACKEND=io_uring mpirun "${mpi_flags[@]}" -n 3 "$build/bench/mpi_bench" \
    --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
    --benchmark_out="$out/mpi.json" --benchmark_out_format=json >&2
  if /usr/bin/python3 -c "import mpi4py" 2>/dev/null; then
    mpirun "${mpi_flags[@]}" -n 3 /usr/bin/python3 -m mpi4py.futures "$(dirname "$0")/py_mpi4py.py" \
      | tee "$out/py_mpi4py.txt" >&2
  fi
fi
/usr/bin/python3 "$(dirname "$0")/compare.py" "$out"  # Debian's python3-matplotlib draws the plots
