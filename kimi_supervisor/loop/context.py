"""What the loop's parts share: the ports, the event bus (what goes out to subscribers), the
one loop state, and the records every part keeps (persist the state, append to the history,
queue an event for the bus, warn). It changes
no state of vLLM's life (loop/lifecycle.py does) and publishes no status (loop/daemon.py does,
once per pass): it calls nothing back. Owned and used by the loop thread.
"""

from __future__ import annotations

import collections
import functools
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kimi_supervisor.config import Config
from kimi_supervisor.decide.downtime import expected_parts
from kimi_supervisor.decide.eta import Estimate, argv_key, estimate
from kimi_supervisor.loop.loopstate import LoopState
from kimi_supervisor.loop.observer import Observer
from kimi_supervisor.messages import End, Event
from kimi_supervisor.model import Mode, TeardownReport, utcnow
from kimi_supervisor.ports.bounded import IoWorker, Worker
from kimi_supervisor.ports.clock import Clock
from kimi_supervisor.ports.gpu import GpuPort
from kimi_supervisor.ports.metrics import Metrics
from kimi_supervisor.ports.notify import Notifier
from kimi_supervisor.ports.output import OutputPort
from kimi_supervisor.ports.systemd import SystemdPort
from kimi_supervisor.store import history
from kimi_supervisor.store.state import (
    Kept,
    Known,
    PersistedState,
    StateError,
    StateStore,
    replaced,
    same,
    with_desired,
    with_transition,
)

Log = Callable[..., None]
# History records kept in memory while the history cannot be appended to (a full disk).
MAX_PENDING = 1000
# What the loop reads of the history at most (its own estimates and checks; the newest records
# first): a history of large records holds the loop for the time to take in 8 MiB, not 100.
LOOP_HISTORY_MAX_BYTES = 8 << 20
# What status says while a call to the state folder is stuck (see Context.disk).
DISK_STUCK = "the state folder does not answer"


# -- the event bus: the loop publishes, connection threads subscribe. A subscriber that falls
# behind (a stuck client) loses its subscription instead of slowing the loop down.


class Subscription:
    def __init__(self, bus: EventBus, maxsize: int) -> None:
        self.bus = bus
        self.queue: queue.Queue[Event | End] = queue.Queue(maxsize)
        self.overflowed = False

    def get(self, timeout_s: float) -> Event | End | None:
        try:
            return self.queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        self.bus.unsubscribe(self)


class EventBus:
    def __init__(self, maxsize: int = 10_000) -> None:
        self._subs: set[Subscription] = set()
        self._lock = threading.Lock()
        self.maxsize = maxsize

    def subscribe(self) -> Subscription:
        sub = Subscription(self, self.maxsize)
        with self._lock:
            self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.discard(sub)

    def publish(self, msg: Event | End) -> None:
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            try:
                sub.queue.put_nowait(msg)
            except queue.Full:
                # The reader sees this at its next poll (at most a second later) and ends.
                sub.overflowed = True
                self.unsubscribe(sub)


@dataclass
class Pending:
    """A history record not written yet. `written` is set once the append is done, even by a
    call the loop gave up on (its answer comes late, to `_written`): never appended twice."""

    kind: str
    record: TeardownReport | dict[str, Any]
    written: bool = False
    # An append of it was tried and its end is not known (no answer in time, its process
    # gone): the next one first looks whether that one wrote it (history.append's `once`).
    tried: bool = False


def _written(p: Pending, _result: object) -> None:
    p.written = True


def new_id() -> str:
    return f"t-{utcnow():%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"


