"""A call with a deadline, for blocking I/O that cannot be cancelled: NVML, the state folder.

A call stuck in the kernel (a driver that does not answer, a frozen or hung file system) cannot
be interrupted from Python, and joining it would hold the daemon's loop, a stop or a switch for
as long as it lasts. So each kind of such I/O gets one thread of its own (`Worker`): the caller
hands the call over and waits at most the deadline. A call that passes it is abandoned: left on
its thread (a daemon thread), never joined. Until it returns, every other call fails at once,
so that no threads pile up behind it and no caller waits twice; once it returns, the next call
runs as usual.

What a thread cannot do: the kernel ends a process (exit, execve) only once each of its threads
has left the kernel, so a call stuck in state D (a frozen file system, a hung driver) on a thread
would hold the process's own exit, and so `systemctl stop`, up to TimeoutStopSec. The daemon
therefore runs these calls in processes of their own (`ProcessWorker`, `python -m
kimi_supervisor.ports.iochild`), each moved into a transient scope of its own before its first
call, outside the daemon's unit: the daemon waits for an answer on a pipe (a wait the kernel
interrupts), and a child stuck in the kernel holds neither the daemon's exit nor its unit's
stop. It ends once the kernel lets it go and it reads the end of its input. A call handed to a
process is data: a module-level function or a `functools.partial` of one, with arguments that
pickle; what it changes, it returns (`on_late` hears the answer of a call given up on). The
thread `Worker` (`copy=True`) hands its calls over the same way, so that tests on it catch a
call that would not cross.

The failure is `TimeoutError`, an `OSError`: callers that treat a failing disk as data (kept in
memory, written again later) treat a stuck one the same way. A call whose caller gave up before
it began never runs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")

# A frame on the pipes between the daemon and an I/O process: its length (8 bytes, big-endian),
# then a pickle. The daemon reads at most MAX_FRAME of an answer (the history's reads are the
# largest: capped far below this by their callers).
HEADER = struct.Struct("!Q")
MAX_FRAME = 256 << 20
# How long one look for a stuck call's late answer may read (`stuck`, and each call's start).
LATE_READ_S = 0.05
NAME = b"kimi-io"  # an I/O process's name (its comm), as ps and the scope's listing show it
SCOPE_PREFIX = "kimi-supervisor-io-"  # its scope: SCOPE_PREFIX + worker name + "-" + PID


class ProcessGone(OSError):
    """The I/O process ended (or said what cannot be read) before it answered a call."""


class IoWorker(Protocol):
    """What the daemon's callers need of a worker, on a thread or in a process of its own."""

    abandoned: int
    timeout_s: float  # a call's deadline, unless the call gives its own

    def call(
        self,
        fn: Callable[[], T],
        what: str,
        timeout_s: float | None = None,
        *,
        on_late: Callable[[T], None] | None = None,
    ) -> T: ...

    def stuck(self) -> tuple[str, float] | None: ...

    def close(self) -> None: ...


def handed_over(fn: Callable[[], T], what: str) -> bytes:
    """`fn` as a process of its own receives it; TypeError, saying what, if it cannot be."""
    try:
        return pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise TypeError(
            f"{what}: the call cannot be handed to another process ({e}): give a module-level "
            "function or a functools.partial of one, with arguments that pickle"
        ) from e


_objects: dict[tuple[Any, tuple[Any, ...]], Any] = {}


def on_object(factory: Callable[..., Any], args: tuple[Any, ...], method: str, *call: Any) -> Any:
    """`method(*call)` of the one object `factory(*args)` of this process (an I/O process's),
    made at its first call and kept: NVML's handles live where its calls run."""
    key = (factory, args)
    obj = _objects.get(key)
    if obj is None:
        obj = _objects[key] = factory(*args)
    return getattr(obj, method)(*call)


class _Call(Generic[T]):
    def __init__(self, fn: Callable[[], T], what: str, on_late: Callable[[T], None] | None) -> None:
        self.fn, self.what, self.on_late = fn, what, on_late
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None
        self.began: float | None = None  # time.monotonic() when it began on the worker
        self.given_up = False


