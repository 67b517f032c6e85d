#!/bin/sh
# `make uninstall`: undoes `make install` with the same variables:
#   uninstall.sh DESTDIR PREFIX BINDIR UNITDIR SYSCONFDIR MANDIR
# The daemon is stopped first (its stop is a teardown) and disabled. The configuration in
# SYSCONFDIR/kimi-supervisor and the state in /var/lib/kimi-supervisor are kept, as
# `apt remove` keeps them; the last lines say how to remove them too.
set -eu
DESTDIR=$1 PREFIX=$2 BINDIR=$3 UNITDIR=$4 SYSCONFDIR=$5 MANDIR=${6:-/usr/local/share/man}
if [ -z "$DESTDIR" ] && [ -d /run/systemd/system ] && [ -e "$UNITDIR/kimi-supervisor.service" ]; then
  systemctl disable --now kimi-supervisor.service || true
  systemctl stop vllm-kimi-k25.service 2>/dev/null || true
fi
for cmd in kimi-supervisor kimi-mode; do
  link="$DESTDIR$BINDIR/$cmd"
  # Only the link `make install` made: a command of the same name from elsewhere stays.
  if [ -L "$link" ] && [ "$(readlink "$link")" = "$PREFIX/bin/$cmd" ]; then
    rm -f "$link"
  fi
done
rm -f "$DESTDIR$UNITDIR/kimi-supervisor.service" "$DESTDIR$UNITDIR/vllm-kimi-k25.service" \
  "$DESTDIR/usr/local/lib/sysusers.d/kimi-supervisor.conf" \
  "$DESTDIR/usr/local/lib/tmpfiles.d/kimi-supervisor.conf" \
  "$DESTDIR$MANDIR/man1/kimi-mode.1.gz" "$DESTDIR$MANDIR/man8/kimi-supervisor.8.gz" \
  "$DESTDIR$MANDIR/man5/kimi-supervisor.toml.5.gz"
share="$DESTDIR$(dirname "$MANDIR")"
for cmd in kimi-supervisor kimi-mode; do
  rm -f "$share/bash-completion/completions/$cmd" "$share/zsh/site-functions/_$cmd"
done
rm -rf "$DESTDIR$PREFIX"
[ -z "$DESTDIR" ] && systemctl daemon-reload 2>/dev/null || true
echo "uninstall: removed kimi-supervisor from $DESTDIR$PREFIX and its commands, units and pages."
echo "  Kept: $DESTDIR$SYSCONFDIR/kimi-supervisor (the config), /var/lib/kimi-supervisor (state, captures), /var/cache/kimi-supervisor (vLLM's caches),"
echo "  /var/lib/kimi-vllm (vLLM's home), the group kimi and vLLM's user kimi-vllm. Remove them with:"
echo "  rm -r $SYSCONFDIR/kimi-supervisor /var/lib/kimi-supervisor /var/cache/kimi-supervisor /var/lib/kimi-vllm; groupdel kimi; userdel kimi-vllm"
