#!/bin/sh
# `make deb` / `./dev package`: the Debian package, from this checkout's files (tracked and not
# ignored: what a clone of this commit has), built in build/deb/ and put in dist/.
#   build-deb.sh [--version V] [--out DIR]
#     V    a Debian version for this build (a hotfix); default, debian/changelog's;
#     DIR  where the .deb goes (default dist/); the build itself runs in DIR/.build.
# Needs the build tools of `scripts/setup-system.sh --package`, and the Python package index
# (every download is checked against packaging/lock/). Prints the path of the .deb.
set -eu
cd "$(dirname "$0")/.."
version="" out=dist
while [ $# -gt 0 ]; do
  case "$1" in
    --version) version=${2:?--version needs a value}; shift 2 ;;
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    *) echo "build-deb: unknown option '$1' (use --version V, --out DIR)" >&2; exit 2 ;;
  esac
done
for tool in dpkg-buildpackage dh fakeroot; do
  command -v $tool >/dev/null 2>&1 || {
    echo "build-deb: $tool is missing: run \`sh scripts/setup-system.sh --package\` (as root)" >&2
    exit 1
  }
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$out/.build
rm -rf "$work"
mkdir -p "$work/src"
# The checkout's files as a clone has them: no .venv, no build outputs, no caches. A release
# tree without git: everything but what .gitignore names.
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git ls-files -z --cached --others --exclude-standard \
    | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -x -C "$work/src"
else
  tar --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./dist --exclude=./.sandbox \
    --exclude=./.whl --exclude=__pycache__ --exclude='*.egg-info' --exclude=.pytest_cache \
    --exclude=.mypy_cache --exclude=.ruff_cache --exclude="./${out#"$PWD"/}" -cf - . \
    | tar -x -C "$work/src"
fi
case "$out/" in "$PWD"/*) rm -rf "$work/src/${out#"$PWD"/}" ;; esac  # not the output in the input
if [ -n "$version" ]; then
  maint=$(sed -n 's/^Maintainer: //p' debian/control)
  { printf 'kimi-supervisor (%s) bookworm; urgency=medium\n\n  * Build %s of this checkout.\n\n -- %s  %s\n\n' \
      "$version" "$version" "$maint" "$(date -R)"
    cat debian/changelog; } > "$work/src/debian/changelog"
fi
(cd "$work/src" && dpkg-buildpackage -b -us -uc >../build.log 2>&1) || {
  tail -40 "$work/build.log" >&2
  echo "build-deb: the build failed; its log is $work/build.log" >&2
  exit 1
}
for deb in "$work"/*.deb; do
  mv -f "$deb" "$out/"
  echo "$out/$(basename "$deb")"
done
rm -rf "$work"
