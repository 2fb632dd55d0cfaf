#!/usr/bin/env python3
"""Each snippet here must fail to compile, with the message its first line expects: the
compile-time rules (no pointers in plain aggregates, a codec for every value) say what to do.
And the public headers compile warning-free under a user's strict flags.
Usage: check.py INCLUDE_DIR COMPILER [ARGS...]"""
import pathlib
import subprocess
import sys

include, compiler = sys.argv[1], sys.argv[2:]
failures = 0
for snippet in sorted(pathlib.Path(__file__).parent.glob("*.cpp")):
    lines = snippet.read_text().splitlines()
    expected = lines[0].removeprefix("// expect: ").strip()
    standard = lines[1].removeprefix("// standard: ").strip() if lines[1].startswith("// standard: ") else "c++20"
    run = subprocess.run(compiler + [f"-std={standard}", "-fsyntax-only", "-I", include, str(snippet)],
                         capture_output=True, text=True)
    if run.returncode == 0:
        print(f"FAIL {snippet.name}: compiled, but must not")
        failures += 1
    elif expected not in run.stderr:
        print(f"FAIL {snippet.name}: the compiler did not say '{expected}':\n{run.stderr[:3000]}")
        failures += 1
    else:
        print(f"ok   {snippet.name}: '{expected}' ({len(run.stderr.splitlines())} lines of diagnostics)")
strict = ["-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Wshadow", "-Wpedantic", "-Werror", "-I", include,
          "-x", "c++", "-"]
run = subprocess.run(compiler + strict, input="#include <forkpool/forkpool.hpp>\nint main() {}\n",
                     capture_output=True, text=True)
if run.returncode != 0:
    print(f"FAIL <forkpool/forkpool.hpp> under {' '.join(strict[2:7])}:\n{run.stderr[:3000]}")
    failures += 1
else:
    print("ok   <forkpool/forkpool.hpp> compiles under -Wall -Wextra -Wshadow -Wpedantic -Werror")
sys.exit(1 if failures else 0)
