"""The suite passes however it is started: as a systemd service or inside a scope (as CI
runners and `systemd-run` start it), with SIGINT ignored (as a background job inherits it).
A few tests that kill and that press Ctrl-C run again, in a pytest started that way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import CHECKOUT, SandboxHelper

pytestmark = pytest.mark.systemd

TESTS = [
    # In-process teardown: the ghost shares the suite's own cgroup, and is still killed.
    "tests/sandbox/test_teardown.py::test_a_ghost_with_an_innocuous_title_on_every_gpu_is_killed_as_a_gpu_holder",
    # Ctrl-C reaches kimi-mode although the suite ignores SIGINT.
    "tests/sandbox/test_kimi_mode.py::test_ctrl_c_while_following_stops_following_and_the_switch_completes",
]


@pytest.mark.parametrize("how", ["service", "scope"])
def test_killing_and_ctrl_c_tests_pass_in_a_suite_started_as_a_unit_with_sigint_ignored(
    sandbox: SandboxHelper, how: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "KIMI_"))}
    nested = (
        f'trap "" INT; exec {sys.executable} -m pytest -q -p no:cacheprovider '
        f"--basetemp={tmp_path / 'nested'} {' '.join(TESTS)}"
    )
    unit = (
        ["--wait", "--pipe", "--collect", "-p", "Delegate=yes"] if how == "service" else ["--scope"]
    )
    setenv = [f"--setenv={k}={v}" for k, v in env.items()] if how == "service" else []
    r = subprocess.run(
        ["systemd-run", "--user", "--quiet", *unit, f"--working-directory={CHECKOUT}", *setenv,
         "sh", "-c", nested],
        env={**env, **{k: v for k, v in sandbox.sb.env.items() if k in (
            "DBUS_SESSION_BUS_ADDRESS", "XDG_RUNTIME_DIR")}},
        cwd=CHECKOUT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "2 passed" in r.stdout
