"""Which files a process has open and mapped, compared by identity rather than by path.

A path a process's descriptor or mapping shows is its own view: from a chroot, a container, a
bind mount or a hard link it differs from the host's. Files are compared as the kernel knows
them (`file_key`), and device nodes as their driver does (the GPU port's `node_key`), so a node
in a container's own /dev is the host's GPU. Only names like the wanted files' (or, in maps,
like a device file) are looked at closer: a stat of any open file could hang on a dead network
mount.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from kimi_supervisor.ports.processes import PROC


def open_paths(pid: int) -> Iterator[tuple[int, str]]:
    """(fd, target) for each open descriptor of `pid`; nothing if it is gone or unreadable."""
    fd_dir = PROC / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return
    for name in names:
        with contextlib.suppress(OSError):
            yield int(name), os.readlink(fd_dir / name)


Key = tuple[object, ...]
# How a GPU's driver tells its device nodes apart, given a node's stat (and a path to it that can
# be read): the GpuPort's `node_key`. None: by `file_key`, as the kernel does.
NodeKey = Callable[[str, os.stat_result], Key | None]
# A device file's basename, as the NVIDIA driver's nodes are named (nvidia0..N, nvidiactl,
# nvidia-uvm, nvidia-modeset ...), in a container's /dev as on the host.
DEVICE_NAME = b"nvidia"


def file_key(st: os.stat_result) -> Key:
    """A file as the kernel knows it: a character device by its device number (one driver node,
    whatever /dev it sits in), anything else by its file system and inode."""
    return (0, st.st_rdev) if stat.S_ISCHR(st.st_mode) else (1, st.st_dev, st.st_ino)


@dataclass(frozen=True)
class _Identities:
    keys: dict[Key, str]  # each path's file_key, and its node_key where that differs
    tokens: dict[bytes, str]  # its /proc/PID/maps token (" MAJ:MIN INODE ")
    names: frozenset[str]  # its basename
    node_key: NodeKey | None

    def of(self, path: str, st: os.stat_result) -> str | None:
        """Which of the paths the file `st` (read at `path`) is: by file_key, else by the
        driver's node_key (a node of the same device at another inode)."""
        hit = self.keys.get(file_key(st))
        if hit is None and self.node_key is not None:
            alias = self.node_key(path, st)
            hit = self.keys.get(alias) if alias is not None else None
        return hit


@functools.lru_cache(maxsize=64)
def _identities(paths: frozenset[str], _second: int, node_key: NodeKey | None) -> _Identities:
    """For `paths`: their identities, their maps tokens, their names. Cached for the current
    second: a scan asks for the same files for every process, and a device node made again (a
    driver reload) is seen a second later at most."""
    keys: dict[Key, str] = {}
    tokens: dict[bytes, str] = {}
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        keys[file_key(st)] = p
        alias = node_key(p, st) if node_key is not None else None
        if alias is not None:
            keys.setdefault(alias, p)
        dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
        tokens[f" {dev} {st.st_ino} ".encode()] = p
    return _Identities(keys, tokens, frozenset(os.path.basename(p) for p in paths), node_key)


def _ids(paths: Iterable[str], node_key: NodeKey | None) -> _Identities:
    return _identities(frozenset(paths), int(time.monotonic()), node_key)


def holds_any(pid: int, paths: Iterable[str], node_key: NodeKey | None = None) -> set[str]:
    """Which of `paths` `pid` has open. Compared by identity, not by the path its descriptors
    show: from a chroot, a container or through a bind mount or a hard link that path differs.
    Only descriptors named like one of `paths` are looked at closer (a stat of any open file
    could hang on a dead network mount)."""
    ids = _ids(paths, node_key)
    found: set[str] = set()
    fd_dir = PROC / str(pid) / "fd"
    for fd, target in open_paths(pid):
        if os.path.basename(target.removesuffix(" (deleted)")) not in ids.names:
            continue
        link = str(fd_dir / str(fd))
        try:
            path = ids.of(link, os.stat(link))
        except OSError:
            continue
        if path is not None:
            found.add(path)
    return found


