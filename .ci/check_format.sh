#!/usr/bin/env bash
# Every C++ file as .clang-format has it (clang-format 14, Debian 12's: other versions format
# differently). Exits 1 naming the files that differ, 77 (a skip) without clang-format 14.
# Fix them with: clang-format-14 -i <files>.
set -uo pipefail
cd "$(dirname "$0")/.."
format=$(command -v clang-format-14 || true)
if [ -z "$format" ] && command -v clang-format >/dev/null && clang-format --version | grep -q "version 14\."; then
  format=$(command -v clang-format)
fi
if [ -z "$format" ]; then echo "format: clang-format 14 not installed: skipped"; exit 77; fi
if [ -d .git ] && command -v git >/dev/null; then
  files=$(git ls-files '*.cpp' '*.hpp' '*.h' '*.c' | grep -v '^subprojects/' || true)
else
  files=$(find runtime ipc shm sync worker pool data mpi torch python tests bench examples include -name '*.[ch]pp' -o -name '*.[ch]' | sort)
fi
bad=0
for f in $files; do
  if ! "$format" --dry-run --Werror "$f" >/dev/null 2>&1; then
    echo "not formatted: $f"
    bad=1
  fi
done
echo "format: $(echo "$files" | wc -w) files checked, $([ $bad = 0 ] && echo all formatted || echo some differ)"
exit $bad
