"""vLLM's trace folder as root sees it: judged on the way there, entered once by descriptor.

vLLM runs as its own user and writes the traces; that user may own the trace folder, or the
folder it sits in (an armed production's `torch_profiler_dir` of the operator's choosing). During
a flush it can rename the folder away and put a link to another folder in its place: a capture
that listed, opened and renamed by path would then move and chown whatever root's folder the link
names (the daemon's state, other users' captures). So the trace folder is:

1. reached from / one component at a time, never through a link another user placed: a link is
   followed only where it sits in a folder only root can change and root made it (`/var/lib` ->
   `/data/lib`); the trace folder itself is never a link. Every folder on the way, and the trace
   folder, is owned by root or vLLM's user and writable by nobody else; a sticky folder (`/tmp`)
   on the way may be, when the entry below it is root's or vLLM's user's (nobody else may rename
   it), never the trace folder itself. This is the check the launcher makes of vLLM's cache
   (ports/launcher.cache_untrusted);
2. opened once, at the capture's start, and kept: listing, stat, rename and read go through that
   descriptor and `*at` calls, never through the path again;
3. named again by its path after the flush: if the path no longer leads to the very folder
   opened (device and inode), vLLM wrote its traces somewhere else, and nothing is taken.

A file in it is vLLM's when it is a regular file owned by the unit's `User=` with one name: never
"owned by whoever owns the folder" (root's own files would pass), never a hard link to a file
elsewhere (vLLM's user may link any file it can write).
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from kimi_supervisor.ports import safeopen

MAX_LINKS = 40  # as the kernel's own limit on the links one path may follow
# A trace folder holds a few files per capture (one per rank and API server, and vLLM's text
# tables); a listing stops here, and the capture says so: a folder of 10^6 names is no vLLM's.
MAX_ENTRIES = 100_000


class Untrusted(Exception):
    """Why root will not act in the trace folder: the operator's next step is in the text."""


class Missing(Untrusted):
    """The trace folder itself does not exist (yet): vLLM makes it at its first flush."""


Listed = tuple[int, int, safeopen.Identity]  # size, modification time (ns), identity


def _writers(st: os.stat_result) -> str:
    """Who besides the owner may write a folder ("" for nobody)."""
    who = [w for bit, w in ((0o020, "its group"), (0o002, "everyone")) if st.st_mode & bit]
    return " and ".join(who)


