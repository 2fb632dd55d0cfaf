#!/usr/bin/env bash
# Installs the build into a scratch DESTDIR, then builds and runs the user project in
# tests/install/project (the README's program, beside a runtime/error.hpp of the project's own)
# twice: with nothing but `pkg-config --cflags --libs forkpool`, and with CMake's
# find_package(forkpool CONFIG). The installed headers must be complete, need no library the
# package files do not name, and not clash with the user's own headers.
# Usage: check.sh BUILD_DIR SOURCE_DIR CXX
set -euo pipefail
build=$1 source=$2 cxx=$3
project="$source/tests/install/project"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
meson install -C "$build" --destdir "$scratch/root" --quiet >/dev/null
pc=$(find "$scratch/root" -name forkpool.pc | head -n 1)
prefix=$(sed -n 's/^prefix=//p' "$pc")
root="$scratch/root$prefix"

# pkg-config: the .pc file names the final prefix; point it into the scratch root instead.
mkdir "$scratch/pc"
sed "s#^prefix=.*#prefix=$root#" "$pc" > "$scratch/pc/forkpool.pc"
flags=$(PKG_CONFIG_PATH="$scratch/pc" pkg-config --cflags --libs forkpool)
case " $flags " in *NOMINMAX*|*"/include/forkpool "*) echo "pkg-config leaks: $flags" >&2; exit 1 ;; esac
libdir=$(PKG_CONFIG_PATH="$scratch/pc" pkg-config --variable=libdir forkpool)
$cxx -std=c++20 -Wall -Wextra -Werror -I"$project" "$project/consumer.cpp" "$project/own_headers.cpp" \
  -o "$scratch/consumer-pc" $flags -Wl,-rpath,"$libdir"
"$scratch/consumer-pc"
# The soname is versioned.
# (Read whole: `grep -q` would stop reading early, and objdump's SIGPIPE fail the pipeline.)
soname=$(objdump -p "$libdir/libforkpool.so" | sed -n 's/^ *SONAME *//p')
[ "$soname" = libforkpool.so.0 ] || { echo "soname is '$soname', not libforkpool.so.0" >&2; exit 1; }

# CMake, where it is installed.
if command -v cmake >/dev/null; then
  CXX=$cxx cmake -S "$project" -B "$scratch/cmake-build" -DCMAKE_PREFIX_PATH="$root" \
    -DCMAKE_BUILD_RPATH="$libdir" >/dev/null
  cmake --build "$scratch/cmake-build" >/dev/null
  "$scratch/cmake-build/consumer"
else
  echo "cmake not installed: the CMake consumer was not checked" >&2
fi
