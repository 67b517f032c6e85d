#!/bin/sh
# `make install`: DESTDIR PREFIX BINDIR UNITDIR SYSCONFDIR PYTHON MANDIR (see the Makefile).
# The virtualenv is built under DESTDIR+PREFIX and its scripts point at PREFIX, so a staged tree
# works once copied to /. Without DESTDIR, the group and directories are created and systemd
# reloaded; nothing is enabled or started (docs/operations.md says what to run next).
set -eu
DESTDIR=$1 PREFIX=$2 BINDIR=$3 UNITDIR=$4 SYSCONFDIR=$5 PYTHON=${6:-python3}
MANDIR=${7:-/usr/local/share/man}
cd "$(dirname "$0")/.."
sh scripts/setup-system.sh --install
root="$DESTDIR$PREFIX"
version=$("$PYTHON" -c 'import tomllib; print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')
echo "install: kimi-supervisor $version into $root"
"$PYTHON" -m venv --clear "$root"
"$root/bin/pip" install -q --upgrade pip
"$root/bin/pip" install -q --no-compile .
if [ -n "$DESTDIR" ]; then
  # Scripts name the interpreter by its staged path: point them at the final one.
  for f in "$root"/bin/*; do
    if [ -f "$f" ] && head -c 2 "$f" | grep -q '#!'; then
      sed -i "1s|^#!$root/|#!$PREFIX/|" "$f"
    fi
  done
fi
install -d -m 0755 "$DESTDIR$BINDIR" "$DESTDIR$UNITDIR" "$DESTDIR$SYSCONFDIR/kimi-supervisor" \
  "$root/docs" "$DESTDIR/usr/lib/sysusers.d" "$DESTDIR/usr/lib/tmpfiles.d"
# kimi-mode(1) and kimi-supervisor(8), rendered from the installed commands' own options.
"$root/bin/python" -m kimi_supervisor.cli.manpage "$DESTDIR$MANDIR" >/dev/null
# bash and zsh completion for both, generated from the same parsers, beside the man pages.
"$root/bin/python" -m kimi_supervisor.cli.completion install "$DESTDIR$(dirname "$MANDIR")" >/dev/null
ln -sf "$PREFIX/bin/kimi-supervisor" "$DESTDIR$BINDIR/kimi-supervisor"
ln -sf "$PREFIX/bin/kimi-mode" "$DESTDIR$BINDIR/kimi-mode"
install -m 0644 units/kimi-supervisor.service units/vllm-kimi-k25.service "$DESTDIR$UNITDIR/"
install -m 0644 packaging/kimi-supervisor.sysusers "$DESTDIR/usr/lib/sysusers.d/kimi-supervisor.conf"
install -m 0644 packaging/kimi-supervisor.tmpfiles "$DESTDIR/usr/lib/tmpfiles.d/kimi-supervisor.conf"
install -m 0644 docs/*.md README.md "$root/docs/"
# The alert rules and the dashboard, for the operator's Prometheus and Grafana.
install -d -m 0755 "$root/config/prometheus" "$root/config/grafana"
install -m 0644 config/prometheus/kimi-supervisor-alerts.yml config/prometheus/kimi-supervisor-fleet.yml \
  config/prometheus/prometheus-fleet.yml config/prometheus/kimi-targets.yml "$root/config/prometheus/"
install -m 0644 config/grafana/kimi-supervisor.json "$root/config/grafana/"
conf="$DESTDIR$SYSCONFDIR/kimi-supervisor/kimi-supervisor.toml"
if [ -e "$conf" ]; then
  install -m 0644 config/kimi-supervisor.toml "$conf.dist"
  echo "install: kept your $conf (the shipped one is $conf.dist)"
else
  install -m 0644 config/kimi-supervisor.toml "$conf"
fi
if [ -z "$DESTDIR" ]; then
  systemd-sysusers /usr/lib/sysusers.d/kimi-supervisor.conf
  systemd-tmpfiles --create /usr/lib/tmpfiles.d/kimi-supervisor.conf
  systemctl daemon-reload 2>/dev/null || true
  echo "install: done. Next: kimi-supervisor check-config $SYSCONFDIR/kimi-supervisor/kimi-supervisor.toml,"
  echo "  then systemctl enable --now kimi-supervisor (first install) or systemctl reload kimi-supervisor (upgrade)"
fi
