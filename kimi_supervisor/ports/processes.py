"""The processes port: reading /proc and sending signals by identity.

A process is identified by (pid, start time in clock ticks since boot), never by PID alone: a PID
can be reused between a scan and a kill. Signals go through a pidfd opened and then checked
against the start time, so a recycled PID is never hit.
"""

from __future__ import annotations

import collections
import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from kimi_supervisor.model import ProcessDescription, ProcessTimes, printable
from kimi_supervisor.ports import safeopen

PROC = Path("/proc")
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, order=True)
class ProcessRef:
    """A process's identity: its PID plus when it started."""

    pid: int
    start_ticks: int


class SignalResult:
    DELIVERED = "delivered"
    GONE = "already gone"
    RECYCLED = "not sent: the PID now belongs to another process"


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (which may hold spaces and parens)."""
    try:
        raw = (PROC / str(pid) / "stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    except OSError as e:
        if e.errno in (errno.ESRCH, errno.ENOENT):
            return None
        raise
    close = raw.rfind(b")")
    return raw[close + 2 :].decode().split()


def start_ticks(pid: int) -> int | None:
    fields = _stat_fields(pid)
    # stat field 22 (starttime) is index 19 after the state field's position 3.
    return int(fields[19]) if fields else None


def ref_of(pid: int) -> ProcessRef | None:
    ticks = start_ticks(pid)
    return ProcessRef(pid, ticks) if ticks is not None else None


def is_alive(ref: ProcessRef) -> bool:
    """True while the process exists and is not a zombie (a zombie has closed its files)."""
    fields = _stat_fields(ref.pid)
    if not fields:
        return False
    return int(fields[19]) == ref.start_ticks and fields[0] not in ("Z", "X")


def state_of(pid: int) -> str:
    fields = _stat_fields(pid)
    return fields[0] if fields else ""


def cpu_of(pid: int) -> tuple[str, float] | None:
    """The process's state (R, S, D, T, t, Z...) and its CPU time so far (user and system,
    seconds, all its threads, and its children's that it has waited for), from
    /proc/PID/stat; None once it is gone. A child that exits and is reaped moves its time into
    its parent's: summed over a tree, work done by short-lived helpers (a compiler, a shell's
    commands) stays in the sum instead of leaving it with them."""
    fields = _stat_fields(pid)
    if not fields:
        return None
    # stat fields 14-17 (utime, stime, cutime, cstime) are indexes 11-14 after the state's
    # position 3.
    return fields[0], sum(int(f) for f in fields[11:15]) / _CLK_TCK


def times_of(pid: int) -> ProcessTimes | None:
    """The process's identity, parent, state and CPU times (as cpu_of, and its reaped
    children's apart), from one read of /proc/PID/stat; None once it is gone."""
    fields = _stat_fields(pid)
    if not fields:
        return None
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return ProcessTimes(
        pid, int(fields[19]), int(fields[1]), fields[0],
        (utime + stime + cutime + cstime) / _CLK_TCK, (cutime + cstime) / _CLK_TCK,
    )  # fmt: skip


def ppid_of(pid: int) -> int:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else 0


def comm_of(pid: int) -> str:
    """The process's comm, its control characters escaped (its owner chose it: model.printable);
    "" where it cannot be read."""
    try:
        raw = (PROC / str(pid) / "comm").read_bytes()
    except OSError:
        return ""
    return printable(raw.removesuffix(b"\n").decode(errors="replace"))


def exe_name(pid: int) -> str:
    """The basename of the executable (/proc/PID/exe); "" where it cannot be read."""
    try:
        return os.path.basename(os.readlink(PROC / str(pid) / "exe").removesuffix(" (deleted)"))
    except OSError:
        return ""


