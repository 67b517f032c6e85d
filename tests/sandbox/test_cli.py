"""The admin commands as an operator runs them, against the sandbox."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_supervisor.store import baseline

from ..conftest import SandboxHelper

pytestmark = pytest.mark.systemd


def cli(sandbox: SandboxHelper, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kimi_supervisor.cli.admin", *args],
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


def test_the_incidents_ghost_planted_from_the_cli_is_cleared_and_the_monitor_left_running(
    sandbox: SandboxHelper,
) -> None:
    from kimi_supervisor.ports import processes

    r = cli(
        sandbox, "sandbox", "ghost", "--dir", str(sandbox.sb.root), "--gpu", "1", "--mib",
        "5000", "--title", "python3 train.py", "--helper", "pt_data_worker",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    helper = processes.ref_of(int(r.stdout))
    assert helper is not None and processes.comm_of(helper.pid) == "pt_data_worker"
    sandbox.started.append(helper)
    (gpu1,) = sandbox.gpu.sample([1])
    assert gpu1.used_mib == 5_615 and helper.pid not in [p.pid for p in gpu1.processes]
    monitor = sandbox.ghost(gpu="all", mib=0, title="nvtop")
    r = cli(sandbox, "teardown")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"killed PID {helper.pid} (pt_data_worker) in kill_gpu_holders" in r.stdout
    assert "open and mapped" in r.stdout
    assert processes.is_alive(monitor)


def test_both_commands_say_their_version() -> None:
    import subprocess
    import sys
    from importlib.metadata import version

    for module, prog in (
        ("kimi_supervisor.cli.admin", "kimi-supervisor"),
        ("kimi_supervisor.cli.kimi_mode", "kimi-mode"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", module, "--version"], capture_output=True, text=True
        )
        assert r.returncode == 0 and r.stdout.strip() == f"{prog} {version('kimi-supervisor')}"


def test_a_one_shot_teardown_run_from_a_service_kills_a_ghost_that_shares_that_service(
    sandbox: SandboxHelper,
) -> None:
    # cron's service, or a CI job run as a unit: only the daemon's own service is a shelter.
    script = (
        f"ghost=$({sys.executable} -m kimi_supervisor.sandbox.ghost --detach --gpu all --mib 3000 "
        "--title python | cut -d' ' -f2) && echo GHOST $ghost && "
        f"exec {sys.executable} -m kimi_supervisor.cli.admin teardown"
    )
    setenv = [f"--setenv={k}={v}" for k, v in {**os.environ, **sandbox.sb.env}.items()]
    r = subprocess.run(
        ["systemd-run", "--user", "--wait", "--pipe", "--quiet", "--collect",
         f"--working-directory={Path.cwd()}", *setenv, "sh", "-c", script],
        env={**os.environ, **sandbox.sb.env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    ghost = int(r.stdout.split("GHOST ")[1].split()[0])
    assert f"killed PID {ghost} (python) in kill_gpu_holders" in r.stdout
    assert not Path(f"/proc/{ghost}").exists()
