#!/usr/bin/env python3
"""The layer check fails where it should: it passes on a copy of the tree, and fails, naming the
file, on a copy with a private header placed in internal/, with a header of one layer including
a layer above it (the worker's side including the parent's among them), and with an internal
type outside a detail namespace."""
import pathlib
import shutil
import subprocess
import sys
import tempfile

source = pathlib.Path(__file__).resolve().parent.parent
check = source / ".ci" / "check_layers.py"
LAYERS = ["runtime", "ipc", "shm", "sync", "worker", "pool", "data", "mpi", "torch"]
failures = []


def copy_tree(into):
    for layer in LAYERS:
        shutil.copytree(source / layer, into / layer)
    shutil.copytree(source / "include", into / "include", symlinks=True)


def run(root):
    done = subprocess.run([sys.executable, str(check), "--root", str(root)], capture_output=True, text=True)
    return done.returncode, done.stdout


def expect(name, breakage, expected_line):
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        copy_tree(root)
        if breakage:
            breakage(root)
        code, out = run(root)
        ok = code == 0 if not breakage else (code == 1 and expected_line in out)
        print(f"{'ok  ' if ok else 'FAIL'} {name}: exit {code}")
        if breakage:
            print("     " + "\n     ".join(line for line in out.splitlines() if expected_line in line))
        if not ok:
            failures.append(name)
            print(out)


def private_in_internal(root):
    (root / "pool/private/pool_worker.hpp").rename(root / "pool/internal/pool_worker.hpp")


def layer_above(root):
    with open(root / "shm/tensor.cpp", "a") as f:
        f.write("\n#include <forkpool/pool/pool.hpp>\n")


def worker_includes_pool(root):
    with open(root / "worker/worker.cpp", "a") as f:
        f.write("\n#include <forkpool/pool/internal/job.hpp>\n")


def type_outside_detail(root):
    with open(root / "ipc/internal/frame.hpp", "a") as f:
        f.write("\nnamespace forkpool {\nstruct LeakedInternal {\n  int x;\n};\n}  // namespace forkpool\n")


expect("an intact tree passes", None, "")
expect("a private header in internal/ fails", private_in_internal, "pool/internal/pool_worker.hpp is in internal/")
expect("an include of a layer above fails", layer_above, "shm/tensor.cpp includes pool/")
expect("the worker's side including the parent's fails", worker_includes_pool, "worker/worker.cpp includes pool/")
expect("an internal type outside detail fails", type_outside_detail, "LeakedInternal is defined in namespace forkpool")
sys.exit(1 if failures else 0)
