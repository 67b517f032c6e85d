"""Finding the teardown's candidates on the host: who listens on vLLM's port, who carries vLLM's
signature, who holds a device file or a shared-memory segment, and who must never be touched.

Scans read /proc through the processes port. The whole-host descriptor scan is the expensive one
and is used only where cheaper evidence (NVML's lists) does not explain what is seen.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from kimi_supervisor.ports import openfiles, processes
from kimi_supervisor.ports.bounded import NAME as IO_NAME_BYTES
from kimi_supervisor.ports.bounded import SCOPE_PREFIX as IO_SCOPE
from kimi_supervisor.ports.openfiles import NodeKey
from kimi_supervisor.ports.sockets import Address, listening_inodes
from kimi_supervisor.ports.systemd import SystemdError, SystemdPort
from kimi_supervisor.teardown.events import EventSink, Warned
from kimi_supervisor.teardown.ownership import DeviceUse

# Never signalled, whatever they hold: the driver's helpers, the DCGM stack and the managers.
# These are executable names; `comm` holds at most COMM_LEN characters of them, and the cut forms
# are derived below, never typed by hand.
BUILTIN_PROTECTED_NAMES = frozenset(
    {
        "nvidia-persistenced",  # the driver's persistence daemon
        "nv-fabricmanager",  # NVSwitch fabric manager (the binary of nvidia-fabricmanager.service)
        "nvidia-fabricmanager",
        "nv-hostengine",  # DCGM's host engine (nvidia-dcgm.service)
        "dcgm-exporter",
        "nvidia-powerd",
        "nvidia-imex",
        "systemd",
        "init",
    }
)
IO_NAME = IO_NAME_BYTES.decode()
COMM_LEN = 15  # TASK_COMM_LEN (16) less the terminating NUL: the kernel cuts `comm` there

# vLLM's own signatures: process titles (full and as `comm` cuts them to 15 characters) and the
# entrypoints found in a command line.
VLLM_TITLE = re.compile(r"^VLLM::")
VLLM_CMDLINE = re.compile(r"vllm\.entrypoints|(^|/)vllm serve\b|\bvllm/bin/vllm\b")


@dataclass
class Protection:
    """Who must never be signalled: ourselves, our ancestors, PID 1, kernel threads, and
    protected names and units.

    A name matches the executable's basename (/proc/PID/exe), argv[0]'s basename, or `comm`,
    compared with the name as the kernel cuts it (its first COMM_LEN characters)."""

    names: frozenset[str]
    units: frozenset[str]
    configured: frozenset[str] = frozenset()  # of `names`, those from teardown.protected_names
    self_pid: int = field(default_factory=os.getpid)
    # True in the daemon: its own service's cgroup (its helpers) is spared too. Not for a
    # one-shot teardown, which may run from any service (cron's, a CI job's) whose other
    # processes are exactly what it may have to kill.
    own_service: bool = False

    def __post_init__(self) -> None:
        self.never = {1, 2, self.self_pid, *processes.ancestors(self.self_pid)}
        self.comm_cuts = {n[:COMM_LEN]: n for n in self.names}
        own = processes.cgroup_of(self.self_pid) if self.own_service else ""
        # Never "/" or a session's scope.
        self.own_cgroup = own if own.endswith(".service") else ""

    @classmethod
    def from_config(
        cls, names: Iterable[str], units: Iterable[str], own_service: bool = False
    ) -> Protection:
        mine = frozenset(names) - BUILTIN_PROTECTED_NAMES
        return cls(BUILTIN_PROTECTED_NAMES | mine, frozenset(units), mine, own_service=own_service)

    def _named(self, name: str) -> str:
        if name in self.configured:
            return f"teardown.protected_names has {name!r}"
        return f"built-in protected name {name!r}"

    def _own_io(self, pid: int) -> bool:
        """The daemon's I/O process (ports/bounded.py): its child, or root's in a scope of the
        daemon's making (one an earlier daemon left, stuck in the kernel). NVML's holds the
        GPUs' device files open, as every NVML client does. Another user can take its name,
        not root's ownership."""
        if processes.ppid_of(pid) == self.self_pid:
            return True
        scope = processes.cgroup_of(pid).rsplit("/", 1)[-1]
        return scope.startswith(IO_SCOPE) and processes.uid_of(pid) == 0

    def why_protected(self, pid: int) -> str | None:
        if pid in self.never:
            return "the supervisor itself, one of its ancestors, or PID 1"
        if processes.ppid_of(pid) == 2:
            return "a kernel thread"
        comm = processes.comm_of(pid)
        if comm == IO_NAME and self._own_io(pid):
            return "one of the supervisor's I/O processes (NVML's calls, the state folder's)"
        if comm in self.comm_cuts:
            return f"{self._named(self.comm_cuts[comm])} (comm {comm!r})"
        argv = processes.cmdline_of(pid)
        argv0 = os.path.basename(argv[0].split()[0]) if argv and argv[0].split() else ""
        for what, name in (("executable", processes.exe_name(pid)), ("argv[0]", argv0)):
            if name in self.names:
                return f"{self._named(name)} ({what})"
        cgroup = processes.cgroup_of(pid)
        if self.own_cgroup and cgroup == self.own_cgroup:
            return "in the supervisor's own service"
        for unit in self.units:
            if cgroup.endswith("/" + unit):
                return f"in {unit}, which teardown.protected_units names"
        return None


