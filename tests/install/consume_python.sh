#!/usr/bin/env bash
# Imports forkpool for Python as installed under ROOT (python3-forkpool unpacked with dpkg -x) with
# Debian's /usr/bin/python3, and nothing from a build tree, and runs a pool: a map, a task that
# raises, and a tensor written in place by a worker.
# Usage: consume_python.sh ROOT
set -euo pipefail
root_dir=$1
site="$root_dir/usr/lib/python3/dist-packages"
[ -d "$site/forkpool" ] || { echo "no forkpool package under $site" >&2; exit 1; }
libdir="$root_dir/usr/lib/$(dpkg-architecture -qDEB_HOST_MULTIARCH)"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cat >"$scratch/consumer.py" <<'PY'
import sys

import torch

import forkpool


def fill(t):
    t.fill_(7)


def fail(x):
    raise KeyError(x)


if __name__ == "__main__":
    assert forkpool.__file__.startswith(sys.argv[1]), forkpool.__file__
    with forkpool.Pool(2) as pool:
        assert pool.map(abs, range(-50, 0)) == list(range(50, 0, -1))
        try:
            pool.apply(fail, ("key",))
            raise AssertionError("the task's KeyError was not raised")
        except KeyError as error:
            assert error.args == ("key",)
        t = torch.zeros(1000)
        pool.apply(fill, (t,))
        assert bool((t == 7).all())
    print("python3-forkpool: a pool ran from", forkpool.__file__)
PY
cd "$scratch"
PYTHONPATH="$site" LD_LIBRARY_PATH="$libdir" /usr/bin/python3 consumer.py "$site"
