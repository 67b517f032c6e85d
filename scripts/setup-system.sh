#!/bin/sh
# System packages kimi-supervisor needs to build (pystemd compiles against libsystemd) and to
# run its tests (a real systemd user manager with its own dbus-daemon). Debian 12, as root.
# `--install`: only what `make install` needs on a host (building and running the daemon).
set -eu
need=""
promtool=""
install_only=false
[ "${1:-}" = "--install" ] && install_only=true
# Building and running the daemon (`make install` on a host).
command -v pkg-config >/dev/null 2>&1 || need="$need pkg-config"
[ -e /usr/include/systemd/sd-bus.h ] || need="$need libsystemd-dev"
[ -x /lib/systemd/systemd ] || [ -x /usr/lib/systemd/systemd ] || need="$need systemd"
command -v gcc >/dev/null 2>&1 || need="$need gcc"
command -v make >/dev/null 2>&1 || need="$need make"
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need="$need python3-venv"
python3 -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
  || need="$need python3-dev"
if ! $install_only; then
  # The tests: a real systemd user manager with its own dbus-daemon, which joins its session bus
  # through dbus-user-session (without it the manager "did not come up in 30 s").
  command -v dbus-daemon >/dev/null 2>&1 || need="$need dbus-daemon"
  [ -e /usr/lib/systemd/user/dbus.socket ] || need="$need dbus-user-session"
  command -v unshare >/dev/null 2>&1 || need="$need util-linux"
  command -v setpriv >/dev/null 2>&1 || need="$need util-linux"
  command -v nsenter >/dev/null 2>&1 || need="$need util-linux"
  command -v fuser >/dev/null 2>&1 || need="$need psmisc"
  [ -x /bin/kill ] || [ -x /usr/bin/kill ] || need="$need procps"
  # The live switch display is checked in a real terminal.
  command -v tmux >/dev/null 2>&1 || need="$need tmux"
  # The shipped alert rules are checked and unit-tested with promtool (Debian ships it in the
  # prometheus package; its server is not started, see below).
  command -v promtool >/dev/null 2>&1 || promtool=prometheus
  # The fleet test over SSH (two booted hosts on the loopback address): ssh and ssh-keygen.
  command -v ssh-keygen >/dev/null 2>&1 || need="$need openssh-client"
  # The booted-host tests: a Debian 12 root file system booted under its own systemd.
  command -v debootstrap >/dev/null 2>&1 || need="$need debootstrap"
  command -v systemd-nspawn >/dev/null 2>&1 || need="$need systemd-container"
fi
if [ -n "$need$promtool" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup: missing system packages:$need $promtool (run as root, or install them)" >&2
    exit 1
  fi
  echo "setup: installing$need $promtool"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  [ -z "$need" ] || apt-get install -y -qq --no-install-recommends $need
fi
if [ -n "$promtool" ]; then
  # Only promtool is wanted from the prometheus package, not a server on :9090: installed with
  # Debian's policy-rc.d saying no service may start.
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy"
    trap 'rm -f "$policy"' EXIT
  fi
  apt-get install -y -qq --no-install-recommends prometheus
fi
