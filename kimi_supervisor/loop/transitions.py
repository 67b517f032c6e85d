"""The lifecycle actions: what the loop does once reconcile or policy has chosen.

    begin_transition -> teardown job ... job_done -> policy.after_teardown -> start | rollback |
                                                    failure | stuck | take over | stop
    start -> (the loop polls /health: reconcile) -> ready | start_failed -> teardown job ...

The setbacks (a failed start, a death, an intrusion, STUCK) and how a transition ends are in
loop/setbacks.py. A teardown runs on a job thread (loop/jobs.py), which changes nothing the loop
owns: it reports its progress and its end through the loop's inbox, and the loop applies them.
So nothing here calls itself, and requests keep being answered while a teardown runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import datetime, timedelta

from kimi_supervisor.decide import policy
from kimi_supervisor.decide.policy import Next, Purpose
from kimi_supervisor.decide.progress import Progress
from kimi_supervisor.decide.reconcile import Action, Do, Observed
from kimi_supervisor.loop.context import Context, new_id
from kimi_supervisor.loop.inbox import JobDone, JobEvent, LivenessSeen, Message, Warmed
from kimi_supervisor.loop.jobs import Jobs, shutdown_budget_s
from kimi_supervisor.loop.liveness import Liveness, Reading
from kimi_supervisor.loop.loopstate import Job, Serving
from kimi_supervisor.loop.setbacks import Setbacks
from kimi_supervisor.loop.window import Window
from kimi_supervisor.model import Mode, State, TeardownReport, utcnow
from kimi_supervisor.ports import launcher, processes
from kimi_supervisor.ports.systemd import SystemdError
from kimi_supervisor.status import LivenessStatus
from kimi_supervisor.store.state import TransitionRecord


class Lifecycle(Setbacks):
    def __init__(self, ctx: Context, put: Callable[[Message], None]) -> None:
        self.ctx = ctx
        self.s = ctx.s
        self._put = put
        self.jobs = Jobs(ctx, put)
        self.window = Window(ctx)
        self.liveness = Liveness(ctx.config, lambda r: put(LivenessSeen(r)))

    # ------------------------------------------------------------------ reconcile's actions
    def act(self, action: Action, obs: Observed) -> None:
        s, log = self.s, self.ctx.log
        if action.do is Do.NOTHING:
            return
        log("reconcile", action=action.do.value, reason=action.reason, state=s.state.value)
        match action.do:
            case Do.ADOPT:
                self.adopt(obs, action.reason)
            case Do.RESUME_START:
                self.resume_start(obs)
            case Do.READY:
                self.ready(obs)
            case Do.START_FAILED:
                self.start_failed(action.reason)
            case Do.DIED:
                self.died(action.reason)
            case Do.HOLD_FOR_CAPTURE:
                c = s.capture
                if c is not None and c.phase.stoppable and not c.stop.is_set():
                    log("capture_stopped_for_switch", capture=c.id)
                    c.stop.set()
            case Do.SWITCH if s.intent is not None:
                # An operator's switch: it ends the one in progress (a load) and starts anew.
                intent, s.intent = s.intent, None
                if s.transition is not None:
                    why = f"superseded by a switch to {intent.mode.value}"
                    self.end_transition(False, "preempted", why)
                self.begin_transition(
                    intent.mode, "switch", f"asked by {intent.by}", intent.by, intent.id,
                    intent.force,
                )  # fmt: skip
            case Do.SWITCH | Do.RETRY:
                kind, reason = ("retry" if action.do is Do.RETRY else "switch"), action.reason
                if s.interrupted is not None:
                    i = s.interrupted
                    kind = "switch"
                    reason = (
                        f"redoing {i.id} (to {i.target.value}), interrupted at {i.step}: {reason}"
                    )
                    s.interrupted = None
                elif s.state is State.BOOTING:
                    kind = "boot"
                self.begin_transition(s.desired, kind, reason, "daemon")

    def adopt(self, obs: Observed, reason: str) -> None:
        s = self.s
        ref = processes.ref_of(obs.main_pid)
        since = utcnow()
        if ref is not None:
            with contextlib.suppress(OSError, ValueError):
                since = datetime.fromtimestamp(processes.start_time_epoch(ref), tz=since.tzinfo)
        s.serving = Serving(obs.running_mode or s.desired, obs.main_pid, since)
        if s.transition is not None or s.interrupted is not None:
            s.transition = s.transition or s.interrupted
            self.end_transition(True, "ready", f"{s.desired.value} was already running")
        s.interrupted = None
        self.ctx.log("adopted", mode=s.desired.value, main_pid=obs.main_pid, reason=reason)
        if obs.argv_stale:
            self.ctx.log(
                "restart_needed",
                level="warning",
                mode=s.desired.value,
                main_pid=obs.main_pid,
                message=f"vLLM runs {s.desired.value} with an earlier config's argv; it keeps "
                f"serving: `kimi-mode {s.desired.value} --apply` loads the config's",
            )
        self.ctx.set_state(State.SERVING, reason)
        s.stuck_retries, s.last_failure, s.liveness = 0, None, None

    def resume_start(self, obs: Observed) -> None:
        s, ctx = self.s, self.ctx
        tr, s.interrupted = s.interrupted, None
        now = utcnow()
        if tr is None or tr.target is not s.desired:
            tr = TransitionRecord(
                id=new_id(),
                target=s.desired,
                kind="boot",
                reason="found loading at boot",
                requested_by="daemon",
                started_at=now,
                step="starting",
                step_changed_at=now,
            )
        limit = timedelta(seconds=ctx.config.daemon.start_timeout_s)
        deadline_at = tr.start_deadline_at or now + limit
        s.transition = tr.model_copy(update={"step": "starting", "start_deadline_at": deadline_at})
        ctx.persist_transition()
        s.start_deadline = ctx.clock.monotonic() + (deadline_at - now).total_seconds()
        ctx.output.begin()
        s.progress = Progress()
        ctx.log("start_resumed", transition=tr.id, main_pid=obs.main_pid)
        ctx.set_state(State.STARTING, "a load was in progress when the daemon started")

    # ------------------------------------------------------------------ a switch
    def begin_transition(
        self, target: Mode, kind: str, reason: str, by: str, id: str = "", force: bool = False
    ) -> None:
        """A transition begins: recorded, persisted, announced, and its teardown started. `id`:
        the one made when an operator's switch was accepted (else a new one)."""
        s, ctx = self.s, self.ctx
        now = utcnow()
        obs = s.observed
        previous = s.serving.mode if s.serving else None
        served = s.serving is not None
        warm = served and not force and ctx.config.warm.enabled and not s.stuck_since
        self.window.begin(served)
        if previous is None and obs is not None and obs.unit_up:
            previous = obs.running_mode
        tr = TransitionRecord(
            id=id or new_id(),
            target=target,
            previous=previous,
            kind=kind,  # type: ignore[arg-type]
            reason=reason,
            requested_by=by,
            started_at=now,
            step="warming" if warm else "teardown",
            step_changed_at=now,
        )
        # While it warms, the old vLLM still serves (and status says so).
        s.transition, s.next_attempt_at, s.warm = tr, None, None
        if not warm:
            s.serving = None
        ctx.persist_transition()
        ctx.log("transition_started", **tr.model_dump(mode="json"))
        ctx.event("transition_started", tr.model_dump(mode="json"))
        # STUCK lasts while it is true: the GPUs are not clean until a teardown says so, and
        # neither a retry nor a switch asked for meanwhile makes them so.
        state = State.STUCK if s.stuck_since else State.WARMING if warm else State.TEARING_DOWN
        ctx.set_state(state, reason)
        argv = ctx.config.launch_argv(target) if warm else None
        self.jobs.run(Purpose.SWITCH, reason, probe=served and not force, warm_argv=argv)

    def start(self) -> None:
        s, ctx = self.s, self.ctx
        tr = s.transition
        assert tr is not None
        argv_file = launcher.write_argv_file(ctx.config, tr.target)
        ctx.output.begin()
        s.progress = Progress()
        deadline_at = utcnow() + timedelta(seconds=ctx.config.daemon.start_timeout_s)
        s.transition = tr = tr.model_copy(
            update={
                "step": "starting",
                "step_changed_at": utcnow(),
                "start_deadline_at": deadline_at,
            }
        )
        ctx.persist_transition()
        argv = ctx.config.launch_argv(tr.target)
        try:
            if ctx.systemd.status(ctx.unit).active_state == "failed":
                ctx.systemd.reset_failed(ctx.unit)
            ctx.systemd.start(ctx.unit)
        except SystemdError as e:
            ctx.set_state(State.STARTING)
            self.start_failed(f"systemd refused to start {ctx.unit}: {e}")
            return
        s.load_started = ctx.clock.monotonic()
        s.start_deadline = s.load_started + ctx.config.daemon.start_timeout_s
        s.eta, s.load_key, s.expected_parts = ctx.estimate_load(tr.target, argv)
        expected = {"expected_s": s.eta.expected_s, "past": s.eta.past} if s.eta else {}
        ctx.log("vllm_starting", mode=tr.target.value, argv=argv, argv_file=str(argv_file))
        ctx.event("starting", {"mode": tr.target.value, "argv": argv, **expected})
        ctx.set_state(State.STARTING, f"started {ctx.unit} in {tr.target.value}")

    def ready(self, obs: Observed) -> None:
        s, ctx = self.s, self.ctx
        tr = s.transition
        ctx.follow_output()
        mode = tr.target if tr else s.desired
        s.serving = Serving(mode, obs.main_pid, utcnow())
        s.progress = Progress("ready")
        took = round((utcnow() - tr.started_at).total_seconds(), 3) if tr else 0.0
        info = {"mode": mode.value, "main_pid": obs.main_pid, "duration_s": took}
        load = s.finish_load(ctx.clock.monotonic())
        if ctx.metrics and load:
            ctx.metrics.start_seconds.labels(mode.value).observe(load["load_s"])
        if window := self.window.ready(mode):
            load["downtime"] = window
        ctx.event("ready", info | load)
        ctx.log("vllm_ready", **info, **load)
        s.stuck_retries, s.last_failure, s.liveness = 0, None, None
        self.end_transition(True, "ready", f"{mode.value} is ready ({took:.1f} s)", load)
        ctx.set_state(State.SERVING, "GET /health answered 200")

    # ------------------------------------------------------------------ liveness
    def judge_liveness(self, obs: Observed) -> None:
        """A pass while vLLM serves: a liveness probe, when one is due (loop/liveness.py)."""
        s = self.s
        if s.state is State.SERVING and s.serving and obs.main_pid == s.serving.pid:
            capturing = s.capture is not None and s.capture.active
            self.liveness.serving(s.serving.pid, self.ctx.clock.monotonic(), capturing)

    def liveness_seen(self, reading: Reading) -> None:
        s, ctx = self.s, self.ctx
        why = self.liveness.seen(reading, ctx.clock.monotonic())
        c, w = reading.canary, reading.work
        seen = (s.liveness or LivenessStatus()).model_copy(
            update={"running": w.running if w else None, "tokens": w.tokens if w else None}
        )
        if c is not None:
            seen = seen.model_copy(
                update={"canary_at": utcnow().isoformat(), "canary_ok": c.ok,
                        "canary_s": round(c.took_s, 3), "canary_tokens": c.tokens}
            )  # fmt: skip
        s.liveness = seen
        if c is not None and c.answered and not c.ok:
            ctx.warn(f"the liveness canary was refused ({c.detail}): only /metrics can tell")
        elif c is not None and c.ok:
            ctx.unwarn("the liveness canary was refused")
        serving = s.state is State.SERVING and s.serving and s.serving.pid == reading.pid
        if why and serving and not s.busy:
            self.hung(why, reading)

    # ------------------------------------------------------------------ stopping
    def begin_shutdown(self) -> None:
        """`systemctl stop`: teardown to CLEAN (up to policy.SHUTDOWN_ATTEMPTS tries). Stopped
        while still waiting for the GPU driver, the daemon has started nothing, and no GPU can
        be read: vLLM's unit is stopped (should anyone have started it) and the daemon ends,
        with no teardown that could only fail."""
        ctx, s = self.ctx, self.s
        if not s.driver_ready:
            ctx.set_state(State.STOPPING, "stop requested")
            try:
                ctx.systemd.stop(ctx.unit)
                note = f"stopped {ctx.unit}; no GPU was read: {s.waiting_for or 'no driver'}"
            except SystemdError as e:
                note = f"{ctx.unit} not stopped ({e}); no GPU was read"
            ctx.log("stopped", clean=None, desired=s.desired.value, note=note)
            s.stopped_clean = True
            return
        ctx.notifier.extend_timeout(shutdown_budget_s(ctx.config))
        ctx.set_state(State.STOPPING, "stop requested")
        ctx.notifier.stopping("stopping: tearing vLLM down")
        self.end_transition(False, "stopped", "the daemon is stopping")
        self.jobs.run(Purpose.SHUTDOWN, "the supervisor is stopping")

    # ------------------------------------------------------------------ the teardown job
    def main_exited(self) -> None:
        """vLLM's MainPID exited. While a switch warms, the old mode no longer serves: the
        warming stops (there is nothing left to keep serving for) and the teardown begins."""
        s = self.s
        self.ctx.observer.forget_health()
        if s.state is State.WARMING:
            s.serving = None
            s.stop_warming()

    def job_message(self, msg: JobEvent | JobDone | Warmed) -> None:
        match msg:
            case JobEvent():
                self.jobs.apply(msg)
            case Warmed():
                self.jobs.warmed(msg)
            case JobDone():
                self.job_done(msg)

    def job_done(self, done: JobDone) -> None:
        self.window.probed(done.ok_at)
        job, report, clean = self.jobs.finish(done)
        if clean and done.began is not None:
            self.window.teardown_done(report, done.began)
        self._after_teardown(job, report, clean)

    def _after_teardown(self, job: Job, report: TeardownReport, clean: bool) -> None:
        s, ctx = self.s, self.ctx
        purpose, detail = job.purpose, job.detail
        tr = s.transition
        back = policy.rollback_target(tr.target, tr.previous) if tr else None
        then = policy.after_failed_start(
            ctx.config.daemon.rollback, tr is not None and tr.kind == "rollback", back
        )
        if clean:
            self.unstuck("a teardown made them clean")
        match policy.after_teardown(
            purpose, clean, s.stop_requested, s.intent is not None, then, job.attempt
        ):
            case Next.EXIT:
                self.unstuck("the daemon stopped with them still not clean")
                s.stopped_clean = clean
                ctx.log("stopped", clean=clean, desired=s.desired.value)
            case Next.SHUTDOWN_AGAIN:
                ctx.notifier.extend_timeout(shutdown_budget_s(ctx.config))
                self.jobs.run(purpose, job.reason, attempt=job.attempt + 1)
            case Next.STUCK:
                self.stuck(report, detail)
            case Next.STOPPED:
                self.end_transition(False, "stopped", "the daemon is stopping", detail)
            case Next.TAKE_OVER:
                intent, s.intent = s.intent, None
                assert intent is not None
                why = f"superseded by a switch to {intent.mode.value}"
                self.end_transition(False, "preempted", why, detail)
                by = intent.by
                why = f"asked by {by} (took over)"
                self.begin_transition(intent.mode, "switch", why, by, intent.id)
            case Next.START:
                self.start()
            case Next.ROLLBACK:
                assert tr is not None and back is not None
                why = f"{tr.target.value} did not become ready ({job.cause})"
                self.end_transition(
                    False, "rolled_back", f"{why}; rolling back to {back.value}", detail
                )
                ctx.desire(back, "rollback")
                self.begin_transition(back, "rollback", why, "rollback")
            case Next.FAILURE if purpose is Purpose.START_FAILED and tr is not None:
                self.failure(f"{tr.target.value} did not become ready: {job.cause}", detail)
            case Next.FAILURE if purpose is Purpose.INTRUSION:
                self.failure(f"{job.cause}; torn down", detail, outcome="intruded")
            case Next.FAILURE:
                self.failure(job.cause or job.reason, detail)
