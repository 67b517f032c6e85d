"""The setbacks of a lifecycle: a start that failed, a vLLM that died, an intrusion while it
loads, the failure window and its backoff, a STUCK teardown and its episode, and how every
transition ends (its one history record). Lifecycle (loop/transitions.py) builds on these.
"""

from __future__ import annotations

from typing import Any

from kimi_supervisor.decide import policy
from kimi_supervisor.decide.cause import explain
from kimi_supervisor.decide.policy import Purpose
from kimi_supervisor.loop.context import Context
from kimi_supervisor.loop.intrusion import Intruder, incident
from kimi_supervisor.loop.jobs import Jobs
from kimi_supervisor.loop.liveness import Reading
from kimi_supervisor.loop.loopstate import LoopState
from kimi_supervisor.loop.window import Window
from kimi_supervisor.messages import End
from kimi_supervisor.model import State, TeardownReport, utcnow
from kimi_supervisor.status import FailureStatus, IntrusionStatus
from kimi_supervisor.store import history

# How many of the newest history records are searched for a transition already recorded.
RECENT = 200


class Setbacks:
    ctx: Context
    s: LoopState
    jobs: Jobs
    window: Window

    # ------------------------------------------------------------------ failures
    def start_failed(self, reason: str) -> None:
        s, ctx = self.s, self.ctx
        tr = s.transition
        assert tr is not None
        ctx.follow_output()
        tail = ctx.output.tail()
        said, more = explain(tail), ctx.output.where
        if said:
            reason = f"{reason}; vLLM said: {' / '.join(said)}"
        s.last_failure = FailureStatus(
            at=utcnow().isoformat(), mode=tr.target, reason=reason, said=said, more=more
        )
        ctx.log(
            "vllm_start_failed",
            level="error",
            mode=tr.target.value,
            reason=reason,
            output_tail=tail,
            more=more,
        )
        ctx.event(
            "start_failed",
            {"mode": tr.target.value, "reason": reason, "output_tail": tail, "more": more},
        )
        s.transition = tr.model_copy(update={"step": "teardown"})
        ctx.set_state(State.TEARING_DOWN, reason)
        detail = {"reason": reason, "said": said, "more": more, "output_tail": tail}
        why = f"start of {tr.target.value} failed: {reason}"
        self.jobs.run(Purpose.START_FAILED, why, detail, cause=reason)

    def died(self, reason: str) -> None:
        self._lost("vllm_died", reason, reason, f"vLLM died: {reason}", reason, {})

    def hung(self, reason: str, reading: Reading) -> None:
        """vLLM serves but does no work (loop/liveness.py): what a dead one gets, an incident
        with what was seen, a teardown, a start again under the failure window's backoff."""
        seen: dict[str, Any] = {"main_pid": reading.pid}
        if reading.work is not None:
            seen |= {"running": reading.work.running, "tokens": reading.work.tokens}
        if reading.canary is not None:
            seen |= {"canary_s": round(reading.canary.took_s, 1)}
        if self.ctx.metrics:
            self.ctx.metrics.hangs.inc()
        what = f"vLLM hung: {reason}"
        self._lost("vllm_hung", reason, what, what, f"hung: {reason}", seen)

    def _lost(
        self, event: str, reason: str, what: str, why: str, cause: str, seen: dict[str, Any]
    ) -> None:
        """The vLLM that served is lost (dead or hung): logged, an incident (`what`, with
        what was `seen`), an event, and the teardown (`why`) that comes before serving again."""
        s, ctx = self.s, self.ctx
        mode = s.serving.mode.value if s.serving else None
        ctx.log(event, level="error", reason=reason, mode=mode, **seen)
        ctx.incident({"at": utcnow().isoformat(), "what": what, **seen})
        ctx.event(event, {"reason": reason, **seen})
        s.serving = None
        self.window.lost()
        ctx.set_state(State.TEARING_DOWN, what)
        self.jobs.run(Purpose.DIED, why, cause=cause)

    def intrusion(self, found: list[Intruder]) -> None:
        """While vLLM loads, a process outside its unit took a managed GPU: noticed (history,
        event, metric, status), then torn down with vLLM's partial load (the teardown kills it
        on NVML's evidence), then the load again after the failure backoff."""
        s, ctx = self.s, self.ctx
        tr = s.transition
        assert tr is not None
        reason, record = incident(found, ctx.unit, tr.target)
        s.last_intrusion = IntrusionStatus.model_validate(record)
        ctx.incident(record)
        ctx.log("gpu_intrusion", level="warning", **record)
        ctx.event("gpu_intrusion", record)
        if ctx.metrics:
            for f in found:
                ctx.metrics.intrusions.labels(str(f.gpu)).inc()
        s.transition = tr.model_copy(update={"step": "teardown"})
        ctx.set_state(State.TEARING_DOWN, reason)
        self.jobs.run(Purpose.INTRUSION, reason, {"intrusion": record}, cause=reason)

    def failure(self, reason: str, detail: dict[str, Any], outcome: str = "failed") -> None:
        s, ctx, d = self.s, self.ctx, self.ctx.config.daemon
        now = ctx.clock.monotonic()
        v = policy.after_failure(
            s.failures,
            now,
            d.failure_window_s,
            d.max_failures,
            d.restart_backoff_initial_s,
            d.restart_backoff_max_s,
        )
        s.failures = v.failures
        n = len(v.failures)
        if v.failed:
            msg = (
                f"{reason}; {n} failures within {d.failure_window_s:g} s: not retrying. "
                f"Fix the cause, then `kimi-mode {s.desired.value}`"
            )
            self.end_transition(False, "failed", msg, detail)
            ctx.log("failed", level="error", message=msg)
            ctx.set_state(State.FAILED, msg)
            return
        s.next_attempt_at = now + v.backoff_s
        msg = (
            f"{reason}; starting {s.desired.value} again in {v.backoff_s:g} s (failure {n} "
            f"of {d.max_failures})"
        )
        self.end_transition(False, outcome, msg, detail)
        ctx.set_state(State.BACKOFF, msg)

    def stuck(self, report: TeardownReport, detail: dict[str, Any] | None = None) -> None:
        """A teardown ended STUCK: the episode begins, or goes on. Its own retries end their
        transitions unrecorded (the episode's incident counts them when it ends), so that the
        history keeps what operators asked for in view."""
        s, ctx, d = self.s, self.ctx, self.ctx.config.daemon
        tr = s.transition
        retry = s.stuck_since is not None and tr is not None and tr.kind == "retry"
        if s.stuck_since is None:
            s.stuck_since = utcnow()
        wait = policy.stuck_retry_s(s.stuck_retries, d.stuck_retry_s, d.restart_backoff_max_s)
        s.stuck_retries += 1
        s.next_attempt_at = ctx.clock.monotonic() + wait
        msg = (
            f"teardown STUCK: {report.diagnosis}. Next: {report.next_action}. "
            f"Retrying in {wait:g} s; vLLM is not started on occupied GPUs"
        )
        self.end_transition(False, "stuck", msg, detail or {}, recorded=not retry)
        ctx.log("stuck", level="error", message=msg, retries=s.stuck_retries)
        ctx.set_state(State.STUCK, msg)

    def unstuck(self, how: str) -> None:
        """The STUCK episode is over: one incident, with how long it lasted and its retries."""
        s, ctx = self.s, self.ctx
        since, retries = s.stuck_since, s.stuck_retries
        if since is None:
            return
        now = utcnow()
        took = (now - since).total_seconds()
        what = (
            f"the GPUs were STUCK for {took:.0f} s (since {since.isoformat()}), "
            f"{retries} teardown(s) tried again: {how}"
        )
        ctx.incident(
            {
                "at": now.isoformat(),
                "what": what,
                "stuck_since": since.isoformat(),
                "stuck_s": round(took, 1),
                "retries": retries,
            }
        )
        ctx.log("unstuck", message=what)
        s.stuck_since, s.stuck_retries, s.stuck_recorded = None, 0, ""

    def end_transition(
        self,
        ok: bool,
        outcome: str,
        message: str,
        detail: dict[str, Any] | None = None,
        recorded: bool = True,
    ) -> None:
        s, ctx = self.s, self.ctx
        tr = s.transition
        if tr is None:
            return
        record = tr.finished(utcnow(), outcome, message, detail or {})
        # One record per transition, whatever the moment of a kill: a daemon killed between
        # this append and clearing the persisted transition finds it here when it ends it again
        # (only a transition inherited at boot can have been recorded already).
        if recorded and (
            tr.id != s.inherited_id
            or not any(
                e.get("kind") == "transition" and e.get("id") == tr.id
                for e in history.read(ctx.config.state.dir, RECENT)
            )
        ):
            ctx.record("transition", record)
        if ctx.metrics:
            ctx.metrics.transitions.labels(tr.target.value, outcome).inc()
        ctx.log("transition_finished", level="info" if ok else "warning", **record)
        ctx.bus.publish(
            End(ok=ok, outcome=outcome, message=message, data={"transition": tr.id, **record})
        )
        s.transition = None
        ctx.persist_transition()
