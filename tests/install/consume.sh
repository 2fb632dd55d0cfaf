#!/usr/bin/env bash
# Builds and runs the user project in tests/install/project against forkpool as installed under
# ROOT (a DESTDIR, or Debian packages unpacked with dpkg -x), and nothing else: no build tree on
# any include or library path. Twice: with nothing but `pkg-config`, and with CMake's
# find_package(forkpool CONFIG). COMPONENTS (mpi, torch) adds each optional part's program,
# linked through `pkg-config forkpool-<part>` and through the CMake target forkpool::<part>.
# Usage: consume.sh ROOT SOURCE_DIR CXX [COMPONENT...]
set -euo pipefail
root_dir=$1 source=$2 cxx=$3
shift 3
components=("$@")
project="$source/tests/install/project"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

pc=$(find "$root_dir" -name forkpool.pc | head -n 1)
[ -n "$pc" ] || { echo "no forkpool.pc under $root_dir" >&2; exit 1; }
prefix=$(sed -n 's/^prefix=//p' "$pc")
root="$root_dir$prefix"

# pkg-config: the .pc files name the final prefix; point them into the root instead.
mkdir "$scratch/pc"
for file in "$(dirname "$pc")"/forkpool*.pc; do
  sed "s#^prefix=.*#prefix=$root#" "$file" > "$scratch/pc/$(basename "$file")"
done
# The installed files name installed paths only.
build_paths="$source\|/build\|/obj-"
if grep -q "$build_paths" "$(dirname "$pc")"/forkpool*.pc; then
  echo "a .pc file names a build path:" >&2; grep "$build_paths" "$(dirname "$pc")"/forkpool*.pc >&2; exit 1
fi
flags=$(PKG_CONFIG_PATH="$scratch/pc" pkg-config --cflags --libs forkpool)
case " $flags " in *NOMINMAX*|*"/include/forkpool "*) echo "pkg-config leaks: $flags" >&2; exit 1 ;; esac
libdir=$(PKG_CONFIG_PATH="$scratch/pc" pkg-config --variable=libdir forkpool)
$cxx -std=c++20 -Wall -Wextra -Werror -I"$project" "$project/consumer.cpp" "$project/own_headers.cpp" \
  -o "$scratch/consumer-pc" $flags -Wl,-rpath,"$libdir"
"$scratch/consumer-pc"
for part in "${components[@]}"; do
  part_flags=$(PKG_CONFIG_PATH="$scratch/pc" pkg-config --cflags --libs "forkpool-$part")
  $cxx -std=c++20 -Wall -Wextra -Werror "$project/${part}_consumer.cpp" -o "$scratch/$part-pc" $part_flags \
    -Wl,-rpath,"$libdir"
  "$scratch/$part-pc"
done
# The sonames are versioned.
# (Read whole: `grep -q` would stop reading early, and objdump's SIGPIPE fail the pipeline.)
for lib in forkpool "${components[@]/#/forkpool-}"; do
  soname=$(objdump -p "$libdir/lib$lib.so" | sed -n 's/^ *SONAME *//p')
  [ "$soname" = "lib$lib.so.0" ] || { echo "soname of lib$lib.so is '$soname', not lib$lib.so.0" >&2; exit 1; }
done

# CMake, where it is installed.
if command -v cmake >/dev/null; then
  cmake_config=$(find "$root" -name forkpoolConfig.cmake | head -n 1)
  if grep -q "$build_paths" "$cmake_config"; then echo "$cmake_config names a build path" >&2; exit 1; fi
  list=$(IFS=';'; echo "${components[*]}")
  CXX=$cxx cmake -S "$project" -B "$scratch/cmake-build" -DCMAKE_PREFIX_PATH="$root" \
    -DCMAKE_BUILD_RPATH="$libdir" -DFORKPOOL_COMPONENTS="$list" >/dev/null
  cmake --build "$scratch/cmake-build" >/dev/null
  "$scratch/cmake-build/consumer"
  for part in "${components[@]}"; do "$scratch/cmake-build/${part}_consumer"; done
else
  echo "cmake not installed: the CMake consumer was not checked" >&2
fi
echo "consumer built and run against $root_dir${components[*]:+ (with ${components[*]})}"
