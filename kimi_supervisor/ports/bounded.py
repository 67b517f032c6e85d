"""A call with a deadline, for blocking I/O that cannot be cancelled: NVML, the state folder.

A call stuck in the kernel (a driver that does not answer, a frozen or hung file system) cannot
be interrupted from Python, and joining it would hold the daemon's loop, a stop or a switch for
as long as it lasts. So each kind of such I/O gets one thread of its own (`Worker`): the caller
hands the call over and waits at most the deadline. A call that passes it is abandoned: left on
its thread (a daemon thread), never joined. Until it returns, every other call fails at once,
so that no threads pile up behind it and no caller waits twice; once it returns, the next call
runs as usual.

What a thread cannot do: the kernel ends a process (exit, execve) only once each of its threads
has left the kernel, so a call stuck in state D (a frozen file system, a hung driver) still
holds the process's own exit and re-exec, not its loop. The daemon defers a re-exec while a
call is stuck (loop/daemon.py); its exit waits for the call (systemd's TimeoutStopSec). Only a
process of its own, in a scope of its own, would free it: as the warming's reader does.

The failure is `TimeoutError`, an `OSError`: callers that treat a failing disk as data (kept in
memory, written again later) treat a stuck one the same way. A call whose caller gave up before
it began never runs.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class _Call(Generic[T]):
    def __init__(self, fn: Callable[[], T], what: str) -> None:
        self.fn, self.what = fn, what
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None
        self.began: float | None = None  # time.monotonic() when it began on the worker
        self.given_up = False


class Worker:
    """One thread for one kind of blocking I/O; see the module's docstring."""

    def __init__(self, name: str, timeout_s: float) -> None:
        self.name, self.timeout_s = name, timeout_s
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Call[object]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stuck: _Call[object] | None = None  # given up while running: not returned yet
        self.abandoned = 0  # calls given up while running, since the start

    def stuck(self) -> tuple[str, float] | None:
        """What call is stuck and since when (time.monotonic()); None when none is."""
        c = self._stuck
        if c is None or c.began is None:
            return None
        return c.what, c.began

    def call(self, fn: Callable[[], T], what: str, timeout_s: float | None = None) -> T:
        """fn() on the worker, waited for at most `timeout_s` (the worker's by default).
        TimeoutError if it did not end by then, or if an earlier call is still stuck."""
        c: _Call[T] = _Call(fn, what)
        with self._lock:
            if self._stuck is not None:
                raise TimeoutError(self._still_stuck(what))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._queue.put(c)  # type: ignore[arg-type]
        limit = self.timeout_s if timeout_s is None else timeout_s
        if not c.done.wait(limit):
            with self._lock:
                if not c.done.is_set():
                    c.given_up = True
                    if c.began is not None:
                        self._stuck = c  # type: ignore[assignment]
                        self.abandoned += 1
                    raise TimeoutError(
                        f"{what}: no answer in {limit:g} s; the call is abandoned, not waited "
                        "for (I/O stuck in the kernel cannot be cancelled)"
                    )
        if c.error is not None:
            raise c.error
        return c.result  # type: ignore[return-value]

    def _still_stuck(self, what: str) -> str:
        c = self._stuck
        assert c is not None and c.began is not None
        return (
            f"{what}: not tried, since {c.what} has had no answer for "
            f"{time.monotonic() - c.began:.0f} s (stuck in the kernel)"
        )

    def _run(self) -> None:
        while True:
            c = self._queue.get()
            with self._lock:
                if c.given_up:
                    continue  # its caller went on without it: never begun
                c.began = time.monotonic()
            try:
                c.result = c.fn()
            except BaseException as e:  # handed to the caller, who decides
                c.error = e
            with self._lock:
                c.done.set()
                if self._stuck is c:
                    self._stuck = None
