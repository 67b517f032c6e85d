"""The incident bundle, made at the moment it matters (store/bundle.py says what is in it): at a
STUCK (the episode's first teardown), at FAILED, and at a hang restart (a `vllm_hung` verdict
whose teardown ended clean, vLLM started again after the backoff).

Evidence, not a step of the state machine: the loop hands the moment's data (the teardown
report, the history not written yet, the holders the report names, the health last read,
vLLM's last output lines it followed) to a thread of its own and goes on at once. The thread
asks NVML for the managed GPUs (the daemon's `nvml` process, `gpus.timeout_s`), then hands
the rest to the bundle's I/O process (ports/bounded.py; `kimi-supervisor-io-bundle-PID.scope`),
which reads the holders' /proc, the history and the kernel's Xid lines and writes the file,
waited for at most `BUNDLE_TIMEOUT_S`. What comes back (`BundleDone`) only changes what status
and the metrics say of bundles. A failure is logged and said there; nothing else changes. The
loop never waits for the thread: a read stuck in the kernel holds no pass, no stop, no switch.
One bundle is made at a time; one asked for while one is made waits (the newest one; an older
one waiting is replaced, and the log says so).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from kimi_supervisor.loop.context import Context
from kimi_supervisor.loop.inbox import BundleDone, Message
from kimi_supervisor.model import TeardownReport, utcnow
from kimi_supervisor.ports.bounded import IoWorker, Worker
from kimi_supervisor.ports.gpu import reading_error
from kimi_supervisor.status import BundleStatus
from kimi_supervisor.store import bundle
from kimi_supervisor.store.bundle import Bundle, Holder

# How long the bundle's I/O process may take to read and write one bundle: its /proc reads
# (bundle.PROC_READ_S each, then none once one is stuck), the journal's Xid lines (3 s), the
# history and the file (1 MiB at most). Past it, the call is abandoned in its process.
BUNDLE_TIMEOUT_S = 30.0
_ROLE_ORDER = {"suspect": 0, "candidate": 1, "unknown": 2, "bystander": 3}
# How long the newest bundle's look-up at the start may take.
FIND_TIMEOUT_S = 5.0


def _pending(kind: str, record: TeardownReport | dict[str, Any]) -> dict[str, Any]:
    """A history record not written yet, as the history will hold it."""
    body = record.model_dump(mode="json") if isinstance(record, TeardownReport) else record
    return {"kind": kind, **body}


class Bundles:
    def __init__(
        self,
        ctx: Context,
        put: Callable[[Message], None],
        *,
        kept: Callable[[], dict[str, str] | None] = lambda: None,
    ) -> None:
        self.ctx = ctx
        self._put = put
        # What explains a hang, read before its teardown (loop/liveness.Liveness.take_kept:
        # vLLM's stacks, the GPUs' counters, the last /metrics, its last output lines), taken
        # by the next bundle: the hang's restart, or the STUCK or FAILED its teardown ends in.
        self._kept = kept
        self.worker: IoWorker = ctx.bundle_worker or Worker(
            "bundle-io", BUNDLE_TIMEOUT_S, copy=True
        )
        self.folder = str(ctx.config.state.dir / bundle.DIR)
        self._lock = threading.Lock()
        self._busy = False
        self._waiting: Bundle | None = None
        self._written: list[str] = []  # the bundles this daemon wrote, oldest first

    # ------------------------------------------------------------------ the loop's side
    def find_newest(self) -> None:
        """At the start: the newest bundle already there, so that status names it across a
        restart (asked off the loop, like a bundle)."""
        worker, d = self.worker, self.ctx.config.state.dir

        def run() -> None:
            try:
                found = worker.call(
                    functools.partial(bundle.newest, d), "finding the newest bundle",
                    FIND_TIMEOUT_S,
                )  # fmt: skip
            except Exception:  # evidence only: none is known then
                return
            if found is not None:
                made = bundle.Made(found[0], found[1], (), "")
                self._put(BundleDone("", made=made, found=True))

        threading.Thread(target=run, name="incident-bundle", daemon=True).start()

    def collect(self, trigger: str, reason: str, report: TeardownReport | None) -> None:
        """The loop's thread, at the moment: the data handed to a thread of its own. Never
        raises, never waits."""
        ctx, s = self.ctx, self.ctx.s
        try:
            kept = self._kept()
            now = utcnow()
            holders: list[Holder] = []
            if report is not None:
                # Suspects first, bystanders last: the cap on holders read keeps what matters.
                for r in sorted(report.remaining, key=lambda r: _ROLE_ORDER.get(r.role.value, 9)):
                    p = r.process
                    seen = f" ({r.seen})" if r.seen and r.seen not in r.why else ""
                    holders.append(Holder(p.pid, p.start_time, f"{r.role.value}: {r.why}{seen}"))
                named = {h.pid for h in holders}
                for d in report.devices:
                    for pid in d.processes:
                        if pid not in named:
                            named.add(pid)
                            holders.append(Holder(pid, None, f"listed by NVML on GPU {d.index}"))
            body = report.model_dump(mode="json") if report is not None else None
            if kept and "output" in kept:  # read at the verdict: the last lines before it
                output = kept["output"].splitlines()
            else:
                ctx.output.read_new()  # the lines since the load, if they were not followed
                output = ctx.output.tail()
            due = Bundle(
                trigger=trigger,
                at=now.isoformat(),
                stamp=f"{now:%Y%m%dT%H%M%S.%fZ}",
                reason=reason,
                unit=ctx.unit,
                state_dir=ctx.config.state.dir,
                keep=ctx.config.state.bundles_keep,
                report=body,
                pending=[_pending(p.kind, p.record) for p in ctx.pending if not p.written],
                holders=tuple(holders),
                gpu_health=s.gpu_health.model_dump(mode="json") if s.gpu_health else None,
                output_tail=output,
                output_where=ctx.output.where,
                kept={k: v for k, v in (kept or {}).items() if k != "output"},
            )
        except Exception as e:  # a bundle never costs the daemon what it was doing
            ctx.log("incident_bundle_failed", level="error", trigger=trigger, error=repr(e))
            return
        ctx.log("incident_bundle_collecting", trigger=trigger, holders=len(holders))
        with self._lock:
            if self._busy:
                if self._waiting is not None:
                    ctx.log("incident_bundle_replaced", level="warning",
                            trigger=self._waiting.trigger, by=trigger)  # fmt: skip
                self._waiting = due
                return
            self._busy = True
        indices = list(s.indices)
        threading.Thread(
            target=self._run, args=(due, indices), name="incident-bundle", daemon=True
        ).start()

    def done(self, msg: BundleDone) -> None:
        """The loop's thread: what the bundle's thread came back with, shown."""
        ctx, s = self.ctx, self.ctx.s
        old = s.bundle or BundleStatus(folder=self.folder)
        if msg.made is not None:
            m = msg.made
            if msg.found:
                if old.path is None:
                    s.bundle = old.model_copy(update={"path": m.path, "size": m.size})
                return
            s.bundle = BundleStatus(
                path=m.path, at=utcnow().isoformat(), trigger=msg.trigger, size=m.size,
                cut=list(m.cut), unread=list(m.unread), folder=self.folder,
            )  # fmt: skip
            ctx.log("incident_bundle_written", trigger=msg.trigger, path=m.path, size=m.size,
                    cut=list(m.cut), unread=list(m.unread), pruned=m.pruned)  # fmt: skip
            if ctx.metrics:
                ctx.metrics.bundles.inc()
                ctx.metrics.last_bundle.set(utcnow().timestamp())
            return
        s.bundle = old.model_copy(update={"error": msg.error, "error_at": utcnow().isoformat()})
        ctx.log("incident_bundle_failed", level="error", trigger=msg.trigger, error=msg.error)
        if ctx.metrics:
            ctx.metrics.bundle_failures.inc()

    # ------------------------------------------------------------------ the bundle's thread
    def _run(self, due: Bundle | None, indices: list[int]) -> None:
        while due is not None:
            self._put(self._one(due, indices))
            with self._lock:
                due, self._waiting = self._waiting, None
                if due is None:
                    self._busy = False

    def _one(self, due: Bundle, indices: list[int]) -> BundleDone:
        try:
            samples = self.ctx.gpu.sample(indices)
            gpus: list[dict[str, object]] | str = [asdict(d) for d in samples]
            named = {h.pid for h in due.holders}
            more: list[Holder] = []
            for d in samples:
                for p in d.processes:
                    if p.pid not in named:
                        named.add(p.pid)
                        more.append(Holder(p.pid, None, f"listed by NVML on GPU {d.index}"))
            due = replace(bundle.with_gpus(due, gpus), holders=due.holders + tuple(more))
        except Exception as e:  # no reading: said in the bundle
            due = bundle.with_gpus(due, reading_error(e))
        with self._lock:  # what it wrote before, kept first by the prune (a stepped clock)
            due = replace(due, recent=tuple(self._written[-due.keep :]))
        try:
            made = self.worker.call(
                functools.partial(bundle.make, due),
                f"writing the incident bundle {due.name}",
                BUNDLE_TIMEOUT_S,
            )
        except Exception as e:  # StateError, TimeoutError, the process gone: said, no more
            return BundleDone(due.trigger, error=str(e) or repr(e))
        with self._lock:
            self._written = [*self._written[-due.keep :], due.name]
        return BundleDone(due.trigger, made=made)
