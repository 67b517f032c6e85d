"""Signalling by identity: a PID is never hit once it belongs to another process."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

from kimi_supervisor.ports import processes
from kimi_supervisor.ports.processes import ProcessRef, SignalResult


def test_a_recycled_pid_is_not_signalled() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        real = processes.ref_of(proc.pid)
        assert real is not None
        # The same PID with another start time: what a scan saw before the PID was reused.
        stale = ProcessRef(proc.pid, real.start_ticks - 1)
        assert processes.send_signal(stale, signal.SIGKILL) == SignalResult.RECYCLED
        assert processes.is_alive(real)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_is_gone_counts_as_already_gone() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    ref = processes.ref_of(proc.pid)
    assert ref is not None
    proc.wait()
    assert processes.send_signal(ref, signal.SIGKILL) == SignalResult.GONE
    assert not processes.is_alive(ref)


def test_a_process_the_kernel_answers_enoent_for_counts_as_gone(monkeypatch: Any) -> None:
    """pidfd_open answered ENOENT, not ESRCH, for a process that had just ended on CI's Linux
    6.18: the sandbox's teardown raised FileNotFoundError (a failed CI run)."""

    def enoent(pid: int) -> int:
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(processes.os, "pidfd_open", enoent)
    assert processes.send_signal(ProcessRef(1, 0), signal.SIGKILL) == SignalResult.GONE


def test_a_zombie_is_not_alive_because_it_has_closed_its_files() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    ref = processes.ref_of(proc.pid)
    assert ref is not None
    import time

    deadline = time.monotonic() + 60
    while processes.state_of(proc.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert processes.state_of(proc.pid) == "Z"
    assert not processes.is_alive(ref)
    proc.wait()