def cmdline_of(pid: int) -> list[str]:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    parts = raw.split(b"\0")
    if parts and parts[-1] == b"":
        parts.pop()
    out = [p.decode(errors="replace") for p in parts]
    # setproctitle writes the title over argv and pads it: keep the title, not the padding.
    while out and not out[-1].strip():
        out.pop()
    if out:
        out[-1] = out[-1].rstrip()
    return out


# /proc/PID/environ is what the process was exec'd with: with argv, at most ARG_MAX, a quarter of
# the stack's limit (2 MiB under the usual 8 MiB); more than this is not read.
MAX_ENVIRON_BYTES = 16 << 20


def environ_of(pid: int) -> dict[str, str]:
    """The environment `pid` was exec'd with (root reads anyone's); {} where it cannot be read."""
    try:
        with open(PROC / str(pid) / "environ", "rb") as f:
            raw = f.read(MAX_ENVIRON_BYTES)
    except OSError:
        return {}
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        name, eq, value = item.partition(b"=")
        if eq and name:  # the first of a name twice is what getenv (and Python) see
            out.setdefault(name.decode(errors="replace"), value.decode(errors="replace"))
    return out


def _cgroup_text(pid: int) -> str | None:
    """/proc/PID/cgroup, its bytes kept whole (surrogateescape): a cgroup's name is any bytes
    its creator chose (a user's own delegated cgroup, `x` and the byte 0xff), which a strict
    decoding turned into an exception where a holder was described. None where unreadable."""
    try:
        return (PROC / str(pid) / "cgroup").read_bytes().decode("utf-8", "surrogateescape")
    except OSError:
        return None


