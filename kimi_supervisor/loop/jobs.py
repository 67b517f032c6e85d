"""The teardown job: a teardown (teardown/escalation.py) run on a thread of its own, which changes
nothing the loop owns. Its progress (`JobEvent`) and its end (`JobDone`) come back through the
inbox, and the loop applies them here: the step persisted in the transition, the GPU readings
shown in status, the events to the bus, the log and the metrics, and the report recorded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kimi_supervisor.config import Config
from kimi_supervisor.decide.policy import Purpose
from kimi_supervisor.loop import boot, warming
from kimi_supervisor.loop.context import Context
from kimi_supervisor.loop.inbox import JobDone, JobEvent, Message, Warmed
from kimi_supervisor.loop.loopstate import Job
from kimi_supervisor.model import Outcome, State, TeardownReport, utcnow
from kimi_supervisor.ports.http import request as http_request
from kimi_supervisor.status import WarmStatus
from kimi_supervisor.teardown.escalation import Teardown
from kimi_supervisor.teardown.events import GpusRead, Signalled, Spared, StepStarted

# The last /health probe of a serving vLLM before its stop: it answers in milliseconds while it
# serves; one that does not within this is not waited for (its last 200 stays the loop's).
PROBE_S = 1.0


def shutdown_budget_s(config: Config) -> float:
    """How long one shutdown teardown may take (asked of systemd with EXTEND_TIMEOUT_USEC)."""
    t = config.teardown
    return (
        t.term_grace_s
        + t.cgroup_kill_timeout_s
        + t.strays_timeout_s
        + t.holders_timeout_s
        + t.release_timeout_s
        + 30
    )


class Jobs:
    def __init__(self, ctx: Context, put: Callable[[Message], None]) -> None:
        self.ctx = ctx
        self.s = ctx.s
        self._put = put

    def run(
        self,
        purpose: Purpose,
        reason: str,
        detail: dict[str, Any] | None = None,
        cause: str = "",
        attempt: int = 1,
        probe: bool = False,
        warm_argv: list[str] | None = None,
    ) -> None:
        """Start a teardown on the job thread; its JobDone comes back through the inbox.
        `probe`: a vLLM serves until now; /health is asked once more just before the unit's
        stop, so that its unavailable window opens at its real last answer. `warm_argv`: the
        next vLLM's argv, whose model files are read into the page cache first, while the old
        vLLM still serves (loop/warming.py)."""
        s, ctx = self.s, self.ctx
        if not s.baselines:
            boot.resolve_baseline(ctx)
        s.job = job = Job(purpose, reason, detail or {}, attempt, cause)
        put = self._put
        td = Teardown(
            ctx.config,
            ctx.systemd,
            ctx.gpu,
            ctx.clock,
            dict(s.baselines),
            on_event=lambda e: put(JobEvent(e)),
            in_daemon=True,
            listed_since=ctx.observer.first_listed.snapshot(),
        )

        url, clock = ctx.config.vllm.health_url, ctx.clock

        def run() -> None:
            if warm_argv is not None:
                try:
                    end = warming.warm(
                        ctx.config.warm, warm_argv, job.stop_warm, clock, lambda w: put(Warmed(w))
                    )
                except Exception as e:  # a warming never stops the switch
                    end = WarmStatus(under_way=False, text=f"nothing warmed: it failed: {e!r}")
                put(Warmed(end, done=True))
            ok_at = None
            if probe and http_request(url, timeout_s=PROBE_S).status == 200:
                ok_at = clock.monotonic()
            began = clock.monotonic()
            try:
                put(JobDone(td.run(), ok_at=ok_at, began=began))
            except BaseException as e:  # reported to the loop, which decides
                put(JobDone(None, e, ok_at, began))

        threading.Thread(target=run, name="teardown", daemon=True).start()

    def apply(self, job_event: JobEvent) -> None:
        s, ctx, e = self.s, self.ctx, job_event.event
        tid = s.transition.id if s.transition else None
        data = e.data()
        ctx.log(e.kind, transition=tid, **data)
        match e:
            case StepStarted(step=step) if s.transition is not None:
                s.transition = s.transition.model_copy(
                    update={"step": f"teardown:{step.value}", "step_changed_at": utcnow()}
                )
                ctx.persist_transition()
            case GpusRead(devices=devices):
                ctx.observer.gpus_from_teardown(devices)
            case Signalled(record=r) if r.signal == "SIGKILL" and ctx.metrics:
                ctx.metrics.kills.labels(r.step.value, r.evidence.value).inc()
            case Spared() if ctx.metrics:
                ctx.metrics.spared.inc()
        ctx.event(e.kind, data)
        ctx.publish()

    def warmed(self, w: Warmed) -> None:
        """The warming's progress shown; at its end the teardown begins (on the job thread):
        the old vLLM stops serving now."""
        s, ctx = self.s, self.ctx
        s.warm = w.status
        ctx.event("warm", w.status.model_dump(mode="json"))
        if not w.done:
            ctx.publish()
            return
        ctx.log("warmed", **w.status.model_dump(mode="json"))
        if s.transition is not None:
            s.transition = s.transition.model_copy(
                update={"step": "teardown", "step_changed_at": utcnow()}
            )
            ctx.persist_transition()
        s.serving = None
        ctx.set_state(State.TEARING_DOWN, w.status.text)

    def finish(self, done: JobDone) -> tuple[Job, TeardownReport, bool]:
        """The teardown's end, recorded (history, metrics, status); what policy reads next."""
        s, ctx = self.s, self.ctx
        job, s.job = s.job, None
        assert job is not None
        report = done.report
        if report is None:
            ctx.log("teardown_crashed", level="error", error=repr(done.error))
            report = TeardownReport(unit=ctx.unit, started_at=utcnow(), outcome=Outcome.STUCK)
            report.diagnosis = f"the teardown failed with an internal error: {done.error!r}"
            report.next_action = "see `journalctl -u kimi-supervisor`, then retry the switch"
        s.last_teardown = report
        tid = s.transition.id if s.transition else None
        body = report.model_dump(mode="json") | {"transition": tid, "reason": job.reason}
        stuck = report.outcome is Outcome.STUCK
        # A STUCK episode's retry that killed nothing and found what the last record says is
        # counted (the episode's incident), not recorded again: the history stays readable.
        if not (stuck and s.stuck_since and not report.kills and
                report.diagnosis == s.stuck_recorded):  # fmt: skip
            ctx.record("teardown", body)
            s.stuck_recorded = report.diagnosis if stuck else ""
        if ctx.metrics:
            ctx.metrics.teardown_seconds.labels(report.outcome.value).observe(report.duration_s)
        clean = report.outcome is Outcome.CLEAN
        if clean and s.baseline_provisional:
            boot.resolve_baseline(ctx)
        ctx.observer.sample(s.indices, s.baselines)
        ctx.publish()
        return job, report, clean
