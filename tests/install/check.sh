#!/usr/bin/env bash
# Installs the build into a scratch DESTDIR, then builds and runs the user project in
# tests/install/project against it (consume.sh: the README's program, beside a runtime/error.hpp of
# the project's own, with pkg-config and with CMake). The installed headers must be complete, need
# no library the package files do not name, and not clash with the user's own headers.
# Usage: check.sh BUILD_DIR SOURCE_DIR CXX
set -euo pipefail
build=$1 source=$2 cxx=$3
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
meson install -C "$build" --destdir "$scratch/root" --quiet >/dev/null
# The optional parts this build installed are checked too.
components=()
for part in mpi torch; do
  [ -n "$(find "$scratch/root" -name "forkpool-$part.pc")" ] && components+=("$part")
done
bash "$source/tests/install/consume.sh" "$scratch/root" "$source" "$cxx" "${components[@]}"
