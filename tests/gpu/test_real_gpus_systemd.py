"""End to end on real GPUs under a real systemd user manager: the daemon as a service of the
manager, vLLM's unit with the fake vLLM in real-CUDA mode, switched with kimi-mode.

On a host without systemd, point KIMI_SANDBOX_SYSTEMD_DIR at a carried systemd (see
kimi_supervisor/sandbox/usermanager.py); skipped where neither NVML nor a manager can be had.

    KIMI_SANDBOX_SYSTEMD_DIR=$PWD/.sd python3 -m pytest -q tests/gpu -s
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.ports import processes
from kimi_supervisor.ports.gpu import GpuUnavailable, NvmlGpu
from kimi_supervisor.sandbox.fake_options import FakeOptions
from kimi_supervisor.sandbox.sandbox import Sandbox
from kimi_supervisor.sandbox.usermanager import unavailable_reason


def _reason() -> str | None:
    try:
        gpu = NvmlGpu()
        gpu.device_count()
        gpu.close()
    except GpuUnavailable as e:
        return f"no GPU: {e}"
    why = unavailable_reason()
    return f"no systemd user manager: {why}" if why else None


REASON = _reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]
GIB = 1024
SEED_WORKER_MIB = 96 * GIB  # what each worker of the seed's vLLM held (96,844 MiB)
GHOST_MIB = 20 * GIB


@pytest.fixture
def sandbox(tmp_path: Path) -> Iterator[Sandbox]:
    gpu = NvmlGpu()
    try:
        samples = gpu.sample(range(gpu.device_count()))
    finally:
        gpu.close()
    busy = [s.index for s in samples if s.processes]
    if busy:
        pytest.skip(f"the shared GPU host is busy on GPU(s) {busy}: not touching it")
    # The seed's worker held 96 GiB of an H200's 141 GB; beside the ghost, a card with less
    # (an 80 GB H100) gets its free memory less the ghost and 4 GiB of CUDA's own (a worker
    # sized for the H200 failed to load there and the test waited out the daemon's start).
    free = min(s.total_mib - s.used_mib for s in samples[:8])
    worker_mib = min(SEED_WORKER_MIB, free - GHOST_MIB - 4 * GIB)
    sb = Sandbox.up(tmp_path / "sbx", gpus=8, real_gpus=True, daemon=False)
    try:
        sb.set_fake_options(FakeOptions(mib_per_worker=worker_mib))
        sb.start_daemon()
        yield sb
    finally:
        for log in (sb.root / "manager" / "manager.log", sb.daemon_log, sb.vllm_log):
            if log.exists():
                print(
                    f"\n== last lines of {log.name}\n"
                    + "\n".join(log.read_text(errors="replace").splitlines()[-25:])
                )
        sb.down()


def kimi_mode(sb: Sandbox, *args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [sys.executable, "-m", "kimi_supervisor.cli.kimi_mode", *args],
        env={**os.environ, **sb.env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(f"\n$ kimi-mode {' '.join(args)}  (exit {r.returncode})\n{r.stdout}{r.stderr}")
    return r


def status(sb: Sandbox) -> dict[str, Any]:
    return json.loads(kimi_mode(sb, "status", "--json").stdout)  # type: ignore[no-any-return]


def wait_serving(sb: Sandbox, mode: str, timeout_s: float = 240) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = subprocess.run(
            [sys.executable, "-m", "kimi_supervisor.cli.kimi_mode", "status", "--json"],
            env={**os.environ, **sb.env},
            capture_output=True,
            text=True,
        )
        if r.returncode == 0:
            s = json.loads(r.stdout)
            if s["state"] == "serving" and s["mode"] == mode:
                return s  # type: ignore[no-any-return]
        time.sleep(0.5)
    raise AssertionError(f"not serving {mode}: {sb.daemon_log.read_text()[-3000:]}")


def test_kimi_mode_switches_real_gpus_with_a_ghost_under_a_real_systemd_manager(
    sandbox: Sandbox,
) -> None:
    sb = sandbox
    wait_serving(sb, "production")  # the daemon brought production up at its start
    ghost = sb.start_ghost("all", GHOST_MIB, "python3 train.py")
    persistenced = sb.start_ghost("all", 0, "nvidia-persistenced")
    r = kimi_mode(sb, "profile")
    assert r.returncode == 0
    assert f"killed PID {ghost.pid} python3 train.py" in r.stdout
    assert not processes.is_alive(ghost) and processes.is_alive(persistenced)
    s = wait_serving(sb, "profile")
    held = json.loads(sb.fake_options_path.read_text())["mib_per_worker"]
    assert all(g["used_mib"] - g["baseline_mib"] >= held for g in s["gpus"])
    r = kimi_mode(sb, "production")
    assert r.returncode == 0
    # The daemon's metrics name each real GPU by its NVML UUID, in bytes.
    m = sb.config().metrics
    with urllib.request.urlopen(f"http://{m.address}:{m.port}/metrics", timeout=5) as page:
        text = page.read().decode()
    labels = re.findall(r'^kimi_supervisor_gpu_used_bytes\{gpu="(\d+)",uuid="(GPU-[^"]+)"\}', text,
                        re.MULTILINE)  # fmt: skip
    assert sorted(int(g) for g, _ in labels) == [g["index"] for g in s["gpus"]], text
    kimi_mode(sb, "history", "-n", "6")
    for line in kimi_mode(sb, "history", "--json").stdout.splitlines():
        e = json.loads(line)
        if e["kind"] == "teardown":
            killed = [k["process"]["pid"] for k in e["kills"] if k["signal"] == "SIGKILL"]
            print(f"TIMING systemd teardown {e['duration_s'] * 1000:.0f} ms, killed {killed}")
    # `systemctl stop kimi-supervisor`: vLLM torn down, the GPUs at baseline when it returns.
    sb.stop_daemon()
    gpu = NvmlGpu()
    try:
        samples = gpu.sample(range(len(s["gpus"])))
    finally:
        gpu.close()
    base = {g["index"]: g["baseline_mib"] for g in s["gpus"]}
    leftover = {d.index: d.used_mib for d in samples if d.used_mib > base[d.index] + 256}
    assert leftover == {}, leftover
    print(f"AFTER STOP {[(d.index, d.used_mib) for d in samples]}")
