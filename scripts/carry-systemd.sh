#!/usr/bin/env bash
# Builds .sd/: systemd 252 and dbus-daemon from this Debian machine, with every library they link
# and Debian's own loader, for a host that has no systemd (the lent GPU host). There:
#   KIMI_SANDBOX_SYSTEMD_DIR=$PWD/.sd kimi-supervisor sandbox up --dir D --real-gpus
# Also builds a pystemd wheel for CPython 3.12 into .whl/ if python3.12 is here.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .sd && mkdir -p .sd/lib .sd/bin .sd/share/dbus-1 .sd/user-units .sd/wrap
bins=(/lib/systemd/systemd /bin/systemctl /usr/bin/dbus-daemon)
cp "${bins[@]}" .sd/bin/
for b in "${bins[@]}"; do ldd "$b" | awk '/=>/ {print $3} /ld-linux/ {print $1}'; done |
  sort -u | while read -r lib; do cp -L "$lib" .sd/lib/; done
cp /usr/share/dbus-1/session.conf .sd/share/dbus-1/
cp /usr/lib/systemd/user/*.target /usr/lib/systemd/user/*.slice \
   /usr/lib/systemd/user/systemd-exit.service .sd/user-units/
cat > .sd/wrap/systemctl <<'WRAP'
#!/bin/sh
# systemctl from the carried systemd, through its own loader and libraries.
d="$(dirname "$(dirname "$(readlink -f "$0")")")"
exec "$d/lib/ld-linux-x86-64.so.2" --library-path "$d/lib" "$d/bin/systemctl" "$@"
WRAP
chmod +x .sd/wrap/systemctl
grep -qx '/.sd/' .git/info/exclude || echo '/.sd/' >> .git/info/exclude
# pystemd for the GPU host's CPython 3.12 (there is no binary wheel on PyPI): built here with a
# python3.12 (PY312=... to name one), against this machine's libsystemd-dev.
py312="${PY312:-python3.12}"
if "$py312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
  "$py312" -m pip wheel -q --no-deps pystemd -w .whl/
else
  echo "no python3.12 here (set PY312): pystemd for CPython 3.12 not built" >&2
fi
du -sh .sd
