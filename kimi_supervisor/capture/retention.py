"""Which capture folders in `profiling.captures_dir` are kept, oldest first by creation.

A folder's name starts with the UTC time its capture began, but that name is a clock's: after
the clock is stepped back (NTP, a wrong RTC at boot) a new capture's name sorts before older
ones, and ordering by name would remove the capture just taken. So the order of creation is
kept in ORDER, a file of the daemon's in captures_dir, one folder name per line, appended when
a folder is made. Folders it does not list (made before it existed) count as older than every
listed one, in the order of their names.

What retention may remove, whatever else is in captures_dir: only a directory (never a link)
named as the daemon names captures (ID), and never the capture just taken. A capture's size is
the blocks it takes on disk, not its files' apparent sizes: its asker owns it, and vLLM's user
wrote its traces; either could make a sparse file of a terabyte that takes nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from pathlib import Path

ORDER = ".order"
ID = re.compile(r"\d{8}T\d{6}\.\d{3}Z")
# ORDER holds one 21-byte line per folder kept (keep_captures <= 10,000): read no more than this.
MAX_ORDER_BYTES = 1 << 20
# A capture holds a few files per rank: the size of one is counted over at most this many names.
MAX_WALK = 100_000


def record(captures_dir: Path, name: str) -> None:
    """Append `name` (a folder just made) to ORDER."""
    fd = os.open(
        captures_dir / ORDER,
        os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o640,
    )
    try:
        os.write(fd, f"{name}\n".encode())
    finally:
        os.close(fd)


def _listed(captures_dir: Path) -> list[str]:
    try:
        fd = os.open(captures_dir / ORDER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return []
        raw = os.read(fd, MAX_ORDER_BYTES)
    finally:
        os.close(fd)
    seen: dict[str, None] = {}
    for line in raw.decode("ascii", "replace").splitlines():
        if ID.fullmatch(line):
            seen.setdefault(line)
    return list(seen)


def _is_capture(captures_dir: Path, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(captures_dir / name).st_mode)
    except OSError:
        return False


def oldest_first(captures_dir: Path) -> list[Path]:
    """The capture folders, oldest first by creation (see the module's docstring)."""
    try:
        names = {n for n in os.listdir(captures_dir) if ID.fullmatch(n)}
    except FileNotFoundError:
        return []
    present = {n for n in names if _is_capture(captures_dir, n)}
    listed = [n for n in _listed(captures_dir) if n in present]
    unlisted = sorted(present.difference(listed))
    return [captures_dir / n for n in unlisted + listed]


def _rewrite(captures_dir: Path, names: list[str]) -> None:
    """ORDER with only the folders still there (it stays as short as what is kept)."""
    tmp = captures_dir / f".order.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    try:
        os.write(fd, "".join(f"{n}\n" for n in names).encode())
    finally:
        os.close(fd)
    os.replace(tmp, captures_dir / ORDER)


def _size(d: Path, counted: set[tuple[int, int]]) -> int:
    """The bytes `d` takes on disk: blocks allocated, never the apparent size (a sparse file of
    1 TB takes none, and must not push every other capture out), and each file once however
    many names it has here or in another capture (`counted`: the files already counted; one
    file linked 2,000 times takes its blocks once). Walked by descriptor, no link followed; at
    most MAX_WALK names are looked at (a capture holds a few per rank; its asker owns it and
    may fill it with names), what lies beyond is not counted."""
    total, seen = 0, 0
    try:
        for _top, _dirs, files, dir_fd in os.fwalk(d, follow_symlinks=False):
            for name in files:
                seen += 1
                if seen > MAX_WALK:
                    return total  # the walk's descriptors close with its generator
                with contextlib.suppress(OSError):
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in counted:
                        counted.add((st.st_dev, st.st_ino))
                        total += st.st_blocks * 512
    except OSError:
        pass
    return total


def retention(captures_dir: Path, keep: int, max_total_gb: float, *, newest: str) -> list[str]:
    """Remove the oldest captures beyond `keep`, then beyond `max_total_gb`, never `newest`
    (the capture just taken); returns what went."""
    folders = oldest_first(captures_dir)
    removable = [f for f in folders if f.name != newest]
    removed: list[str] = []

    def drop() -> None:
        old = removable.pop(0)
        folders.remove(old)
        shutil.rmtree(old, ignore_errors=True)  # fd-based: never follows a link inside
        removed.append(str(old))

    while len(folders) > keep and removable:
        drop()
    if max_total_gb > 0:
        counted: set[tuple[int, int]] = set()
        sizes = {f: _size(f, counted) for f in folders}
        while removable and sum(sizes[f] for f in folders) > max_total_gb * 1e9:
            drop()
    if removed or len(_listed(captures_dir)) > len(folders):
        with contextlib.suppress(OSError):
            _rewrite(captures_dir, [f.name for f in folders])
    return removed
