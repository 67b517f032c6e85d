"""What wakes the daemon's loop, as types: requests (each with a reply the asker waits for), and
what the loop's own helpers report (the teardown job's events and its end, vLLM's MainPID exiting).

Connection threads and signal handlers only build these and put them in the inbox; the loop
thread alone handles them, one at a time, dispatching with `match` (kimi_supervisor/loop/daemon.py).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kimi_supervisor.messages import Reply
from kimi_supervisor.model import Mode, TeardownReport
from kimi_supervisor.status import WarmStatus

if TYPE_CHECKING:
    from kimi_supervisor.capture.job import Capture
    from kimi_supervisor.loop.liveness import Reading
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