class Worker:
    """One thread for one kind of blocking I/O; see the module's docstring. With `copy`, each
    call is handed over as a process would receive it (pickled), so that its effects are only
    what it returns, as in a `ProcessWorker`."""

    def __init__(self, name: str, timeout_s: float, copy: bool = False) -> None:
        self.name, self.timeout_s, self.copy = name, timeout_s, copy
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Call[object]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stuck: _Call[object] | None = None  # given up while running: not returned yet
        self._late: list[_Call[object]] = []  # given up, returned since: their on_late is due
        self.abandoned = 0  # calls given up while running, since the start

    def stuck(self) -> tuple[str, float] | None:
        """What call is stuck and since when (time.monotonic()); None when none is. The
        answers of calls given up on that came since are handed to their `on_late` here."""
        with self._lock:
            late, self._late = self._late, []
        for done in late:
            if done.error is None and done.on_late is not None:
                done.on_late(done.result)
        c = self._stuck
        if c is None or c.began is None:
            return None
        return c.what, c.began

    def call(
        self,
        fn: Callable[[], T],
        what: str,
        timeout_s: float | None = None,
        *,
        on_late: Callable[[T], None] | None = None,
    ) -> T:
        """fn() on the worker, waited for at most `timeout_s` (the worker's by default).
        TimeoutError if it did not end by then, or if an earlier call is still stuck."""
        if self.copy:
            fn = pickle.loads(handed_over(fn, what))
        c: _Call[T] = _Call(fn, what, on_late)
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
                    raise TimeoutError(_no_answer(what, limit))
        if c.error is not None:
            raise c.error
        return c.result  # type: ignore[return-value]

    def _still_stuck(self, what: str) -> str:
        c = self._stuck
        assert c is not None and c.began is not None
        return _not_tried(what, c.what, c.began)

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
                    self._late.append(c)

    def close(self) -> None:
        """Nothing to end: the thread is a daemon thread, left as it is."""


def _no_answer(what: str, limit: float) -> str:
    return (
        f"{what}: no answer in {limit:g} s; the call is abandoned, not waited for (I/O stuck "
        "in the kernel cannot be cancelled)"
    )


def _not_tried(what: str, stuck: str, began: float) -> str:
    return (
        f"{what}: not tried, since {stuck} has had no answer for "
        f"{time.monotonic() - began:.0f} s (stuck in the kernel)"
    )


class _Sent:
    """A call handed to an I/O process and given up on: its answer is still to come."""

    def __init__(
        self, rid: int, what: str, began: float, *, on_late: Callable[[Any], None] | None
    ) -> None:
        self.rid, self.what, self.began, self.on_late = rid, what, began, on_late


