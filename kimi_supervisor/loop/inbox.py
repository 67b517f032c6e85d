"""What wakes the daemon's loop, as types: requests (each with a reply the asker waits for), and
what the loop's own helpers report (the teardown job's events and its end, vLLM's MainPID exiting).

Connection threads and signal handlers only build these and put them in the inbox; the loop
thread alone handles them, one at a time, dispatching with `match` (kimi_supervisor/loop/daemon.py).

What the loop sleeps on (Wakeup): a doorbell that every command rings, and a pidfd of the
MainPID of the vLLM it serves, which becomes readable the moment that process exits.

So a request, a signal or vLLM's death wakes the loop at once; only deadlines (ticks, health
probes, backoffs) are waited for. A pidfd tells of MainPID's exit only: a worker that dies while
MainPID lives is noticed by the next /health probe or tick (docs/architecture.md).
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kimi_supervisor.messages import Reply
from kimi_supervisor.model import Mode, TeardownReport
from kimi_supervisor.ports import processes
from kimi_supervisor.ports.processes import PidHandle
from kimi_supervisor.status import WarmStatus

if TYPE_CHECKING:
    from kimi_supervisor.capture.job import Capture
    from kimi_supervisor.loop.liveness import Reading
    from kimi_supervisor.store.bundle import Made
    from kimi_supervisor.teardown.events import TeardownEvent


@dataclass
class Request:
    """Something asked of the loop; `reply` is set once it has been answered."""

    reply: Future[Reply] = field(default_factory=Future, kw_only=True)

    def answer(self, reply: Reply) -> None:
        if not self.reply.done():
            self.reply.set_result(reply)


@dataclass
class Switch(Request):
    mode: Mode
    by: str
    force: bool = False
    for_s: float | None = None  # profile mode only: how long until production again
    apply: bool = False  # restart a serving vLLM that runs an earlier config's argv


@dataclass
class Stop(Request):
    """SIGTERM/SIGINT (`systemctl stop`): tear down to clean, then exit."""


@dataclass
class Reexec(Request):
    """SIGHUP (`systemctl reload`): exec a fresh copy of the daemon, leaving vLLM running."""


@dataclass
class CaptureStart(Request):
    by: str
    seconds: float | None = None
    then: str = "production"
    out: Path | None = None
    # --out as the asker opened it, passed over the socket; the handler closes it after.
    out_fd: int | None = None
    uid: int = 0  # the asker's, from the socket's peer credentials
    gid: int = 0


@dataclass
class CaptureStop(Request):
    by: str


@dataclass
class CaptureDone:
    """A capture's thread has finished (traces flushed, or it failed)."""

    capture: Capture


@dataclass
class JobEvent:
    """The teardown job reports progress (a step began, a kill, the GPUs' drain)."""

    event: TeardownEvent


@dataclass
class JobDone:
    report: TeardownReport | None
    error: BaseException | None = None
    # The old vLLM's /health probed just before the unit's stop answered 200 then (monotonic).
    ok_at: float | None = None
    began: float | None = None  # when the teardown began (monotonic)


@dataclass
class Warmed:
    """The switch's warming (loop/warming.py): its progress, and its end (`done`)."""

    status: WarmStatus
    done: bool = False


@dataclass
class MainExited:
    pid: int


@dataclass
class LivenessSeen:
    """A liveness probe's reading of the vLLM with MainPID `pid` (loop/liveness.py)."""

    reading: Reading


@dataclass
class BundleDone:
    """The incident bundle's thread (loop/bundles.py) has ended: the bundle written (`made`),
    or why not (`error`); `found`: the newest one found at the daemon's start."""

    trigger: str
    made: Made | None = None
    error: str | None = None
    found: bool = False


Message = (
    Switch
    | Stop
    | Reexec
    | CaptureStart
    | CaptureStop
    | CaptureDone
    | JobEvent
    | JobDone
    | Warmed
    | MainExited
    | LivenessSeen
    | BundleDone
)


class Inbox:
    """The loop's queue: any thread puts, the loop takes; `ring` wakes the loop's sleep. A
    deque's append and popleft are atomic and take no lock, so a signal handler may put too
    (a queue.Queue could deadlock against the interrupted thread holding its lock)."""

    def __init__(self, ring: Callable[[], None]) -> None:
        self._q: collections.deque[Message] = collections.deque()
        self._ring = ring

    def put(self, msg: Message) -> None:
        self._q.append(msg)
        self._ring()

    def take(self) -> Message | None:
        """The oldest message, or None."""
        try:
            return self._q.popleft()
        except IndexError:
            return None

    def __len__(self) -> int:
        return len(self._q)


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
