"""A booted host that a killed test session left running is ended by the next session, and
never one whose session lives (tests/booted/host.reap_leftover_hosts, run at session start)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_until

from .host import reap_leftover_hosts

pytestmark = pytest.mark.booted

TOPS = [Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")]


def _top() -> Path | None:
    for top in TOPS:
        if (top / "cgroup.procs").exists() and os.access(top, os.W_OK):
            return top
    return None


@pytest.fixture
def planted() -> Iterator[tuple[Path, Path, subprocess.Popen[bytes], subprocess.Popen[bytes]]]:
    """Two boots' cgroups, each with a sleeping process of this test (a host's stand-in): one
    named for a pytest process that has ended, one for this live session."""
    top = _top()
    if top is None or os.geteuid() != 0:
        pytest.skip("needs root and a writable cgroup hierarchy")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead, live = top / f"kimi-booted-{gone.pid}-1", top / f"kimi-booted-{os.getpid()}-2"
    procs = []
    for d in (dead, live):
        d.mkdir()
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        (d / "cgroup.procs").write_text(str(p.pid))
        procs.append(p)
    try:
        yield dead, live, procs[0], procs[1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # our own child, by its handle
            p.wait()
        for d in (dead, live):
            wait_until(lambda d=d: not d.exists() or not (d / "cgroup.procs").read_text().strip(),
                       30, "the cgroup to empty")  # fmt: skip
            if d.exists():
                d.rmdir()


def test_a_leftover_hosts_processes_are_ended_and_a_live_sessions_are_kept(
    planted: tuple[Path, Path, subprocess.Popen[bytes], subprocess.Popen[bytes]],
) -> None:
    dead, live, leftover, kept = planted
    reaped = reap_leftover_hosts()
    assert any(r.startswith(str(dead)) for r in reaped), reaped
    assert not any(r.startswith(str(live)) for r in reaped), reaped
    assert leftover.wait(timeout=30) == -9 and not dead.exists()
    assert kept.poll() is None and live.exists(), "a live session's host is never touched"
