"""An isolated, real `systemd --user` manager, for the sandbox and the tests.

systemd 252 refuses to run as a user manager unless /run/systemd/system exists, so it is started
in its own mount namespace with a tmpfs on /run/systemd, its own XDG_RUNTIME_DIR and its own
session bus (dbus-daemon). Each manager is first put in a cgroup of its own, so two managers do
not collide on /app.slice. Stopping it ends only the processes it started.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kimi_supervisor.ports import processes
from kimi_supervisor.ports.processes import ProcessRef

CGROUP_ROOT = Path("/sys/fs/cgroup")
SYSTEMD_CANDIDATES = ("/lib/systemd/systemd", "/usr/lib/systemd/systemd")

_INIT = r"""
set -eu
mount -t tmpfs -o mode=755 tmpfs /run/systemd
mkdir -p /run/systemd/system
for hierarchy in $KIMI_CGROUP_DIRS; do
  mkdir -p "$hierarchy"
  echo $$ > "$hierarchy/cgroup.procs"
done
if [ -n "$KIMI_DBUS_DAEMON" ]; then
  $KIMI_DBUS_DAEMON --address="unix:path=$XDG_RUNTIME_DIR/bus" --nofork --nopidfile \
    --syslog-only &
  echo $! > "$KIMI_SANDBOX_STATE/dbus.pid"
fi
exec $KIMI_SYSTEMD --user
"""

# A host without systemd (the lent GPU host) can run one carried from a Debian machine: a folder
# with bin/{systemd,systemctl,dbus-daemon}, lib/ (their libraries and Debian's loader, so nothing
# of the host's userspace is mixed in), share/dbus-1/session.conf, user-units/ (the targets and
# slices a user manager expects) and wrap/systemctl. Named by KIMI_SANDBOX_SYSTEMD_DIR.
CARRIED_ENV = "KIMI_SANDBOX_SYSTEMD_DIR"


def carried_systemd() -> Path | None:
    d = os.environ.get(CARRIED_ENV, "")
    if not d:
        return None
    root = Path(d).resolve()
    need = ["bin/systemd", "bin/dbus-daemon", "lib/ld-linux-x86-64.so.2", "wrap/systemctl"]
    missing = [n for n in need if not (root / n).exists()]
    if missing:
        raise ManagerUnavailable(f"{CARRIED_ENV}={d} lacks {', '.join(missing)}")
    return root


def _carried_cmd(root: Path, binary: str) -> str:
    return f"{root}/lib/ld-linux-x86-64.so.2 --library-path {root}/lib {root}/bin/{binary}"


def _install_carried_units(carried: Path, unit_dir: Path) -> None:
    """The targets and slices a user manager expects, and a socket-activated session bus from
    the carried dbus-daemon, where the host has none of them."""
    for unit in (carried / "user-units").iterdir():
        target = unit_dir / unit.name
        if not target.exists():
            target.write_text(unit.read_text())
    (unit_dir / "dbus.socket").write_text(
        "[Unit]\nDescription=D-Bus user message bus socket (carried)\n\n"
        "[Socket]\nListenStream=%t/bus\n"
    )
    (unit_dir / "dbus.service").write_text(
        "[Unit]\nDescription=D-Bus user message bus (carried)\nRequires=dbus.socket\n\n"
        "[Service]\n"
        f"ExecStart={_carried_cmd(carried, 'dbus-daemon')} "
        f"--config-file={carried}/share/dbus-1/session.conf --address=systemd: --nofork "
        "--nopidfile --systemd-activation --syslog-only\n"
    )
    wants = unit_dir / "sockets.target.wants"
    wants.mkdir(exist_ok=True)
    link = wants / "dbus.socket"
    if not link.is_symlink():
        link.symlink_to("../dbus.socket")


def _path_with_systemctl() -> str:
    path = os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    carried = carried_systemd()
    return f"{carried}/wrap:{path}" if carried else path


class ManagerUnavailable(Exception):
    """This machine cannot run an isolated user manager; the message says why."""


def _cap_sys_admin() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) & (1 << 21))
    return False


def systemd_binary() -> str | None:
    return next((p for p in SYSTEMD_CANDIDATES if os.access(p, os.X_OK)), None)


def cgroup_hierarchies() -> list[Path]:
    """Where a process must be moved to change its cgroup (v2, or hybrid v1 + unified)."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return [CGROUP_ROOT]
    found = [CGROUP_ROOT / h for h in ("systemd", "unified") if (CGROUP_ROOT / h).is_dir()]
    return found