@dataclass
class Context:
    config: Config
    systemd: SystemdPort
    gpu: GpuPort
    output: OutputPort
    notifier: Notifier
    log: Log
    clock: Clock
    metrics: Metrics | None
    store: StateStore
    bus: EventBus
    observer: Observer
    s: LoopState = field(default_factory=LoopState)
    disk_worker: IoWorker | None = None  # the daemon's: a process of its own (cli/run.py)
    bundle_worker: IoWorker | None = None  # the incident bundles' I/O (loop/bundles.py)

    def __post_init__(self) -> None:
        self.unit = self.config.service.unit
        self.saved = PersistedState()  # what state.json holds, as last read or written
        self.saved_stamp: tuple[int, int, int] | None = None  # its inode, size, mtime then
        self.unsaved_state = False
        self.pending: collections.deque[Pending] = collections.deque()
        # Every read and write of the state folder (state.json, history.jsonl) runs on this
        # one worker, waited for at most state.timeout_s (ports/bounded.py): a hung or frozen
        # file system holds no pass of the loop longer, and, the daemon's being a process in a
        # scope of its own, no stop either. A call that passes it is left there; until it
        # returns, the others fail at once, as a full disk's do (kept in memory). Without one
        # given, a thread that hands each call over as the process would (`copy`).
        self.disk: IoWorker = self.disk_worker or Worker(
            "state-io", self.config.state.timeout_s, copy=True
        )
        # What this pass has to say to the bus's subscribers: sent by the daemon once the
        # pass's status is published, so that whoever reacts to an event reads a status at
        # least as new as the event.
        self.outbox: list[Event | End] = []

    def persist(
        self, change: Callable[[PersistedState], PersistedState], must: bool = False
    ) -> None:
        """Write a change to state.json. A failure (a full disk, a state dir made untrustworthy)
        is an event, not a crash: logged, shown in status and metrics, kept in memory and written
        again at the next pass (`flush`). With `must`, it raises StateError instead, so that the
        caller refuses what it was asked before any effect. A file found corrupt is rewritten
        from what the daemon last knew, and recorded."""
        # A write the caller must have on disk first is refused when it times out: it must not
        # land afterwards either (a refused switch coming back at the next start), so it is
        # dropped before its rename if the wait ended by then. Any other keeps its course: it
        # holds what memory holds, and the next pass writes memory over it anyway.
        limit = self.disk.timeout_s
        deadline = time.monotonic() + limit if must else None
        known = Known(self.saved, self.unsaved_state, self.saved_stamp is not None)
        try:
            done = self.disk.call(
                functools.partial(self.store.update_known, change, known, deadline),
                f"writing {self.store.path}",
                limit,
            )
        except (StateError, OSError) as e:
            if isinstance(e, TimeoutError):
                # It may still land when the folder answers: written over from memory then.
                self.unsaved_state = True
                self._disk_stuck()
            if must:
                raise StateError(str(e)) from e
            self.saved = change(self.saved)
            key = "cannot persist the state"
            self._unsaved("state.json", f"{key}, kept in memory: {e}", key)
            return
        new, warning, kept, gone = done.state, done.warning, done.kept, done.gone
        self.saved = new
        self.saved_stamp = self.stamp()
        self.unsaved_state = False
        self.unwarn("cannot persist the state")
        self._report_outside(kept)
        if gone and not warning:
            # Deleted (or hidden by a mount) behind the daemon's back: written again from
            # memory, never from the defaults a read of no file gives (they would switch to
            # production at a restart). Recorded; no warning stays, since the file is back.
            what = (
                f"{self.store.path} disappeared while the daemon ran; rewritten from the "
                "daemon's state in memory"
            )
            self.log("state_file_missing", level="error", message=what)
            self.incident({"at": utcnow().isoformat(), "what": what})
        if warning:
            self.warn(warning)
            self.log("state_file_corrupt", level="error", message=warning)
            self.incident({"at": utcnow().isoformat(), "what": warning})

    def stamp(self) -> tuple[int, int, int] | None:
        path = self.store.path
        try:
            st = self.disk.call(
                functools.partial(os.stat, path, follow_symlinks=False), f"reading {path}"
            )
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _disk_stuck(self) -> None:
        stuck = self.disk.stuck()
        if stuck is not None:
            self.warn(f"{DISK_STUCK}: {stuck[0]} has had no answer since it began; what the "
                      "daemon writes is kept in memory until it answers")  # fmt: skip

    def disk_answers(self) -> bool:
        """Each pass: False while a call to the state folder is stuck (said in status)."""
        if self.disk.stuck() is not None:
            self._disk_stuck()
            return False
        self.unwarn(DISK_STUCK)
        return True

    def verify_state(self) -> None:
        """state.json changed behind the daemon's back (a stat per pass): read it again, so that
        a file that stopped parsing is moved aside, recorded and rewritten from memory now,
        not found at the next restart (which would start from defaults)."""
        if self.unsaved_state or not self.disk_answers():
            return
        if self.stamp() != self.saved_stamp:
            # A calibrate's baseline taken (StateStore.reconcile); a file deleted is written again
            # from memory and reported (see persist).
            self.persist(same)

    def _report_outside(self, kept: list[Kept]) -> None:
        for k in kept:
            fields, mode, aside = k.fields, k.mode, k.aside
            what = (
                f"{self.store.path} was changed outside the daemon ({', '.join(fields)}; "
                f"desired mode {mode.value} there, {self.saved.desired_mode.value} here): not "
                f"taken, kept as {aside} and written again from the daemon's state. To change "
                "the mode, use kimi-mode"
            )
            self.warn(what)
            self.log("state_file_changed", level="error", message=what, fields=fields)
            self.incident({"at": utcnow().isoformat(), "what": what})

    def _unsaved(self, file: str, message: str, key: str) -> None:
        self.log("persist_failed", level="error", file=file, message=message)
        if self.metrics:
            self.metrics.persist_failures.labels(file).inc()
        self.warn(message, key=key)
        if file == "state.json":
            self.unsaved_state = True

    def record(self, kind: str, record: TeardownReport | dict[str, Any]) -> None:
        """Append to history.jsonl; a record that cannot be written is kept and appended at
        the next pass (up to MAX_PENDING; older ones are counted as lost in the log)."""
        self.pending.append(Pending(kind, record))
        self.flush()

    def flush(self) -> None:
        """Write what could not be written: the state, then pending history records in order."""
        if not self.disk_answers():
            self._bound_pending()
            return
        if self.unsaved_state:
            saved = self.saved
            self.persist(functools.partial(replaced, saved))
        st = self.config.state
        while self.pending:
            p = self.pending[0]
            if p.written:  # by a call given up on, which returned since
                self.pending.popleft()
                continue

            append = functools.partial(
                history.append, st.dir, p.kind, p.record,
                max_bytes=int(st.history_max_mb * 2**20), keep=st.history_keep, once=p.tried,
            )  # fmt: skip
            try:
                self.disk.call(
                    append,
                    f"appending to {history.history_path(st.dir)}",
                    on_late=functools.partial(_written, p),
                )
            except (StateError, OSError) as e:
                if isinstance(e, TimeoutError):
                    self._disk_stuck()
                # A StateError is a write undone: this try is known not to have written it.
                p.tried = p.tried or not isinstance(e, StateError)
                self._bound_pending()
                key = "cannot append to the history"
                self._unsaved("history.jsonl", f"{key}, kept: {e}", key)
                return
            self.pending.popleft()
            self.unwarn("cannot append to the history")

    def _bound_pending(self) -> None:
        while len(self.pending) > MAX_PENDING:
            dropped = self.pending.popleft()
            if not dropped.written:
                self.log("history_record_lost", level="error", kind=dropped.kind)

    def persist_transition(self) -> None:
        tr = self.s.transition
        self.persist(functools.partial(with_transition, tr=tr))

    def desire(self, mode: Mode, by: str, must: bool = False) -> None:
        """Persist the desired mode: always before anything is torn down for it (`must`: an
        operator's request, refused with StateError if it cannot be persisted)."""
        self.persist(functools.partial(with_desired, mode=mode, by=by), must)
        if mode is not self.s.desired:
            self.log(
                "desired_mode_changed", previous=self.s.desired.value, desired=mode.value, by=by
            )
        self.s.desired = mode
        if by != "rollback":  # another switch asked for: the last rollback is history
            self.s.rolled_back = None

    def event(self, name: str, data: dict[str, Any] | None = None) -> None:
        tid = self.s.transition.id if self.s.transition else None
        self.outbox.append(Event(event=name, at=utcnow(), transition=tid, data=data or {}))

    def end(self, end: End) -> None:
        """A transition's end, to its followers (after the pass's status, like an event)."""
        self.outbox.append(end)

    def send_events(self) -> None:
        """The daemon, once the pass's status is published: what the pass had to say."""
        out, self.outbox = self.outbox, []
        for msg in out:
            self.bus.publish(msg)

    def read_history(self, last: int) -> list[dict[str, Any]]:
        """The last `last` history records, at most LOOP_HISTORY_MAX_BYTES of them, read by
        the state folder's process (OSError, TimeoutError included, when it cannot be read in
        time). The cap bounds what crosses its pipe, and the loop's time to take it in."""
        d = self.config.state.dir
        return self.disk.call(
            functools.partial(history.read, d, last, LOOP_HISTORY_MAX_BYTES),
            "reading the history",
        )

    def incident(self, record: dict[str, Any]) -> None:
        self.record("incident", record)

    def warn(self, message: str, key: str | None = None) -> None:
        """Logged once while it lasts (a failing read repeats every tick); shown in status.
        With `key`, the warning that starts with it is replaced, not logged again: one line
        for one cause, whatever its text says from pass to pass (an elapsed time)."""
        w = self.s.warnings
        if key is not None:
            for i, old in enumerate(w):
                if old.startswith(key):
                    w[i] = message
                    return
        if message not in w:
            self.log("warning", level="warning", message=message)
            w.append(message)
            del w[:-10]

    def unwarn(self, prefix: str) -> None:
        self.s.warnings = [w for w in self.s.warnings if not w.startswith(prefix)]

    def estimate_load(
        self, mode: Mode, argv: list[str]
    ) -> tuple[Estimate | None, str, dict[str, float]]:
        """What the past loads of `mode` with this argv predict, the argv's key, and the
        median of each part of the past switches' unavailable windows (decide/downtime.py)."""
        key = argv_key(argv)
        try:
            records = self.read_history(1000)
        except OSError:
            return None, key, {}
        return estimate(records, mode.value, key), key, expected_parts(records, mode.value, key)
