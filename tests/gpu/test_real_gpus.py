"""The teardown on real NVIDIA GPUs with the real NVML backend and the fake vLLM in real-CUDA
mode. Runs only where NVML answers; skipped with the reason elsewhere.

    KIMI_GPU_TESTS=1 python3 -m pytest -q tests/gpu -s     # on a GPU host

There is no systemd on the lent GPU host: the unit's processes are started by the test and the
teardown's unit steps find no unit (NoSystemd). Every process a test starts is ended by it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.config import Config
from kimi_supervisor.configfile import parse_config
from kimi_supervisor.model import Evidence, Outcome
from kimi_supervisor.ports import processes
from kimi_supervisor.ports.clock import SystemClock
from kimi_supervisor.ports.gpu import GpuUnavailable, NvmlGpu
from kimi_supervisor.ports.processes import ProcessRef
from kimi_supervisor.store import baseline
from kimi_supervisor.teardown.escalation import Teardown
from tests.fakes import NoSystemd


def _nvml_reason() -> str | None:
    try:
        gpu = NvmlGpu()
        n = gpu.device_count()
        gpu.close()
    except GpuUnavailable as e:
        return str(e)
    return None if n >= 1 else "NVML reports no GPU"


REASON = _nvml_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"no GPU: {REASON}")]
GIB = 1024
SEED_WORKER_MIB = 96 * GIB  # what each worker of the seed's vLLM held (96,844 MiB)


def _become_subreaper() -> None:
    PR_SET_CHILD_SUBREAPER = 36
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Host:
    def __init__(self, tmp: Path) -> None:
        _become_subreaper()
        self.gpu = NvmlGpu()
        self.indices = list(range(min(self.gpu.device_count(), 8)))
        self.tmp = tmp
        self.started: list[tuple[ProcessRef, subprocess.Popen[bytes]]] = []
        self.port = _port()
        self.config: Config = parse_config(f"""
[vllm]
command = ["{sys.executable}", "-m", "kimi_supervisor.sandbox.fake_vllm", "serve", "m",
           "--tensor-parallel-size", "{len(self.indices)}"]