class ProcessWorker:
    """One process of its own for one kind of blocking I/O; see the module's docstring.

    The process (`kimi_supervisor.ports.iochild`) is started at the first call, or by `start`,
    and moved into a scope of its own by `adopt(pid)` (which says the scope's name, "" if it
    could not) before it is handed anything. Calls are one at a time (a lock, waited for within
    the call's own deadline). A process that ends is started again at the next call; one stuck
    past a deadline is left as it is, and every call fails at once until it answers (its answer
    then goes to the call's `on_late`). `close` ends its input and never waits for a stuck one.
    """

    def __init__(
        self,
        name: str,
        timeout_s: float,
        adopt: Callable[[int], str] = lambda _pid: "",
        *,
        log: Callable[..., None] = lambda *_a, **_k: None,
    ) -> None:
        self.name, self.timeout_s = name, timeout_s
        self._adopt, self._log = adopt, log
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = bytearray()  # what came of the next answer (appended to, never copied)
        self._rid = 0
        self._stuck: _Sent | None = None
        self.abandoned = 0
        self._closed = False  # by `close`: no process is started again
        self.started = 0  # processes started, since the daemon's start
        self.scope = ""  # where the current one runs ("": in the daemon's own unit)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        """Its process runs (a call would not start one)."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the process now (the daemon does so at boot), not at the first call."""
        with self._lock:
            self._ensure()

    def _ensure(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._drop()
        root = str(Path(__file__).resolve().parent.parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", "kimi_supervisor.ports.iochild", self.name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd="/",  # `-m` puts the working directory first on the import path
            env=env,
        )
        assert proc.stdin is not None and proc.stdout is not None
        os.set_blocking(proc.stdin.fileno(), False)
        os.set_blocking(proc.stdout.fileno(), False)
        self._proc, self._buf = proc, bytearray()
        self.started += 1
        self.scope = self._adopt(proc.pid)
        self._log("io_process_started", worker=self.name, pid=proc.pid, scope=self.scope)
        return proc

    def _drop(self, kill: bool = False) -> None:
        """Forget the process: its pipes closed (it reads their end and exits once free)."""
        proc, self._proc, self._buf = self._proc, None, bytearray()
        if proc is None:
            return
        if kill:
            with contextlib.suppress(OSError):
                proc.kill()
        for f in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(0)  # reaped if it has ended; else its new parent reaps it

    def stuck(self) -> tuple[str, float] | None:
        """What call is stuck and since when; an answer that came since ends it (see `call`)."""
        if self._lock.acquire(blocking=False):
            try:
                self._hear_late()
            finally:
                self._lock.release()
        c = self._stuck
        return None if c is None else (c.what, c.began)

    def _hear_late(self) -> None:
        c = self._stuck
        if c is None:
            return
        # Nothing waiting on its pipe: no answer yet, and the look costs nothing. Else a
        # moment's reading at most: a large late answer is taken in over several looks.
        proc = self._proc
        if proc is not None and proc.stdout is not None:
            ready, _, _ = select.select([proc.stdout.fileno()], [], [], 0)
            if not ready:
                return
        got = self._receive(time.monotonic() + LATE_READ_S)
        if got is None:
            return
        self._stuck = None
        if isinstance(got, str):
            self._log("io_process_ended", worker=self.name, while_=c.what)
            self._drop()
            return
        rid, ok, value = got
        if rid == c.rid and ok and c.on_late is not None:
            c.on_late(value)

    def call(
        self,
        fn: Callable[[], T],
        what: str,
        timeout_s: float | None = None,
        *,
        on_late: Callable[[T], None] | None = None,
    ) -> T:
        """fn() in the process, waited for at most `timeout_s` (the worker's by default).
        TimeoutError if it did not end by then, or if an earlier call is still stuck; OSError
        if the process ended before it answered (it is started again at the next call)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        request = handed_over(fn, what)
        if not self._lock.acquire(timeout=limit):
            raise TimeoutError(f"{what}: not tried in {limit:g} s: another call holds it")
        try:
            self._hear_late()
            if self._stuck is not None:
                s = self._stuck
                raise TimeoutError(_not_tried(what, s.what, s.began))
            if self._closed:
                raise ProcessGone(errno.EIO, f"{what}: its I/O process was closed")
            try:
                proc = self._ensure()
            except OSError as e:
                raise ProcessGone(e.errno or errno.EIO, f"{what}: its I/O process: {e}") from e
            self._rid += 1
            rid, began = self._rid, time.monotonic()
            frame = pickle.dumps((rid, request), protocol=pickle.HIGHEST_PROTOCOL)
            if not self._send(proc, HEADER.pack(len(frame)) + frame, deadline):
                self._drop(kill=True)  # a frame cut short: its stream cannot be read on
                raise TimeoutError(_no_answer(what, limit))
            while True:
                got = self._receive(deadline)
                if got is None:
                    self._stuck = _Sent(rid, what, began, on_late=on_late)
                    self.abandoned += 1
                    raise TimeoutError(_no_answer(what, limit))
                if isinstance(got, str):
                    code = None
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        code = proc.wait(0.5)  # its output closed: it is ending
                    self._drop()
                    raise ProcessGone(
                        errno.EIO, f"{what}: its I/O process ended (exit {code}) before it answered"
                    )
                if got[0] == rid:
                    break
            _, ok, value = got
        finally:
            self._lock.release()
        if ok:
            return value  # type: ignore[no-any-return]
        if isinstance(value, BaseException):
            raise value
        raise ProcessGone(errno.EIO, f"{what}: its I/O process answered with no exception")

    def _send(self, proc: subprocess.Popen[bytes], data: bytes, deadline: float) -> bool:
        assert proc.stdin is not None
        fd, view = proc.stdin.fileno(), memoryview(data)
        while view:
            _, ready, _ = select.select([], [fd], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                return False
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                continue
            except OSError:
                return True  # it has ended: heard on its output
        return True

    def _receive(self, deadline: float) -> tuple[int, bool, Any] | str | None:
        """The next answer, "ended" once the process has closed its output (or said what
        cannot be read), or None when nothing whole came by `deadline`: an answer still
        coming at the deadline is kept as far as it came, never waited for past it."""
        proc = self._proc
        if proc is None or proc.stdout is None:
            return "ended"
        fd = proc.stdout.fileno()
        while True:
            if len(self._buf) >= HEADER.size:
                (size,) = HEADER.unpack_from(self._buf)
                if size > MAX_FRAME:
                    self._log("io_process_garbled", level="error", worker=self.name, size=size)
                    self._drop(kill=True)
                    return "ended"
                if len(self._buf) >= HEADER.size + size:
                    frame = bytes(self._buf[HEADER.size : HEADER.size + size])
                    del self._buf[: HEADER.size + size]
                    try:
                        got = pickle.loads(frame)  # our own child's answer, on our own pipe
                    except Exception as e:
                        self._log("io_process_garbled", level="error", worker=self.name,
                                  error=repr(e))  # fmt: skip
                        self._drop(kill=True)
                        return "ended"
                    return got  # type: ignore[no-any-return]
            left = deadline - time.monotonic()
            if left <= 0 and self._buf:
                return None  # still coming: the rest is read by a later look
            ready, _, _ = select.select([fd], [], [], max(left, 0.0))
            if not ready:
                return None
            try:
                chunk = os.read(fd, 1 << 20)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                return "ended"
            self._buf += chunk  # a bytearray grows in place: linear in the answer's size

    def close(self, wait_s: float = 1.0) -> None:
        """End the process's input: an idle one exits, and is waited for at most `wait_s`; a
        stuck one is left in its scope, never waited for (it exits once the kernel lets go)."""
        with self._lock:
            self._closed = True
            proc = self._proc
            if proc is None:
                return
            if self._stuck is None and proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(wait_s)
            self._drop()
