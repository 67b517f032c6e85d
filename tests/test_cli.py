"""The admin commands as an operator runs them, against the sandbox."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from supervisor import baseline

from .conftest import SandboxHelper

pytestmark = pytest.mark.systemd


def cli(sandbox: SandboxHelper, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args],
        env={**os.environ, **sandbox.sb.env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_calibrate_refuses_while_a_compute_process_runs_and_succeeds_once_it_is_gone(
    sandbox: SandboxHelper,
) -> None:
    ghost = sandbox.ghost(gpu="1", mib=2_000, title="python")
    r = cli(sandbox, "calibrate")
    assert r.returncode == 1
    assert (
        f"refusing to calibrate while compute processes run (GPU 1: PIDs {ghost.pid})" in r.stderr
    )
    sandbox.reset()
    r = cli(sandbox, "calibrate")
    assert r.returncode == 0, r.stderr
    assert "GPU 0: baseline 615 MiB" in r.stdout
    stored = baseline.load(sandbox.config.state.dir)
    assert stored is not None and stored.driver_version == "sim-580.159"


def test_teardown_command_prints_what_it_killed_and_exits_0_when_clean(
    sandbox: SandboxHelper,
) -> None:
    sandbox.start_vllm()
    ghost = sandbox.ghost(gpu="all", mib=3_000, title="python")
    r = cli(sandbox, "teardown")
    assert r.returncode == 0, r.stderr
    assert "CLEAN" in r.stdout.splitlines()[0]
    assert f"killed PID {ghost.pid} (python) in kill_gpu_holders" in r.stdout
    events = [json.loads(line)["event"] for line in r.stderr.splitlines()]
    assert events[0] == "teardown_started" and events[-1] == "teardown_finished"


def test_teardown_command_exits_1_with_a_diagnosis_when_stuck(sandbox: SandboxHelper) -> None:
    sandbox.sb.leak(2, 1_000)
    r = cli(sandbox, "teardown", "--json")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert report["outcome"] == "stuck"
    assert "GPU 2: 1615 MiB used" in report["diagnosis"]