port = {self.port}
[modes.production]
args = []
[modes.profile]
args = ["--max-model-len", "4096"]
[gpus]
backend = "nvml"
managed = {self.indices}
tolerance_mib = 256
[teardown]
# The fake's API server is `python -m kimi_supervisor.sandbox.fake_vllm`, not `vllm serve`.
stray_patterns = ["kimi_supervisor[.]sandbox[.]fake_vllm"]
term_grace_s = 3
holders_timeout_s = 10
release_timeout_s = 20
shm_dir = "{tmp}/shm"
# The fake's TMPDIR: a teardown cleans dead sockets there, never the shared host's /tmp.
tmp_dir = "{tmp}/tmp"
[state]
dir = "{tmp}/state"
""")
        (tmp / "shm").mkdir()
        (tmp / "tmp").mkdir()
        try:
            self.baselines = baseline.calibrate(self.gpu, self.indices).devices
        except baseline.BaselineError as e:
            pytest.skip(f"the shared GPU host is busy, not touching it: {e}")
        # The seed's worker held 96 GiB of an H200's 141 GB; beside a 20 GiB ghost, an 80 GB
        # H100 holds at most its free memory less 24 GiB (the workers then failed to load and
        # the tests waited out the fake's start).
        free = min(d.total_mib - d.used_mib for d in self.gpu.sample(self.indices))
        self.worker_mib = min(SEED_WORKER_MIB, free - 24 * GIB)

    def env(self, **fake: object) -> dict[str, str]:
        path = self.tmp / f"fake-{len(self.started)}.json"
        path.write_text(json.dumps(fake))
        return {**os.environ, "KIMI_FAKE_CUDA": "1", "KIMI_FAKE_VLLM_CONFIG": str(path),
                "TMPDIR": str(self.tmp / "tmp")}  # fmt: skip

    def spawn(self, args: list[str], env: dict[str, str], wait_ready: bool = False) -> ProcessRef:
        return self.spawn_tree(args, env, wait_ready)[0]

    def spawn_tree(
        self, args: list[str], env: dict[str, str], wait_ready: bool = False
    ) -> list[ProcessRef]:
        """The process, and the others its "ready PID..." line names (a forked helper)."""
        proc = subprocess.Popen(
            args,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if wait_ready else subprocess.DEVNULL,
            start_new_session=True,
        )
        ref = processes.ref_of(proc.pid)
        assert ref is not None
        self.started.append((ref, proc))
        refs = [ref]
        if wait_ready:
            assert proc.stdout is not None
            line = proc.stdout.readline().split()
            assert line[:1] == [b"ready"], line
            # The "ready" PIDs: the process itself, or the one a starter (atpid) left running.
            refs = [r for r in map(processes.ref_of, map(int, line[1:])) if r is not None]
        return refs

    def ghost(self, title: str, mib: int, gpus: str = "all", **kw: Any) -> ProcessRef:
        return self.ghost_tree(title, mib, gpus, **kw)[0]

    def ghost_tree(
        self,
        title: str,
        mib: int,
        gpus: str = "all",
        env: dict[str, str] | None = None,
        fork_helper: str = "",
        prefix: list[str] | None = None,
        **kw: bool,
    ) -> list[ProcessRef]:
        """A ghost (and, with `fork_helper`, the helper it forked after taking the memory);
        `prefix` runs it through a starter (owndev, atpid)."""
        args = [
            *(prefix or []),
            sys.executable,
            "-m",
            "kimi_supervisor.sandbox.ghost",
            "--title",
            title,
            "--mib",
            str(mib),
            "--gpu",
            gpus,
        ] + [f"--{k.replace('_', '-')}" for k, v in kw.items() if v]
        if fork_helper:
            args += ["--fork-helper", fork_helper]
        return self.spawn_tree(args, {**self.env(), **(env or {})}, wait_ready=True)

    def vllm(self, **fake: object) -> ProcessRef:
        ref = self.spawn([*self.config.vllm.command, "--port", str(self.port)], self.env(**fake))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1):
                    return ref
            except OSError:
                time.sleep(0.1)
        raise AssertionError("the fake vLLM did not become ready in 180 s")

    def used(self) -> list[int]:
        return [d.used_mib for d in self.gpu.sample(self.indices)]

    def clean(self) -> bool:
        return all(
            d.used_mib <= self.baselines[d.index] + 256 and not d.processes
            for d in self.gpu.sample(self.indices)
        )

    def teardown(self) -> tuple[float, object]:
        t0 = time.monotonic()
        report = Teardown(self.config, NoSystemd(), self.gpu, SystemClock(), self.baselines).run()
        return time.monotonic() - t0, report

    def floor(self, refs: list[ProcessRef]) -> float:
        t0 = time.monotonic()
        for r in refs:
            processes.send_signal(r, signal.SIGKILL)
        while not self.clean():
            if time.monotonic() - t0 > 60:
                raise AssertionError("memory did not return within 60 s of SIGKILL")
            time.sleep(0.005)
        return time.monotonic() - t0

    def cleanup_children(self) -> None:
        """End what earlier steps left (an EngineCore without GPU memory, say), keep the NVML
        handle, and wait until the GPUs read baseline again."""
        tree = processes.descendants(os.getpid())
        refs = [ref for ref, _p in self.started] + [r for r in map(processes.ref_of, tree) if r]
        for ref in refs:
            processes.send_signal(ref, signal.SIGCONT)
            processes.send_signal(ref, signal.SIGKILL)
        for ref in refs:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(ref.pid, 0)
        self.started.clear()
        deadline = time.monotonic() + 60
        while not self.clean() and time.monotonic() < deadline:
            time.sleep(0.05)

    def cleanup(self) -> None:
        # We are a child subreaper: everything our trees left behind (an orphaned EngineCore
        # that holds no GPU memory, say) is our descendant, and only that is ended here.
        self.cleanup_children()
        self.gpu.close()


def bystanders(host: Host) -> dict[str, ProcessRef]:
    """Processes a teardown of every GPU must leave alive: an NVML monitor and a persistenced
    stand-in (device files open, nothing mapped, no memory), and a process with no GPU at all."""
    return {
        "NVML monitor (nvtop)": host.ghost("nvtop", 0),
        "persistenced stand-in": host.ghost("nvidia-persistenced", 0),
        "a process with no GPU": host.spawn(
            [sys.executable, "-c", "import time; time.sleep(3600)"], host.env()
        ),
    }


def assert_alive(planted: dict[str, ProcessRef]) -> None:
    dead = [name for name, ref in planted.items() if not processes.is_alive(ref)]
    assert not dead, f"bystanders killed: {dead}"


def killed(report: object) -> set[int]:
    return {k.process.pid for k in report.kills if k.signal == "SIGKILL"}  # type: ignore[attr-defined]


def timing(name: str, seconds: float) -> None:
    print(f"\nTIMING {name} {seconds * 1000:.0f} ms")


def test_the_seeds_incident_ghost_is_found_and_only_it_is_killed(host: Host) -> None:
    # A vLLM-like tree whose workers hold ~96 GiB each, stopped; a ghost outside it on every GPU.
    api = host.vllm(mib_per_worker=host.worker_mib, load_s=0.2, shards=4)
    ghost = host.ghost("python", 20 * GIB)
    planted = bystanders(host)
    processes.send_signal(api, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while processes.is_alive(api) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert host.used()[0] - host.baselines[0] > 19 * GIB
    seconds, report = host.teardown()
    timing("seed-incident teardown", seconds)
    assert report.outcome is Outcome.CLEAN, report.diagnosis  # type: ignore[attr-defined]
    assert killed(report) == {ghost.pid}
    assert_alive(planted)
    assert os.getpid() not in killed(report)


def test_memory_only_a_protected_live_holder_keeps_is_reported_stuck_at_once(host: Host) -> None:
    # Real CUDA memory held by a process under a protected name (DCGM's host engine): it is
    # spared, so no release can come, and the teardown says STUCK without waiting for one.
    engine = host.ghost("nv-hostengine", 20 * GIB)
    planted = bystanders(host)
    assert host.used()[0] - host.baselines[0] > 19 * GIB
    seconds, report = host.teardown()
    timing("spared-holder STUCK teardown", seconds)
    r: Any = report
    assert r.outcome is Outcome.STUCK and killed(r) == set()
    holders = [s for s in r.steps if s.step.value == "kill_gpu_holders"][-1]
    after = (r.started_at - holders.started_at).total_seconds() + r.duration_s - holders.duration_s
    timing("spared-holder STUCK after the kill steps", after)
    assert after < 1.0
    assert processes.is_alive(engine)
    assert_alive(planted)


def test_a_worker_ignoring_sigterm_and_a_stopped_holder_are_killed(host: Host) -> None:
    host.vllm(mib_per_worker=8 * GIB, load_s=0.2, shards=4, ignore_sigterm=True)
    stopped = host.ghost("python", 4 * GIB, gpus="0")
    os.kill(stopped.pid, signal.SIGSTOP)
    planted = bystanders(host)
    seconds, report = host.teardown()
    timing("sigterm-ignoring + stopped teardown", seconds)
    assert report.outcome is Outcome.CLEAN, report.diagnosis  # type: ignore[attr-defined]
    assert stopped.pid in killed(report)
    assert_alive(planted)
    evid = {k.evidence for k in report.kills}  # type: ignore[attr-defined]
    assert Evidence.VLLM_SIGNATURE in evid or Evidence.NVML_LISTED in evid


def test_floor_and_teardown_for_a_ghost_measured_in_one_run(host: Host) -> None:
    floors, teardowns = [], []
    planted = bystanders(host)
    for _ in range(3):
        ghost = host.ghost("python", 20 * GIB)
        floors.append(host.floor([ghost]))
        host.ghost("python", 20 * GIB)
        seconds, report = host.teardown()
        assert report.outcome is Outcome.CLEAN  # type: ignore[attr-defined]
        assert_alive(planted)
        teardowns.append(seconds)
    floors.sort()
    teardowns.sort()
    timing("ghost floor median", floors[1])
    timing("ghost teardown median", teardowns[1])
    print(f"RATIO ghost teardown/floor {teardowns[1] / floors[1]:.2f}")


def test_calibration_refuses_while_a_compute_process_runs(host: Host) -> None:
    host.ghost("python", 2 * GIB, gpus="0")
    with pytest.raises(baseline.BaselineError, match="refusing to calibrate"):
        baseline.calibrate(host.gpu, host.indices)
    print(f"\nBASELINE {host.baselines} driver {host.gpu.driver_version()}")


def test_floor_and_teardown_for_each_scenario_measured_in_one_run(host: Host) -> None:
    """Per scenario, from the same starting state: the floor (SIGKILL of every holder until NVML
    reads baseline) and the teardown (until verified CLEAN), two runs each. No grace period is
    inside either figure: there is no unit to stop here, so the teardown starts at its stray step.
    The figures go to stdout and, with KIMI_GPU_RESULTS set, to that JSON file."""

    def tree(**fake: object) -> list[ProcessRef]:
        api = host.vllm(load_s=0.2, shards=4, **fake)
        return [r for r in map(processes.ref_of, [api.pid, *processes.descendants(api.pid)]) if r]

    def seed() -> list[ProcessRef]:
        api = host.vllm(mib_per_worker=host.worker_mib, load_s=0.2, shards=4)
        ghost = host.ghost("python", 20 * GIB)
        host.ghost("nvidia-persistenced", 0)
        processes.send_signal(api, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while processes.is_alive(api) and time.monotonic() < deadline:
            time.sleep(0.02)
        return [ghost]

    held = f"{len(host.indices)} worker(s) x {host.worker_mib / GIB:g} GiB"
    scenarios = {
        f"well-behaved tree ({held})": lambda: tree(mib_per_worker=host.worker_mib),
        f"tree ignoring SIGTERM ({held})": lambda: tree(
            mib_per_worker=host.worker_mib, ignore_sigterm=True
        ),
        "ghost (20 GiB on each GPU)": lambda: [host.ghost("python", 20 * GIB)],
        "seed incident (tree stopped, ghost left)": seed,
    }
    results = {}
    for name, setup in scenarios.items():
        floors, teardowns = [], []
        for _ in range(2):
            floors.append(host.floor(setup()))
            host.cleanup_children()
            setup()
            planted = bystanders(host)  # after the floor, which needs the GPUs to itself
            seconds, report = host.teardown()
            assert report.outcome is Outcome.CLEAN, report.diagnosis  # type: ignore[attr-defined]
            assert_alive(planted)
            teardowns.append(seconds)
            host.cleanup_children()
        f, t = sum(floors) / 2, sum(teardowns) / 2
        results[name] = {"floor_ms": floors, "teardown_ms": teardowns, "ratio": t / f}
        print(
            f"\nSCENARIO {name}: floor {f * 1000:.0f} ms, teardown {t * 1000:.0f} ms, "
            f"ratio {t / f:.2f}"
        )
    out = os.environ.get("KIMI_GPU_RESULTS")
    if out:
        Path(out).write_text(
            json.dumps(
                {
                    "driver": host.gpu.driver_version(),
                    "gpus": len(host.indices),
                    "baseline_mib": host.baselines,
                    "scenarios": {
                        n: {
                            k: (v if k == "ratio" else [round(x * 1000) for x in v])
                            for k, v in r.items()
                        }
                        for n, r in results.items()
                    },
                },
                indent=2,
            )
        )


def test_the_nvml_backend_names_each_gpu_by_the_uuid_nvidia_smi_shows(host: Host) -> None:
    # The metrics label each GPU's series with it, so that they join dcgm-exporter's.
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    expected = {int(i): u.strip() for i, u in (line.split(",") for line in smi.splitlines())}
    assert {i: host.gpu.uuid(i) for i in host.indices} == {i: expected[i] for i in host.indices}
    assert all(u.startswith("GPU-") for u in expected.values())


def test_doctor_reads_the_drivers_gpus_and_persistence_mode_as_nvidia_smi_shows_them(
    host: Host,
) -> None:
    """kimi-mode doctor's GPU checks against the real driver: what it says of persistence mode
    is what nvidia-smi says (on an H200, 2026-12-02: Enabled, read in 0.15 s with the other
    checks: bench/results/h200x1-2026-12-02-doctor.txt)."""
    from kimi_supervisor.cli import checks

    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,persistence_mode", "--format=csv,noheader"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    enabled = {int(i): m.strip() == "Enabled" for i, m in (x.split(",") for x in smi.splitlines())}
    results = {c.name: c for c in checks.check_gpus(host.config)}
    assert results["GPU driver"].ok and results["managed GPUs"].ok, results
    persistence = results["nvidia-persistenced"]
    assert persistence.ok is all(enabled[i] for i in host.indices), (persistence, smi)
    health = results["GPU health"]  # read, whatever it says of this GPU
    assert health.ok is not None and "could not be read" not in health.message, health


def test_the_gpus_health_is_read_as_nvidia_smi_reports_it_through_the_daemons_nvml_process(
    host: Host,
) -> None:
    """What the daemon reads before each load (gpus.health_check), through its NVML process
    as the daemon composes it, against nvidia-smi's own report of the same counters. The
    figures go to $KIMI_HEALTH_OUT (the simulated host copies a healthy H200's answer)."""
    from kimi_supervisor.cli.compose import open_gpu
    from kimi_supervisor.decide.gpuhealth import judge, signals
    from kimi_supervisor.ports.bounded import ProcessWorker

    worker = ProcessWorker("nvml", 10)
    gpu = open_gpu(host.config, worker)
    try:
        t0 = time.monotonic()
        healths = gpu.health(host.indices)
        took = time.monotonic() - t0
    finally:
        gpu.close()

    def smi_q(what: str) -> str:
        return subprocess.run(
            ["nvidia-smi", "-q", "-d", what, "-i", ",".join(map(str, host.indices))],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip

    remapper = smi_q("ROW_REMAPPER")
    smi = remapper + smi_q("ECC")
    v = judge(healths)
    out = os.environ.get("KIMI_HEALTH_OUT")
    if out:
        read = {"took_s": round(took, 4), "verdict": v.text(), "unread": v.unread,
                "gpus": [signals(h) for h in healths]}  # fmt: skip
        Path(out).write_text(
            json.dumps(read, indent=1) + "\n\nnvidia-smi -q -d ROW_REMAPPER,ECC:\n" + smi
        )
    for h in healths:
        assert h.remap_pending is not None, "an H200 remaps rows: NVML says whether it waits"
        assert h.xids is not None, "root reads the kernel's log"
    pending = [line for line in remapper.splitlines() if line.strip().startswith("Pending")]
    if pending:  # nvidia-smi's "Pending : No/Yes" per GPU, in index order
        said = [line.split(":")[1].strip() == "Yes" for line in pending]
        assert said[: len(healths)] == [h.remap_pending for h in healths], (said, healths)
