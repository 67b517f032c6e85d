#!/bin/sh
# System packages, split by purpose (Debian 12, as root). Each purpose installs only its own:
#   --install   what `make install` needs on a host: build the virtualenv from source
#               (pystemd compiles against libsystemd) and run the daemon;
#   --package   what `make deb` needs to build the Debian package (build-essential,
#               debhelper, dpkg-dev, fakeroot, lintian);
#   (no option) all of the above, and what the test suite needs (`./dev test`, `./dev demo`).
# The Debian package itself needs none of this on the host it is installed on: its Depends
# are what running needs (docs/operations.md). No purpose enables or starts a service.
set -eu
need=""
purpose=${1:-test}
case "$purpose" in
  --install) purpose=install ;;
  --package) purpose=package ;;
  test) ;;
  *) echo "setup: unknown option '$purpose' (use --install, --package or none)" >&2; exit 2 ;;
esac
# Building the virtualenv from source, and running the daemon (every purpose).
command -v pkg-config >/dev/null 2>&1 || need="$need pkg-config"
[ -e /usr/include/systemd/sd-bus.h ] || need="$need libsystemd-dev"
[ -x /lib/systemd/systemd ] || [ -x /usr/lib/systemd/systemd ] || need="$need systemd"
command -v gcc >/dev/null 2>&1 || need="$need gcc"
command -v make >/dev/null 2>&1 || need="$need make"
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need="$need python3-venv"
python3 -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
  || need="$need python3-dev"
if [ "$purpose" != install ]; then
  # Building the Debian package (`make deb`), and checking it (lintian).
  # dpkg-buildpackage requires build-essential (Debian policy's implicit build dependency).
  dpkg-query -W -f='${Status}' build-essential 2>/dev/null | grep -q 'ok installed' \
    || need="$need build-essential"
  command -v dh >/dev/null 2>&1 || need="$need debhelper"
  command -v dpkg-buildpackage >/dev/null 2>&1 || need="$need dpkg-dev"
  command -v fakeroot >/dev/null 2>&1 || need="$need fakeroot"
  command -v lintian >/dev/null 2>&1 || need="$need lintian"
fi
promtool=false
if [ "$purpose" = test ]; then
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
  # The fleet test over SSH (two booted hosts on the loopback address): ssh and ssh-keygen.
  command -v ssh-keygen >/dev/null 2>&1 || need="$need openssh-client"
  # The booted-host tests: a Debian 12 root file system booted under its own systemd.
  command -v debootstrap >/dev/null 2>&1 || need="$need debootstrap"
  command -v systemd-nspawn >/dev/null 2>&1 || need="$need systemd-container"
  # The alert rules are checked and unit-tested with promtool; a real Prometheus scrapes the
  # daemon while another user holds connections to it (tests/sandbox/test_scrapes.py).
  command -v promtool >/dev/null 2>&1 || promtool=true
  command -v prometheus >/dev/null 2>&1 || promtool=true
fi
if [ -n "$need" ] || $promtool; then
  if [ "$(id -u)" != 0 ]; then
    $promtool && need="$need promtool"
    echo "setup: missing system packages:$need (run as root, or install them)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
fi
if [ -n "$need" ]; then
  echo "setup: installing$need"
  apt-get install -y -qq --no-install-recommends $need
fi
if $promtool; then
  # Debian ships promtool only inside its prometheus package, with the server, which that
  # package enables (it listened on *:9090 after a reboot). Only the two binaries are taken
  # from it (they need nothing but libc): the package is downloaded, not installed, and no
  # service is made; the tests start the server themselves, on loopback, and stop it.
  echo "setup: installing promtool and prometheus (binaries from Debian's package, no service)"
  tmp=$(mktemp -d) && chmod 0755 "$tmp"  # apt-get download writes as _apt
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && apt-get download -qq prometheus)
  dpkg-deb --fsys-tarfile "$tmp"/prometheus_*.deb \
    | tar -x -C "$tmp" ./usr/bin/promtool ./usr/bin/prometheus
  install -m 0755 "$tmp/usr/bin/promtool" /usr/local/bin/promtool
  install -m 0755 "$tmp/usr/bin/prometheus" /usr/local/bin/prometheus
fi
