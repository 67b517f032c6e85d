"""The output port: the unit's stdout/stderr, followed from the moment it is started.

On a real host that is the journal (`journalctl -u UNIT -f`, read by a thread into a bounded
buffer); the sandbox writes the unit's output to a file (`vllm.log_file`), which is read from the
offset it had when following began. Either way the last lines are kept for failure reports.
"""

from __future__ import annotations

import collections
import contextlib
import os
import subprocess
import threading
from pathlib import Path
from typing import Literal, Protocol


class OutputPort(Protocol):
    def begin(self) -> None: ...
    def read_new(self) -> list[str]: ...
    def tail(self) -> list[str]: ...
    def close(self) -> None: ...


class FileOutput:
    def __init__(self, path: Path, keep: int = 30) -> None:
        self.path = path
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
                f.seek(self._offset)
                data = f.read(max(size - self._offset, 0))
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        out = [ln.decode(errors="replace") for ln in lines]
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
        self._proc: subprocess.Popen[bytes] | None = None
        self._new: collections.deque[str] = collections.deque(maxlen=10_000)
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
        for raw in proc.stdout:
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
