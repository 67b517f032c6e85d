"""A Debian 12 host booted under its own systemd (PID 1), in systemd-nspawn, for the tests of
what only a real system manager does: enable at boot, stop and reboot ordering, restart, the
journal.

- The root file system comes from debootstrap, once, cached by the hash of its package list in
  CACHE (about 300 MB; a few minutes from the machine's own Debian mirror, read from its apt
  sources, so no host is named here).
- Each host copies it, with this checkout in /src and the session's Debian packages in
  /root/debs. The root file system has no compiler and the host's package index is cut off (an
  unreachable proxy, no cached lists): the package must install from itself alone.
  `install_package` runs `apt-get install` as an admin does; configure.py then configures the
  installed package for the simulated GPU host and the fake vLLM through /etc.
- nspawn runs from a cgroup of its own (both the unified and the systemd hierarchies), with
  `--keep-unit --register=no`: no machined is needed. A reboot inside exits nspawn with 133; the
  harness boots it again.
- Commands run inside with `nsenter -t <container PID 1> -a`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests import checkout
from tests.debs import CACHE

ROOT = Path(__file__).resolve().parents[2]
# A GPU host as the package finds it: what the package depends on is there (Python, systemd,
# dbus), a compiler and Python's build tools are not.
PACKAGES = (
    "systemd,systemd-sysv,dbus,python3,procps,util-linux,psmisc,ca-certificates,openssh-server"
)
PACKAGE_PYTHON = "/usr/lib/kimi-supervisor/current/bin/python3"  # the installed package's
CONFIGURE = [PACKAGE_PYTHON, "/src/tests/booted/configure.py", "/src"]
# apt-get as an admin runs it, without questions: an edited config kept, the new default beside
# it. Followed by install, remove or purge.
APT = (
    "DEBIAN_FRONTEND=noninteractive apt-get -y -q -o Dpkg::Options::=--force-confold "
    "-o Dpkg::Options::=--force-confdef"
)


class Unavailable(Exception):
    pass


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "booting a host needs root"
    for tool in ("debootstrap", "systemd-nspawn", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install debootstrap systemd-container)"
    if (
        not Path("/sys/fs/cgroup/cgroup.controllers").exists()
        and not Path("/sys/fs/cgroup/unified").exists()
    ):
        return "no cgroup v2 hierarchy for nspawn"
    return None


def _mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 or one-line sources)."""
    texts = [p.read_text() for p in Path("/etc/apt/sources.list.d").glob("*.sources")]
    for text in texts:
        for line in text.splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    sources = Path("/etc/apt/sources.list")
    if sources.exists():
        for line in sources.read_text().splitlines():
            m = re.match(r"deb\s+(\S+)\s+bookworm\s", line)
            if m:
                return m.group(1)
    raise Unavailable("no Debian mirror in /etc/apt/sources.list(.d)")


