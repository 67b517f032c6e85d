#!/usr/bin/env bash
# What a systemd user manager would need on this host, printed as facts (run on the GPU host).
echo "== os"; . /etc/os-release 2>/dev/null; echo "$PRETTY_NAME"; uname -r
echo "== binaries"
for b in systemd /lib/systemd/systemd /usr/lib/systemd/systemd systemctl dbus-daemon unshare gcc cc; do
  printf '%-28s %s\n' "$b" "$(command -v "$b" 2>/dev/null || ls "$b" 2>/dev/null || echo missing)"
done
echo "== python headers"; python3 -c 'import sysconfig,os; p=sysconfig.get_paths()["include"]; print(p, os.path.exists(p+"/Python.h"))'
echo "== libsystemd"; ldconfig -p 2>/dev/null | grep -E "libsystemd|libdbus" || echo "no libsystemd/libdbus"
echo "== capabilities"; grep -E "^Cap(Eff|Bnd)" /proc/self/status
capsh --decode="$(awk '/^CapEff/ {print $2}' /proc/self/status)" 2>/dev/null || true
echo "== pid 1"; cat /proc/1/comm; tr '\0' ' ' < /proc/1/cmdline; echo
echo "== cgroups"; grep cgroup /proc/self/mounts; cat /proc/self/cgroup
d=/sys/fs/cgroup/kimi-probe-$$
if mkdir "$d" 2>/dev/null; then echo "cgroup: can create $d"; rmdir "$d"; else echo "cgroup: cannot create $d"; fi
echo "== mount namespace"
if unshare --mount --propagation private sh -c 'mount -t tmpfs tmpfs /mnt && echo "tmpfs mount in a new mount namespace: ok"' 2>&1; then :; fi
