"""The page cache: how much memory the host has to spare, a model's files, and reading them so
that the kernel keeps them cached for the next vLLM's load.

Reading is all this does to a file: no write, no mmap, no lock. The daemon runs as root and the
model's folder may be another user's, so each file is opened without following a link at its
last component unless the link stays inside the folder's own tree (Hugging Face's snapshots link
to ../../blobs), checked to be a regular file on the descriptor it reads (never a FIFO or a
device, which could block or never end), and read at most to the size it had when opened.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CHUNK = 16 << 20  # one read; a stop is seen between two


class PageCacheError(Exception):
    pass


@dataclass(frozen=True)
class Memory:
    available: int  # MemAvailable, bytes
    total: int  # MemTotal


def memory(meminfo: Path = Path("/proc/meminfo")) -> Memory:
    fields: dict[str, int] = {}
    try:
        for line in meminfo.read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("MemAvailable", "MemTotal"):
                fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError) as e:
        raise PageCacheError(f"cannot read {meminfo}: {e}") from None
    if len(fields) != 2:
        raise PageCacheError(f"{meminfo} has no MemAvailable or MemTotal")
    return Memory(fields["MemAvailable"], fields["MemTotal"])


@dataclass(frozen=True)
class File:
    path: Path
    size: int


def files_in(folder: Path, tree: Path | None = None) -> list[File]:
    """The regular files directly in `folder` (its sub-folders are not vLLM's to read), sorted
    by name. A link is followed only when its target is inside `tree` (default: `folder`)."""
    tree = (tree or folder).resolve()
    out: list[File] = []
    try:
        entries = list(os.scandir(folder))
    except OSError as e:
        raise PageCacheError(f"cannot list {folder}: {e}") from None
    for entry in entries:
        try:
            if entry.is_symlink():
                target = Path(entry.path).resolve()
                if not target.is_relative_to(tree):
                    continue
                st = target.stat()
            else:
                st = entry.stat(follow_symlinks=False)
        except (OSError, RuntimeError):
            continue
        if stat.S_ISREG(st.st_mode):
            out.append(File(Path(entry.path), st.st_size))
    return sorted(out, key=lambda f: f.path.name)


def read_through(
    file: File, stopped: Callable[[], bool], done: Callable[[int], None], buffer: bytearray
) -> int:
    """Read `file` to its end (or its size when it was listed, whichever comes first), so that
    its pages are cached; `done(n)` after each chunk. Returns the bytes read; stops between two
    chunks once `stopped()` says so."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(file.path, flags)
    except OSError:
        return 0
    total = 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return 0
        limit = min(st.st_size, file.size)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        view = memoryview(buffer)
        while total < limit and not stopped():
            n = os.readv(fd, [view[: min(len(buffer), limit - total)]])
            if n <= 0:
                break
            total += n
            done(n)
    except OSError:
        pass
    finally:
        os.close(fd)
    return total


def evict(path: Path) -> None:
    """Drop one file's pages from the page cache (the bench's cold start for that file alone,
    where /proc/sys/vm/drop_caches would drop every file of the host)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
