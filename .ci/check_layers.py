#!/usr/bin/env python3
"""The layers in a straight line: runtime <- ipc <- shm <- sync <- pool <- mpi, and torch after pool (it
includes neither mpi nor is included by it). A file may include its own layer
and those before it, never one after it. Exits 1 naming every violation."""
import pathlib
import re
import sys

LAYERS = ["runtime", "ipc", "shm", "sync", "pool", "mpi", "torch"]
root = pathlib.Path(__file__).resolve().parent.parent
include = re.compile(r'^\s*#\s*include\s*[<"]forkpool/(\w+)/', re.M)
violations = []
for rank, layer in enumerate(LAYERS):
    for path in sorted((root / layer).rglob("*")):
        if path.suffix not in (".hpp", ".cpp", ".h"):
            continue
        for used in include.findall(path.read_text()):
            if used in LAYERS and LAYERS.index(used) > rank:
                violations.append(f"{path.relative_to(root)} includes {used}/, a layer above {layer}/")
for v in violations:
    print(v)
print(f"layers: {len(violations)} violation(s)")
sys.exit(1 if violations else 0)
