"""The output port: the unit's stdout/stderr, followed from the moment it is started.

On a real host that is the journal (`journalctl -u UNIT -f`, read by a thread into a bounded
buffer); the sandbox writes the unit's output to a file (`vllm.log_file`), which is read from the
offset it had when following began. Either way the last lines are kept for failure reports.

vLLM's output is an outsider's to the daemon (root), so memory is bounded whatever it holds: a
line longer than MAX_LINE bytes is cut into pieces of that size, a file is read MAX_READ bytes at
a time, and a file that runs further ahead than that is skipped to its last MAX_READ bytes (one
line says how much was skipped). Unbounded, 300 MB with no newline took the daemon from 49 to
774 MB.
"""

from __future__ import annotations

import collections
import contextlib
import os
import subprocess
import threading
from pathlib import Path
from typing import Literal, Protocol

MAX_LINE = 8192  # bytes of one line kept; vLLM's progress lines are under 300
MAX_READ = 1 << 20  # bytes of a file read per pass
MAX_NEW = 2000  # lines waiting to be read (the journal's reader)


def _cut(data: bytes) -> tuple[list[bytes], bytes]:
    """Complete lines of `data` (each cut into MAX_LINE pieces) and the partial last one (at
    most MAX_LINE bytes: beyond that it is a piece too)."""
    *lines, partial = data.split(b"\n")
    out = [ln[i : i + MAX_LINE] for ln in lines for i in range(0, max(len(ln), 1), MAX_LINE)]
    while len(partial) > MAX_LINE:
        out.append(partial[:MAX_LINE])
        partial = partial[MAX_LINE:]
    return out, partial


class OutputPort(Protocol):
    where: str  # where an operator reads all of it

    def begin(self) -> None: ...
    def read_new(self) -> list[str]: ...
    def tail(self) -> list[str]: ...
    def close(self) -> None: ...


class FileOutput:
    def __init__(self, path: Path, keep: int = 30) -> None:
        self.path = path
        self.where = str(path)
        self._offset = 0
        self._partial = b""
        self._tail: collections.deque[str] = collections.deque(maxlen=keep)

    def begin(self) -> None:
        try:
            self._offset = self.path.stat().st_size
        except FileNotFoundError:
            self._offset = 0
        self._partial = b""
        self._tail.clear()

    def read_new(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self._offset:  # truncated or replaced: start over
                    self._offset, self._partial = 0, b""
                skipped = 0
                if size - self._offset > MAX_READ:  # far behind: only the latest counts
                    skipped, self._offset = size - MAX_READ - self._offset, size - MAX_READ
                    self._partial = b""
                f.seek(self._offset)
                data = f.read(min(max(size - self._offset, 0), MAX_READ))
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines, self._partial = _cut(self._partial + data)
        out = [ln.decode(errors="replace") for ln in lines]
        if skipped:
            out.insert(0, f"[kimi-supervisor: {skipped} bytes of output skipped]")
        self._tail.extend(out)
        return out

    def tail(self) -> list[str]:
        return list(self._tail) + (
            [self._partial.decode(errors="replace")] if self._partial else []
        )

    def close(self) -> None:
        pass


class JournalOutput:
    def __init__(self, unit: str, scope: Literal["system", "user"], keep: int = 30) -> None:
        self.unit = unit
        self.scope = scope
        self.where = f"journalctl {'--user ' if scope == 'user' else ''}-u {unit}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._new: collections.deque[str] = collections.deque(maxlen=MAX_NEW)
        self._tail: collections.deque[str] = collections.deque(maxlen=keep)
        self._lock = threading.Lock()

    def begin(self) -> None:
        self.close()
        self._tail.clear()
        which = ["--user-unit", self.unit] if self.scope == "user" else ["--unit", self.unit]
        try:
            self._proc = subprocess.Popen(
                ["journalctl", *which, "--follow", "--lines=0", "--output=cat", "--no-pager"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                stdin=subprocess.DEVNULL,
            )
        except OSError:
            self._proc = None  # no journal: progress stays unknown, readiness still works
            return
        proc = self._proc
        threading.Thread(target=self._pump, args=(proc,), daemon=True, name="journal").start()

    def _pump(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        while raw := proc.stdout.readline(MAX_LINE):  # a longer line comes in pieces
            line = raw.decode(errors="replace").rstrip("\n")
            with self._lock:
                self._new.append(line)
                self._tail.append(line)

    def read_new(self) -> list[str]:
        with self._lock:
            out = list(self._new)
            self._new.clear()
        return out

    def tail(self) -> list[str]:
        with self._lock:
            return list(self._tail)

    def close(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.kill()
            self._proc.wait()
            self._proc = None
