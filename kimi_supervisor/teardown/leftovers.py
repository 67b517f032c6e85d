"""What a stopped vLLM leaves behind on the host, found and removed: its shared-memory segments,
its temporary files, and its ZMQ IPC sockets (the teardown's HOST_LEFTOVERS step).

The daemon runs as root, and these directories are shared by every program on the host: the
names alone prove nothing (`psm_*` and `sem.mp-*` are Python multiprocessing's names for any
program). An entry is removed only if all of these hold:
- its name matches a configured pattern (or, in the tmp directory, it is a Unix socket named by
  a UUID), and it is not a link;
- it belongs to vLLM's user: the owner of vLLM's processes when the teardown began, else the
  unit's user as the teardown runs (root for the shipped unit), and everything inside a
  directory does too;
- it is vLLM's by time: created or changed since its unit last left `inactive` (systemd's
  InactiveExitTimestamp; else since vLLM's oldest process started, else since boot); or its
  name carries a PID of vLLM's tree (`<pid>-tp:0-0-cpushm_N` of the CPU build);
- no live process has it, or anything inside it, open, mapped or bound.
Directories are judged by their contents (at most MAX_ENTRIES of them, links never followed);
an entry that fails any rule is kept and reported.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from kimi_supervisor.config import TeardownConfig
from kimi_supervisor.ports import openfiles, processes
from kimi_supervisor.ports.processes import ProcessRef
from kimi_supervisor.ports.sockets import bound_unix_paths
from kimi_supervisor.teardown.events import EventSink, LeftoverKept

# A ZMQ IPC socket of vLLM: `$TMPDIR/<uuid4>` (vllm/utils/network_utils.py get_open_zmq_ipc_path).
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_DIGITS = re.compile(r"\d+")
# A directory with more entries than this is not judged (kept): its walk is bounded.
MAX_ENTRIES = 10_000


@dataclass(frozen=True)
class Owner:
    """Whose leftovers these are: vLLM's user(s), since when, and its tree's PIDs."""

    uids: frozenset[int]
    since: float  # epoch seconds: entries unchanged since before this are not this vLLM's
    pids: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def of(cls, tree: list[ProcessRef], activated_at: float | None = None) -> Owner:
        """From vLLM's processes when the teardown began (their users) and when its unit last
        left inactive (`activated_at`: everything vLLM made since, its API server's too, even
        after that one died); without the unit's time, the oldest process's start, else this
        boot. With no process, the unit's user as this teardown runs (its own uid)."""
        uids = {u for u in map(processes.uid_of, (r.pid for r in tree)) if u is not None}
        if activated_at is not None:
            since = activated_at
        elif tree:
            since = min(processes.started_at(r) for r in tree)
        else:
            since = processes.boot_time()
        return cls(frozenset(uids or {os.geteuid()}), since, frozenset(r.pid for r in tree))

    def why_not(self, path: Path, st: os.stat_result) -> str | None:
        """Why `path` (lstat `st`) is not provably vLLM's; None if it is."""
        if st.st_uid not in self.uids:
            users = ", ".join(map(str, sorted(self.uids)))
            return f"owned by uid {st.st_uid}, not vLLM's user ({users})"
        names_pid = any(int(d) in self.pids for d in _DIGITS.findall(path.name))
        if st.st_ctime < self.since and not names_pid:
            return "older than vLLM's start and names no PID of its tree"
        return None


def leftovers(directory: Path, patterns: list[str], ipc_sockets: bool = False) -> set[Path]:
    """Entries of `directory` (not below it) named by one of `patterns`, and with `ipc_sockets`
    the Unix sockets named by a UUID: what a stopped vLLM may leave behind. Links are never
    candidates: the daemon runs as root and removes only what it expected."""
    found: set[Path] = set()
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return found
    for e in entries:
        if e.is_symlink():
            continue
        if any(fnmatch.fnmatch(e.name, p) for p in patterns):
            found.add(Path(e.path))
        elif ipc_sockets and _UUID.fullmatch(e.name):
            try:
                if stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode):
                    found.add(Path(e.path))
            except FileNotFoundError:
                pass
    return found


def _inside(directory: Path) -> list[tuple[Path, os.stat_result]] | None:
    """Everything below `directory`, links not followed; None past MAX_ENTRIES."""
    out: list[tuple[Path, os.stat_result]] = []
    for root, dirs, files in os.walk(directory, followlinks=False):
        for name in dirs + files:
            p = Path(root, name)
            try:
                out.append((p, os.lstat(p)))
            except FileNotFoundError:
                continue
            if len(out) > MAX_ENTRIES:
                return None
    return out


def in_use(paths: set[Path]) -> set[Path]:
    """Which of `paths` a live process has open or mapped (a directory: anything inside it), or
    (a socket) has bound. A socket's users show as `socket:[inode]`, never by path: only
    /proc/net/unix says whether it is bound, and the walk over every process (tens of ms on a
    busy host) is left for the other files."""
    sockets, dirs = set(), set()
    for p in paths:
        try:
            mode = os.lstat(p).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISSOCK(mode):
            sockets.add(str(p))
        elif stat.S_ISDIR(mode):
            dirs.add(str(p))
    used = sockets & bound_unix_paths() if sockets else set()
    files = {str(p) for p in paths} - sockets - dirs
    prefixes = {str(Path(p).parent) + "/" for p in files} | {d + "/" for d in dirs}

    def owner(target: str) -> str | None:
        if target in files:
            return target
        return next((d for d in dirs if target.startswith(d + "/")), None)

    for pid in processes.all_pids() if files or dirs else []:
        for _fd, target in openfiles.open_paths(pid):
            hit = owner(target.removesuffix(" (deleted)"))
            if hit is not None:
                used.add(hit)
        for prefix in prefixes:
            for mapped in openfiles.maps_any(pid, prefix):
                hit = owner(mapped)
                if hit is not None:
                    used.add(hit)
    return {Path(p) for p in used}


def remove(t: TeardownConfig, removed: list[str], on_event: EventSink, owner: Owner) -> str:
    """Remove the leftovers `t` names that are provably vLLM's and that nothing uses (appending
    each to `removed`); the step's note."""
    found = leftovers(t.shm_dir, t.shm_patterns)
    if t.tmp_dir is not None:
        found |= leftovers(t.tmp_dir, t.tmp_patterns, ipc_sockets=True)
    if not found:
        return "no leftovers"
    foreign: dict[Path, str] = {}
    for path in sorted(found):
        why = _why_not_vllms(path, owner)
        if why is not None:
            foreign[path] = why
    kept = in_use(found - set(foreign))
    for path, why in foreign.items():
        on_event(LeftoverKept(str(path), f"not provably vLLM's: {why}"))
    for path in sorted(found - kept - set(foreign)):
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(str(path))
        except FileNotFoundError:
            pass
        except OSError as e:
            on_event(LeftoverKept(str(path), str(e)))
    note = f"; {len(kept)} still in use, kept" if kept else ""
    if foreign:
        note += f"; {len(foreign)} not provably vLLM's, kept"
    return f"{len(removed)} leftover(s) removed{note}"


def _why_not_vllms(path: Path, owner: Owner) -> str | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "gone"
    why = owner.why_not(path, st)
    if why is not None or not stat.S_ISDIR(st.st_mode):
        return why
    inside = _inside(path)
    if inside is None:
        return f"a directory of more than {MAX_ENTRIES} entries"
    for p, s in inside:
        if s.st_uid not in owner.uids:
            return f"{p} inside it is owned by uid {s.st_uid}"
    return None