@dataclass
class TraceDir:
    """vLLM's trace folder, open (see the module's docstring). Close it, or use it in `with`."""

    path: Path
    fd: int
    dev: int
    ino: int
    vllm_uid: int

    @classmethod
    def open(cls, path: Path, vllm_uid: int | None) -> TraceDir:
        """The trace folder at `path`, judged and opened; Untrusted says why not and what to do.
        `vllm_uid`: the unit's `User=` (None: not known, and nothing can be judged)."""
        if vllm_uid is None:
            raise Untrusted(
                "who vLLM runs as is not known (the unit is not loaded, or has DynamicUser=), so "
                "no file in its trace folder can be told to be vLLM's: set User= in the unit"
            )
        pfd = _walk(path, vllm_uid)
        try:
            fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=pfd)
        except OSError as e:
            raise Untrusted(f"cannot open the trace folder {path}: {e.strerror}") from None
        finally:
            os.close(pfd)
        st = os.fstat(fd)
        return cls(path, fd, st.st_dev, st.st_ino, vllm_uid)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> TraceDir:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def files(self) -> dict[str, Listed]:
        """Name -> (size, modification time, identity) of the regular files in the folder
        opened, as lstat sees them through its descriptor: a link is never one."""
        out: dict[str, Listed] = {}
        with os.scandir(self.fd) as entries:
            for n, e in enumerate(entries):
                if n >= MAX_ENTRIES:
                    raise Untrusted(
                        f"the trace folder {self.path} holds more than {MAX_ENTRIES:,} names: "
                        "not vLLM's traces alone; empty it"
                    )
                try:
                    st = os.stat(e.name, dir_fd=self.fd, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    out[e.name] = (st.st_size, st.st_mtime_ns, safeopen.Identity.of(st))
        return out

    def replaced(self) -> str:
        """Why the path no longer leads to the folder opened ("" while it does): renamed away,
        a link or another folder in its place."""
        try:
            pfd = _walk(self.path, self.vllm_uid)
        except Untrusted as e:
            return f"the trace folder {self.path} was replaced during the capture: {e}"
        try:
            st = os.fstat(pfd)
        finally:
            os.close(pfd)
        if (st.st_dev, st.st_ino) != (self.dev, self.ino):
            return (
                f"the trace folder {self.path} was replaced during the capture (inode "
                f"{self.dev}:{self.ino}, now {st.st_dev}:{st.st_ino})"
            )
        return ""

    def not_vllms(self, st: os.stat_result) -> str:
        """Why a file is not one vLLM wrote ("" if it is)."""
        if not stat.S_ISREG(st.st_mode):
            return f"{safeopen.kind(st.st_mode)}, not a regular file"
        if st.st_nlink != 1:
            return f"a file with {st.st_nlink} names (a hard link to a file elsewhere)"
        if st.st_uid != self.vllm_uid:
            return f"owned by uid {st.st_uid}, not by vLLM's user (uid {self.vllm_uid})"
        return ""


def _walk(path: Path, vllm_uid: int) -> int:
    """An O_PATH descriptor of the folder `path`, reached as the module's docstring says. The
    folders on the way are kept open, judged, as a stack: a `..` in a link root placed (Fedora's
    `/var/run -> ../run`) goes back to the folder judged before, never through a name again."""
    text = os.fspath(path)
    if not text.startswith("/"):
        raise Untrusted(f"the trace folder {text} is not an absolute path")
    parts = [p for p in text.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Untrusted(f"the trace folder {text} has '..' in its path: name it plainly")
    ours = {0, vllm_uid}
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
    root = os.open("/", flags)
    stack: list[tuple[int, os.stat_result, str]] = [(root, os.fstat(root), "/")]
    links = 0
    try:
        while parts:
            name = parts.pop(0)
            fd, folder, here = stack[-1]
            if name == "..":  # only from a link root placed: back to the folder judged before
                if len(stack) > 1:
                    os.close(stack.pop()[0])
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                if not parts:
                    raise Missing(f"the trace folder {text} does not exist (yet)") from None
                why = "missing"
            except OSError as e:
                why = e.strerror or str(e)
            else:
                why = ""
            if why:
                raise Untrusted(f"cannot reach the trace folder {text}: {name}: {why}")
            shown = os.path.join(here, name)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                by_root = st.st_uid == 0 and folder.st_uid == 0 and not folder.st_mode & 0o022
                if not parts or not by_root or links > MAX_LINKS:
                    raise Untrusted(
                        f"{shown} is a symbolic link"
                        + ("" if parts else " (the trace folder itself)")
                        + " that root did not place in a folder only root can change: set "
                        "torch_profiler_dir to the folder it points to"
                    )
                target = os.readlink(name, dir_fd=fd)
                parts = [p for p in target.split("/") if p not in ("", ".")] + parts
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop()[0])
                continue
            try:
                nxt = os.open(name, flags, dir_fd=fd)
            except OSError as e:
                raise Untrusted(f"{shown}: {e.strerror}") from None
            stack.append((nxt, os.fstat(nxt), shown))
            got = stack[-1][1]
            if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
                raise Untrusted(f"{shown} changed while it was checked: try again")
            writers = _writers(folder)
            if writers and not (folder.st_mode & stat.S_ISVTX and got.st_uid in ours):
                raise Untrusted(
                    f"{here} is writable by {writers}, who could put another folder in the "
                    f"place of {name}: `chmod go-w {here}`, or choose a trace folder under one "
                    "that only root and vLLM's user can write"
                )
            if got.st_uid not in ours:
                raise Untrusted(
                    f"{shown} is owned by uid {got.st_uid}, neither root nor vLLM's user "
                    f"(uid {vllm_uid}): `chown {vllm_uid} {shown}` or choose another trace folder"
                )
        fd, folder, _ = stack.pop()
        # The trace folder itself: writable by root and vLLM's user alone, sticky or not (a
        # shared /tmp lets anyone fill it with names, and every capture would fail).
        if writers := _writers(folder):
            os.close(fd)
            raise Untrusted(
                f"the trace folder {text} is writable by {writers}: `chmod go-w {text}`, or "
                "choose a folder of vLLM's user's"
            )
        return fd
    finally:
        for fd, _, _ in stack:
            with contextlib.suppress(OSError):
                os.close(fd)
