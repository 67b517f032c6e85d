"""What a stopped vLLM leaves behind on the host, found and removed: its shared-memory segments,
its temporary files, and its ZMQ IPC sockets (the teardown's HOST_LEFTOVERS step).

An entry is removed only if its name matches a configured pattern (or, in the tmp directory, it is
a Unix socket named by a UUID), it is not a link, and no live process has it open, mapped or bound.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import stat
from pathlib import Path

from kimi_supervisor.config import TeardownConfig
from kimi_supervisor.ports import openfiles, processes
from kimi_supervisor.ports.sockets import bound_unix_paths
from kimi_supervisor.teardown.events import EventSink, LeftoverKept

# A ZMQ IPC socket of vLLM: `$TMPDIR/<uuid4>` (vllm/utils/network_utils.py get_open_zmq_ipc_path).
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


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


def in_use(paths: set[Path]) -> set[Path]:
    """Which of `paths` a live process has open or mapped, or (a socket) has bound. A socket's
    users show as `socket:[inode]`, never by path: only /proc/net/unix says whether it is bound,
    and the walk over every process (tens of ms on a busy host) is left for the other files."""
    sockets = set()
    for p in paths:
        try:
            if stat.S_ISSOCK(os.lstat(p).st_mode):
                sockets.add(str(p))
        except FileNotFoundError:
            pass
    used = sockets & bound_unix_paths() if sockets else set()
    files = {str(p) for p in paths} - sockets
    prefixes = {str(Path(p).parent) + "/" for p in files}
    for pid in processes.all_pids() if files else []:
        for _fd, target in openfiles.open_paths(pid):
            if target.removesuffix(" (deleted)") in files:
                used.add(target.removesuffix(" (deleted)"))
        for prefix in prefixes:
            used |= openfiles.maps_any(pid, prefix) & files
    return {Path(p) for p in used}


def remove(t: TeardownConfig, removed: list[str], on_event: EventSink) -> str:
    """Remove the leftovers `t` names that nothing uses (appending each to `removed`); the step's
    note."""
    found = leftovers(t.shm_dir, t.shm_patterns)
    if t.tmp_dir is not None:
        found |= leftovers(t.tmp_dir, t.tmp_patterns, ipc_sockets=True)
    if not found:
        return "no leftovers"
    kept = in_use(found)
    for path in sorted(found - kept):
        try:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(str(path))
        except FileNotFoundError:
            pass
        except OSError as e:
            on_event(LeftoverKept(str(path), str(e)))
    note = f"; {len(kept)} still in use, kept" if kept else ""
    return f"{len(removed)} leftover(s) removed{note}"
