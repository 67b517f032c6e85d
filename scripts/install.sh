#!/bin/sh
# `make install` (development; hosts install the Debian package, `make deb`):
#   install.sh DESTDIR PREFIX BINDIR UNITDIR SYSCONFDIR PYTHON MANDIR   (see the Makefile)
# The virtualenv is built from the hash-pinned locks (packaging/build-venv.sh) beside the old one
# and swapped in by two renames: an upgrade never leaves the commands missing, and a failed build
# leaves the installed one as it was. Its scripts name PREFIX, so a staged tree (DESTDIR) works
# once copied to /. The units go to UNITDIR (/usr/local/lib/systemd/system, where packages do not
# write and an admin's /etc/systemd/system overrides them), their paths pointed at BINDIR and
# PREFIX. Without DESTDIR the group, vLLM's user (kimi-vllm) and the directories are created and
# systemd reloaded; nothing is enabled or started (docs/operations.md). `make uninstall` removes
# all of it but the config, the state, the group and the user.
set -eu
DESTDIR=$1 PREFIX=$2 BINDIR=$3 UNITDIR=$4 SYSCONFDIR=$5 PYTHON=${6:-/usr/bin/python3}
MANDIR=${7:-/usr/local/share/man}
cd "$(dirname "$0")/.."
[ -n "$DESTDIR" ] || sh scripts/setup-system.sh --install
root="$DESTDIR$PREFIX"
version=$("$PYTHON" -c 'import tomllib; print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')
echo "install: kimi-supervisor $version into $root"
mkdir -p "$(dirname "$root")"
work=$(mktemp -d)
trap 'rm -rf "$work" "$root.new"' EXIT
PYTHON=$PYTHON sh packaging/build-venv.sh "$work" "$root.new" "$PREFIX"
install -d -m 0755 "$root.new/docs" "$root.new/config/prometheus" "$root.new/config/grafana"
install -m 0644 docs/*.md README.md "$root.new/docs/"
# The alert rules and the dashboard, for the operator's Prometheus and Grafana.
install -m 0644 config/prometheus/*.yml "$root.new/config/prometheus/"
install -m 0644 config/grafana/kimi-supervisor.json "$root.new/config/grafana/"
# The swap: the old tree steps aside, the new one takes its name, the old one goes.
[ -e "$root" ] && mv -T "$root" "$root.old"
mv -T "$root.new" "$root"
rm -rf "$root.old"
install -d -m 0755 "$DESTDIR$BINDIR" "$DESTDIR$UNITDIR" "$DESTDIR$SYSCONFDIR/kimi-supervisor" \
  "$DESTDIR/usr/local/lib/sysusers.d" "$DESTDIR/usr/local/lib/tmpfiles.d"
# kimi-mode(1) and kimi-supervisor(8), rendered from the installed commands' own options.
"$root/bin/python3" -m kimi_supervisor.cli.manpage "$DESTDIR$MANDIR" >/dev/null
# bash and zsh completion for both, generated from the same parsers, beside the man pages.
"$root/bin/python3" -m kimi_supervisor.cli.completion install "$DESTDIR$(dirname "$MANDIR")" >/dev/null
ln -sfn "$PREFIX/bin/kimi-supervisor" "$DESTDIR$BINDIR/kimi-supervisor"
ln -sfn "$PREFIX/bin/kimi-mode" "$DESTDIR$BINDIR/kimi-mode"
for unit in kimi-supervisor.service vllm-kimi-k25.service; do
  sed -e "s|/usr/bin/kimi-supervisor|$BINDIR/kimi-supervisor|g" \
      -e "s|file:///usr/share/doc/kimi-supervisor/|file://$PREFIX/docs/|g" \
      "units/$unit" > "$DESTDIR$UNITDIR/$unit"
  chmod 0644 "$DESTDIR$UNITDIR/$unit"
done
install -m 0644 packaging/kimi-supervisor.sysusers "$DESTDIR/usr/local/lib/sysusers.d/kimi-supervisor.conf"
install -m 0644 packaging/kimi-supervisor.tmpfiles "$DESTDIR/usr/local/lib/tmpfiles.d/kimi-supervisor.conf"
conf="$DESTDIR$SYSCONFDIR/kimi-supervisor/kimi-supervisor.toml"
if [ -e "$conf" ]; then
  install -m 0644 config/kimi-supervisor.toml "$conf.dist"
  echo "install: kept your $conf (the shipped one is $conf.dist)"
else
  install -m 0644 config/kimi-supervisor.toml "$conf"
fi
if [ -z "$DESTDIR" ]; then
  systemd-sysusers /usr/local/lib/sysusers.d/kimi-supervisor.conf
  systemd-tmpfiles --create /usr/local/lib/tmpfiles.d/kimi-supervisor.conf
  systemctl daemon-reload 2>/dev/null || true
  # An older `make install` wrote the units to /etc/systemd/system, which overrides UNITDIR.
  for unit in kimi-supervisor.service vllm-kimi-k25.service; do
    if [ "$UNITDIR" != /etc/systemd/system ] && [ -f "/etc/systemd/system/$unit" ]; then
      echo "install: /etc/systemd/system/$unit overrides $UNITDIR/$unit: remove it if an older" \
        "make install wrote it (keep your edits as a drop-in: systemctl edit ${unit%.service})"
    fi
  done
  echo "install: done. Next: kimi-supervisor check-config $SYSCONFDIR/kimi-supervisor/kimi-supervisor.toml,"
  echo "  then systemctl enable --now kimi-supervisor (first install) or systemctl reload kimi-supervisor (upgrade)"
fi
