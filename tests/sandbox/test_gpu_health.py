"""A GPU's health before a long load, on the simulated host: a GPU whose
remapped rows wait for a reset, as NVML reports one (the simulated host copies a healthy
H200's answer, bench/results/h200x1-2026-12-04-gpu-health.txt, and changes one GPU's)."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from kimi_supervisor.sandbox import simgpu
from kimi_supervisor.sandbox.sandbox import UNIT

from ..conftest import DaemonHelper, SandboxHelper, flat, wait_until
from ..promtool import PROMETHEUS, dashboard_queries, prometheus, query

pytestmark = pytest.mark.systemd


def test_a_simulated_gpu_with_rows_waiting_for_a_reset_is_refused_and_loaded_once_reset(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    """gpus.health_check = "refuse": the start is refused before vLLM is started, status and
    doctor say which GPU and why; once the GPU is reset, the retry loads."""
    simgpu.set_health(sandbox.sb.gpu_dir, 1, remap_pending=True, xids=[63])
    try:
        # Refused starts are retried under the failure backoff; a loaded host's doctor may
        # take as long as three of them, and FAILED would then wait for a person.
        with daemon.configured(gpus={"health_check": "refuse"}, daemon={"max_failures": 100}):
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


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus (the set-up takes it from Debian's)")
def test_a_switch_onto_a_gpu_with_xid_79_and_a_pending_remap_says_so_everywhere_an_operator_looks(
    sandbox: SandboxHelper, daemon: DaemonHelper, tmp_path: Path
) -> None:
    """gpus.health_check = "warn" (the default) loads on it all the same, and says so: in the
    followed switch (it printed 0 of 39 lines about it), as a metric per GPU and signal, in the
    shipped alert and the dashboard's panel, through a real Prometheus."""
    daemon.start()
    daemon.wait_serving("production")
    simgpu.set_health(sandbox.sb.gpu_dir, 1, remap_pending=True, xids=[79])
    m = sandbox.config.metrics
    try:
        with prometheus(tmp_path, f"{m.address}:{m.port}", rules=True) as web:
            r = daemon.kimi_mode("profile", timeout=120)
            said = flat(r.stdout)
            assert r.returncode == 0, r.stdout + r.stderr
            for found in (
                "GPU 1: rows remapped, waiting for a GPU reset to take effect",
                "GPU 1: the kernel logged Xid 79 (the GPU fell off the bus) since boot",
            ):
                assert f"warning: {found} (gpus.health_check = warn: loading all the same)" in (
                    said), said  # fmt: skip
            assert all(len(x) <= 80 for x in r.stdout.splitlines()), r.stdout
            with urllib.request.urlopen(f"http://{m.address}:{m.port}/metrics", timeout=5) as h:
                text = h.read().decode()
            for signal, value in (("xid_errors", "1.0"), ("row_remap_pending", "1.0"),
                                  ("row_remap_failure", "0.0")):  # fmt: skip
                assert re.search(rf'^kimi_supervisor_gpu_health\{{gpu="1",signal="{signal}",'
                                 rf'uuid="[^"]*"\}} {value}$', text, re.M), text  # fmt: skip
            (panel,) = [q for t, q in dashboard_queries() if t.startswith("GPU health")]
            wait_until(lambda: 1.0 in query(web, panel), 30, "the panel to show the GPU")
            firing = 'ALERTS{alertname="KimiSupervisorGpuHealthFailing",alertstate="firing"}'
            wait_until(lambda: len(query(web, firing)) == 2, 30, "the alert, for both signals")
            assert sorted(query(web, panel)).count(1.0) == 2  # GPU 0 is healthy: its 0s
    finally:
        simgpu.set_health(sandbox.sb.gpu_dir, 1)
