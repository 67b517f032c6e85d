"""Opening, as root, a file that another user can change: the file opened is the file judged.

The daemon reads folders that are not its own: a model's folder and the hub's cache (the
warming, ports/pagecache.py), vLLM's trace folder and a capture's folder (capture/job.py, the
summary). Their owner may rename a link, a FIFO or a device over a file between the listing and
the open. So every file is:
1. reached from a folder's descriptor, never through a link: openat2 with RESOLVE_BENEATH |
   RESOLVE_NO_SYMLINKS (Linux 5.6); where openat2 is missing (ENOSYS) or filtered (EPERM), one
   component at a time, each with O_NOFOLLOW, and `..` refused;
2. first opened with O_PATH, which opens nothing: no driver's open runs (a watchdog device acts
   on open), a FIFO does not block, no IN_OPEN is reported;
3. judged on that descriptor (fstat): a regular file, and, where the caller listed it, the very
   device and inode the listing saw. Anything else is refused with the reason;
4. only then opened for reading, through /proc/self/fd/N (that very inode, whatever the path
   names by now), with O_NONBLOCK | O_NOCTTY | O_CLOEXEC, and checked again.

A device, a FIFO or a socket is therefore never opened, not even with O_NONBLOCK: its open alone
may act. `Refused` carries the reason the caller says (the skip is never silent).
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

SYS_OPENAT2 = 437  # the same number on every architecture (added after the tables merged)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class Refused(Exception):
    """Why a path was not opened: said to the operator as the skip's reason."""


@dataclass(frozen=True)
class Identity:
    """What a listing saw of a regular file: its device and inode, and its size then."""

    dev: int
    ino: int
    size: int

    @classmethod
    def of(cls, st: os.stat_result) -> Identity:
        return cls(st.st_dev, st.st_ino, st.st_size)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]  # fmt: skip


_libc = ctypes.CDLL(None, use_errno=True)
_openat2_works: bool | None = None  # None: not tried yet