def has_vllm_signature(pid: int, extra: list[re.Pattern[str]]) -> bool:
    argv = processes.cmdline_of(pid)
    if argv and VLLM_TITLE.match(argv[0]):
        return True
    if VLLM_TITLE.match(processes.comm_of(pid)):
        return True
    line = " ".join(argv)
    return bool(VLLM_CMDLINE.search(line)) or any(p.search(line) for p in extra)


def bind_conflicts(vllm_host: str, addr: Address) -> bool:
    """Whether a listener on `addr` stands where vLLM, configured to bind `vllm_host`, must
    listen: the same address, or either side the wildcard. A name (not an address) is taken as
    loopback when it says localhost, else as possibly any address."""
    if addr.is_unspecified:
        return True
    try:
        want = ipaddress.ip_address(vllm_host)
    except ValueError:
        return vllm_host != "localhost" or addr.is_loopback
    if isinstance(want, ipaddress.IPv6Address) and want.ipv4_mapped:
        want = want.ipv4_mapped
    return want.is_unspecified or want == addr


def listeners(port: int, host: str, likely: Iterable[int] = ()) -> dict[int, set[str]]:
    """PID -> the addresses it listens on, for the TCP `port` sockets that stand where vLLM
    binds (`bind_conflicts`); a socket on `port` at another address is not vLLM's and is
    ignored. Free unless something listens; then the `likely` PIDs (vLLM's tree) are looked at
    first, and the whole host only if the listening sockets are not all found there."""
    sockets = {
        f"socket:[{inode}]": addr
        for inode, addr in listening_inodes(port).items()
        if bind_conflicts(host, addr)
    }
    if not sockets:
        return {}

    def holders(pids: Iterable[int]) -> tuple[dict[int, set[str]], set[str]]:
        found: dict[int, set[str]] = {}
        seen: set[str] = set()
        for pid in pids:
            held = {t for _fd, t in openfiles.open_paths(pid) if t in sockets}
            if held:
                found[pid] = {str(sockets[t]) for t in held}
                seen |= held
        return found, seen

    found, seen = holders(likely)
    return found if seen == set(sockets) else holders(processes.all_pids())[0]


def device_users(
    files: Iterable[str],
    holding: Iterable[str] | None = None,
    mapped_too: bool = False,
    *,
    node_key: NodeKey | None = None,
    pids: Iterable[int] | None = None,
) -> dict[int, DeviceUse]:
    """How the host's processes (or `pids`) use `files`, the GPUs' device files with nvidiactl
    and nvidia-uvm: those holding any of `holding` (default: any of `files`) open, with what they
    have open and mapped of `files`, compared as `node_key` (the GPU port's) tells device nodes
    apart. With `mapped_too`, also those that only map one, or whose maps cannot be read: that
    reads every process's maps, so it is for a STUCK diagnosis, not for the teardown's fast
    path."""
    wanted = set(files)
    select = set(holding) if holding is not None else wanted
    out: dict[int, DeviceUse] = {}
    for pid in processes.all_pids() if pids is None else pids:
        held = openfiles.holds_any(pid, wanted, node_key)
        if held & select or mapped_too:
            mapped = openfiles.maps_of(pid, wanted, node_key)
            unreadable = mapped is None and processes.ref_of(pid) is not None
            if held & select or mapped or (unreadable and held):
                out[pid] = DeviceUse(
                    pid, frozenset(held), frozenset(mapped or ()), maps_unreadable=unreadable
                )
    return out


def unit_tree(systemd: SystemdPort, unit: str, on_event: EventSink) -> list[processes.ProcessRef]:
    """The unit's processes when a teardown begins: its cgroup and MainPID's descendants."""
    pids: set[int] = set()
    try:
        status = systemd.status(unit)
        pids.update(systemd.cgroup_pids(unit))
    except SystemdError as e:
        on_event(Warned(f"cannot read {unit}: {e}"))
        return []
    if status.main_pid:
        pids.add(status.main_pid)
        pids.update(processes.descendants(status.main_pid))
    return [r for r in map(processes.ref_of, pids) if r is not None]
