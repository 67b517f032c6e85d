"""The front desk: answers each request the loop takes, in an operator's words.

The decisions are policy's (`policy.admit`, `policy.profile_until`); this module applies them to
the loop state and words the reply. An accepted switch is persisted as the desired mode at once
(nothing accepted is lost if the daemon dies) and recorded as the loop's next intent; the loop
applies it when the current step returns (loop/lifecycle.py), never in the middle of one.
"""

from __future__ import annotations

import functools
import os
import time

from kimi_supervisor.capture import stall
from kimi_supervisor.capture.job import Capture, CaptureSpec, check_out
from kimi_supervisor.decide import policy
from kimi_supervisor.decide.reconcile import Intent
from kimi_supervisor.loop.context import Context, new_id
from kimi_supervisor.loop.inbox import CaptureDone, CaptureStart, CaptureStop, Switch
from kimi_supervisor.loop.publish import status_line
from kimi_supervisor.messages import Reply
from kimi_supervisor.model import SWITCHING_STATES, Mode, State, utcnow
from kimi_supervisor.ports.systemd import SystemdError
from kimi_supervisor.store.state import StateError, with_fields
from kimi_supervisor.teardown.strays import port_blockers


class Desk:
    def __init__(self, ctx: Context, put: object) -> None:
        self.ctx = ctx
        self._put = put  # the inbox's put: a capture reports its end through it

    def _line(self) -> str:
        return status_line(self.ctx.s, self.ctx.clock.monotonic())

    # -- switches --
    def switch(self, r: Switch) -> Reply:
        if r.for_s is not None and r.mode is not Mode.PROFILE:
            return Reply(ok=False, code="bad_request", message="--for applies to profile mode only")
        reply = self._admit(r)
        if reply.ok:  # joined or already running, too: `--for` sets a new end
            expiry = self.set_expiry(r.mode, r.for_s, r.by)
            if expiry:
                reply = reply.model_copy(update={"message": f"{reply.message}; {expiry}"})
        return reply

    def _admit(self, r: Switch) -> Reply:
        s = self.ctx.s
        tr = s.transition
        switching = tr is not None and (s.state in SWITCHING_STATES or s.busy)
        obs = s.observed
        view = policy.AdmissionView(
            stopping=s.stop_requested or s.state is State.STOPPING,
            booting=s.state is State.BOOTING,
            running=(
                policy.Running(
                    tr.target, tr.started_at, tr.step, tr.requested_by, s.intent is not None
                )
                if tr is not None and switching
                else None
            ),
            serving_healthy=(
                s.serving.mode
                if s.state is State.SERVING and s.serving and obs is not None and obs.healthy
                else None
            ),
            desired=s.desired,
            capture_active=s.capture is not None and s.capture.phase.holds_switch,
            # An armed vLLM with no profile guard: the daemon's own start of the mode adds it,
            # so `--apply` restarts it as it does one with an earlier config's argv.
            stale=obs is not None and (obs.argv_stale or obs.unguarded),
        )
        verdict = policy.admit(r.mode, r.force, view, apply=r.apply)
        info = {"transition": tr.model_dump(mode="json")} if tr is not None and switching else {}
        match verdict:
            case policy.Admit.REFUSE_STOPPING:
                return Reply(ok=False, code="stopping", message="the daemon is shutting down")
            case policy.Admit.REFUSE_BOOTING:
                return Reply(
                    ok=False,
                    code="busy",
                    message=f"the daemon is booting ({self._line()}); ask again in a moment",
                )
            case policy.Admit.JOIN:
                assert tr is not None
                return Reply(
                    ok=True,
                    code="joined",
                    message=f"already switching to {r.mode.value} since "
                    f"{tr.started_at:%H:%M:%S} ({tr.step}): following it",
                    data=info | {"transition_id": tr.id},
                )
            case policy.Admit.REFUSE_BUSY:
                assert tr is not None
                return Reply(
                    ok=False,
                    code="busy",
                    message=f"a switch to {tr.target.value} is in progress since "
                    f"{tr.started_at.isoformat(timespec='seconds')} (step {tr.step}, asked by "
                    f"{tr.requested_by or 'the daemon'}); wait for it, or use --force to take over",
                    data=info,
                )
            case policy.Admit.ALREADY:
                pid = s.serving.pid if s.serving else 0
                if view.stale and obs is not None and obs.unguarded and not obs.argv_stale:
                    said = "; its profiler routes are open (no profile guard): --apply restarts it"
                elif view.stale:
                    said = (
                        "; it runs an earlier config's argv: --apply restarts it with the config's"
                    )
                elif r.apply:
                    said = " with the config's argv"
                else:
                    said = ""
                return Reply(
                    ok=True,
                    code="already",
                    message=f"{r.mode.value} is already running and healthy (vLLM PID "
                    f"{pid}){said}; nothing to do",
                )
        if obs is not None and obs.load_state != "loaded":
            u = self.ctx.unit
            return Reply(
                ok=False,
                code="unit_not_loaded",
                message=f"not switching to {r.mode.value}: systemd reads {u} as "
                f"{obs.load_state} (its file moved away, masked or broken), so vLLM could not be "
                f"started again; nothing was stopped. Put the file back, run `systemctl "
                "daemon-reload`, and ask again",
            )
        if blocked := self._port_blocked(r.mode):
            return blocked
        try:
            self.ctx.desire(r.mode, r.by, must=True)
        except StateError as e:
            return Reply(
                ok=False,
                code="state_error",
                message=f"not switching: the desired mode cannot be persisted ({e}); nothing "
                "was changed. Free space or fix the state directory, then ask again",
            )
        if verdict is policy.Admit.TAKE_OVER:
            assert tr is not None
            s.intent = Intent(r.mode, r.by, force=True, id=new_id())
            s.stop_warming(f"a --force switch to {r.mode.value} took over")  # never waits
            return Reply(
                ok=True,
                code="accepted",
                message=f"taking over from the switch to {tr.target.value}",
                data=info | {"transition_id": s.intent.id},
            )
        s.failures = ()  # an operator's request starts a fresh count
        s.intent = intent = Intent(r.mode, r.by, force=r.force, id=new_id())
        ids = {"transition_id": intent.id}
        c = s.capture
        if verdict is policy.Admit.ACCEPT_AFTER_CAPTURE and c is not None:
            return Reply(
                ok=True,
                code="accepted",
                message=f"switch to {r.mode.value} accepted: it waits for capture {c.id} "
                f"({c.phase}) to finish flushing; --force cuts the capture short",
                data=ids,
            )
        what = "restart of" if view.serving_healthy is r.mode else "switch to"
        return Reply(ok=True, code="accepted", message=f"{what} {r.mode.value} accepted", data=ids)

    def _port_blocked(self, mode: Mode) -> Reply | None:
        """A refusal, before anything stops, when a process that no teardown would stop holds
        vLLM's port (teardown/blockers.py): the switch could only end with no vLLM at all."""
        ctx, s = self.ctx, self.ctx.s
        if not s.baselines:
            return None  # not calibrated yet: which GPUs are managed is not known
        if s.job is not None:
            # A teardown runs on the job thread, which owns the ports meanwhile (one D-Bus
            # connection, one thread); it judges the port itself (--force over a switch).
            return None
        found = port_blockers(
            ctx.config, ctx.systemd, ctx.gpu, baselines=s.baselines, clock=ctx.clock,
            listed_since=ctx.observer.first_listed.snapshot(),
        )  # fmt: skip
        if not found:
            return None
        v = ctx.config.vllm
        who = "; ".join(b.describe(v.port) for b in found)
        return Reply(
            ok=False,
            code="port_taken",
            message=f"not switching to {mode.value}: {who}. The teardown never stops such a "
            f"process, so the new vLLM could not listen. Stop or move it, or set another "
            f"vllm.port (or vllm.host); nothing was stopped",
            data={"blockers": [{"pid": b.pid, "name": b.name, "what": b.what} for b in found]},
        )

    # -- timed profile mode --
    def set_expiry(self, mode: Mode, for_s: float | None, by: str) -> str:
        """Persist when profile mode ends (or that it does not); returns words for the reply."""
        ctx, p = self.ctx, self.ctx.config.profiling
        e = policy.profile_until(
            mode, for_s, p.default_duration_s, max_s=p.max_duration_s, now=utcnow()
        )
        if e.until == ctx.s.profile_until:
            return ""
        ctx.s.profile_until = until = e.until
        ctx.persist(
            functools.partial(
                with_fields, {"profile_until": until, "profile_until_changed_at": utcnow()}
            )
        )
        if until is None:
            return ""
        ctx.log("profile_expiry_set", until=until.isoformat(), by=by)
        return f"back to production at {until:%Y-%m-%d %H:%M:%S} UTC" + (
            f" (capped at profiling.max_duration_s = {p.max_duration_s:g} s)" if e.capped else ""
        )

    def check_expiry(self) -> None:
        """Timed profile mode: once it has expired, production is desired again."""
        ctx = self.ctx
        until = ctx.s.profile_until
        if until is None or not policy.profile_expired(ctx.s.desired, until, utcnow()):
            return
        ctx.log("profile_expired", until=until.isoformat())
        ctx.incident({"at": utcnow().isoformat(), "what": f"profile mode expired at {until}"})
        ctx.s.profile_until = None
        ctx.persist(
            functools.partial(
                with_fields, {"profile_until": None, "profile_until_changed_at": utcnow()}
            )
        )
        ctx.desire(Mode.PRODUCTION, "profile expiry")

    # -- captures --
    def capture_start(self, r: CaptureStart) -> Reply:
        s = self.ctx.s
        if s.capture is not None and s.capture.active:
            c = s.capture
            return Reply(
                ok=False,
                code="busy",
                message=f"capture {c.id} is {c.phase} (since {c.started_at:%H:%M:%S})",
                data={"capture": c.describe().model_dump(mode="json")},
            )
        if s.transition is not None or s.intent is not None or s.busy:
            return Reply(ok=False, code="busy", message=f"a switch is in progress: {self._line()}")
        # vLLM records only when started with --profiler-config: profile mode, or production
        # where an operator armed it (docs/operations.md, "Captures without a restart").
        serving = s.serving.mode if s.state is State.SERVING and s.serving else None
        if serving is None or self.ctx.config.profiler_config(serving) is None:
            return Reply(
                ok=False,
                code="wrong_mode",
                message=f"vLLM is not serving with its profiler armed ({self._line()}): switch "
                "first with `kimi-mode profile`, or use `kimi-mode capture --switch`",
            )
        out_fd = None
        if r.out is not None and r.out_fd is not None:
            if (wrong := check_out(r.out_fd, r.uid)) is not None:
                return Reply(ok=False, code="bad_request", message=f"--out {r.out}: {wrong}")
            out_fd = os.dup(r.out_fd)
        # In an armed production, a window: a capture left recording slows every client and fills
        # the disk. Profile mode exists to record; there "until stopped" stays the asker's.
        config = self.ctx.config
        seconds, bounds = r.seconds, []
        cap = config.profiling.armed_capture_max_s
        if serving is not Mode.PROFILE and (seconds is None or seconds > cap):
            seconds = cap
            bounds.append(f"at most {cap:g} s in {serving.value} (profiling.armed_capture_max_s)")
        if steps := config.profiler_max_iterations(serving):
            bounds.append(f"vLLM stops recording after {steps} engine steps (max_iterations)")
        # The liveness reading that opens the stall's "before" window (both on time.monotonic:
        # the readings carry when /metrics answered).
        pid = s.serving.pid if s.serving else 0
        before = stall.pick_before(list(s.tokens_seen), pid, time.monotonic())
        ceiling = stall.ceiling_of(list(s.tokens_seen), pid)
        try:
            vllm_uid = self.ctx.systemd.run_as(self.ctx.unit)  # whose files are vLLM's traces
        except SystemdError:
            vllm_uid = None  # the capture then refuses to judge the trace folder (fails closed)
        spec = CaptureSpec(
            seconds=seconds, then=r.then, out=r.out, by=r.by, out_fd=out_fd, uid=r.uid,
            gid=r.gid, mode=serving, before=before, vllm_uid=vllm_uid, ceiling=ceiling,
        )  # fmt: skip
        put = self._put
        c = s.capture = Capture(
            self.ctx.config,
            spec,
            self.ctx.bus.publish,
            on_done=lambda done: put(CaptureDone(done)),  # type: ignore[operator]
            log=self.ctx.log,
            gpu=self.ctx.gpu,
        )
        c.start()
        self.ctx.log("capture_started", **c.describe().model_dump(mode="json"))
        return Reply(
            ok=True,
            code="accepted",
            message=f"capture {c.id} starting"
            + (f" for {spec.seconds:g} s" if spec.seconds else " until stopped")
            + (f" ({'; '.join(bounds)})" if bounds else ""),
            data={"capture": c.describe().model_dump(mode="json")},
        )

    def capture_done(self, c: Capture) -> None:
        """A capture ended (traces flushed, or it failed): recorded, and with `--then
        production` production is desired again (the switch waits for nothing now)."""
        s = self.ctx.s
        record = {
            **c.describe().model_dump(mode="json"),
            # The switch a capture held starts at released_at; the summary may end later.
            "released_at": c.released_at.isoformat() if c.released_at else None,
            "finished_at": utcnow().isoformat(),
            "ok": c.ok,
            "message": c.message,
            "folder": str(c.folder) if c.folder else None,
            "stall": c.stall.as_dict() if c.stall else None,
        }
        d = s.last_downtime
        if d is not None and d.target is Mode.PROFILE:
            # What the switch into profile mode before it cost in service.
            record["downtime_before"] = d.model_dump(mode="json")
        self.ctx.record("capture", record)
        if self.ctx.metrics:
            self.ctx.metrics.captures.labels("ok" if c.ok else "failed").inc()
            if c.stall is not None:
                self.ctx.metrics.set_capture_stall(c.stall.as_dict())
        if s.capture is c:
            s.capture = None
        if c.spec.then == "production" and s.desired is Mode.PROFILE:
            by = f"capture {c.id} (--then production)"
            self.ctx.desire(Mode.PRODUCTION, by)
            self.set_expiry(Mode.PRODUCTION, None, "capture")
            s.intent = Intent(Mode.PRODUCTION, by, id=new_id())

    def capture_stop(self, r: CaptureStop) -> Reply:
        c = self.ctx.s.capture
        if c is None or not c.phase.stoppable:
            return Reply(ok=False, code="no_capture", message="no capture is recording")
        c.stop.set()
        return Reply(ok=True, code="accepted", message=f"capture {c.id}: stopping, flushing")