def rootfs(packages: str | None = PACKAGES) -> Path:
    """The cached Debian 12 root file system, built once per package list. None: a plain
    `debootstrap bookworm DIR`, the fresh machine an operator starts from."""
    key = hashlib.sha256((packages or "default").encode()).hexdigest()[:12]
    done = CACHE / f"bookworm-{key}"
    if (done / "etc" / "os-release").exists():
        return done
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = CACHE / f".building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    chosen = ["--variant=minbase", f"--include={packages}"] if packages else []
    r = subprocess.run(
        ["debootstrap", *chosen, "bookworm", str(tmp), _mirror()],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise Unavailable(f"debootstrap failed: {r.stdout[-1500:]}{r.stderr[-1500:]}")
    tmp.rename(done)
    return done


def network() -> tuple[list[str], dict[str, str]]:
    """nspawn binds and environment for pip inside: the machine's CA bundle (a TLS-intercepting
    proxy's root may be in it) and its pip cache."""
    pip_cache = Path("/root/.cache/pip")
    pip_cache.mkdir(parents=True, exist_ok=True)
    binds = [f"{pip_cache}:/root/.cache/pip"]
    env = {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    ca = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    if ca and Path(ca).is_file():
        binds.append(f"{ca}:/etc/kimi-host-ca.crt")
        env |= {"PIP_CERT": "/etc/kimi-host-ca.crt", "SSL_CERT_FILE": "/etc/kimi-host-ca.crt"}
    return binds, env


def copy_checkout(dest: Path) -> None:
    """This checkout's files (tracked and not ignored) to `dest`, as a clone or a release tree
    has them (no .git, no virtualenv, no build outputs)."""
    for rel in checkout.files(ROOT):
        if not (ROOT / rel).is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)


class BootedHost:
    def __init__(self, work: Path, base: Path | None = None) -> None:
        self.work = work
        self.base = base
        self.root = work / "rootfs"
        self.nspawn: subprocess.Popen[bytes] | None = None
        self.cgroups: list[Path] = []
        self.console = work / "console.log"
        self.binds: list[str] = []

    # -- set-up --
    def copy_checkout(self, dest: str) -> None:
        """This checkout's files (tracked and not ignored) to `dest` inside, as a clone has them."""
        copy_checkout(self.root / dest.lstrip("/"))

    def prepare(self, debs: tuple[Path, ...] = (), ssh: tuple[int, str] | None = None) -> None:
        """The root file system with this checkout in /src, `debs` in /root/debs and the package
        index out of reach. sshd runs only with `ssh` (a port on 127.0.0.1 and a public key for
        root): the host shares this machine's network."""
        base = self.base or rootfs()
        subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(self.root)], check=True)
        self.copy_checkout("/src")
        (self.root / "root/debs").mkdir(parents=True, exist_ok=True)
        for deb in debs:
            shutil.copy2(deb, self.root / "root/debs" / deb.name)
        # No index: every download goes to a port nothing listens on, and none is cached.
        (self.root / "etc/apt/apt.conf.d/99kimi-test-offline").write_text(
            'Acquire::http::Proxy "http://127.0.0.1:9";\nAcquire::https::Proxy "http://127.0.0.1:9";\n'
        )
        lists = self.root / "var/lib/apt/lists"
        for f in lists.glob("*") if lists.exists() else []:
            if f.is_file():
                f.unlink()
        if ssh is None:
            for unit in ("ssh.service", "ssh.socket"):
                mask = self.root / "etc/systemd/system" / unit
                mask.unlink(missing_ok=True)
                mask.symlink_to("/dev/null")
        else:
            port, key = ssh
            conf = self.root / "etc/ssh/sshd_config.d/kimi-test.conf"
            conf.write_text(
                f"Port {port}\nListenAddress 127.0.0.1\nPermitRootLogin prohibit-password\n"
            )
            dot = self.root / "root/.ssh"
            dot.mkdir(mode=0o700, exist_ok=True)
            (dot / "authorized_keys").write_text(key)
            (dot / "authorized_keys").chmod(0o600)

    def install_package(
        self, deb: str, options: str = "", check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """`apt-get install /root/debs/DEB` in the booted host, as an admin runs it (an edited
        config kept, the new default beside it)."""
        return self.sh(f"{APT} install {options} /root/debs/{deb} 2>&1", check=check, timeout=600)

    def configure(self, vllm_port: int, metrics_port: int) -> None:
        """configure.py in the booted host, with ports of its own (hosts booted side by side
        share this machine's network)."""
        self.sh(" ".join([*CONFIGURE, "--ports", str(vllm_port), str(metrics_port)]))

    # -- booting --
    def _own_cgroup(self) -> None:
        """nspawn --keep-unit wants a cgroup of its own: one per boot, on the name=systemd and
        unified hierarchies of a hybrid host, or on the one of a pure cgroup v2 host."""
        tops = [Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified")]
        tops = [t for t in tops if (t / "cgroup.procs").exists()] or [Path("/sys/fs/cgroup")]
        name = f"kimi-booted-{os.getpid()}-{time.monotonic_ns()}"
        self.cgroups = []
        for top in tops:
            (top / name).mkdir()
            self.cgroups.append(top / name)

    def boot(self, timeout_s: float = 60) -> None:
        self._own_cgroup()
        cgroups = [str(d / "cgroup.procs") for d in self.cgroups]
        script = "".join(f"echo $$ > {c}; " for c in cgroups)
        log = open(self.console, "ab")  # noqa: SIM115 - owned by the Popen
        self.nspawn = subprocess.Popen(
            ["sh", "-c", script + "exec systemd-nspawn -q --register=no --keep-unit --boot "
             + "".join(f"--bind={b} " for b in self.binds) + f"-D {self.root}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.nspawn.poll() is not None:
                raise Unavailable(f"nspawn exited {self.nspawn.returncode}: {self._tail()}")
            if self.pid1() and self.sh(
                "systemctl is-system-running", check=False
            ).stdout.strip() in ("running", "degraded"):
                return
            time.sleep(0.1)
        raise Unavailable(f"the host did not boot in {timeout_s:g} s: {self._tail()}")

    def pid1(self) -> int:
        """The container's PID 1 (systemd), as this machine sees it."""
        if self.nspawn is None:
            return 0
        todo = [self.nspawn.pid]
        while todo:
            pid = todo.pop()
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                continue
            nspid = next(
                (ln.split()[1:] for ln in status.splitlines() if ln.startswith("NSpid:")), []
            )
            if len(nspid) > 1 and nspid[-1] == "1":
                return pid
            todo += [int(k) for k in kids]
        return 0

    def sh(
        self, command: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """A shell command inside the booted host, in all its namespaces."""
        r = subprocess.run(
            ["nsenter", "-t", str(self.pid1()), "-a", "sh", "-c", command],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if check and r.returncode != 0:
            raise AssertionError(f"`{command}` exited {r.returncode}: {r.stdout}{r.stderr}")
        return r

    def reboot(self, timeout_s: float = 90) -> int:
        """`systemctl reboot` inside; nspawn exits 133; boot again. Returns nspawn's status."""
        assert self.nspawn is not None
        self.sh("systemctl reboot", check=False)
        code = self.nspawn.wait(timeout=timeout_s)
        self._drop_cgroups()
        self.boot()
        return code

    def poweroff(self) -> None:
        if self.nspawn is None:
            return
        if self.nspawn.poll() is None:
            self.sh("systemctl poweroff", check=False)
            try:
                self.nspawn.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.nspawn.pid, signal.SIGKILL)  # our own session: nspawn and PID 1
                self.nspawn.wait()
        self._drop_cgroups()

    def _drop_cgroups(self) -> None:
        """Remove this boot's cgroups, the ones nspawn made inside them first (deepest first)."""
        for top in self.cgroups:
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()
        self.cgroups = []

    def _tail(self) -> str:
        return self.console.read_text(errors="replace")[-2000:] if self.console.exists() else ""


def reap_leftover_hosts(*, wait_s: float = 15.0) -> list[str]:
    """Hosts that an earlier test session booted and never powered off (it was killed, or
    interrupted past its cleanup): each boot's cgroup is named for the pytest process that made
    it (`kimi-booted-PID-NS`), and one whose process is gone is a leftover. Its processes
    (nspawn, the host's PID 1, the daemon inside) share this machine's network and would answer
    another host's daemon on its port: SIGKILLed, by the PIDs its cgroup lists, and the cgroup
    removed. A live session's hosts are never touched. Returns the cgroups reaped."""
    tops = [Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")]
    reaped: list[str] = []
    for top in tops:
        if not (top / "cgroup.procs").exists():
            continue
        for d in top.glob("kimi-booted-*"):
            parts = d.name.split("-")
            if len(parts) != 4 or not parts[2].isdigit() or Path(f"/proc/{parts[2]}").exists():
                continue  # not one of ours, or its session lives
            pids = {int(p) for f in d.rglob("cgroup.procs") for p in f.read_text().split()}
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + wait_s
            while any(f.read_text().strip() for f in d.rglob("cgroup.procs")):
                if time.monotonic() > deadline:
                    break  # a process in D: its cgroup stays, said by the caller's next run
                time.sleep(0.05)
            for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    sub.rmdir()
            with contextlib.suppress(OSError):
                d.rmdir()
            reaped.append(f"{d} ({len(pids)} process(es))")
    return reaped