def kind(mode: int) -> str:
    """What a file is, as an operator reads it."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISREG, "a regular file")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def _openat2(dir_fd: int, rel: str, flags: int) -> int | None:
    """openat2 beneath `dir_fd` with no link followed; None where openat2 cannot be used."""
    global _openat2_works
    if _openat2_works is False:
        return None
    how = _OpenHow(flags, 0, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(SYS_OPENAT2, dir_fd, os.fsencode(rel), ctypes.byref(how),
                       ctypes.sizeof(how))  # fmt: skip
    if fd >= 0:
        _openat2_works = True
        return int(fd)
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM) and not _openat2_works:
        _openat2_works = False  # an older kernel, or a seccomp filter that answers EPERM
        return None
    if err == errno.ELOOP:
        raise Refused("a symbolic link (never followed)")
    if err == errno.EXDEV:
        raise Refused("outside the folder it was listed in")
    raise Refused(os.strerror(err).lower())


def _walk(dir_fd: int, rel: str, flags: int) -> int:
    """The fallback: each component opened with O_NOFOLLOW from the one before."""
    parts = rel.split("/")
    fd = dir_fd
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            want = flags if last else os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
            try:
                nxt = os.open(part, want | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and not last:
                    raise Refused("a symbolic link (never followed)") from None
                raise Refused((e.strerror or str(e)).lower()) from None
            if fd != dir_fd:
                os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        if fd != dir_fd:
            os.close(fd)
        raise


def _check_rel(rel: str) -> str:
    if not rel or rel.startswith("/") or "\0" in rel:
        raise Refused(f"not a path inside the folder: {rel!r}")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Refused("outside the folder it was listed in")
    return "/".join(parts) or "."


def _path_fd(dir_fd: int, rel: str) -> int:
    """An O_PATH descriptor of `rel` beneath `dir_fd`, reached through no link."""
    rel = _check_rel(rel)
    flags = os.O_PATH | os.O_CLOEXEC
    fd = _openat2(dir_fd, rel, flags)
    if fd is None:
        fd = _walk(dir_fd, rel, flags)
    return fd


def identify(dir_fd: int, rel: str) -> Identity:
    """The identity of the regular file `rel` beneath `dir_fd` (for a listing), without
    opening it; Refused when it is anything else."""
    fd = _path_fd(dir_fd, rel)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode):
        raise Refused(f"{kind(st.st_mode)}, not a regular file (never opened)")
    return Identity.of(st)


def _reopen(path_fd: int, flags: int) -> int:
    try:
        return os.open(f"/proc/self/fd/{path_fd}", flags)
    except OSError as e:
        raise Refused(f"cannot be opened through /proc/self/fd: {e.strerror}") from None


def open_file(dir_fd: int, rel: str, listed: Identity | None = None) -> int:
    """`rel` beneath `dir_fd` opened for reading (the module's steps), blocking reads; only a
    regular file, and only the one `listed` when given. Refused says why not."""
    pfd = _path_fd(dir_fd, rel)
    try:
        st = os.fstat(pfd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{kind(st.st_mode)}, not a regular file (never opened)")
        if listed is not None and (st.st_dev, st.st_ino) != (listed.dev, listed.ino):
            raise Refused(
                f"replaced since it was listed (inode {listed.dev}:{listed.ino}, now "
                f"{st.st_dev}:{st.st_ino}): not the file judged"
            )
        fd = _reopen(pfd, READ_FLAGS)
    finally:
        os.close(pfd)
    again = os.fstat(fd)
    if not stat.S_ISREG(again.st_mode) or (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise Refused("changed while it was opened")
    os.set_blocking(fd, True)  # a regular file: O_NONBLOCK served the open, nothing else
    return fd


def open_dir(dir_fd: int, rel: str) -> int:
    """The folder `rel` beneath `dir_fd`, reached through no link, opened for listing."""
    pfd = _path_fd(dir_fd, rel)
    try:
        st = os.fstat(pfd)
        if not stat.S_ISDIR(st.st_mode):
            raise Refused(f"{kind(st.st_mode)}, not a folder")
        return _reopen(pfd, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    finally:
        os.close(pfd)


MAX_LINKS = 40  # as the kernel's own limit on links followed in one path


def open_root(path: Path | str) -> int:
    """The folder an operator named (config, vLLM's argv), opened as named: the anchor that
    everything beneath is reached from. Refused if it is no folder. Walked a component at a
    time without following links; a link is followed only where it sits in a folder that only
    root (or the daemon's user) can change, as sshd's StrictModes judges: `/models` ->
    `/mnt/nfs/models` made by root is followed, while a model folder its owner swapped for a
    link to a root-only folder is refused (an outside review had root read that folder)."""
    text = os.fspath(path)
    if not text.startswith("/"):
        raise Refused(f"cannot open the folder {text}: not an absolute path")
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open("/", flags | os.O_DIRECTORY)
    parts, links = [p for p in text.split("/") if p], 0
    try:
        while parts:
            name = parts.pop(0)
            if name == ".":
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError as e:
                raise Refused(f"cannot open the folder {text}: {name}: {e.strerror}") from None
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > MAX_LINKS or not _trusted(os.fstat(fd), st):
                    raise Refused(
                        f"cannot open the folder {text}: {name} is a link in a folder another "
                        "user can change (name the folder it points to)"
                    )
                target = os.readlink(name, dir_fd=fd)
                parts = [p for p in target.split("/") if p] + parts
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", flags | os.O_DIRECTORY)
                continue
            nxt = os.open(name, flags, dir_fd=fd)  # ".." too: lexically walked, as the kernel
            os.close(fd)
            fd = nxt
        try:
            return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        except OSError as e:
            raise Refused(f"cannot open the folder {text}: {e.strerror}") from None
    finally:
        os.close(fd)


def _trusted(folder: os.stat_result, link: os.stat_result) -> bool:
    """Whether a link in `folder` is the word of root or the daemon's user: the folder is
    theirs and nobody else may write it (or it is sticky, like /tmp, and the link theirs)."""
    ours = (0, os.geteuid())
    others_write = bool(folder.st_mode & 0o022)
    sticky_and_ours = bool(folder.st_mode & stat.S_ISVTX) and link.st_uid in ours
    return folder.st_uid in ours and (not others_write or sticky_and_ours)


def read_small(dir_fd: int, rel: str, limit: int) -> bytes:
    """At most `limit` bytes of the regular file `rel` beneath `dir_fd` (a hub's refs/main)."""
    fd = open_file(dir_fd, rel)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


def try_open(dir_fd: int, name: str) -> tuple[int | None, str]:
    """open_file for callers that take errors as data (analysis/ranks.py's opener): (fd, "")
    or (None, why not)."""
    try:
        return open_file(dir_fd, name), ""
    except Refused as e:
        return None, str(e)
    except OSError as e:
        return None, f"cannot open it: {e.strerror}"
