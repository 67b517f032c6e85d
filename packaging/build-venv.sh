#!/bin/sh
# The package's virtualenv, built from the hash-pinned locks (packaging/lock/), for
# debian/rules:  build-venv.sh WORK DEST FINAL
#   WORK   a scratch directory (the build environment and the wheels);
#   DEST   where the virtualenv is made (inside the package's staging tree);
#   FINAL  the path it runs from on the host (its scripts and byte code name it).
# Every dependency is checked against its hash. pystemd has no wheel: it is compiled here,
# against this machine's libsystemd, with the build tools of packaging/lock/build.lock and no
# build isolation (an isolated build would fetch unpinned tools). pip itself is not in the
# result: the host runs the daemon, it installs nothing.
set -eu
WORK=$1 DEST=$2 FINAL=$3
mkdir -p "$(dirname "$DEST")"
# Absolute: the scripts pip writes name DEST's absolute path, which is rewritten below.
DEST=$(cd "$(dirname "$DEST")" && pwd)/$(basename "$DEST")
# Debian's own interpreter, the one the package depends on (never a pyenv or /usr/local one).
PY=${PYTHON:-/usr/bin/python3}
here=$(cd "$(dirname "$0")" && pwd)
src=$(dirname "$here")
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
rm -rf "$WORK" "$DEST"
mkdir -p "$WORK/wheels"
"$PY" -m venv "$WORK/buildenv"
pip="$WORK/buildenv/bin/pip"
"$pip" install -q --require-hashes --no-deps -r "$here/lock/build.lock"
"$pip" wheel -q --require-hashes --no-deps --no-build-isolation -r "$here/lock/requirements.lock" \
  -w "$WORK/wheels"
"$pip" wheel -q --no-deps --no-build-isolation "$src" -w "$WORK/wheels"
"$PY" -m venv --without-pip "$DEST"
"$pip" --python "$DEST/bin/python3" install -q --no-index --no-deps --no-compile "$WORK/wheels"/*.whl
# Point every script and pyvenv.cfg at the path the virtualenv runs from.
for f in "$DEST"/bin/*; do
  if [ -f "$f" ] && [ ! -L "$f" ] && head -c 2 "$f" | grep -q '#!'; then
    sed -i "1s|^#!$DEST/|#!$FINAL/|" "$f"
  fi
done
rm -f "$DEST"/bin/activate* "$DEST"/bin/Activate.ps1  # no shell of an operator activates it
# The interpreter by its versioned name: the package depends on python3.X, and a later change
# of Debian's default python3 does not move the virtualenv to a Python it was not built for.
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
ln -sfn "/usr/bin/python$pyver" "$DEST/bin/python3"
sed -i "s|$DEST|$FINAL|g" "$DEST/pyvenv.cfg"
# pip records where each wheel came from (direct_url.json): a path of this build machine.
find "$DEST" -name direct_url.json -path '*.dist-info/*' -delete
sed -i '/direct_url.json/d' "$DEST"/lib/python*/site-packages/*.dist-info/RECORD
# Byte code made now, owned by the package: Python never writes into /usr at run time, and a
# purge leaves no __pycache__ behind. Hash-based, unchecked: no timestamps, reproducible.
find "$DEST" -name __pycache__ -type d -prune -exec rm -rf {} +
"$PY" -m compileall -q -j0 --invalidation-mode unchecked-hash -s "$DEST" -p "$FINAL" \
  "$DEST/lib" >/dev/null
