"""Signalling by identity: a PID is never hit once it belongs to another process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
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


def test_a_units_cgroup_is_read_with_its_folders_below_and_no_link_is_followed(
    tmp_path: Path,
) -> None:
    """The unit's cgroup (v2) holds what its parent links lose (a compiler's daemon, a double
    fork). Read as root from folders a delegated unit's user may change: a link is never
    followed, nothing but a regular cgroup.procs is opened, and the PIDs and folders are
    bounded."""
    fs = tmp_path / "cgroup"
    unit = fs / "system.slice" / "vllm.service"
    (unit / "payload" / "deeper").mkdir(parents=True)
    (unit / "cgroup.procs").write_text("100\n101\n")
    (unit / "payload" / "cgroup.procs").write_text("300\n")
    (unit / "payload" / "deeper" / "cgroup.procs").write_text("301\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "cgroup.procs").write_text("999\n")
    (unit / "linked").symlink_to(elsewhere)  # a folder that is a link: never entered
    (unit / "procs-link").mkdir()
    (unit / "procs-link" / "cgroup.procs").symlink_to(elsewhere / "cgroup.procs")
    (unit / "fifo").mkdir()
    os.mkfifo(unit / "fifo" / "cgroup.procs")  # never opened: its open alone would block

    got = processes.cgroup_pids("/system.slice/vllm.service", limit=256, root=fs)
    assert got is not None and sorted(got[0]) == [100, 101, 300, 301] and not got[1]
    cut = processes.cgroup_pids("/system.slice/vllm.service", limit=2, root=fs)
    assert cut is not None and len(cut[0]) <= 2 and cut[1], "more than the bound is said"
    assert processes.cgroup_pids("/", limit=256, root=fs) is None, "the root cgroup: no unit"
    assert processes.cgroup_pids("/system.slice/gone.service", limit=256, root=fs) is None
    assert processes.cgroup_pids("/system.slice/../elsewhere", limit=256, root=fs) is None


def test_a_units_folder_is_found_in_its_mainpids_cgroup_path_or_there_is_none() -> None:
    nested = "/user.slice/user@0.service/app.slice/vllm.service/payload"
    assert processes.unit_cgroup(nested, "vllm.service") == (
        "/user.slice/user@0.service/app.slice/vllm.service"
    )
    assert processes.unit_cgroup("/system.slice/other.service", "vllm.service") == ""
    assert processes.unit_cgroup("/", "vllm.service") == ""
    assert processes.unit_cgroup("/system.slice/vllm.service (deleted)", "vllm.service") == ""
    # A folder below may be named so by whoever may make it: only a name, the unit still found.
    assert processes.unit_cgroup("/system.slice/vllm.service/x (deleted)", "vllm.service") == (
        "/system.slice/vllm.service"
    )


def test_a_cgroup_whose_name_is_no_utf8_is_read_whole_and_shown_escaped(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A local user names their own delegated cgroup `x\xff` and puts a GPU holder there: a
    strict decoding raised where the teardown described that holder (an internal error instead
    of its name), and dropped the liveness reading of a unit whose process sat in one."""
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_bytes(
        b"1:name=systemd:/user.slice/x\xff\n0::/user.slice/user@1000.service/x\xff/vllm.service\n"
    )
    monkeypatch.setattr(processes, "PROC", tmp_path)
    path = processes.cgroup_of(4242)
    assert path.encode("utf-8", "surrogateescape").endswith(b"/x\xff/vllm.service")
    assert processes.shown_path(path) == "/user.slice/user@1000.service/x\\xff/vllm.service"
    assert processes.unit_cgroup(processes.cgroup2_of(4242), "vllm.service") == path


def test_a_wide_cgroup_tree_is_read_holding_a_few_descriptors(tmp_path: Path) -> None:
    """300 folders below the unit's: each is opened when read, not all held while queued (256
    descriptors at once before, against a soft limit of 1024)."""
    unit = tmp_path / "system.slice" / "vllm.service"
    for i in range(300):
        (unit / f"c{i}").mkdir(parents=True)
        (unit / f"c{i}" / "cgroup.procs").write_text(f"{1000 + i}\n")
    (unit / "cgroup.procs").write_text("7\n")
    most, opened = 0, processes.safeopen.open_dir

    def counting(dir_fd: int, rel: str) -> int:
        nonlocal most
        most = max(most, len(os.listdir("/proc/self/fd")))
        return opened(dir_fd, rel)

    before = len(os.listdir("/proc/self/fd"))
    processes.safeopen.open_dir = counting  # type: ignore[assignment]
    try:
        got = processes.cgroup_pids("/system.slice/vllm.service", limit=512, root=tmp_path)
    finally:
        processes.safeopen.open_dir = opened  # type: ignore[assignment]
    assert got is not None and sorted(got[0]) == [7, *range(1000, 1300)] and not got[1]
    assert most - before <= 4, (before, most)


def test_cgroup_v2_is_found_where_it_is_mounted_unified_or_hybrid(tmp_path: Path) -> None:
    assert processes.cgroup2_root(tmp_path) is None, "cgroup v1 alone"
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified" / "cgroup.controllers").write_text("")
    assert processes.cgroup2_root(tmp_path) == tmp_path / "unified"
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    assert processes.cgroup2_root(tmp_path) == tmp_path
