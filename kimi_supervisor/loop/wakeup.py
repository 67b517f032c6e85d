"""What the daemon's loop sleeps on: a doorbell that every command rings, and a pidfd of the
MainPID of the vLLM it serves, which becomes readable the moment that process exits.

So a request, a signal or vLLM's death wakes the loop at once; only deadlines (ticks, health
probes, backoffs) are waited for. A pidfd tells of MainPID's exit only: a worker that dies while
MainPID lives is noticed by the next /health probe or tick (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import os
import select

from kimi_supervisor.ports import processes
from kimi_supervisor.ports.processes import PidHandle


class Wakeup:
    def __init__(self) -> None:
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._pidfd: int | None = None
        self.watched = 0

    def ring(self) -> None:
        """Wake the loop (from any thread, or a signal handler)."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._w, b"\0")

    def watch(self, pid: int) -> None:
        """Watch `pid` (0: nothing) until it exits; a process found gone is not watched."""
        if pid == self.watched:
            return
        self.unwatch()
        ref = processes.ref_of(pid) if pid else None
        alive = ref is not None and processes.is_alive(ref)  # a zombie has exited already
        handle = PidHandle.open(ref) if ref is not None and alive else None
        if isinstance(handle, PidHandle):
            self._pidfd, self.watched = handle.fd, pid

    def unwatch(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
        self._pidfd, self.watched = None, 0

    def wait(self, timeout_s: float, watch: bool = True) -> int:
        """Sleep until the doorbell rings, the watched process exits, or `timeout_s` passes.
        Returns the PID that exited (then no longer watched), else 0."""
        fds = [self._r]
        if watch and self._pidfd is not None:
            fds.append(self._pidfd)
        ready = select.select(fds, [], [], max(timeout_s, 0.0))[0]
        if self._r in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._r, 4096):
                    pass
        if self._pidfd is not None and self._pidfd in ready:
            pid = self.watched
            self.unwatch()
            return pid
        return 0

    def close(self) -> None:
        self.unwatch()
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)
