#!/usr/bin/env python3
"""The folders are the architecture. Exits 1 naming every violation of:

1. Layers in a straight line: runtime <- ipc <- shm <- sync <- worker <- pool <- data <- mpi, and torch after data
   (it includes neither mpi nor is included by it). A file may include its own layer and those
   before it, never one after it.
2. Header tiers. In each layer, public headers sit at the top, installed internals in internal/,
   headers private to the library in private/. The installed headers (meson's <layer>_headers
   and <layer>_internal_headers) are exactly what the umbrella headers reach: a header in
   internal/ that no public header includes belongs in private/, and a private/ header must never
   be reached from a public one.
3. A type defined in an internal/ or private/ header lives in a namespace `detail`.

`--root DIR` checks another tree (the tests show it failing on broken copies)."""
import pathlib
import re
import sys

LAYERS = ["runtime", "ipc", "shm", "sync", "worker", "pool", "data", "mpi", "torch"]
UMBRELLAS = ["forkpool.hpp", "mpi.hpp", "torch.hpp"]

root = pathlib.Path(__file__).resolve().parent.parent
if "--root" in sys.argv:
    root = pathlib.Path(sys.argv[sys.argv.index("--root") + 1]).resolve()
include = re.compile(r'^\s*#\s*include\s*[<"]forkpool/([^>"]+)[>"]', re.M)
violations = []


def headers(layer):
    return sorted(p for p in (root / layer).rglob("*") if p.suffix in (".hpp", ".h"))


# 1. Layers.
for rank, layer in enumerate(LAYERS):
    for path in sorted((root / layer).rglob("*")):
        if path.suffix not in (".hpp", ".cpp", ".h"):
            continue
        for used in include.findall(path.read_text()):
            used_layer = used.split("/")[0]
            if used_layer in LAYERS and LAYERS.index(used_layer) > rank:
                violations.append(f"{path.relative_to(root)} includes {used_layer}/, a layer above {layer}/")

# 2. Tiers: what the umbrella headers reach, against what meson installs.
reached, stack = set(), []
for umbrella in UMBRELLAS:
    if (root / "include/forkpool" / umbrella).exists():
        stack += include.findall((root / "include/forkpool" / umbrella).read_text())
while stack:
    header = stack.pop()
    if header in reached or not (root / header).exists():
        continue
    reached.add(header)
    stack += include.findall((root / header).read_text())

installed = set()
files_list = re.compile(r"(\w+)_(headers|internal_headers)\s*=\s*files\(([^)]*)\)", re.S)
for layer in LAYERS:
    build = root / layer / "meson.build"
    if not build.exists():
        continue
    for name, _, body in files_list.findall(build.read_text()):
        for f in re.findall(r"'([^']+)'", body):
            installed.add(f"{layer}/{f}")

for layer in LAYERS:
    for path in headers(layer):
        rel = str(path.relative_to(root))
        tier = path.parent.name
        if tier == "private" and rel in reached:
            violations.append(f"{rel} is private but a public header reaches it: move it to {layer}/internal/")
        if tier == "private" and rel in installed:
            violations.append(f"{rel} is private but installed")
        if tier == "internal" and rel not in reached:
            violations.append(f"{rel} is in internal/ but no public header reaches it: move it to {layer}/private/")
        if rel in reached and rel not in installed:
            violations.append(f"{rel} is reached from a public header but not installed ({layer}/meson.build)")
for rel in sorted(installed - reached):
    if (root / rel).exists():
        violations.append(f"{rel} is installed but no public header reaches it")

# 3. Internal types in namespace detail. A definition at namespace scope (`struct X {`, `class X
# final : ...`, `enum class X {`) is checked against the namespaces open on its line.
definition = re.compile(r"^(?:template\s*<.*>\s*)?(?:class|struct|enum(?: class)?|union)\s+(?:alignas\(\w+\)\s+)?(\w+)[^;]*\{")
opening = re.compile(r"^namespace\s+([\w:]*)\s*\{")
for layer in LAYERS:
    for path in headers(layer):
        if path.parent.name not in ("internal", "private"):
            continue
        stack = []  # (namespace, brace depth when opened)
        depth = 0
        for line in path.read_text().splitlines():
            stripped = line.strip()
            m = opening.match(stripped)
            if m:
                stack.append((m.group(1), depth))
            d = definition.match(line)
            at_namespace_scope = stack and depth == stack[-1][1] + 1
            # A specialization (`struct codec<detail::X> {`) lives where its template does.
            specialization = d and line[d.end(1):].startswith("<")
            if d and at_namespace_scope and not specialization and not any("detail" in ns.split("::") for ns, _ in stack):
                violations.append(f"{path.relative_to(root)}: {d.group(1)} is defined in namespace "
                                  f"{'::'.join(ns for ns, _ in stack)}, not in a detail namespace")
            depth += line.count("{") - line.count("}")
            while stack and depth <= stack[-1][1]:
                stack.pop()

for v in violations:
    print(v)
print(f"layers and tiers: {len(violations)} violation(s)")
sys.exit(1 if violations else 0)
