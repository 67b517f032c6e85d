"""What a stopped vLLM leaves behind on the host, found and removed: its shared-memory segments,
its temporary files, and its ZMQ IPC sockets (the teardown's HOST_LEFTOVERS step).

The daemon runs as root, and these directories are shared by every program on the host: the
names alone prove nothing (`psm_*` and `sem.mp-*` are Python multiprocessing's names for any
program). An entry is removed only if all of these hold:
- its name matches a configured pattern (or, in the tmp directory, it is a Unix socket named by
  a UUID), and it is not a link;
- it belongs to vLLM's user: the user its unit runs it as (`User=`, as systemd says: the
  package's `kimi-vllm`) or the owner of one of vLLM's processes when the teardown began; and
  everything inside a directory does too;
- when that owner is root (vLLM run as root anyway, so that every root program's files carry
  its owner), it is vLLM's by identity as well: a process of vLLM's tree had it (a directory:
  something inside it) open or mapped when the teardown began, compared by device and inode,
  or had it bound (a socket, by the path /proc/net/unix names); or its name begins with a PID of
  vLLM's tree (`<pid>-tp:0-0-cpushm_N` of the CPU build);
- it is vLLM's by time: created or changed since its unit last left `inactive` (systemd's
  InactiveExitTimestamp; else since vLLM's oldest process started, else since boot); or its
  name begins with a PID of vLLM's tree;
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
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kimi_supervisor.config import TeardownConfig
from kimi_supervisor.ports import openfiles, processes
from kimi_supervisor.ports.openfiles import Key
from kimi_supervisor.ports.processes import ProcessRef
from kimi_supervisor.ports.sockets import bound_unix_paths, unix_paths_by_inode
from kimi_supervisor.teardown.events import EventSink, LeftoverKept, LeftoversUnlisted

# A ZMQ IPC socket of vLLM: `$TMPDIR/<uuid4>` (vllm/utils/network_utils.py get_open_zmq_ipc_path).
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# A name that begins with its maker's PID: the CPU build's `<pid>-tp:0-0-cpushm_N`. Only there:
# digits elsewhere in a name (`psm_a1234b`, random hex) say nothing about who made it.
_PID_FIRST = re.compile(r"(\d+)-")
# A directory with more entries than this is not judged (kept): its walk is bounded.
MAX_ENTRIES = 10_000
# Kept leftovers that are not provably vLLM's are logged one by one up to this many a teardown,
# the most recently changed first, the rest as a count: another program's files in /dev/shm
# would otherwise add a line each to every teardown's log (a hundred of them, left by vLLM's CPU
# build on a test host), and the same old ones would hide a new one.
FOREIGN_LISTED = 20
ROOT = 0
ROOTS_RULE = (
    "owned by root, and vLLM runs as root: only what its processes held when the teardown "
    "began, or what names one of their PIDs, is provably vLLM's"
)


@dataclass(frozen=True)
class Owner:
    """Whose leftovers these are: vLLM's user(s), since when, and its tree's PIDs; with root
    among the users, what the tree held in the leftovers directories when the teardown began."""

    uids: frozenset[int]
    since: float  # epoch seconds: entries unchanged since before this are not this vLLM's
    pids: frozenset[int] = field(default_factory=frozenset)
    held: frozenset[Key] = field(default_factory=frozenset)  # files, by identity
    bound: frozenset[str] = field(default_factory=frozenset)  # sockets, by path

    @classmethod
    def of(
        cls,
        tree: list[ProcessRef],
        activated_at: float | None = None,
        unit_uid: int | None = None,
        *,
        dirs: Iterable[Path] = (),
    ) -> Owner:
        """From vLLM's processes when the teardown began (their users, and with root among
        them what they held under `dirs`), the user its unit runs it as (`unit_uid`: None if
        unknown), and when its unit last left inactive (`activated_at`: everything vLLM made
        since, its API server's too, even after that one died); without the unit's time, the
        oldest process's start, else this boot."""
        uids = {u for u in map(processes.uid_of, (r.pid for r in tree)) if u is not None}
        if unit_uid is not None:
            uids.add(unit_uid)
        if activated_at is not None:
            since = activated_at
        elif tree:
            since = min(processes.started_at(r) for r in tree)
        else:
            since = processes.boot_time()
        held: set[Key] = set()
        bound: set[str] = set()
        if ROOT in uids and tree:
            prefixes = [str(d).rstrip("/") + "/" for d in dirs]
            inodes: set[int] = set()
            for r in tree:
                keys, sockets = openfiles.held_under(r.pid, prefixes)
                held |= keys
                inodes |= sockets
            paths = unix_paths_by_inode() if inodes else {}
            bound = {paths[i] for i in inodes if i in paths}
        return cls(
            frozenset(uids),
            since,
            frozenset(r.pid for r in tree),
            frozenset(held),
            frozenset(bound),
        )

    def names_pid(self, name: str) -> bool:
        m = _PID_FIRST.match(name)
        return m is not None and int(m.group(1)) in self.pids

    def why_not(
        self,
        path: Path,
        st: os.stat_result,
        inside: list[tuple[Path, os.stat_result]] | None = None,
    ) -> str | None:
        """Why `path` (lstat `st`) is not provably vLLM's; None if it is. A directory is judged
        whole only with what is `inside` it (before that, by its own owner and time)."""
        if not self.uids:
            return "vLLM's user is unknown (its unit's user has no entry here, and no vLLM ran)"
        if st.st_uid not in self.uids:
            users = ", ".join(map(str, sorted(self.uids)))
            return f"owned by uid {st.st_uid}, not vLLM's user ({users})"
        for p, s in inside or []:
            if s.st_uid not in self.uids:
                return f"{p} inside it is owned by uid {s.st_uid}"
        names_pid = self.names_pid(path.name)
        if st.st_ctime < self.since and not names_pid:
            return "older than vLLM's start and names no PID of its tree"
        judged_whole = inside is not None or not stat.S_ISDIR(st.st_mode)
        if (
            st.st_uid == ROOT
            and judged_whole
            and not names_pid
            and not self._held(path, st, inside)
        ):
            return ROOTS_RULE
        return None

    def _held(
        self, path: Path, st: os.stat_result, inside: list[tuple[Path, os.stat_result]] | None
    ) -> bool:
        if stat.S_ISSOCK(st.st_mode):
            return str(path) in self.bound
        if stat.S_ISDIR(st.st_mode):
            return any(openfiles.file_key(s) in self.held for _p, s in inside or [])
        return openfiles.file_key(st) in self.held


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


def remove(t: TeardownConfig, removed: list[str], on_event: EventSink, *, owner: Owner) -> str:
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
        if why == GONE:
            found.discard(path)
        elif why is not None:
            foreign[path] = why
    kept = in_use(found - set(foreign))
    for path in sorted(foreign, key=_changed, reverse=True)[:FOREIGN_LISTED]:  # newest first
        on_event(LeftoverKept(str(path), f"not provably vLLM's: {foreign[path]}"))
    if len(foreign) > FOREIGN_LISTED:
        on_event(LeftoversUnlisted(len(foreign) - FOREIGN_LISTED, "not provably vLLM's"))
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


GONE = "gone"


def _changed(path: Path) -> float:
    try:
        return os.lstat(path).st_ctime
    except FileNotFoundError:
        return 0.0


def _why_not_vllms(path: Path, owner: Owner) -> str | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return GONE
    why = owner.why_not(path, st)
    if why is not None or not stat.S_ISDIR(st.st_mode):
        return why
    inside = _inside(path)
    if inside is None:
        return f"a directory of more than {MAX_ENTRIES} entries"
    return owner.why_not(path, st, inside)
