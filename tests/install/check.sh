#!/usr/bin/env bash
# Installs the build into a scratch DESTDIR, then builds and runs consumer.cpp with nothing but
# `pkg-config --cflags --libs forkpool`: the installed headers must be complete and need no
# library the .pc file does not name. Usage: check.sh BUILD_DIR SOURCE_DIR CXX
set -euo pipefail
build=$1 source=$2 cxx=$3
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
meson install -C "$build" --destdir "$scratch/root" --quiet >/dev/null
pc=$(find "$scratch/root" -name forkpool.pc | head -n 1)
prefix=$(sed -n 's/^prefix=//p' "$pc")
# The .pc file names the final prefix; point it into the scratch root instead.
mkdir "$scratch/pc"
sed "s#^prefix=.*#prefix=$scratch/root$prefix#" "$pc" > "$scratch/pc/forkpool.pc"
flags=$(PKG_CONFIG_PATH="$scratch/pc" pkg-config --cflags --libs forkpool)
libdir=$(PKG_CONFIG_PATH="$scratch/pc" pkg-config --variable=libdir forkpool)
$cxx -std=c++20 -Wall -Wextra -Werror "$source/tests/install/consumer.cpp" -o "$scratch/consumer" $flags -Wl,-rpath,"$libdir"
"$scratch/consumer"