def shown_path(path: str) -> str:
    """A path read with its bytes kept whole (surrogateescape), as text to show: bytes that are
    no UTF-8 as a backslash, x and two hex digits, controls escaped (model.printable)."""
    return printable(path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace"))


def cgroup_of(pid: int) -> str:
    """The process's cgroup path: the unified (v2) one, else the name=systemd (v1) one (bytes
    that are no UTF-8 kept as surrogates: shown_path shows it)."""
    text = _cgroup_text(pid)
    return "" if text is None else cgroup_path(text)


def cgroup_path(text: str) -> str:
    """The cgroup path a /proc/PID/cgroup text names: its unified (v2) line's, else its
    name=systemd (v1) line's; "" where it has neither."""
    v1 = ""
    for line in text.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            return path
        if controllers == "name=systemd":
            v1 = path
    return v1


def cgroup2_of(pid: int) -> str:
    """The process's cgroup v2 path (its "0::" line: "/system.slice/x.service", bytes kept
    whole); "" where it has none (no cgroup v2) or it cannot be read. Ends " (deleted)" for a
    removed cgroup (then no folder of that name opens)."""
    text = _cgroup_text(pid)
    if text is None:
        return ""
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return ""


CGROUP_FS = Path("/sys/fs/cgroup")
PROCS_LINE_BYTES = 12  # a PID of /proc/sys/kernel/pid_max (at most 2**22) and its newline


def cgroup2_root(fs: Path = CGROUP_FS) -> Path | None:
    """Where cgroup v2 is mounted: /sys/fs/cgroup (unified), /sys/fs/cgroup/unified (hybrid),
    or None (v1 alone)."""
    for root in (fs, fs / "unified"):
        if (root / "cgroup.controllers").is_file():
            return root
    return None


def unit_cgroup(path: str, unit: str) -> str:
    """The folder of the unit `unit` in a cgroup v2 `path` (a process of the unit may sit in a
    folder below it, as a delegated unit arranges): the path up to its first component named
    `unit`; "" where there is none (the process is not in the unit, or the unit's folder was
    removed: "x.service (deleted)"). A folder below named " (deleted)" is only a name."""
    parts = path.split("/")
    if unit not in parts:
        return ""
    return "/".join(parts[: parts.index(unit) + 1])


def cgroup_pids(
    path: str, *, limit: int, root: Path | str | None = None
) -> tuple[list[int], bool] | None:
    """The PIDs in the cgroup v2 folder `path` ("/system.slice/x.service") and every folder
    below it (its `cgroup.procs`), breadth first: at most `limit` PIDs and `limit` folders, and
    whether some were left out. None where there is none to read: no cgroup v2, the root
    cgroup, or the folder cannot be opened. Read as root from folders that a delegated unit's
    user may change: every folder and file is reached from the mount's descriptor through no
    link and opened only as what it is (ports/safeopen.py); one that is anything else is
    passed over."""
    base = root if root is not None else cgroup2_root()
    rel = path.strip("/")
    if base is None or not rel:
        return None
    try:
        top = safeopen.open_root(base)
    except (safeopen.Refused, OSError):
        return None
    # Folders are queued by name and opened from the mount's descriptor one at a time when
    # read: a wide tree holds two descriptors, not one per folder queued.
    pids: list[int] = []
    todo, folders, cut, first = collections.deque([rel]), 1, False, True
    try:
        while todo:
            at = todo.popleft()
            try:
                fd = safeopen.open_dir(top, at)
            except (safeopen.Refused, OSError):
                if first:
                    return None
                continue  # removed meanwhile, or not a folder by now
            first = False
            try:
                pids += _procs(fd, limit + 1 - len(pids))
                with os.scandir(fd) as entries:
                    for entry in entries:
                        if not entry.is_dir(follow_symlinks=False):
                            continue
                        if folders >= limit:
                            cut = True
                            break
                        todo.append(f"{at}/{entry.name}")
                        folders += 1
            finally:
                os.close(fd)
            if len(pids) > limit:
                cut = True
                break
    finally:
        os.close(top)
    return pids[:limit], cut


def _procs(dir_fd: int, most: int) -> list[int]:
    """The PIDs of the folder's cgroup.procs (at most `most`); none where it cannot be read."""
    try:
        fd = safeopen.open_file(dir_fd, "cgroup.procs")
    except (safeopen.Refused, OSError):
        return []
    want = most * PROCS_LINE_BYTES
    chunks: list[bytes] = []
    try:
        while want > 0:
            chunk = os.read(fd, min(want, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            want -= len(chunk)
    except OSError:
        return []
    finally:
        os.close(fd)
    out = []
    for word in b"".join(chunks).split()[:most]:
        if word.isdigit():
            out.append(int(word))
    return out


def unit_pids(pid: int, unit: str, *, limit: int) -> tuple[list[int], bool] | None:
    """The PIDs of the unit `unit`'s cgroup (v2) that `pid` (its MainPID) is in, with its
    folders below; None where it has none to read (no cgroup v2, `pid` not in the unit's
    folder, the folder unreadable): cgroup_pids."""
    folder = unit_cgroup(cgroup2_of(pid), unit)
    return cgroup_pids(folder, limit=limit) if folder else None


def unit_of(pid: int) -> str:
    """The systemd service a process runs in (the last `.service` of its cgroup path), or ""."""
    for part in reversed(cgroup_of(pid).split("/")):
        if part.endswith(".service"):
            return part
    return ""


def boot_time() -> float:
    for line in (PROC / "stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise RuntimeError("/proc/stat has no btime")


_BOOT_TIME: float | None = None


def start_time_epoch(ref: ProcessRef) -> float:
    global _BOOT_TIME
    if _BOOT_TIME is None:
        _BOOT_TIME = boot_time()
    return _BOOT_TIME + ref.start_ticks / _CLK_TCK


def started_at(ref: ProcessRef) -> float:
    """When the process started, in epoch seconds, to a clock tick (10 ms): against the boot
    clock now, not /proc/stat's btime, which is whole seconds."""
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ref.start_ticks / _CLK_TCK)


def uid_of(pid: int) -> int | None:
    """The uid that owns the files a process creates (its filesystem uid, /proc/PID/status's
    fourth `Uid:` field), or None if it is gone. Not the owner of /proc/PID, which is its
    effective uid (the files inside are root's for a process that is not dumpable)."""
    try:
        status = (PROC / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("Uid:"):
            fields = line.split()
            return int(fields[4]) if len(fields) == 5 else None
    return None


def describe(ref: ProcessRef) -> ProcessDescription:
    return ProcessDescription(
        pid=ref.pid,
        start_time=start_time_epoch(ref),
        state=state_of(ref.pid),
        comm=comm_of(ref.pid),
        # Shown (records, status, the followed switch): its owner chose it, escaped.
        cmdline=[printable(a) for a in cmdline_of(ref.pid)],
        cgroup=shown_path(cgroup_of(ref.pid)),
    )


def all_pids() -> list[int]:
    return [int(n) for n in os.listdir(PROC) if n.isdigit()]


def children_map() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for pid in all_pids():
        tree.setdefault(ppid_of(pid), []).append(pid)
    return tree


def children_of(pid: int) -> list[int] | None:
    """Direct children from /proc/PID/task/*/children (cost: the size of the tree, not of the
    host); None if the kernel does not provide the file (CONFIG_PROC_CHILDREN)."""
    try:
        tasks = os.listdir(PROC / str(pid) / "task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tasks:
        try:
            out += [
                int(c) for c in (PROC / str(pid) / "task" / tid / "children").read_text().split()
            ]
        except FileNotFoundError:
            if not (PROC / str(pid) / "task" / tid).exists():
                continue  # the thread ended
            return None
        except OSError:
            continue
    return out


def descendants(root: int, tree: dict[int, list[int]] | None = None) -> list[int]:
    if tree is None and children_of(root) is not None:

        def kids(pid: int) -> list[int]:
            return children_of(pid) or []
    else:
        full = tree if tree is not None else children_map()

        def kids(pid: int) -> list[int]:
            return full.get(pid, [])

    # Breadth first: where a reader keeps only the first N, it keeps the processes nearest the
    # root (every rank before a rank's compile pool).
    out, todo = [], collections.deque(kids(root))
    while todo:
        pid = todo.popleft()
        out.append(pid)
        todo.extend(kids(pid))
    return out


def ancestors(pid: int) -> list[int]:
    """PIDs from `pid`'s parent up to PID 1."""
    out = []
    while pid > 1:
        pid = ppid_of(pid)
        if pid <= 0:
            break
        out.append(pid)
    return out


def now_ticks() -> int:
    """Now, in the clock of a process's start time (/proc/PID/stat's clock ticks since boot)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * _CLK_TCK)


class PidHandle:
    """A pidfd for a process whose identity was checked after opening it."""

    def __init__(self, ref: ProcessRef, fd: int) -> None:
        self.ref = ref
        self.fd = fd

    @classmethod
    def open(cls, ref: ProcessRef) -> PidHandle | str:
        """The handle, or a SignalResult string saying why there is none."""
        try:
            fd = os.pidfd_open(ref.pid)
        except (ProcessLookupError, FileNotFoundError):
            # ESRCH; ENOENT on this CI's Linux 6.18 for a process that just ended (seen in a
            # sandbox's teardown, where it failed a CI run): gone either way.
            return SignalResult.GONE
        # The pidfd now pins whatever process has this PID; if it started at another time it
        # is not the one we meant.
        if start_ticks(ref.pid) != ref.start_ticks:
            os.close(fd)
            return SignalResult.RECYCLED
        return cls(ref, fd)

    def send(self, sig: int) -> str:
        try:
            signal.pidfd_send_signal(self.fd, sig)
        except ProcessLookupError:
            return SignalResult.GONE
        return SignalResult.DELIVERED

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> PidHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def send_signal(ref: ProcessRef, sig: int) -> str:
    """Signal exactly the process `ref` names; returns a SignalResult string."""
    handle = PidHandle.open(ref)
    if isinstance(handle, str):
        return handle
    with handle:
        return handle.send(sig)
