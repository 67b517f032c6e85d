"""Finding the teardown's candidates on the host: who listens on vLLM's port, who carries vLLM's
signature, who holds a device file or a shared-memory segment, and who must never be touched.

Scans read /proc through the processes port. The whole-host descriptor scan is the expensive one
and is used only where cheaper evidence (NVML's lists) does not explain what is seen.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.ports import processes

# Never signalled, whatever they hold: the driver's helpers and the monitoring stack.
BUILTIN_PROTECTED_NAMES = frozenset(
    {
        "nvidia-persistenced",
        "nv-hostengine",
        "dcgm-exporter",
        "nvidia-fabricmanager",
        "nvidia-fabricmanage",
        "nvidia-persiste",
        "systemd",
        "init",
    }
)

# vLLM's own signatures: process titles (full and as `comm` cuts them to 15 characters) and the
# entrypoints found in a command line.
VLLM_TITLE = re.compile(r"^VLLM::")
VLLM_CMDLINE = re.compile(r"vllm\.entrypoints|(^|/)vllm serve\b|\bvllm/bin/vllm\b")


@dataclass
class Protection:
    """Who must never be signalled: ourselves, our ancestors, PID 1, kernel threads, and
    protected names and units."""

    names: frozenset[str]
    units: frozenset[str]
    self_pid: int = field(default_factory=os.getpid)

    def __post_init__(self) -> None:
        self.never = {1, 2, self.self_pid, *processes.ancestors(self.self_pid)}
        own = processes.cgroup_of(self.self_pid)
        # Our own service's cgroup (the daemon's helpers) is ours too, but never "/" or a session.
        self.own_cgroup = own if own.endswith(".service") else ""

    @classmethod
    def from_config(cls, names: Iterable[str], units: Iterable[str]) -> Protection:
        return cls(BUILTIN_PROTECTED_NAMES | set(names), frozenset(units))

    def why_protected(self, pid: int) -> str | None:
        if pid in self.never:
            return "the supervisor itself, one of its ancestors, or PID 1"
        if processes.ppid_of(pid) == 2:
            return "a kernel thread"
        comm = processes.comm_of(pid)
        argv = processes.cmdline_of(pid)
        argv0 = os.path.basename(argv[0].split()[0]) if argv and argv[0] else ""
        for name in (comm, argv0):
            if name in self.names:
                return f"protected process name {name!r}"
        cgroup = processes.cgroup_of(pid)
        if self.own_cgroup and cgroup == self.own_cgroup:
            return "in the supervisor's own service"
        for unit in self.units:
            if cgroup.endswith("/" + unit):
                return f"in protected unit {unit}"
        return None


def has_vllm_signature(pid: int, extra: list[re.Pattern[str]]) -> bool:
    argv = processes.cmdline_of(pid)
    if argv and VLLM_TITLE.match(argv[0]):
        return True
    if VLLM_TITLE.match(processes.comm_of(pid)):
        return True
    line = " ".join(argv)
    return bool(VLLM_CMDLINE.search(line)) or any(p.search(line) for p in extra)


def listeners(port: int, likely: Iterable[int] = ()) -> list[int]:
    """PIDs holding a socket that listens on TCP `port`. Free unless something listens; then the
    `likely` PIDs (vLLM's tree) are looked at first, and the whole host only if the listening
    sockets are not all found there."""
    inodes = processes.listening_inodes(port)
    if not inodes:
        return []
    wanted = {f"socket:[{i}]" for i in inodes}

    def holders(pids: Iterable[int]) -> tuple[list[int], set[str]]:
        found, seen = [], set()
        for pid in pids:
            held = {t for _fd, t in processes.open_paths(pid) if t in wanted}
            if held:
                found.append(pid)
                seen |= held
        return found, seen

    found, seen = holders(likely)
    if seen == wanted:
        return found
    return holders(processes.all_pids())[0]


def fd_holders(paths: Iterable[str], pids: Iterable[int] | None = None) -> dict[int, set[str]]:
    """Which of `pids` (default: every process) hold any of `paths` open."""
    wanted = set(paths)
    out: dict[int, set[str]] = {}
    for pid in processes.all_pids() if pids is None else pids:
        held = processes.holds_any(pid, wanted)
        if held:
            out[pid] = held
    return out


def shm_in_use(shm_dir: Path, names: set[str]) -> set[str]:
    """Which of `names` in `shm_dir` some live process has open or mapped."""
    paths = {str(shm_dir / n) for n in names}
    used: set[str] = set()
    for pid in processes.all_pids():
        for _fd, target in processes.open_paths(pid):
            if target.removesuffix(" (deleted)") in paths:
                used.add(target)
        used |= processes.maps_any(pid, str(shm_dir) + "/") & paths
    return {Path(p).name for p in used}
