"""Compiles every installed header alone, as a user's first #include would (seastar's
checkheaders): a header that leans on what another included before it fails here.

Usage: check_headers.py SOURCE_ROOT COMPILER [FLAG...] -- HEADER...
Each header is a path under SOURCE_ROOT; it is included as it is installed, <forkpool/PATH>
(include/forkpool/NAME.hpp as <forkpool/NAME.hpp>).
"""
import concurrent.futures
import os
import subprocess
import sys


def include_name(root, header):
    relative = os.path.relpath(header, root)
    if relative.startswith("include" + os.sep):
        return os.path.relpath(relative, "include")
    return os.path.join("forkpool", relative)


def check(compiler, flags, name):
    source = f"#include <{name}>\n#include <{name}>\n"  # twice: its include guard holds too
    result = subprocess.run([*compiler, *flags, "-fsyntax-only", "-x", "c++", "-"], input=source,
                            capture_output=True, text=True)
    return name, result.returncode, result.stderr


def main():
    root = sys.argv[1]
    split = sys.argv.index("--")
    compiler, flags = sys.argv[2:3], sys.argv[3:split]
    flags = ["-std=c++20", "-Wall", "-Wextra", "-Werror", "-I", os.path.join(root, "include"), *flags]
    headers = sys.argv[split + 1:]
    missing = [h for h in headers if not os.path.exists(h)]
    if missing or not headers:
        print(f"no such header: {missing}" if missing else "no headers given")
        return 1
    names = sorted(include_name(root, h) for h in headers)
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for name, code, errors in pool.map(lambda n: check(compiler, flags, n), names):
            if code != 0:
                failed += 1
                print(f"FAIL {name}\n{errors}")
            else:
                print(f"ok   {name}")
    print(f"headers: {len(names)} compiled alone, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