def unavailable_reason() -> str | None:
    if os.geteuid() != 0 or not _cap_sys_admin():
        return "an isolated systemd user manager needs root with CAP_SYS_ADMIN"
    try:
        carried = carried_systemd()
    except ManagerUnavailable as e:
        return str(e)
    if carried is None and systemd_binary() is None:
        return "no systemd binary (install the systemd package)"
    for tool in (() if carried else ("dbus-daemon",)) + ("unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is missing (install the dbus-daemon and util-linux packages)"
    if not cgroup_hierarchies():
        return "no cgroup hierarchy under /sys/fs/cgroup"
    return None


@dataclass
class UserManager:
    """A running isolated manager. `env` is what a client needs (systemctl --user, pystemd)."""

    root: Path
    name: str
    pid: int

    @property
    def runtime_dir(self) -> Path:
        return self.root / "run"

    @property
    def config_home(self) -> Path:
        return self.root / "config"

    @property
    def unit_dir(self) -> Path:
        return self.config_home / "systemd" / "user"

    @property
    def bus_address(self) -> str:
        return f"unix:path={self.runtime_dir / 'bus'}"

    @property
    def env(self) -> dict[str, str]:
        return {
            "XDG_RUNTIME_DIR": str(self.runtime_dir),
            "DBUS_SESSION_BUS_ADDRESS": self.bus_address,
        }

    @property
    def cgroup_dirs(self) -> list[Path]:
        return [h / self.name for h in cgroup_hierarchies()]

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["systemctl", "--user", *args],
            env={**os.environ, **self.env, "PATH": _path_with_systemctl()},
            capture_output=True,
            text=True,
            check=check,
            timeout=60,
        )

    def cannot_apply(self, settings: list[str]) -> list[str]:
        """Those of `settings` ("Key=value" lines of a [Service] section) this manager fails to
        start a unit with. A manager inside a container may be unable to build the mount
        namespace some of them need (the unit fails with 226/NAMESPACE): found by starting a
        probe unit with all of them, then, if that fails, one per setting."""

        def fails(batch: list[list[str]]) -> list[bool]:
            names = [f"kimi-probe-{i}.service" for i in range(len(batch))]
            for name, lines in zip(names, batch, strict=True):
                body = "".join(f"{line}\n" for line in lines)
                (self.unit_dir / name).write_text(
                    f"[Service]\nType=oneshot\nExecStart=/bin/true\n{body}"
                )
            self.systemctl("daemon-reload")
            try:
                return [self.systemctl("start", n, check=False).returncode != 0 for n in names]
            finally:
                for name in names:
                    (self.unit_dir / name).unlink()
                self.systemctl("daemon-reload")

        if not settings or not fails([settings])[0]:
            return []
        return [s for s, bad in zip(settings, fails([[s] for s in settings]), strict=True) if bad]

    # -- lifecycle --
    @classmethod
    def start(cls, root: Path, timeout_s: float = 30.0) -> UserManager:
        reason = unavailable_reason()
        if reason:
            raise ManagerUnavailable(reason)
        root = root.resolve()
        name = "kimi-sbx-" + hashlib.sha1(str(root).encode()).hexdigest()[:10]
        state = root / "manager"
        for d in (root / "run", root / "config" / "systemd" / "user", state):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(root / "run", 0o700)
        # Short stop timeouts so that shutting the sandbox down is quick.
        (root / "config" / "systemd" / "user.conf").write_text(
            "[Manager]\nDefaultTimeoutStopSec=5s\n"
        )
        carried = carried_systemd()
        if carried is not None:
            systemd = _carried_cmd(carried, "systemd")
            # A user manager talks on the bus only once its own dbus.socket and dbus.service
            # run, so the bus is socket-activated by the manager here, as on a desktop.
            dbus_cmd = ""
            _install_carried_units(carried, root / "config" / "systemd" / "user")
        else:
            found = systemd_binary()
            assert found is not None
            systemd, dbus_cmd = found, "dbus-daemon --session"
        env = {
            "PATH": _path_with_systemctl(),
            "HOME": str(root),
            "XDG_RUNTIME_DIR": str(root / "run"),
            "XDG_CONFIG_HOME": str(root / "config"),
            "KIMI_CGROUP_DIRS": " ".join(str(h / name) for h in cgroup_hierarchies()),
            "KIMI_SANDBOX_STATE": str(state),
            "KIMI_SYSTEMD": systemd,
            "KIMI_DBUS_DAEMON": dbus_cmd,
            "LANG": "C.UTF-8",
        }
        log = open(state / "manager.log", "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", _INIT],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()
        mgr = cls(root, name, proc.pid)
        try:
            mgr._wait_running(proc, timeout_s)
        except BaseException:
            mgr.stop()
            raise
        ref = processes.ref_of(proc.pid)
        dbus = _read_pid(state / "dbus.pid")
        (state / "pids.json").write_text(
            json.dumps(
                {
                    "name": name,
                    "manager": [ref.pid, ref.start_ticks] if ref else None,
                    "dbus": [dbus.pid, dbus.start_ticks] if dbus else None,
                }
            )
        )
        return mgr

    @classmethod
    def attach(cls, root: Path) -> UserManager | None:
        """The manager a previous `start` left running under `root`, if it is still alive."""
        try:
            info = json.loads((root.resolve() / "manager" / "pids.json").read_text())
        except (OSError, ValueError):
            return None
        ref = ProcessRef(*info["manager"]) if info.get("manager") else None
        if ref is None or not processes.is_alive(ref):
            return None
        return cls(root.resolve(), info["name"], ref.pid)

    def _wait_running(self, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
        from pystemd.dbuslib import DBusAddress
        from pystemd.systemd1 import Manager

        deadline = time.monotonic() + timeout_s
        last = "not started"
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log = (self.root / "manager" / "manager.log").read_text(errors="replace")
                raise ManagerUnavailable(
                    f"systemd --user exited with {proc.returncode}: {log.strip()[-800:]}"
                )
            if (self.runtime_dir / "bus").exists():
                try:
                    with DBusAddress(self.bus_address.encode()) as bus:
                        m = Manager(bus=bus, _autoload=True)
                        last = m.Manager.SystemState.decode()
                        if last in ("running", "degraded"):
                            return
                except Exception as e:  # the bus is up before the manager has its name
                    last = str(e)
            time.sleep(0.05)
        log = (self.root / "manager" / "manager.log").read_text(errors="replace")
        raise ManagerUnavailable(
            f"systemd --user did not come up in {timeout_s} s ({last}): {log.strip()[-1500:]}"
        )

    def pids_in_cgroup(self) -> list[int]:
        pids: set[int] = set()
        for top in self.cgroup_dirs:
            for dirpath, _dirs, files in os.walk(top):
                if "cgroup.procs" in files:
                    with contextlib.suppress(OSError):
                        text = (Path(dirpath) / "cgroup.procs").read_text()
                        pids.update(int(x) for x in text.split())
        return sorted(pids)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the manager and everything in its cgroup; then its bus. Idempotent."""
        state = self.root / "manager"
        mgr = processes.ref_of(self.pid)
        if mgr is not None:
            processes.send_signal(mgr, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s / 2
        while mgr is not None and processes.is_alive(mgr) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Whatever is still in our cgroup was started by this manager: end it.
        for _ in range(3):
            left = [r for r in map(processes.ref_of, self.pids_in_cgroup()) if r is not None]
            if not left:
                break
            for ref in left:
                processes.send_signal(ref, signal.SIGKILL)
            end = time.monotonic() + timeout_s / 4
            while any(processes.is_alive(r) for r in left) and time.monotonic() < end:
                time.sleep(0.02)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(self.pid, os.WNOHANG)
        dbus = _read_pid(state / "dbus.pid")
        if dbus is not None:
            processes.send_signal(dbus, signal.SIGTERM)
        for top in self.cgroup_dirs:
            _remove_cgroup_tree(top)


def _read_pid(path: Path) -> ProcessRef | None:
    try:
        return processes.ref_of(int(path.read_text().strip()))
    except (OSError, ValueError):
        return None


def _remove_cgroup_tree(top: Path) -> None:
    if not top.is_dir():
        return
    for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda t: -len(t[0])):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)