def maps_any(pid: int, prefix: str) -> set[str]:
    """Files under `prefix` that `pid` has mapped (a mapping outlives the descriptor)."""
    found: set[str] = set()
    try:
        with open(PROC / str(pid) / "maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[5:]
                if path and path[0].startswith(prefix):
                    found.add(path[0].removesuffix(" (deleted)"))
    except OSError:
        pass
    return found


_SOCKET = re.compile(r"socket:\[(\d+)\]")


def held_under(pid: int, prefixes: Iterable[str]) -> tuple[set[Key], set[int]]:
    """What `pid` has open or mapped under `prefixes` (directories, each ending in "/"), by
    identity (`file_key`), and the inodes of every socket it has open. The path a descriptor or
    a mapping shows (the process's own view: a private /tmp, a container) only chooses what to
    look at: the identity is the descriptor's own stat, or the device and inode its maps line
    names. Nothing if it is gone or unreadable."""
    wanted = tuple(prefixes)
    keys: set[Key] = set()
    sockets: set[int] = set()
    fd_dir = PROC / str(pid) / "fd"
    for fd, target in open_paths(pid):
        m = _SOCKET.fullmatch(target)
        if m:
            sockets.add(int(m.group(1)))
        elif target.startswith(wanted):
            with contextlib.suppress(OSError):
                keys.add(file_key(os.stat(fd_dir / str(fd))))
    try:
        with open(PROC / str(pid) / "maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.rstrip("\n").split(maxsplit=5)
                if len(fields) < 6 or not fields[5].startswith(wanted):
                    continue
                with contextlib.suppress(ValueError):
                    major, minor = (int(x, 16) for x in fields[3].split(":"))
                    keys.add((1, os.makedev(major, minor), int(fields[4])))
    except OSError:
        pass
    return keys, sockets


_DEVICE_LINE = re.compile(rb"^[^\n]*/" + DEVICE_NAME + rb"[^/\n]*$", re.MULTILINE)


def maps_of(pid: int, wanted: Iterable[str], node_key: NodeKey | None = None) -> set[str] | None:
    """Which of `wanted` files `pid` has mapped, by identity (None: its maps cannot be read).

    Each mapping line names its file's device and inode (" MAJ:MIN INODE "), whatever path it
    shows; a CUDA process maps thousands of files, so these tokens are searched for in the raw
    text. A device node in the process's own /dev (a container's, a chroot's) is another inode
    with the same device number: a line named like a device file that no token matched is
    resolved through the process's own root (/proc/PID/root, then the path as shown, for a
    chroot), taken only if the file found there is the very inode the line names, and compared
    by its device number."""
    ids = _ids(wanted, node_key)
    try:
        data = (PROC / str(pid) / "maps").read_bytes()
    except OSError:
        return None
    found = {p for token, p in ids.tokens.items() if token in data}
    if (b"/" + DEVICE_NAME) not in data or len(found) == len(ids.tokens):
        return found
    for m in _DEVICE_LINE.finditer(data):
        fields = m.group().split(maxsplit=5)
        if len(fields) < 6 or any(t in m.group() for t in ids.tokens):
            continue
        hit = _resolve_mapped(pid, fields[3], fields[4], shown=fields[5], ids=ids)
        if hit is not None:
            found.add(hit)
    return found


def device_maps_lines(pid: int, max_read: int, max_keep: int) -> tuple[list[str], int, int] | None:
    """The lines of /proc/PID/maps that map a file named like a device file (`DEVICE_NAME`,
    the rule `maps_of` reads a line by), as the kernel wrote them, for a person to read: at most
    `max_keep` bytes of them, and no more than `max_read` bytes of the file read (a CUDA process
    maps thousands of files; another's may map millions). Returns the lines, the bytes of
    matching lines not kept, and the bytes of the file not read (0 when read whole); None when
    the maps cannot be read (gone, another namespace's, hidepid)."""
    kept: list[str] = []
    size, dropped, rest, partial = 0, 0, 0, b""
    try:
        with open(PROC / str(pid) / "maps", "rb", buffering=0) as f:
            read = 0
            while True:
                chunk = f.read(min(1 << 16, max_read - read)) if read < max_read else b""
                if not chunk:
                    if read >= max_read:
                        rest = len(f.read(1 << 16))  # at least this much more, unread
                    break
                read += len(chunk)
                *lines, partial = (partial + chunk).split(b"\n")
                for line in lines:
                    if _DEVICE_LINE.fullmatch(line) is None:
                        continue
                    if size + len(line) + 1 > max_keep:
                        dropped += len(line) + 1
                        continue
                    size += len(line) + 1
                    kept.append(line.decode(errors="backslashreplace"))
    except OSError:
        return None
    return kept, dropped, rest


def _resolve_mapped(
    pid: int, dev: bytes, inode: bytes, *, shown: bytes, ids: _Identities
) -> str | None:
    try:
        major, minor = (int(x, 16) for x in dev.split(b":"))
        ino = int(inode)
        path = os.fsdecode(shown.removesuffix(b" (deleted)"))
    except ValueError:
        return None
    if not path.startswith("/"):
        return None
    for candidate in (f"{PROC}/{pid}/root{path}", path):
        try:
            st = os.lstat(candidate)
        except (OSError, ValueError):
            continue
        if st.st_ino == ino and st.st_dev == os.makedev(major, minor):
            return ids.of(candidate, st)
    return None
