#!/bin/sh
# System packages kimi-supervisor needs to build (pystemd compiles against libsystemd) and to
# run its tests (a real systemd user manager with its own dbus-daemon). Debian 12, as root.
set -eu
need=""
command -v pkg-config >/dev/null 2>&1 || need="$need pkg-config"
[ -e /usr/include/systemd/sd-bus.h ] || need="$need libsystemd-dev"
[ -x /lib/systemd/systemd ] || [ -x /usr/lib/systemd/systemd ] || need="$need systemd"
command -v dbus-daemon >/dev/null 2>&1 || need="$need dbus-daemon"
command -v unshare >/dev/null 2>&1 || need="$need util-linux"
command -v gcc >/dev/null 2>&1 || need="$need gcc"
command -v fuser >/dev/null 2>&1 || need="$need psmisc"
command -v make >/dev/null 2>&1 || need="$need make"
# /bin/kill for the units' ExecReload; the user manager joins its session bus through
# dbus-user-session (without it the manager "did not come up in 30 s").
[ -x /bin/kill ] || [ -x /usr/bin/kill ] || need="$need procps"
[ -e /usr/lib/systemd/user/dbus.socket ] || need="$need dbus-user-session"
command -v setpriv >/dev/null 2>&1 || need="$need util-linux"
command -v nsenter >/dev/null 2>&1 || need="$need util-linux"
# The booted-host tests: a Debian 12 root file system booted under its own systemd.
command -v debootstrap >/dev/null 2>&1 || need="$need debootstrap"
command -v systemd-nspawn >/dev/null 2>&1 || need="$need systemd-container"
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need="$need python3-venv"
python3 -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
  || need="$need python3-dev"
if [ -n "$need" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup: missing system packages:$need (run as root, or install them)" >&2
    exit 1
  fi
  echo "setup: installing$need"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $need
fi
