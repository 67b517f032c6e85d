"""vLLM's life, as the loop lives it: every state change in one class, each labelled `# A -> B`.

    BOOTING -> (reconcile) adopt: SERVING | resume_start: STARTING | begin_transition
    begin_transition: WARMING | TEARING_DOWN | STUCK -> the teardown job ... job_done
        -> policy.after_teardown -> start: STARTING | rollback | failure: BACKOFF | FAILED
           | stuck: STUCK | take over | exit
    STARTING -> (the loop polls /health: reconcile) ready: SERVING | start_failed: TEARING_DOWN
    SERVING -> died | hung: TEARING_DOWN ... ; intrusion while STARTING: TEARING_DOWN
    any -> begin_shutdown: STOPPING -> the teardown job ... exit

`set_state` is the only door for a state change, and sends the event that announces its edge
(none sends one of its own). A teardown runs on the job thread
(loop/jobs.py), which changes nothing the loop owns: its progress (`JobEvent`), the warming's
(`Warmed`) and its end (`JobDone`) come back through the inbox and are applied here: the step
persisted in the transition, the GPU readings, the events, the log and the metrics, the report
recorded, then what policy says comes next. So nothing here calls itself, and requests keep
being answered while a teardown runs. How every transition ends (its one history record) is
`end_transition`, at the bottom.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from kimi_supervisor.decide import gpuhealth, policy
from kimi_supervisor.decide.cause import explain
from kimi_supervisor.decide.liveness import Hang
from kimi_supervisor.decide.policy import Next, Purpose
from kimi_supervisor.decide.progress import Progress, advance
from kimi_supervisor.decide.reconcile import Action, Do, Observed
from kimi_supervisor.loop import boot
from kimi_supervisor.loop.bundles import Bundles
from kimi_supervisor.loop.context import Context, new_id
from kimi_supervisor.loop.inbox import JobDone, JobEvent, LivenessSeen, Message, Warmed
from kimi_supervisor.loop.jobs import Jobs, shutdown_budget_s
from kimi_supervisor.loop.liveness import Liveness, Reading
from kimi_supervisor.loop.loopstate import Job, Serving
from kimi_supervisor.loop.observer import Intruder, intrusion_record
from kimi_supervisor.loop.window import Window
from kimi_supervisor.messages import End
from kimi_supervisor.model import Mode, Outcome, State, TeardownReport, utcnow
from kimi_supervisor.ports import launcher, pagecache, processes
from kimi_supervisor.ports.gpu import GpuUnavailable, reading_error
from kimi_supervisor.ports.metrics import evidence_label
from kimi_supervisor.ports.systemd import SystemdError
from kimi_supervisor.status import (
    FailureStatus,
    GpuHealthStatus,
    IntrusionStatus,
    LivenessStatus,
    RolledBackStatus,
)
from kimi_supervisor.store.state import TransitionRecord
from kimi_supervisor.teardown.events import GpusRead, Signalled, Spared, StepStarted

# How many of the newest history records are searched for a transition already recorded.
RECENT = 200
# The status warning while a warming's reader is left stuck in the kernel (its prefix).
WARM_LEFT = "a warming's reader is left"
# The incidents that count against liveness.max_hang_restarts.
VERDICTS = ("vLLM hung", "vLLM unhealthy")


class Lifecycle:
    def __init__(self, ctx: Context, put: Callable[[Message], None]) -> None:
        self.ctx = ctx
        self.s = ctx.s
        self._put = put
        self.jobs = Jobs(ctx, put)
        self.window = Window(ctx)
        # The bundle at a STUCK, FAILED, hang restart; with a hang's evidence, once.
        self.bundles = Bundles(ctx, put, kept=lambda: self.liveness.take_kept())
        self.liveness = Liveness(
            ctx.config, lambda r: put(LivenessSeen(r)), gpu=ctx.gpu, indices=lambda: ctx.s.indices
        )
        self._verdicts: list[str] = []  # when this daemon gave a hang or unhealthy verdict

    # ------------------------------------------------------------------ the one door
    def set_state(
        self, state: State, why: str = "", *, event: str = "", data: dict[str, Any] | None = None
    ) -> None:
        """Every state change goes through here, with its edge's event (`event`, `data`: sent
        even when the state stays, as a STUCK that begins its retry does). The daemon
        publishes the status once per pass, after it."""
        s = self.s
        if event:
            self.ctx.event(event, data)
        if state is not s.state:
            self.ctx.log("state_changed", previous=s.state.value, state=state.value, why=why)
            s.state, s.state_since = state, utcnow()

    def _teardown(self, job: Job) -> None:
        """The teardown job started (loop/jobs.py), against a baseline resolved first."""
        if not self.s.baselines:
            boot.resolve_baseline(self.ctx)
        self.jobs.run(job)

    def follow_output(self) -> None:
        """vLLM's new output lines, read into the load's progress (an event when it moves),
        and the GPUs' memory as last sampled (an event when it moved: the live display's bars
        follow the load)."""
        s, ctx = self.s, self.ctx
        if readings := ctx.observer.readings_changed():
            ctx.event("gpus", {"devices": readings, "phase": "load"})
        before = s.progress
        for line in ctx.output.read_new():
            s.progress = advance(s.progress, line)
        if s.progress != before:
            p = s.progress
            if s.watch is not None:
                s.watch.saw(p, ctx.clock.monotonic())
            eta = s.eta_text(ctx.clock.monotonic())
            ctx.event(
                "progress",
                {"phase": p.phase, "percent": p.percent, "text": p.describe(), "eta": eta},
            )
            if p.phase != before.phase:
                ctx.log("vllm_progress", phase=p.phase, percent=p.percent)

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
            case Do.UNHEALTHY:
                self.unhealthy(action.reason, obs)
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
                    intent.mode, "switch", f"asked by {intent.by}", by=intent.by, id=intent.id,
                    force=intent.force,
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
                self.begin_transition(s.desired, kind, reason, by="daemon")

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
        # BOOTING | SERVING -> SERVING: the desired mode found running and healthy, adopted
        self.set_state(State.SERVING, reason)
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
        # BOOTING -> STARTING: a load found in progress at boot is waited for
        self.set_state(State.STARTING, "a load was in progress when the daemon started")

    # ------------------------------------------------------------------ a switch
    def begin_transition(
        self, target: Mode, kind: str, reason: str, *, by: str, id: str = "", force: bool = False
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
        s.output_failed = False  # a new attempt: the lines shown will be its vLLM's, or none
        if not warm:
            s.serving = None
        ctx.persist_transition()
        ctx.log("transition_started", **tr.model_dump(mode="json"))
        # STUCK lasts while it is true: the GPUs are not clean until a teardown says so, and
        # neither a retry nor a switch asked for meanwhile makes them so.
        state = State.STUCK if s.stuck_since else State.WARMING if warm else State.TEARING_DOWN
        # any but STOPPING -> WARMING | TEARING_DOWN | STUCK: a transition begins
        self.set_state(state, reason, event="transition_started", data=tr.model_dump(mode="json"))
        argv = ctx.config.launch_argv(target) if warm else None
        self._teardown(Job(Purpose.SWITCH, reason, probe=served and not force, warm_argv=argv))

    def start(self) -> None:
        s, ctx = self.s, self.ctx
        tr = s.transition
        assert tr is not None
        try:
            vllm_uid = ctx.systemd.run_as(ctx.unit)  # who may read an armed start's secret
        except SystemdError:
            vllm_uid = None  # the secret stays root's: the guard refuses captures (fail closed)
        argv_file = launcher.write_argv_file(ctx.config, tr.target, vllm_uid)
        ctx.output.begin()
        s.output_failed = False
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
        refused = self._health_before_load()
        if refused:
            # TEARING_DOWN -> STARTING, at once failed: a managed GPU will fail the load
            self.set_state(State.STARTING)
            self.start_failed(refused)
            return
        try:
            if ctx.systemd.status(ctx.unit).active_state == "failed":
                ctx.systemd.reset_failed(ctx.unit)
            ctx.systemd.start(ctx.unit)
        except SystemdError as e:
            # TEARING_DOWN -> STARTING, at once failed: systemd refused the start
            self.set_state(State.STARTING)
            self.start_failed(f"systemd refused to start {ctx.unit}: {e}")
            return
        s.load_started = ctx.clock.monotonic()
        s.start_deadline = s.load_started + ctx.config.daemon.start_timeout_s
        s.eta, s.load_key, s.expected_parts = ctx.estimate_load(tr.target, argv)
        expected = {"expected_s": s.eta.expected_s, "past": s.eta.past} if s.eta else {}
        ctx.log("vllm_starting", mode=tr.target.value, argv=argv, argv_file=str(argv_file))
        # TEARING_DOWN -> STARTING: clean, the unit started
        self.set_state(
            State.STARTING,
            f"started {ctx.unit} in {tr.target.value}",
            event="starting",
            data={"mode": tr.target.value, "argv": argv, **expected},
        )

    def _health_before_load(self) -> str | None:
        """The managed GPUs' health, read before a load that may take 30 minutes
        (gpus.health_check, decide/gpuhealth.py): the reason to refuse the start, or None.
        What it found is in status (`gpu_health`), the log, an event, and the warnings while it
        lasts; a failing GPU loaded on anyway is an incident in the history. No reading is no
        evidence: the load goes on, and status says the health was not read."""
        s, ctx = self.s, self.ctx
        policy = ctx.config.gpus.health_check
        if policy == "off":
            s.gpu_health = None
            return None
        key = "GPU health:"
        at = utcnow().isoformat()
        try:
            healths = ctx.gpu.health(s.indices)
        except Exception as e:  # no reading is no evidence, whatever the error
            # (GpuUnavailable, or a port's own bug: never a start that fails over and over)
            why = reading_error(e)
            s.gpu_health = GpuHealthStatus(
                checked_at=at, verdict="unread", text=f"not read: {why}", policy=policy
            )
            ctx.log("gpu_health_unread", level="warning", error=why)
            return None
        v = gpuhealth.judge(healths)
        refuse = bool(v.failing) and policy == "refuse"
        s.gpu_health = GpuHealthStatus(
            checked_at=at,
            verdict=v.verdict,
            text=v.text(),
            policy=policy,
            refused=refuse,
            gpus=[gpuhealth.signals(h) for h in healths],
            unread=v.unread,
        )
        if v.verdict == "unread":  # nothing read: no evidence either way, a warning kept
            ctx.log("gpu_health_unread", level="warning", error=v.text())
            return None
        if v.healthy:
            ctx.unwarn(key)
            return None
        ctx.warn(f"{key} {v.text()}", key=key)
        ctx.log("gpu_health", level="warning", verdict=v.verdict, policy=policy,
                failing=v.failing, warnings=v.warnings)  # fmt: skip
        ctx.event("gpu_health", s.gpu_health.model_dump(mode="json"))
        if refuse:
            return f"the GPUs' health refuses the load (gpus.health_check = refuse): {v.text()}"
        if v.failing:
            ctx.incident(
                {"at": at, "what": f"GPU health: {v.text()}; loaded all the same "
                 f"(gpus.health_check = {policy})"}
            )  # fmt: skip
        return None

    def ready(self, obs: Observed) -> None:
        s, ctx = self.s, self.ctx
        tr = s.transition
        self.follow_output()
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
        ctx.log("vllm_ready", **info, **load)
        s.stuck_retries, s.last_failure, s.liveness = 0, None, None
        # STARTING -> SERVING: /health answered 200 (announced before the transition's end)
        self.set_state(State.SERVING, "GET /health answered 200", event="ready", data=info | load)
        self.end_transition(True, "ready", f"{mode.value} is ready ({took:.1f} s)", detail=load)

    # ------------------------------------------------------------------ setbacks
    def start_failed(self, reason: str) -> None:
        s, ctx = self.s, self.ctx
        tr = s.transition
        assert tr is not None
        self.follow_output()
        tail = ctx.output.tail()
        s.output_failed = True
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
        s.transition = tr.model_copy(update={"step": "teardown"})
        # STARTING -> TEARING_DOWN: the start failed (died, timed out, refused)
        self.set_state(
            State.TEARING_DOWN,
            reason,
            event="start_failed",
            data={"mode": tr.target.value, "reason": reason, "output_tail": tail, "more": more},
        )
        detail = {"reason": reason, "said": said, "more": more, "output_tail": tail}
        why = f"start of {tr.target.value} failed: {reason}"
        self._teardown(Job(Purpose.START_FAILED, why, detail, cause=reason))

    def died(self, reason: str) -> None:
        self._lost("vllm_died", reason, reason, why=f"vLLM died: {reason}", cause=reason, seen={})

    def unhealthy(self, reason: str, obs: Observed) -> None:
        """/health has failed for `daemon.health_grace_s`, with a second sign of no progress
        (decide/liveness.health_failure): what a hung one gets, under the same bound. The
        unavailable window opens at its last /health 200."""
        seen: dict[str, Any] = {
            "main_pid": obs.main_pid, "health": obs.health, "health_slow": obs.health_slow
        }  # fmt: skip
        at = self._bound_restarts(seen)
        what = f"vLLM unhealthy: {reason}"
        self._lost(
            "vllm_unhealthy", reason, what, why=what, cause=f"unhealthy: {reason}", seen=seen, at=at
        )

    def hung(self, hang: Hang, reading: Reading) -> None:
        """vLLM serves but makes no progress, by two signals (decide/liveness.py): what a dead
        one gets, an incident with what each signal saw, a teardown, a start again under the
        failure window's backoff. The unavailable window opens at the last proof of progress.
        The `liveness.max_hang_restarts`-th hang within `liveness.hang_window_s` is not
        restarted: FAILED, with the evidence, for an operator (no restart loop)."""
        seen: dict[str, Any] = {"main_pid": reading.pid, **hang.evidence}
        if self.ctx.metrics:
            self.ctx.metrics.hangs.inc()
        what = f"vLLM hung: {hang.reason}"
        at = self._bound_restarts(seen)
        self._lost(
            "vllm_hung",
            hang.reason,
            what,
            why=what,
            cause=f"hung: {hang.reason}",
            seen=seen,
            since=hang.since,
            at=at,
        )

    def _bound_restarts(self, seen: dict[str, Any]) -> str:
        """Hangs and unhealthy restarts are bounded together: the `liveness.max_hang_restarts`-th
        within `liveness.hang_window_s` (this one included) is not restarted (`hang_limit`)."""
        c = self.ctx.config.liveness
        at = utcnow().isoformat()
        self._verdicts.append(at)
        del self._verdicts[:-1000]
        n = len(self._recent_verdicts(c.hang_window_s))
        if n >= c.max_hang_restarts:
            seen["hang_limit"] = (
                f"{n} hangs or unhealthy restarts within {c.hang_window_s:g} s "
                f"(liveness.max_hang_restarts = {c.max_hang_restarts}): not restarting"
            )
        return at  # the incident's time: the same verdict is counted once

    def _recent_verdicts(self, window_s: float) -> set[str]:
        """When the hang and unhealthy verdicts within the last `window_s` (wall clock) were
        given: those the history records (a daemon restarted between two counts both), those
        not written yet (a full disk), and this daemon's own (a history it cannot read)."""
        since = utcnow() - timedelta(seconds=window_s)
        records: list[Any] = [p.record for p in self.ctx.pending if p.kind == "incident"]
        with contextlib.suppress(OSError):
            records += self.ctx.read_history(1000)
        at = set(self._verdicts)
        for e in records:
            if e.get("kind", "incident") == "incident" and str(e.get("what", "")).startswith(
                VERDICTS
            ):
                at.add(str(e.get("at", "")))
        recent = set()
        for a in at:
            with contextlib.suppress(ValueError, TypeError):
                if datetime.fromisoformat(a) >= since:
                    recent.add(a)
        return recent

    def _lost(
        self,
        event: str,
        reason: str,
        what: str,
        *,
        why: str,
        cause: str,
        seen: dict[str, Any],
        since: float | None = None,
        at: str | None = None,
    ) -> None:
        """The vLLM that served is lost (dead, hung or unhealthy): logged, an incident (`what`, with
        what was `seen`), an event, and the teardown (`why`) that comes before serving again."""
        s, ctx = self.s, self.ctx
        mode = s.serving.mode.value if s.serving else None
        # vLLM's output read up to now: what it last said is this vLLM's, not its load's.
        ctx.output.read_new()
        s.output_failed = True
        ctx.log(event, level="error", reason=reason, mode=mode, **seen)
        ctx.incident({"at": at or utcnow().isoformat(), "what": what, **seen})
        s.serving = None
        self.window.lost(since)
        # SERVING -> TEARING_DOWN: the vLLM that served died or hung
        self.set_state(State.TEARING_DOWN, what, event=event, data={"reason": reason, **seen})
        limit = {"hang_limit": seen["hang_limit"]} if "hang_limit" in seen else {}
        self._teardown(Job(Purpose.DIED, why, {**limit, "seen": seen} if seen else {}, cause=cause))

    def _recorded(self, tid: str) -> bool:
        """The history holds transition `tid`'s record. One that cannot be read in time says
        no: a record written twice is better than none."""
        try:
            recent = self.ctx.read_history(RECENT)
        except OSError:
            return False
        return any(e.get("kind") == "transition" and e.get("id") == tid for e in recent)

    def intrusion(self, found: list[Intruder]) -> None:
        """While vLLM loads, a process outside its unit took a managed GPU: noticed (history,
        event, metric, status), then torn down with vLLM's partial load (the teardown kills it
        on NVML's evidence), then the load again after the failure backoff."""
        s, ctx = self.s, self.ctx
        tr = s.transition
        assert tr is not None
        reason, record = intrusion_record(found, ctx.unit, tr.target)
        s.last_intrusion = IntrusionStatus.model_validate(record)
        ctx.incident(record)
        ctx.log("gpu_intrusion", level="warning", **record)
        if ctx.metrics:
            for f in found:
                ctx.metrics.intrusions.labels(str(f.gpu)).inc()
        s.transition = tr.model_copy(update={"step": "teardown"})
        # STARTING -> TEARING_DOWN: an intruder on a managed GPU while loading
        self.set_state(State.TEARING_DOWN, reason, event="gpu_intrusion", data=record)
        self._teardown(Job(Purpose.INTRUSION, reason, {"intrusion": record}, cause=reason))

    def failure(self, reason: str, detail: dict[str, Any], outcome: str = "failed") -> None:
        s, ctx, d = self.s, self.ctx, self.ctx.config.daemon
        now = ctx.clock.monotonic()
        v = policy.after_failure(
            s.failures,
            now,
            d.failure_window_s,
            max_failures=d.max_failures,
            backoff_initial_s=d.restart_backoff_initial_s,
            backoff_max_s=d.restart_backoff_max_s,
        )
        s.failures = v.failures
        n = len(v.failures)
        if v.failed:
            self.failed(f"{reason}; {n} failures within {d.failure_window_s:g} s", detail)
            return
        s.next_attempt_at = now + v.backoff_s
        msg = (
            f"{reason}; starting {s.desired.value} again in {v.backoff_s:g} s (failure {n} "
            f"of {d.max_failures})"
        )
        self.end_transition(False, outcome, msg, detail=detail)
        # TEARING_DOWN -> BACKOFF: a failure, retried after the backoff
        self.set_state(State.BACKOFF, msg)

    def failed(self, reason: str, detail: dict[str, Any]) -> None:
        """Not retried: an operator's switch is waited for."""
        s, ctx = self.s, self.ctx
        msg = f"{reason}: not retrying. Fix the cause, then `kimi-mode {s.desired.value}`"
        self._failure_is(reason)
        self.end_transition(False, "failed", msg, detail=detail)
        ctx.log("failed", level="error", message=msg)
        # TEARING_DOWN -> FAILED: too many failures in the window, or hangs
        self.set_state(State.FAILED, msg)
        self.bundles.collect("failed", msg, s.last_teardown)

    def stuck(self, report: TeardownReport, detail: dict[str, Any] | None = None) -> None:
        """A teardown ended STUCK: the episode begins, or goes on. Its own retries end their
        transitions unrecorded (the episode's incident counts them when it ends), so that the
        history keeps what operators asked for in view."""
        s, ctx, d = self.s, self.ctx, self.ctx.config.daemon
        tr = s.transition
        retry = s.stuck_since is not None and tr is not None and tr.kind == "retry"
        first = s.stuck_since is None
        if first:
            s.stuck_since = utcnow()
        wait = policy.stuck_retry_s(s.stuck_retries, d.stuck_retry_s, d.restart_backoff_max_s)
        s.stuck_retries += 1
        s.next_attempt_at = ctx.clock.monotonic() + wait
        msg = (
            f"teardown STUCK: {report.diagnosis}. Next: {report.next_action}. "
            f"Retrying in {wait:g} s; vLLM is not started on occupied GPUs"
        )
        self._failure_is(f"teardown STUCK: {report.diagnosis}")
        self.end_transition(False, "stuck", msg, detail=detail or {}, recorded=not retry)
        ctx.log("stuck", level="error", message=msg, retries=s.stuck_retries)
        # TEARING_DOWN | STUCK -> STUCK: the teardown could not make the GPUs clean
        self.set_state(State.STUCK, msg)
        if first:  # the episode's retries find what its first teardown found
            self.bundles.collect("stuck", msg, report)

    def _failure_is(self, reason: str) -> None:
        """`last_failure` for a way into FAILED or STUCK: the cause, and what vLLM said of it
        when the failure was a start of its (the failed vLLM's lines, or none)."""
        s, ctx = self.s, self.ctx
        start = s.last_failure
        s.last_failure = FailureStatus(
            at=utcnow().isoformat(),
            mode=s.transition.target if s.transition else s.desired,
            reason=reason,
            said=start.said if start else [],
            more=start.more if start else ctx.output.where,
        )

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

    # ------------------------------------------------------------------ liveness
    def judge_liveness(self, obs: Observed) -> None:
        """A pass while vLLM serves: a liveness probe, when one is due (loop/liveness.py)."""
        s = self.s
        if s.state is State.SERVING and s.serving and obs.main_pid == s.serving.pid:
            capturing = s.capture is not None and s.capture.phase.holds_switch
            self.liveness.peer_uid = self.ctx.observer.vllm_uid
            self.liveness.serving(s.serving.pid, self.ctx.clock.monotonic(), capturing)

    def liveness_seen(self, reading: Reading) -> None:
        s, ctx = self.s, self.ctx
        capturing = s.capture is not None and s.capture.phase.holds_switch
        now = ctx.clock.monotonic()
        hang = self.liveness.seen(reading, now, capturing)
        c, w, cpu = reading.canary, reading.work, reading.cpu
        judge = self.liveness.judge
        # A canary's reading (its own thread's) has no counters: the probes' stay shown.
        counters = {} if reading.kind != "probe" else {
            "metrics": reading.metrics,
            "running": w.running if w else None,
            "waiting": w.waiting if w else None,
            "tokens": w.tokens if w else None,
            "steps": w.steps if w else None,
        }  # fmt: skip
        seen = (s.liveness or LivenessStatus()).model_copy(
            update={
                **counters,
                "cpu_s": cpu.seconds if cpu else None,
                "stopped": list(cpu.stopped) if cpu else [],
                "doubt": judge.doubt or None,
                "doubt_since": (
                    (utcnow() - timedelta(seconds=now - judge.doubt_since)).isoformat()
                    if judge.doubt_since is not None
                    else None
                ),
                "judging": "paused: a capture is under way" if capturing else None,
            }
        )
        if c is not None:
            seen = seen.model_copy(
                update={"canary_at": utcnow().isoformat(), "canary_ok": c.ok,
                        "canary_answered": c.answered, "canary_s": round(c.took_s, 3),
                        "canary_tokens": c.tokens}
            )  # fmt: skip
        s.liveness = seen
        # The readings that may open a capture's "before" window: never one taken while a
        # capture is under way (its recording or flush is not "before" the next one's).
        if w is not None and reading.metrics_at and not (s.capture and s.capture.active):
            s.tokens_seen.append((reading.metrics_at, reading.pid, w.tokens))
        if c is not None and c.answered and not c.ok:
            ctx.warn(f"the liveness canary was refused ({c.detail}): only /metrics can tell")
        elif c is not None and c.ok:
            ctx.unwarn("the liveness canary was refused")
        if reading.metrics == "absent":
            # Never read as idle: the engine's CPU and the canary judge alone (logged once).
            ctx.warn(
                "vLLM's /metrics has no vllm:* series (run with --disable-log-stats, or a "
                "metric renamed): liveness judges by the engine's processes and the canary"
            )
        elif reading.metrics == "ok":
            ctx.unwarn("vLLM's /metrics has no vllm:* series")
        serving = s.state is State.SERVING and s.serving and s.serving.pid == reading.pid
        if hang is not None and serving and not s.busy:
            if s.capture is not None and s.capture.active:
                # What no flush does (decide/liveness.Judge.capturing): the capture fails now,
                # saying why, not at profiling.flush_timeout_s.
                s.capture.give_up(f"vLLM hung: {hang.reason}")
            # vLLM's last lines before the hang (the bundle's), not its teardown's.
            ctx.output.read_new()
            kept = self.liveness.kept or {}
            self.liveness.kept = {**kept, "output": "\n".join(ctx.output.tail())}
            self.hung(hang, reading)

    # ------------------------------------------------------------------ stopping
    def begin_shutdown(self) -> None:
        """`systemctl stop`: teardown to CLEAN (up to policy.SHUTDOWN_ATTEMPTS tries). Stopped
        while still waiting for the GPU driver, the daemon has started nothing, and no GPU can
        be read: vLLM's unit is stopped (should anyone have started it) and the daemon ends,
        with no teardown that could only fail."""
        ctx, s = self.ctx, self.s
        if not s.driver_ready:
            # BOOTING -> STOPPING: stopped before the driver answered (no teardown)
            self.set_state(State.STOPPING, "stop requested")
            try:
                ctx.systemd.stop(ctx.unit)
                note = f"stopped {ctx.unit}; no GPU was read: {s.waiting_for or 'no driver'}"
            except SystemdError as e:
                note = f"{ctx.unit} not stopped ({e}); no GPU was read"
            ctx.log("stopped", clean=None, desired=s.desired.value, note=note)
            s.stopped_clean = True
            return
        ctx.notifier.extend_timeout(shutdown_budget_s(ctx.config))
        # any -> STOPPING: `systemctl stop`, the shutdown teardown follows
        self.set_state(State.STOPPING, "stop requested")
        ctx.notifier.stopping("stopping: tearing vLLM down")
        self.end_transition(False, "stopped", "the daemon is stopping")
        self._teardown(Job(Purpose.SHUTDOWN, "the supervisor is stopping"))

    # ------------------------------------------------------------------ the teardown job
    def main_exited(self) -> None:
        """vLLM's MainPID exited. While a switch warms, the old mode no longer serves: the
        warming stops (there is nothing left to keep serving for) and the teardown begins."""
        s = self.s
        self.ctx.observer.forget_health()
        if s.state is State.WARMING:
            s.serving = None
            s.stop_warming("the old vLLM exited: nothing is left to serve meanwhile")

    def job_message(self, msg: JobEvent | JobDone | Warmed) -> None:
        match msg:
            case JobEvent():
                self.job_event(msg)
            case Warmed():
                self.warmed(msg)
            case JobDone():
                self.job_done(msg)

    def job_done(self, done: JobDone) -> None:
        self.window.probed(done.ok_at)
        job, report, clean = self._finish(done)
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
            purpose,
            clean,
            s.stop_requested,
            intent_pending=s.intent is not None,
            then=then,
            attempt=job.attempt,
        ):
            case Next.EXIT:
                self.unstuck("the daemon stopped with them still not clean")
                s.stopped_clean = clean
                ctx.log("stopped", clean=clean, desired=s.desired.value)
            case Next.SHUTDOWN_AGAIN:
                ctx.notifier.extend_timeout(shutdown_budget_s(ctx.config))
                self._teardown(Job(purpose, job.reason, attempt=job.attempt + 1))
            case Next.STUCK:
                self.stuck(report, detail)
            case Next.STOPPED:
                self.end_transition(False, "stopped", "the daemon is stopping", detail=detail)
            case Next.TAKE_OVER:
                intent, s.intent = s.intent, None
                assert intent is not None
                why = f"superseded by a switch to {intent.mode.value}"
                self.end_transition(False, "preempted", why, detail=detail)
                by = intent.by
                why = f"asked by {by} (took over)"
                self.begin_transition(intent.mode, "switch", why, by=by, id=intent.id)
            case Next.START:
                self.start()
            case Next.ROLLBACK:
                assert tr is not None and back is not None
                why = f"{tr.target.value} did not become ready ({job.cause})"
                said = f"{why}; rolling back to {back.value}"
                self.end_transition(False, "rolled_back", said, detail=detail)
                ctx.desire(back, "rollback")
                s.rolled_back = RolledBackStatus(
                    mode=tr.target, at=utcnow().isoformat(), reason=said, transition=tr.id
                )
                self.begin_transition(back, "rollback", why, by="rollback")
            case Next.FAILURE if purpose is Purpose.START_FAILED and tr is not None:
                self.failure(f"{tr.target.value} did not become ready: {job.cause}", detail)
            case Next.FAILURE if purpose is Purpose.DIED and "hang_limit" in detail:
                self.failed(f"{job.cause}; {detail['hang_limit']}", detail)
            case Next.FAILURE if purpose is Purpose.INTRUSION:
                self.failure(f"{job.cause}; torn down", detail, outcome="intruded")
            case Next.FAILURE:
                self.failure(job.cause or job.reason, detail)
        if purpose is Purpose.DIED and job.cause.startswith("hung:") and s.state is State.BACKOFF:
            # A hang restart (a STUCK or a FAILED after the hang has its own bundle)
            self.bundles.collect("hang", f"vLLM {job.cause}", report)

    def job_event(self, job_event: JobEvent) -> None:
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
                ctx.metrics.kills.labels(r.step.value, evidence_label(r.evidence)).inc()
            case Spared() if ctx.metrics:
                ctx.metrics.spared.inc()
        ctx.event(e.kind, data)

    def warmed(self, w: Warmed) -> None:
        """The warming's progress shown; at its end the teardown begins (on the job thread):
        the old vLLM stops serving now."""
        s, ctx = self.s, self.ctx
        s.warm, warm = w.status, w.status.model_dump(mode="json")
        if not w.done:
            ctx.event("warm", warm)
            return
        ctx.log("warmed", **warm)
        if w.status.abandoned:
            s.warm_left = w.status.reader_pid
            ctx.warn(
                f"{WARM_LEFT}: {w.status.abandoned} read(s) of {w.status.folder or 'the model'} "
                f"stuck in the kernel (a hung mount?); its reader (PID {w.status.reader_pid}) is "
                f"left in {w.status.left_in or 'the daemon unit'}, and no warming starts until "
                "it returns"
            )
        if s.transition is not None:
            s.transition = s.transition.model_copy(
                update={"step": "teardown", "step_changed_at": utcnow()}
            )
            ctx.persist_transition()
        s.serving = None
        # WARMING -> TEARING_DOWN: the warming ended, the old vLLM stops serving now
        self.set_state(State.TEARING_DOWN, w.status.text, event="warm", data=warm)

    def warm_left_returned(self) -> None:
        """Each pass while a warming's reader is left: once the kernel has let it end (the
        mount answered, or was aborted), the warning goes and warming may run again."""
        s, ctx = self.s, self.ctx
        if s.warm_left is None or pagecache.stuck_readers():
            return
        ctx.log("warm_reader_ended", pid=s.warm_left)
        ctx.unwarn(WARM_LEFT)
        s.warm_left = None

    def _finish(self, done: JobDone) -> tuple[Job, TeardownReport, bool]:
        """The teardown's end, recorded (history, metrics, status); what policy reads next."""
        s, ctx = self.s, self.ctx
        job, s.job = s.job, None
        assert job is not None
        report = done.report
        if report is None:
            ctx.log("teardown_crashed", level="error", error=repr(done.error))
            report = TeardownReport(unit=ctx.unit, started_at=utcnow(), outcome=Outcome.STUCK)
            if isinstance(done.error, GpuUnavailable):
                # No reading, so the GPUs cannot be called free, and nothing is killed on it.
                report.diagnosis = f"the GPUs could not be read: {done.error}"
                report.next_action = (
                    "check the driver (`nvidia-smi`, the kernel's Xid lines in `dmesg`); the "
                    "teardown is retried, and goes on once NVML answers"
                )
            else:
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
        return job, report, clean

    def end_transition(
        self,
        ok: bool,
        outcome: str,
        message: str,
        *,
        detail: dict[str, Any] | None = None,
        recorded: bool = True,
    ) -> None:
        s, ctx = self.s, self.ctx
        tr = s.transition
        if tr is None:
            return
        record = tr.finished(utcnow(), outcome, message, detail=detail or {})
        # One record per transition, whatever the moment of a kill: a daemon killed between
        # this append and clearing the persisted transition finds it here when it ends it again
        # (only a transition inherited at boot can have been recorded already).
        if recorded and (tr.id != s.inherited_id or not self._recorded(tr.id)):
            ctx.record("transition", record)
        if ctx.metrics:
            ctx.metrics.transitions.labels(tr.target.value, outcome).inc()
        ctx.log("transition_finished", level="info" if ok else "warning", **record)
        ctx.end(End(ok=ok, outcome=outcome, message=message, data={"transition": tr.id, **record}))
        s.transition = None
        ctx.persist_transition()
