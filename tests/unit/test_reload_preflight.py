"""`kimi-supervisor reload` runs the newly installed code: it refuses to signal the daemon when
that code cannot run, so that a broken upgrade leaves the old daemon running."""

from __future__ import annotations

import argparse
import importlib
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.cli import run
from kimi_supervisor.cli.exits import Exit

from .test_config import MINIMAL


def test_every_module_of_the_daemon_imports_here() -> None:
    assert run.preflight() is None


def test_a_module_that_fails_to_import_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def broken(name: str, *a: Any) -> object:
        if name == "kimi_supervisor.loop.daemon":
            raise ImportError("a broken build")
        return real(name, *a)

    monkeypatch.setattr(importlib, "import_module", broken)
    assert run.preflight() == (
        "kimi_supervisor.loop.daemon does not import: ImportError: a broken build"
    )


def test_reload_of_a_broken_build_sends_no_signal_and_says_the_daemon_runs_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(MINIMAL + f'[control]\nsocket = "{tmp_path}/control.sock"\n')
    monkeypatch.setattr(run, "preflight", lambda: "kimi_supervisor.loop.daemon does not import")
    # Stands in for the daemon: SIGHUP's default action would end it.
    daemon = subprocess.Popen(["sleep", "60"])
    try:
        code = run.cmd_reload(argparse.Namespace(config=str(config), pid=daemon.pid))
        assert code == Exit.FAILED
        assert daemon.poll() is None  # not signalled
        err = capsys.readouterr().err
        assert "this version cannot run (kimi_supervisor.loop.daemon does not import)" in err
        assert "the daemon was not signalled and runs on as it was" in err
    finally:
        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
