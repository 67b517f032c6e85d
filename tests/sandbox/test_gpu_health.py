"""A GPU's health before a long load (issue 44, item 8), on the simulated host: a GPU whose
remapped rows wait for a reset, as NVML reports one (the simulated host copies a healthy
H200's answer, bench/results/h200x1-2026-12-04-gpu-health.txt, and changes one GPU's)."""

from __future__ import annotations

import pytest

from kimi_supervisor.sandbox import simgpu
from kimi_supervisor.sandbox.sandbox import UNIT

from ..conftest import DaemonHelper, SandboxHelper, flat, wait_until

pytestmark = pytest.mark.systemd


def test_a_simulated_gpu_with_rows_waiting_for_a_reset_is_refused_and_loaded_once_reset(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    """gpus.health_check = "refuse": the start is refused before vLLM is started, status and
    doctor say which GPU and why; once the GPU is reset, the retry loads."""
    simgpu.set_health(sandbox.sb.gpu_dir, 1, remap_pending=True, xids=[63])
    try:
        with daemon.configured(gpus={"health_check": "refuse"}):
            daemon.start()
            st = daemon.wait_status(lambda s: s["last_failure"] is not None, 30, "the refusal")
            reason = flat(st["last_failure"]["reason"])
            assert "GPU 1: rows remapped, waiting for a GPU reset to take effect" in reason, st
            assert st["gpu_health"]["refused"] and st["gpu_health"]["verdict"] == "failing"
            assert sandbox.systemd.status(UNIT).inactive, "vLLM was never started on it"
            doctor = daemon.kimi_mode("doctor")
            said = flat(doctor.stdout)
            assert doctor.returncode == 1 and "FAIL GPU health GPU 1: rows remapped" in said, said
            simgpu.set_health(sandbox.sb.gpu_dir, 1)  # the operator reset it
            st = daemon.wait_serving("production", 90)
            assert st["gpu_health"]["verdict"] == "healthy", st["gpu_health"]
            assert not any(w.startswith("GPU health:") for w in st["warnings"]), st["warnings"]
            wait_until(lambda: daemon.kimi_mode("doctor").returncode == 0, 30, "doctor passes")
    finally:
        simgpu.set_health(sandbox.sb.gpu_dir, 1)
