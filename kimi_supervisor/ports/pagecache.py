"""The page cache: how much memory the host has to spare, and a model's files read so that the
kernel keeps them cached for the next vLLM's load, by a reader process of their own.

Reading is all this does to a file: no write, no mmap, no lock. The daemon runs as root and the
model's folder may be another user's: each file is listed with its device and inode, and opened
from the model tree's descriptor as it was judged (ports/safeopen.py: never through a link out
of the tree, never a FIFO, a device or a socket, never another inode than the one listed), and
read at most to the size it had when listed. A link in the folder counts only where its target
stays inside the tree (Hugging Face's snapshots link to ../../blobs).

Why a process, and not threads of the daemon: a read on a hung NFS or FUSE mount cannot be
cancelled. Measured here (tests/hungfs.py, kernel 6.18): a thread in such a read keeps its
process from exiting, even after SIGKILL (the FUSE request is waited out, and so is the close's
FLUSH at exit), and a process left in the daemon's unit held `systemctl stop` for the unit's
whole TimeoutStopSec (20 of 20 s in the test). So the reading runs in a child process (`Reader`,
named `kimi-warm`), which the daemon moves into a scope of its own before it touches a file; the
daemon waits for nothing it says, kills it when the warming gives up, and leaves it, in its
scope, when the kernel keeps it (`stuck_readers`).

The reader speaks JSON lines: it is asked to `find` the folder (candidates from the pure
decide/warmset.py), answers `listed`; asked to `read` names, it answers `progress` every
REPORT_S and `done`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import select
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimi_supervisor.ports import processes, safeopen

CHUNK = 16 << 20  # one read
REPORT_S = 0.5  # the reader's progress, at most this often
REFS_MAX = 256  # a hub ref is a 40-character commit
NAME = b"kimi-warm"  # the reader's process name (comm): how a re-executed daemon finds it
SCOPE_PREFIX = "kimi-supervisor-warm-"  # its scope's name: SCOPE_PREFIX + its PID + ".scope"
PR_SET_NAME = 15
_started: set[int] = set()  # the readers this image started, until each is reaped


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


# ---------------------------------------------------------------------- the files (the reader)
@dataclass(frozen=True)
class File:
    name: str  # in the folder
    rel: str  # beneath the tree's descriptor: where it is opened from
    listed: safeopen.Identity

    @property
    def size(self) -> int:
        return self.listed.size


@dataclass
class Listing:
    files: list[File]
    refused: list[tuple[str, str]]  # (name, why) of entries that are not files of the tree


def files_in(tree_fd: int, folder: str = ".") -> Listing:
    """The regular files directly in `folder` beneath the tree `tree_fd` (its sub-folders are
    not vLLM's), sorted by name, each with the identity it was listed with. A link counts only
    when its target is a regular file inside the tree; other entries are refused, with why."""
    try:
        dir_fd = tree_fd if folder == "." else safeopen.open_dir(tree_fd, folder)
    except safeopen.Refused as e:
        raise PageCacheError(f"cannot open {folder}: {e}") from None
    try:
        entries = list(os.scandir(dir_fd))
    except OSError as e:
        raise PageCacheError(f"cannot list {folder}: {e.strerror}") from None
    files: list[File] = []
    refused: list[tuple[str, str]] = []
    try:
        for entry in entries:
            rel = entry.name if folder == "." else f"{folder}/{entry.name}"
            try:
                if entry.is_symlink():
                    target = os.readlink(entry.name, dir_fd=dir_fd)
                    rel = os.path.normpath(os.path.join(os.path.dirname(rel), target))
                    if os.path.isabs(target) or rel == ".." or rel.startswith("../"):
                        refused.append((entry.name, "a link out of the model's tree"))
                        continue
                    listed = safeopen.identify(tree_fd, rel)
                else:
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        refused.append((entry.name, f"{safeopen.kind(st.st_mode)}, never opened"))
                        continue
                    listed = safeopen.Identity.of(st)
            except safeopen.Refused as e:
                refused.append((entry.name, str(e)))
                continue
            except OSError as e:
                refused.append((entry.name, (e.strerror or str(e)).lower()))
                continue
            files.append(File(entry.name, rel, listed))
    finally:
        if dir_fd != tree_fd:
            os.close(dir_fd)
    return Listing(sorted(files, key=lambda f: f.name), refused)


def find(candidates: list[dict[str, str]]) -> tuple[int, str, str] | str:
    """The first candidate folder that exists: (the tree's descriptor, the folder beneath it,
    the folder as a path), or why none does. A candidate is {"root": a local folder} or
    {"root": a hub cache, "repo": "models--org--name", "rev": a revision}."""
    looked = []
    for c in candidates:
        root = c["root"]
        try:
            root_fd = safeopen.open_root(root)
        except safeopen.Refused as e:
            looked.append(str(e))
            continue
        if "repo" not in c:
            return root_fd, ".", root
        try:
            tree_fd = safeopen.open_dir(root_fd, c["repo"])
        except safeopen.Refused as e:
            looked.append(f"{root}/{c['repo']}: {e}")
            continue
        finally:
            os.close(root_fd)
        rev = c.get("rev") or "main"
        try:
            commit = safeopen.read_small(tree_fd, f"refs/{rev}", REFS_MAX).decode().strip()
        except (safeopen.Refused, OSError, UnicodeDecodeError):
            commit = rev  # a commit given as --revision has no ref
        snap = f"snapshots/{commit}"
        if commit and "/" not in commit and commit not in (".", ".."):
            try:
                os.close(safeopen.open_dir(tree_fd, snap))
                return tree_fd, snap, f"{root}/{c['repo']}/{snap}"
            except safeopen.Refused as e:
                looked.append(f"{root}/{c['repo']}/{snap}: {e}")
        else:
            looked.append(f"{root}/{c['repo']}: refs/{rev} names no snapshot ({commit!r})")
        os.close(tree_fd)
    return "; ".join(looked) or "nowhere to look"


def read_through(
    tree_fd: int,
    file: File,
    stopped: Any,
    *,
    done: Any,
    buffer: bytearray,
) -> int:
    """Read `file` to its end (or its size when it was listed, whichever comes first), so that
    its pages are cached; `done(n)` after each chunk; stops between two chunks once `stopped()`
    says so. Returns the bytes read; safeopen.Refused when it is not the file listed."""
    fd = safeopen.open_file(tree_fd, file.rel, file.listed)
    total = 0
    try:
        limit = min(os.fstat(fd).st_size, file.size)
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


class _Reading:
    """The reader process's reading: `threads` threads over the files asked for."""

    def __init__(self, tree_fd: int, files: list[File], threads: int) -> None:
        self.tree_fd = tree_fd
        self.todo: queue.SimpleQueue[File] = queue.SimpleQueue()
        for f in files:
            self.todo.put(f)
        self.lock = threading.Lock()
        self.read_bytes = 0
        self.reading = 0  # threads on a file now (a stuck one stays counted)
        self.refused: list[tuple[str, str]] = []
        self.threads = [
            threading.Thread(target=self._work, daemon=True)
            for _ in range(min(threads, max(len(files), 1)))
        ]

    def _done(self, n: int) -> None:
        with self.lock:
            self.read_bytes += n

    def _work(self) -> None:
        buffer = bytearray(CHUNK)
        while True:
            try:
                f = self.todo.get_nowait()
            except queue.Empty:
                return
            with self.lock:
                self.reading += 1
            try:
                read_through(self.tree_fd, f, lambda: False, done=self._done, buffer=buffer)
            except safeopen.Refused as e:
                with self.lock:
                    self.refused.append((f.name, str(e)))
            except OSError as e:
                with self.lock:
                    self.refused.append((f.name, (e.strerror or str(e)).lower()))
            finally:
                with self.lock:
                    self.reading -= 1

    def said(self) -> dict[str, Any]:
        with self.lock:
            return {"read_bytes": self.read_bytes, "reading": self.reading,
                    "refused": list(self.refused)}  # fmt: skip


def _say(msg: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def reader_main() -> int:
    """`python -m kimi_supervisor.ports.pagecache`: the reader process (see the module)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, NAME, 0, 0, 0)
    tree_fd, files = -1, {}
    for line in sys.stdin:
        ask = json.loads(line)
        if "find" in ask:
            found = find(ask["find"])
            if isinstance(found, str):
                _say({"error": found})
                return 0
            tree_fd, folder, shown = found
            try:
                listing = files_in(tree_fd, folder)
            except PageCacheError as e:
                _say({"error": str(e)})
                return 0
            files = {f.name: f for f in listing.files}
            _say({"listed": {"folder": shown, "files": [[f.name, f.size] for f in listing.files],
                             "refused": listing.refused}})  # fmt: skip
        elif "read" in ask:
            reading = _Reading(tree_fd, [files[n] for n in ask["read"]], int(ask["threads"]))
            for t in reading.threads:
                t.start()
            for t in reading.threads:
                while t.is_alive():
                    t.join(REPORT_S)
                    _say({"progress": reading.said()})
            _say({"done": reading.said()})
            return 0
    return 0


# ------------------------------------------------------------------- the reader (the daemon's side)
class Reader:
    """The reader process as the daemon sees it: asked through its stdin, heard through its
    stdout with a deadline (never a blocking read), killed and never waited for past a bound."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.pid = proc.pid
        assert proc.stdout is not None and proc.stdin is not None
        self._out = proc.stdout.fileno()
        os.set_blocking(self._out, False)
        self._buf = b""
        self._eof = False

    @classmethod
    def start(cls) -> Reader:
        root = str(Path(__file__).resolve().parent.parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", "kimi_supervisor.ports.pagecache"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd="/",  # `-m` puts the working directory first on the import path
            env=env,
        )
        _started.add(proc.pid)
        return cls(proc)

    def ask(self, request: dict[str, Any]) -> None:
        """One request. The reader has read the one before it (it answered), so the pipe is
        empty and a line under its 64 KiB never blocks."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it has ended: its end is heard on stdout

    def next(self, timeout_s: float) -> dict[str, Any] | None:
        """Its next message, {"eof": exit code or None} once it has closed its output, or None
        when nothing came within `timeout_s`."""
        while b"\n" not in self._buf and not self._eof:
            ready, _, _ = select.select([self._out], [], [], max(timeout_s, 0.0))
            if not ready:
                return None
            try:
                chunk = os.read(self._out, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                self._eof = True
            self._buf += chunk
            timeout_s = 0.0
        if b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:
                return {"error": f"the reader said something unreadable: {line[:200]!r}"}
            return msg if isinstance(msg, dict) else {"error": "the reader said a non-object"}
        return {"eof": self.proc.poll()}

    def end(self, wait_s: float) -> bool:
        """Kill it (SIGKILL, on the process it still is: it was never waited for, so its PID is
        not recycled) and wait at most `wait_s` for it to end, on its pidfd. False: the kernel
        keeps it (a read stuck in a hung mount); it is left, and never waited for again."""
        try:
            pidfd = os.pidfd_open(self.pid) if self.proc.returncode is None else -1
        except OSError:
            pidfd = -1  # it has been reaped already, or the kernel has no pidfd (< 5.3)
        try:
            if self.proc.returncode is None:
                with contextlib.suppress(OSError):
                    self.proc.kill()
            if pidfd >= 0:
                select.select([pidfd], [], [], wait_s)  # readable once it has exited
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(wait_s)
            ended = self.proc.poll() is not None
            if ended:  # reaped: its PID may be given to another child from now on
                _started.discard(self.pid)
        finally:
            if pidfd >= 0:
                os.close(pidfd)
            self._close()
        return ended

    def _close(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()


def _children() -> list[int]:
    """This process's children (every thread's): /proc/self/task/*/children, or, where the
    kernel has no such file, every process whose parent this is."""
    me, found = os.getpid(), set[int]()
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                found.update(int(p) for p in f.read().split())
        return sorted(found)
    except OSError:
        pass
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                raw = Path(f"/proc/{name}/stat").read_bytes()
            except OSError:
                continue
            if int(raw[raw.rfind(b")") + 2 :].split()[1]) == me:
                found.add(int(name))
    return sorted(found)


def stuck_readers() -> list[int]:
    """The readers an earlier warming left: this process's children that are readers (started
    by this image, or named `kimi-warm`: an image before a re-exec started them) and have not
    ended. Each one that has ended is reaped here."""
    left = []
    for pid in sorted(_started.union(_children())):
        if pid not in _started:
            try:
                if Path(f"/proc/{pid}/comm").read_bytes().strip() != NAME:
                    continue
            except OSError:
                continue
        try:
            gone, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped already (its Popen did)
            _started.discard(pid)
            continue
        except InterruptedError:
            gone = 0
        if gone:
            _started.discard(pid)
        else:
            left.append(pid)
    return left + [pid for pid in _orphaned() if pid not in left]


def _top_of(cgroup: str) -> str | None:
    """The first folder of a process's cgroup (/proc/PID/cgroup's text), None where it names
    none."""
    path = processes.cgroup_path(cgroup)
    return path.strip("/").split("/", 1)[0] if path else None


def _orphaned(proc: Path = Path("/proc")) -> list[int]:
    """Readers an earlier daemon left that are no child of this one (the daemon was restarted,
    not re-executed: they were handed to PID 1): root's processes named `kimi-warm` in a
    `kimi-supervisor-warm-*` scope under the same top folder of the cgroup tree as this
    process (its manager's: system.slice for the system's, a test's user manager's own
    folder), so that another manager's daemon's stuck reader (sandboxes side by side) holds
    no warming here. Another user can name a process so, but not make it root's: at worst a
    warming is skipped (an outside review found two readers left before)."""
    try:
        mine = _top_of((proc / "self" / "cgroup").read_text())
    except OSError:
        mine = None  # unknown: every such reader counts
    found = []
    try:
        entries = list(os.scandir(proc))
    except OSError:
        return []
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            if (proc / entry.name / "comm").read_bytes().strip() != NAME:
                continue
            if entry.stat().st_uid != 0:
                continue
            cgroup = (proc / entry.name / "cgroup").read_text()
        except OSError:
            continue
        if f"/{SCOPE_PREFIX}" in cgroup and (mine is None or _top_of(cgroup) == mine):
            found.append(int(entry.name))
    return sorted(found)


if __name__ == "__main__":
    sys.exit(reader_main())
