#!/usr/bin/env python3
"""Every ```cpp block in docs/*.md compiles with the build's forkpool; one with a main() runs and
must exit 0. Usage: docs_examples.py SOURCE_DIR BUILD_DIR CXX"""
import pathlib
import re
import subprocess
import sys
import tempfile

source, build, cxx = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
failures = 0
with tempfile.TemporaryDirectory() as scratch:
    for page in sorted((source / "docs").glob("*.md")):
        for n, block in enumerate(re.findall(r"```cpp\n(.*?)```", page.read_text(), re.S)):
            if "#include <forkpool/" not in block:
                continue  # a declaration excerpt, not a program
            name = f"{page.stem}-{n}"
            src = pathlib.Path(scratch) / f"{name}.cpp"
            src.write_text(block)
            runs = "int main(" in block
            out = pathlib.Path(scratch) / name
            cmd = [cxx, "-std=c++20", "-Wall", "-Wextra", "-Werror", f"-I{source / 'include'}", str(src)]
            cmd += ["-o", str(out), f"-L{build}", "-lforkpool", f"-Wl,-rpath,{build}"] if runs else ["-c", "-o", str(out) + ".o"]
            built = subprocess.run(cmd, capture_output=True, text=True)
            if built.returncode != 0:
                print(f"{page.name} example {n} does not compile:\n{built.stderr}")
                failures += 1
                continue
            if runs:
                ran = subprocess.run([str(out)], capture_output=True, text=True, timeout=60)
                if ran.returncode != 0:
                    print(f"{page.name} example {n} exited {ran.returncode}:\n{ran.stderr}")
                    failures += 1
                    continue
            print(f"{page.name} example {n}: ok")
sys.exit(1 if failures else 0)
