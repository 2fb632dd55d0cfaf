#!/usr/bin/env bash
# Builds forkpool's Debian packages (debian/) from the files of this tree git does not ignore, checks them with
# lintian (no error, no warning that is not overridden with a reason), unpacks them into a scratch
# root with dpkg -x (the machine's own packages are not touched), and builds and runs the consumer
# project against that root only (tests/install/consume.sh: pkg-config and CMake, with the
# optional parts built) and the Python package (tests/install/consume_python.sh). Output in build-deb/.
set -euo pipefail
cd "$(dirname "$0")/.."
source_dir=$(pwd)

# One version: meson's project(); debian/changelog must name it.
version=$(sed -n "s/^  version : '\([^']*\)',$/\1/p" meson.build)
changelog_version=$(dpkg-parsechangelog -S Version)
[ -n "$version" ] && [ "$version" = "$changelog_version" ] ||
  { echo "meson.build says version '$version', debian/changelog '$changelog_version'" >&2; exit 1; }

work="$source_dir/build-deb"
rm -rf "$work"
mkdir -p "$work/forkpool-$version" "$work/root"
git ls-files -z --cached --others --exclude-standard | xargs -0 tar -cf - | tar -xf - -C "$work/forkpool-$version"

echo "building the packages (dpkg-buildpackage -us -uc -b)..."
(cd "$work/forkpool-$version" &&
  DEB_BUILD_OPTIONS="parallel=$(nproc)" dpkg-buildpackage -us -uc -b >"$work/build.log" 2>&1) ||
  { tail -40 "$work/build.log" >&2; echo "dpkg-buildpackage failed (log: $work/build.log)" >&2; exit 1; }
ls "$work"/*.deb | sed 's#.*/#  #'

echo "lintian..."
lintian --fail-on error,warning --info "$work"/forkpool_"$version"_*.changes

components=()
for deb in "$work"/*.deb; do
  case "$deb" in *-dbgsym_*) continue ;; esac
  dpkg -x "$deb" "$work/root"
done
[ -n "$(ls "$work"/libforkpool-mpi-dev_*.deb 2>/dev/null)" ] && components+=(mpi)
[ -n "$(ls "$work"/libforkpool-torch-dev_*.deb 2>/dev/null)" ] && components+=(torch)
bash tests/install/consume.sh "$work/root" "$source_dir" "${CXX:-g++}" "${components[@]}"
if [ -n "$(ls "$work"/python3-forkpool_*.deb 2>/dev/null)" ]; then bash tests/install/consume_python.sh "$work/root"; fi
echo "deb: packages built, lintian clean, consumer built and run against them"
