#!/usr/bin/env python3
"""Hogwild's promise, checked on the example: 2 processes, each on its half of the data, reach the
accuracy 1 process reaches on all of it with the same number of samples seen in all.

    torch_hogwild_check.py TORCH_HOGWILD STEPS

Runs `TORCH_HOGWILD 1 2*STEPS` and `TORCH_HOGWILD 2 STEPS`, prints both lines, and fails unless
both runs pass and the 2-process accuracy is within 0.01 of the 1-process one or above it.
Wall time is printed, not judged: the suite runs beside other tests (bench/run_all.sh compares
it on a quiet machine)."""
import re
import subprocess
import sys

LINE = re.compile(r"hogwild: (\d+) processes x (\d+) steps in ([0-9.]+) s: .*accuracy [0-9.]+ -> ([0-9.]+)")


def run(binary, processes, steps):
    done = subprocess.run([binary, str(processes), str(steps)], capture_output=True, text=True, timeout=300)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    found = LINE.search(done.stdout)
    if done.returncode != 0 or not found:
        sys.exit(f"torch_hogwild {processes} {steps} failed (exit {done.returncode})")
    return float(found.group(3)), float(found.group(4))


def main():
    binary, steps = sys.argv[1], int(sys.argv[2])
    one_time, one_accuracy = run(binary, 1, 2 * steps)
    two_time, two_accuracy = run(binary, 2, steps)
    print(f"1 process: accuracy {one_accuracy:.3f} in {one_time:.3f} s; "
          f"2 processes: accuracy {two_accuracy:.3f} in {two_time:.3f} s")
    if two_accuracy < one_accuracy - 0.01:
        sys.exit(f"2 processes reached accuracy {two_accuracy:.3f}, below 1 process's {one_accuracy:.3f}")


if __name__ == "__main__":
    main()
