"""The sandbox: a real isolated systemd user manager, a simulated GPU host and a fake vLLM,
wired together with the project's own unit files, in one directory.

    DIR/run/                XDG_RUNTIME_DIR of the manager (its bus; %t/kimi-supervisor/)
    DIR/config/systemd/user the project's units/ plus a drop-in that points vLLM at the fake
    DIR/gpu/                the simulated GPU host
    DIR/bin/vllm            the fake vLLM's entry point
    DIR/logs/vllm.log       the unit's output
    DIR/hub/                a Hugging Face cache with a small snapshot of the model (the
                            fake's --download-dir), which a switch warms
    DIR/fake-vllm.json      the fake's fault switches
    DIR/kimi-supervisor.toml  config/sandbox.toml with this sandbox's paths filled in
    DIR/ghosts.json         ghosts started here (PID and start time), ended by `down`
    DIR/control/control.sock  the daemon's control socket (kimi-mode finds it via env.sh)
    DIR/logs/kimi-supervisor.log  the daemon's JSON log lines

The daemon runs as the manager's `kimi-supervisor.service`, from the project's own unit file
with a drop-in that points it at this sandbox's config.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimi_supervisor.config import Config
from kimi_supervisor.configfile import load_config, parse_config
from kimi_supervisor.ports import processes
from kimi_supervisor.ports.gpu import GpuPort, NvmlGpu
from kimi_supervisor.ports.processes import ProcessRef
from kimi_supervisor.sandbox import simgpu
from kimi_supervisor.sandbox.fake_vllm import FakeOptions
from kimi_supervisor.sandbox.sandboxconfig import (
    SandboxError,
    extra_paths,
    free_port,
    project_file,
    render_config,
)
from kimi_supervisor.sandbox.simreader import SimGpu
from kimi_supervisor.sandbox.usermanager import UserManager
from kimi_supervisor.store import baseline

UNIT = "vllm-kimi-k25.service"
# Unit settings a manager applies by building a mount namespace for the unit.
MOUNT_SETTINGS = frozenset(
    {
        "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateMounts", "ProtectKernelTunables",
        "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups", "ProtectClock",
        "ProtectHostname", "ReadWritePaths",
    }
)  # fmt: skip
DAEMON_UNIT = "kimi-supervisor.service"


@dataclass
class Sandbox:
    root: Path
    manager: UserManager

    # -- paths --
    @property
    def config_path(self) -> Path:
        return self.root / "kimi-supervisor.toml"

    @property
    def gpu_dir(self) -> Path:
        return self.root / "gpu"

    @property
    def vllm_log(self) -> Path:
        return self.root / "logs" / "vllm.log"

    @property
    def real_gpus(self) -> bool:
        return (self.root / "real-gpus").exists()

    @property
    def daemon_log(self) -> Path:
        return self.root / "logs" / "kimi-supervisor.log"

    @property
    def socket_path(self) -> Path:
        return self.config().control.socket

    @property
    def fake_options_path(self) -> Path:
        return self.root / "fake-vllm.json"

    def config(self) -> Config:
        return load_config(self.config_path)

    @property
    def env(self) -> dict[str, str]:
        return {
            **self.manager.env,
            **(
                {"KIMI_FAKE_CUDA": "1"}
                if self.real_gpus
                else {"KIMI_SIM_GPU_DIR": str(self.gpu_dir)}
            ),
            "KIMI_SUPERVISOR_CONFIG": str(self.config_path),
            "KIMI_SUPERVISOR_SOCKET": str(self.socket_path),
        }

    def exports(self) -> str:
        return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in self.env.items())

    # -- lifecycle --
    @classmethod
    def up(
        cls,
        root: Path,
        gpus: int = 8,
        release_delay_s: float = simgpu.DRIVER_RELEASE_S,
        *,
        daemon: bool = True,
        real_gpus: bool = False,
        overrides: dict[str, Any] | None = None,
        vllm_env: dict[str, str] | None = None,
    ) -> Sandbox:
        """`overrides`: config keys over config/sandbox.toml ({sandbox} is filled in too), for
        example a real `vllm.command`; `vllm_env`: environment for the vLLM unit."""
        root = root.resolve()
        existing = UserManager.attach(root)
        if existing is not None:
            raise SandboxError(
                f"a sandbox is already running in {root} (manager PID "
                f"{existing.pid}); `kimi-supervisor sandbox down --dir {root}`"
            )
        if gpus < 1:
            raise SandboxError("--gpus must be at least 1")
        for d in ("logs", "bin", "state", "shm", "tmp"):
            (root / d).mkdir(parents=True, exist_ok=True)
        hub_snapshot(root / "hub", "moonshotai/Kimi-K2.5")
        if real_gpus:
            nvml = NvmlGpu()
            try:
                gpus = min(gpus, nvml.device_count())
            finally:
                nvml.close()
            (root / "real-gpus").write_text("the fake vLLM and ghosts use the host's GPUs\n")
        else:
            simgpu.create_host(root / "gpu", gpus, release_delay_s=release_delay_s)
        manager = UserManager.start(root)
        sb = cls(root, manager)
        try:
            sb._install(gpus, overrides, vllm_env or {})
            if daemon:
                sb.start_daemon()
        except BaseException:
            manager.stop()
            raise
        return sb

    @classmethod
    def attach(cls, root: Path) -> Sandbox:
        manager = UserManager.attach(root)
        if manager is None:
            raise SandboxError(
                f"no sandbox is running in {root}: start one with "
                f"`kimi-supervisor sandbox up --dir {root}`"
            )
        return cls(root.resolve(), manager)

    def _install(
        self, gpus: int, overrides: dict[str, Any] | None, vllm_env: dict[str, str]
    ) -> None:
        config = render_config(
            self.root,
            gpus,
            free_port(),
            bus_address=self.manager.bus_address,
            real_gpus=self.real_gpus,
            overrides=overrides,
        )
        # Other users must reach the control socket for the permission tests (the socket itself
        # is 0660 and checked per connection).
        self.root.chmod(0o755)
        config.control.socket.parent.mkdir(mode=0o755, exist_ok=True)
        self.config_path.write_text(config.effective_toml())
        parse_config(self.config_path.read_text(), str(self.config_path))  # round-trips
        FakeOptions().save(self.fake_options_path)
        # Units do not inherit this shell's PYTHONPATH: the entry points carry it.
        prelude = f"import sys\nsys.path[:0] = {extra_paths()!r}\n"
        entry = self.root / "bin" / "vllm"
        entry.write_text(
            f"#!{sys.executable}\n"
            "# The sandbox's vllm: the fake from kimi-supervisor, with vLLM's CLI shape.\n"
            f"{prelude}from kimi_supervisor.sandbox.fake_vllm import main\nmain()\n"
        )
        entry.chmod(0o755)
        launcher = self.root / "bin" / "kimi-supervisor"
        launcher.write_text(
            f"#!{sys.executable}\n"
            "# The sandbox's kimi-supervisor (this checkout's package).\n"
            f"{prelude}from kimi_supervisor.cli.admin import main\nsys.exit(main())\n"
        )
        launcher.chmod(0o755)
        gpu_env = (
            "Environment=KIMI_FAKE_CUDA=1\n"
            if self.real_gpus
            else f"Environment=KIMI_SIM_GPU_DIR={self.gpu_dir}\n"
        )
        if extra_paths():  # the fake's children are started with `python -m`
            gpu_env += f"Environment=PYTHONPATH={os.pathsep.join(extra_paths())}\n"
        unit_dir = self.manager.unit_dir
        mounts: list[str] = []
        for unit in project_file("units").glob("*.service"):
            text = unit.read_text()
            (unit_dir / unit.name).write_text(text)
            mounts += [ln for ln in text.splitlines() if ln.split("=", 1)[0] in MOUNT_SETTINGS]
        # The units' hardening applies here too, but for what this machine's manager cannot do.
        mounts.append(f"ReadWritePaths={self.root}")  # the daemon's, below
        off = sorted({ln.split("=", 1)[0] for ln in self.manager.cannot_apply(sorted(set(mounts)))})
        hardening = "".join(f"{key}=\n" if key.endswith("Paths") else f"{key}=no\n" for key in off)
        if off:
            hardening = (
                "# This machine's manager cannot build these (226/NAMESPACE, in a container):\n"
                + hardening
            )
        dropin = unit_dir / f"{UNIT}.d"
        dropin.mkdir(exist_ok=True)
        (dropin / "sandbox.conf").write_text(
            "# Written by `kimi-supervisor sandbox up`: vLLM is the fake, GPUs are simulated.\n"
            "[Service]\n"
            "ExecStart=\n"
            f"ExecStart={launcher} launch-vllm --argv-file %t/kimi-supervisor/vllm-argv.json\n"
            "ExecStartPost=\n"
            f"ExecStartPost=-+{launcher} launch-record "
            "--argv-file %t/kimi-supervisor/vllm-argv.json --pid $MAINPID\n"
            "# vLLM runs as the manager's user (root), not the package's kimi-vllm: the fake\n"
            "# reaches this sandbox's files (under a temporary directory), its home and caches\n"
            "# are the sandbox's, and it shares the sandbox's /tmp with the tests.\n"
            "User=\nGroup=\nSupplementaryGroups=\nStateDirectory=\nCacheDirectory=\n"
            "PrivateTmp=no\n"
            + gpu_env
            + f"Environment=KIMI_FAKE_VLLM_CONFIG={self.fake_options_path}\n"
            + f"Environment=TMPDIR={self.root / 'tmp'}\n"
            + "".join(f'Environment="{k}={v}"\n' for k, v in vllm_env.items())
            + f"StandardOutput=append:{self.vllm_log}\n"
            f"StandardError=append:{self.vllm_log}\n"
            "# The fake's escaping ghost leaves the unit through cgroupfs, which the real unit\n"
            "# forbids (ProtectControlGroups=yes): the escape is simulated, not prevented.\n"
            "ProtectControlGroups=no\n" + hardening
        )
        dropin = unit_dir / f"{DAEMON_UNIT}.d"
        dropin.mkdir(exist_ok=True)
        (dropin / "sandbox.conf").write_text(
            "# Written by `kimi-supervisor sandbox up`: the daemon runs on this sandbox's config.\n"
            "[Service]\n"
            "ExecStart=\n"
            f"ExecStart={launcher} run --config {self.config_path}\n"
            "ExecReload=\n"
            f"ExecReload={launcher} reload --config {self.config_path} --pid $MAINPID\n"
            + gpu_env
            + f"StandardOutput=append:{self.daemon_log}\n"
            f"StandardError=append:{self.daemon_log}\n"
            "# The unit's own hardening applies, but the sandbox's files live under a temporary\n"
            "# directory, shared with the tests: no private /tmp, and that directory writable.\n"
            "PrivateTmp=no\n"
            f"ReadWritePaths={self.root}\n" + hardening
        )
        self.manager.systemctl("daemon-reload")
        (self.root / "env.sh").write_text(self.exports())
        # The GPUs are idle now: calibrate their baseline, as the daemon does at boot.
        gpu: GpuPort = NvmlGpu() if self.real_gpus else SimGpu(self.gpu_dir)
        try:
            baseline.save(config.state.dir, baseline.calibrate(gpu, list(range(gpus))))
        finally:
            gpu.close()

    def start_daemon(self, wait: bool = True) -> None:
        """Start the daemon as a service of the sandbox's manager; returns once it is READY
        (or at once, with wait=False)."""
        r = self.manager.systemctl(
            "start", *(() if wait else ("--no-block",)), DAEMON_UNIT, check=False
        )
        if r.returncode != 0:
            tail = (
                self.daemon_log.read_text(errors="replace")[-1500:]
                if (self.daemon_log.exists())
                else ""
            )
            raise SandboxError(f"{DAEMON_UNIT} did not start: {r.stderr.strip()}\n{tail}")

    def stop_daemon(self) -> None:
        """`systemctl stop kimi-supervisor`: the daemon tears vLLM down, then exits."""
        self.manager.systemctl("stop", DAEMON_UNIT, check=False)
        self.manager.systemctl("reset-failed", DAEMON_UNIT, check=False)

    def set_fake_options(self, opts: FakeOptions) -> None:
        opts.save(self.fake_options_path)

    def ghost_cgroup_procs(self) -> list[str]:
        """cgroup.procs files of the sandbox's own top cgroup: outside every unit."""
        return [str(d / "cgroup.procs") for d in self.manager.cgroup_dirs]

    def start_ghost(
        self, gpu: str = "all", mib: int = 1024, title: str = "python", **kw: Any
    ) -> ProcessRef:
        """A detached process outside every unit holding `mib` MiB on `gpu`; returns it once
        it holds them. Its parent is not the caller: it is reparented, as an orphan is.
        Options as for start_ghost_tree."""
        return self.start_ghost_tree(gpu, mib, title, **kw)[0]

    def start_ghost_tree(
        self,
        gpu: str = "all",
        mib: int = 1024,
        title: str = "python",
        *,
        hidden: bool = False,
        ignore_sigterm: bool = False,
        extra_env: dict[str, str] | None = None,
        fork_helper: str | None = None,
        helper_closes_fds: bool = False,
        own_dev: bool = False,
        at_pid: int | None = None,
        spin: bool = False,
    ) -> list[ProcessRef]:
        """start_ghost, and with `fork_helper` the helper it forked: [ghost, helper]. With
        `own_dev`, it runs behind a /dev of its own, as in a container (sandbox/owndev.py); with
        `at_pid`, as that PID, as a recycled one (sandbox/atpid.py, root only); with `spin`, its
        GPUs read a kernel that spins (ghost.py's --spin)."""
        prefix: list[str] = []
        if at_pid is not None:
            prefix += [sys.executable, "-m", "kimi_supervisor.sandbox.atpid", str(at_pid), "--"]
        if own_dev:
            prefix += [sys.executable, "-m", "kimi_supervisor.sandbox.owndev"]
            prefix += ["--dev", str(self.gpu_dir / "dev"), "--"]
        args = [*prefix, sys.executable, "-m", "kimi_supervisor.sandbox.ghost"]
        args += [] if at_pid is not None else ["--detach"]  # atpid detaches it already
        args += ["--gpu", gpu, "--mib", str(mib), "--title", title]
        flags = {"--hidden": hidden, "--ignore-sigterm": ignore_sigterm, "--spin": spin}
        flags["--helper-closes-fds"] = helper_closes_fds
        args += [flag for flag, on in flags.items() if on]
        if fork_helper:
            args += ["--fork-helper", fork_helper]
        proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env, **(extra_env or {})},
            start_new_session=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        proc.stdout.close()
        proc.wait()  # the starter half of --detach exits at once
        if not line or line[0] != b"ready":
            raise SandboxError(f"the ghost did not start (exit {proc.returncode})")
        refs = [r for r in map(processes.ref_of, map(int, line[1:])) if r is not None]
        if len(refs) != len(line) - 1:
            raise SandboxError(f"the ghost {line!r} ended as it started")
        for ref in refs:
            self._record_ghost(ref)
        return refs

    def _ghosts_file(self) -> Path:
        return self.root / "ghosts.json"

    def _record_ghost(self, ref: ProcessRef) -> None:
        ghosts = self._ghosts()
        ghosts.append(ref)
        self._ghosts_file().write_text(json.dumps([[g.pid, g.start_ticks] for g in ghosts]))

    def _ghosts(self) -> list[ProcessRef]:
        try:
            return [ProcessRef(p, t) for p, t in json.loads(self._ghosts_file().read_text())]
        except (OSError, ValueError):
            return []

    def leak(self, gpu: int, mib: int) -> Path:
        return simgpu.leak(self.gpu_dir, gpu, mib)

    def down(self) -> None:
        """End what this sandbox started: its units (with the manager), its ghosts, its bus."""
        self.manager.stop()
        ghosts = self._ghosts()
        for ref in ghosts:
            processes.send_signal(ref, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while any(processes.is_alive(g) for g in ghosts) and time.monotonic() < deadline:
            time.sleep(0.02)
        self._ghosts_file().unlink(missing_ok=True)


def hub_snapshot(hub: Path, repo: str, shards: int = 4, *, shard_mb: int = 4) -> Path:
    """A Hugging Face cache holding `repo` as the hub lays it out: refs/main names a commit,
    snapshots/<commit>/ links each file to ../../blobs/<hash>. Its shards are random bytes."""
    root = hub / ("models--" + repo.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = root / "snapshots" / commit
    if snap.is_dir():
        return snap
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "blobs").mkdir(exist_ok=True)
    snap.mkdir(parents=True)
    files = {"config.json": b'{"model_type": "kimi_k25"}\n'}
    for i in range(1, shards + 1):
        files[f"model-{i:05d}-of-{shards:05d}.safetensors"] = os.urandom(shard_mb << 20)
    for name, data in files.items():
        blob = root / "blobs" / f"{abs(hash(name)):x}{len(data)}"
        blob.write_bytes(data)
        (snap / name).symlink_to(Path("..", "..", "blobs", blob.name))
    (root / "refs" / "main").write_text(commit)
    return snap
