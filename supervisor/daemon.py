"""The daemon: one loop thread that owns vLLM's unit and the GPUs.

    request or tick -> observe -> reconcile.decide -> act (teardown / start) -> persist -> notify

Only the loop thread changes state. Connection threads read a published snapshot (status
answers at once, even mid-teardown) and hand commands to the loop through a queue; signal
handlers only enqueue. While a teardown runs, its waits between polls are the loop's waits for
commands (`_BusyClock`), so a second switch is answered (joined, refused, or taking over)
within one poll interval, and the watchdog is fed.

The desired mode is persisted before anything is torn down; the transition in progress is
persisted with its step, so a daemon that dies mid-switch redoes it from the start of the
teardown (every step is idempotent), and a daemon that dies mid-load waits for that load.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import signal
import stat
import sys
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from supervisor import baseline, history, intrusion, launcher, policy
from supervisor.capture import Capture, CaptureSpec
from supervisor.config import Config
from supervisor.events import EventBus
from supervisor.messages import End, Event, Reply
from supervisor.metrics import Metrics
from supervisor.model import Mode, Outcome, TeardownReport, utcnow
from supervisor.ports import processes
from supervisor.ports.clock import Clock, SystemClock
from supervisor.ports.gpu import GpuPort, GpuUnavailable
from supervisor.ports.http import request as http_request
from supervisor.ports.notify import Notifier
from supervisor.ports.output import OutputPort
from supervisor.ports.systemd import SystemdError, SystemdPort
from supervisor.progress import Progress, advance
from supervisor.reconcile import (
    SWITCHING_STATES,
    Action,
    Do,
    Memory,
    Observed,
    State,
    decide,
)
from supervisor.state import (
    PersistedState,
    StateStore,
    TransitionRecord,
    with_desired,
    with_transition,
)
from supervisor.teardown import Teardown
from supervisor.wakeup import Wakeup

# Without a stored baseline (state lost while vLLM ran), teardowns judge "clean" against this
# until the GPUs are next seen idle and calibrated. An idle H200 with persistence mode reads
# 615 MiB; the status shows the baseline as provisional meanwhile.
PROVISIONAL_BASELINE_MIB = 1024

Log = Callable[..., None]


@dataclass
class Command:
    kind: str  # "switch", "stop", "reexec", "wedge"
    args: dict[str, Any] = field(default_factory=dict)
    reply: Future[Reply] = field(default_factory=Future)


class _BusyClock:
    """The teardown's clock: its sleeps serve the command queue and feed the watchdog."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def monotonic(self) -> float:
        return self.daemon.clock.monotonic()

    def sleep(self, seconds: float) -> None:
        self.daemon._serve_until(self.daemon.clock.monotonic() + seconds, busy=True)


# After vLLM's MainPID exits, how long to wait for systemd to reflect it before acting.
MAIN_EXIT_SETTLE_S = 0.5


def _new_id() -> str:
    return f"t-{utcnow():%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"


class Daemon:
    def __init__(
        self,
        config: Config,
        systemd: SystemdPort,
        gpu: GpuPort,
        output: OutputPort,
        notifier: Notifier,
        log: Log,
        clock: Clock | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.config = config
        self.systemd = systemd
        self.gpu = gpu
        self.output = output
        self.notifier = notifier
        self.log = log
        self.clock = clock or SystemClock()
        self.metrics = metrics
        self.unit = config.service.unit
        self.store = StateStore(config.state.dir)
        self.bus = EventBus()
        self.commands: queue.Queue[Command] = queue.Queue()
        self.wakeup = Wakeup()
        self.faults = set(os.environ.get("KIMI_SUPERVISOR_FAULTS", "").split(","))
        self._snapshot: dict[str, Any] = {}
        self._snapshot_lock = threading.Lock()
        self.heartbeat = self.clock.monotonic()
        self.started_at = utcnow()
        # -- owned by the loop thread --
        self.state = State.BOOTING
        self.state_since = utcnow()
        self.desired = Mode.PRODUCTION
        self.transition: TransitionRecord | None = None
        self.interrupted: TransitionRecord | None = None
        self.serving_mode: Mode | None = None
        self.serving_pid = 0
        self.mode_since: datetime | None = None
        self.start_deadline: float | None = None
        self.next_attempt_at: float | None = None
        self.unhealthy_since: float | None = None
        self.failures: collections.deque[float] = collections.deque()
        self.stuck_retries = 0
        self.progress = Progress()
        self.observed: Observed | None = None
        self.devices: list[dict[str, Any]] = []
        self.indices: list[int] = []
        self.baselines: dict[int, int] = {}
        self.baseline_provisional = False
        self.last_teardown: TeardownReport | None = None
        self.warnings: list[str] = []
        self.stop_requested = False
        self.reexec_requested = False
        self.preempt: tuple[Mode, str] | None = None
        self.preempt_force = False
        self.profile_until: datetime | None = None
        self.capture: Capture | None = None
        self._last_watchdog = 0.0
        self._last_status_line = ""
        self._mode_of_pid: tuple[int, Mode | None] = (0, None)
        self._health: tuple[int, float] = (-1, 0.0)  # last /health status, when probed
        self._gpus_at: float | None = None  # when the GPUs were last sampled (monotonic)
        self._listed: dict[int, list[int]] = {}  # GPU -> PIDs NVML listed at the last sample
        self._unit_pids: set[int] = set()  # vLLM's unit's processes, as last read
        self.last_intrusion: dict[str, Any] | None = None
        self._publish()  # a status asked for before boot has begun is complete, too
        self._titles: dict[int, str] = {}

    # ---------------------------------------------------------------- state and publication
    def _set_state(self, state: State, why: str = "") -> None:
        if state is not self.state:
            self.log("state_changed", previous=self.state.value, state=state.value, why=why)
            self.state, self.state_since = state, utcnow()
        self._publish()

    def _persist(self, change: Callable[[PersistedState], PersistedState]) -> None:
        self.store.update(change)

    def _persist_transition(self) -> None:
        tr = self.transition
        self._persist(lambda st: with_transition(st, tr))

    def _event(self, name: str, data: dict[str, Any] | None = None) -> None:
        tid = self.transition.id if self.transition else None
        self.bus.publish(Event(event=name, at=utcnow(), transition=tid, data=data or {}))

    def _status_line(self) -> str:
        s = self.state
        if s is State.SERVING and self.serving_mode:
            return f"{self.serving_mode.value}: serving (vLLM PID {self.serving_pid})"
        if s is State.TEARING_DOWN and self.transition:
            return f"switching to {self.transition.target.value}: {self.transition.step}"
        if s is State.STARTING and self.transition:
            return f"switching to {self.transition.target.value}: {self.progress.describe()}"
        if s in (State.BACKOFF, State.STUCK) and self.next_attempt_at is not None:
            wait = max(self.next_attempt_at - self.clock.monotonic(), 0)
            return f"{s.value.upper()}: retrying {self.desired.value} in {wait:.0f} s"
        if s is State.FAILED:
            return f"FAILED: {self.desired.value} gave up; `kimi-mode {self.desired.value}` retries"
        return s.value

    def snapshot(self) -> dict[str, Any]:
        with self._snapshot_lock:
            snap = dict(self._snapshot)
        now = self.clock.monotonic()
        snap["daemon"] = {
            **snap.get("daemon", {}),
            "loop_heartbeat_age_s": round(now - self.heartbeat, 3),
        }
        gpus_at = self._gpus_at
        snap["gpus_age_s"] = round(now - gpus_at, 1) if gpus_at is not None else None
        until = self.profile_until
        snap["profile_left_s"] = (
            max(round((until - utcnow()).total_seconds()), 0) if until is not None else None
        )
        c = self.capture
        if c is not None:
            snap["capture"] = c.describe()
        return snap

    def _publish(self) -> None:
        obs = self.observed
        tr = self.transition
        td = self.last_teardown
        snap: dict[str, Any] = {
            "desired_mode": self.desired.value,
            "mode": self.serving_mode.value if self.serving_mode else None,
            "state": self.state.value,
            "state_since": self.state_since.isoformat(),
            "status_line": self._status_line(),
            "mode_since": self.mode_since.isoformat() if self.mode_since else None,
            "transition": tr.model_dump(mode="json") if tr else None,
            "progress": (
                {
                    "phase": self.progress.phase,
                    "percent": self.progress.percent,
                    "text": self.progress.describe(),
                }
                if self.state is State.STARTING
                else None
            ),
            "unit": {
                "name": self.unit,
                "active_state": obs.active_state if obs else "unknown",
                "sub_state": obs.sub_state if obs else "unknown",
                "main_pid": obs.main_pid if obs else 0,
                "running_mode": obs.running_mode.value if obs and obs.running_mode else None,
                "health": obs.health if obs else -1,
            },
            "gpus": self.devices,
            "baseline_provisional": self.baseline_provisional,
            "last_teardown": _teardown_summary(td) if td else None,
            "failures_in_window": len(self.failures),
            "next_attempt_in_s": (
                round(max(self.next_attempt_at - self.clock.monotonic(), 0.0), 1)
                if self.next_attempt_at is not None and self.state in (State.BACKOFF, State.STUCK)
                else None
            ),
            "warnings": list(self.warnings),
            "last_intrusion": self.last_intrusion,
            "profile_until": self.profile_until.isoformat() if self.profile_until else None,
            "capture": self.capture.describe() if self.capture else None,
            "daemon": {"pid": os.getpid(), "started_at": self.started_at.isoformat()},
        }
        with self._snapshot_lock:
            self._snapshot = snap
        line = snap["status_line"]
        if line != self._last_status_line:
            self._last_status_line = line
            self.notifier.status(line)
        if self.metrics:
            self.metrics.set_modes(self.desired, self.serving_mode)
            self.metrics.set_state(self.state.value, [s.value for s in State])
            for d in self.devices:
                self.metrics.set_gpu(d["index"], d["used_mib"], d["baseline_mib"])

    def _warn(self, message: str) -> None:
        """Logged once while it lasts (a failing read repeats every tick); shown in status."""
        if message not in self.warnings:
            self.log("warning", level="warning", message=message)
            self.warnings.append(message)
            del self.warnings[:-10]

    def _unwarn(self, prefix: str) -> None:
        self.warnings = [w for w in self.warnings if not w.startswith(prefix)]

    # ---------------------------------------------------------------- the command queue
    def submit(self, kind: str, **args: Any) -> Future[Reply]:
        cmd = Command(kind, args)
        self.commands.put(cmd)
        self.wakeup.ring()
        return cmd.reply

    def _feed_watchdog(self) -> None:
        """Called on every wake-up of the loop: pings when half the interval has passed, so the
        pings ride on the ticks instead of waking the loop on their own."""
        now = self.clock.monotonic()
        self.heartbeat = now
        interval = self.notifier.watchdog_interval_s
        if interval and now - self._last_watchdog >= interval / 2:
            self.notifier.watchdog()
            self._last_watchdog = now

    def _serve_until(self, deadline: float, busy: bool = False) -> None:
        """Wait until `deadline`, handling commands as they come and feeding the watchdog."""
        while True:
            self._feed_watchdog()
            now = self.clock.monotonic()
            if now >= deadline:
                return
            wait = deadline - now
            if self.notifier.watchdog_interval_s:
                wait = min(wait, self.notifier.watchdog_interval_s)
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                # Sleep until a command rings, vLLM's MainPID exits (not while busy: the
                # teardown owns the GPUs then), or the wait runs out.
                exited = self.wakeup.wait(wait, watch=not busy)
                if exited:
                    self._main_exited(exited)
                    return  # act on it now
                continue
            try:
                reply = self._handle(cmd, busy)
            except Exception as e:  # never let one bad command take the loop down
                self.log("command_failed", level="error", kind=cmd.kind, error=repr(e))
                reply = Reply(ok=False, code="internal", message=f"internal error: {e}")
            if not cmd.reply.done():
                cmd.reply.set_result(reply)
            if self.stop_requested and not busy:
                return
            if cmd.kind in ("switch", "capture_done") and reply.code == "accepted" and not busy:
                return  # act on it now

    def _handle(self, cmd: Command, busy: bool) -> Reply:
        if cmd.kind == "stop":
            self.stop_requested = True
            return Reply(ok=True, code="accepted", message="stopping")
        if cmd.kind == "reexec":
            self.reexec_requested = True
            return Reply(ok=True, code="accepted", message="re-executing")
        if cmd.kind == "wedge" and "wedge-on-sigusr2" in self.faults:
            self.log("fault_wedge", level="warning", message="loop blocked on purpose (test fault)")
            threading.Event().wait()
        if cmd.kind == "switch":
            return self._on_switch(
                Mode(cmd.args["mode"]),
                cmd.args.get("force", False),
                cmd.args.get("by", "kimi-mode"),
                busy,
                cmd.args.get("for_s"),
            )
        if cmd.kind == "capture_start":
            return self._on_capture(cmd.args)
        if cmd.kind == "capture_stop":
            c = self.capture
            if c is None or c.phase not in ("starting", "recording"):
                return Reply(ok=False, code="no_capture", message="no capture is recording")
            c.stop.set()
            return Reply(ok=True, code="accepted", message=f"capture {c.id}: stopping, flushing")
        if cmd.kind == "capture_done":
            self._capture_done(cmd.args["capture"])
            return Reply(ok=True, code="accepted")
        return Reply(ok=False, code="bad_request", message=f"unknown command {cmd.kind}")

    def _on_switch(
        self, mode: Mode, force: bool, by: str, busy: bool, for_s: float | None = None
    ) -> Reply:
        if for_s is not None and mode is not Mode.PROFILE:
            return Reply(ok=False, code="bad_request", message="--for applies to profile mode only")
        reply = self._switch_reply(mode, force, by, busy)
        if reply.ok:
            expiry = self._set_expiry(mode, for_s, by)
            if expiry:
                reply = reply.model_copy(update={"message": f"{reply.message}; {expiry}"})
        return reply

    def _switch_reply(self, mode: Mode, force: bool, by: str, busy: bool) -> Reply:
        """Admission (policy.admit decides; this applies it and words the reply)."""
        tr = self.transition
        switching = tr is not None and self.state in SWITCHING_STATES
        obs = self.observed
        view = policy.AdmissionView(
            stopping=self.stop_requested or self.state is State.STOPPING,
            booting=self.state is State.BOOTING,
            running=(
                policy.Running(
                    tr.target, tr.started_at, tr.step, tr.requested_by, self.preempt is not None
                )
                if tr is not None and switching
                else None
            ),
            serving_healthy=(
                self.serving_mode
                if self.state is State.SERVING and obs is not None and obs.healthy
                else None
            ),
            desired=self.desired,
            capture_active=self.capture is not None and self.capture.active,
        )
        verdict = policy.admit(mode, force, view)
        info = {"transition": tr.model_dump(mode="json")} if tr is not None and switching else {}
        if verdict is policy.Admit.REFUSE_STOPPING:
            return Reply(ok=False, code="stopping", message="the daemon is shutting down")
        if verdict is policy.Admit.REFUSE_BOOTING:
            return Reply(
                ok=False,
                code="busy",
                message=f"the daemon is booting ({self._status_line()}); ask again in a moment",
            )
        if verdict is policy.Admit.JOIN:
            assert tr is not None
            return Reply(
                ok=True,
                code="joined",
                message=f"already switching to {mode.value} since "
                f"{tr.started_at:%H:%M:%S} ({tr.step}): following it",
                data=info,
            )
        if verdict is policy.Admit.REFUSE_BUSY:
            assert tr is not None
            return Reply(
                ok=False,
                code="busy",
                message=f"a switch to {tr.target.value} is in progress since "
                f"{tr.started_at.isoformat(timespec='seconds')} (step {tr.step}, asked by "
                f"{tr.requested_by or 'the daemon'}); wait for it, or use --force to take over",
                data=info,
            )
        if verdict is policy.Admit.ALREADY:
            return Reply(
                ok=True,
                code="already",
                message=f"{mode.value} is already running and healthy (vLLM PID "
                f"{self.serving_pid}); nothing to do",
            )
        self._desire(mode, by)
        self.preempt = (mode, by)
        if verdict is policy.Admit.TAKE_OVER:
            assert tr is not None
            self.preempt_force = True
            return Reply(
                ok=True,
                code="accepted",
                message=f"taking over from the switch to {tr.target.value}",
                data=info,
            )
        self.failures.clear()  # an operator's request starts a fresh count
        self.preempt_force = force
        c = self.capture
        if verdict is policy.Admit.ACCEPT_AFTER_CAPTURE and c is not None:
            return Reply(
                ok=True,
                code="accepted",
                message=f"switch to {mode.value} accepted: it waits for capture {c.id} "
                f"({c.phase}) to finish flushing; --force cuts the capture short",
            )
        return Reply(ok=True, code="accepted", message=f"switch to {mode.value} accepted")

    # ---------------------------------------------------------------- timed profile mode
    def _set_expiry(self, mode: Mode, for_s: float | None, by: str) -> str:
        """Persist when profile mode ends (or that it does not); returns words for the reply."""
        p = self.config.profiling
        until: datetime | None = None
        if mode is Mode.PROFILE:
            seconds = for_s or p.default_duration_s or None
            if seconds and p.max_duration_s and seconds > p.max_duration_s:
                seconds = p.max_duration_s
            until = utcnow() + timedelta(seconds=seconds) if seconds else None
        if until == self.profile_until:
            return ""
        self.profile_until = until
        self._persist(
            lambda st: st.model_copy(
                update={"profile_until": until, "profile_until_changed_at": utcnow()}
            )
        )
        self._publish()
        if until is None:
            return ""
        self.log("profile_expiry_set", until=until.isoformat(), by=by)
        capped = for_s is not None and p.max_duration_s and for_s > p.max_duration_s
        return f"back to production at {until:%Y-%m-%d %H:%M:%S} UTC" + (
            f" (capped at profiling.max_duration_s = {p.max_duration_s:g} s)" if capped else ""
        )

    def _check_expiry(self) -> None:
        """Timed profile mode: once it has expired, production is desired again."""
        until = self.profile_until
        if until is None or self.desired is not Mode.PROFILE or utcnow() < until:
            return
        self.log("profile_expired", until=until.isoformat())
        history.append(
            self.config.state.dir,
            "incident",
            {"at": utcnow().isoformat(), "what": f"profile mode expired at {until.isoformat()}"},
        )
        self.profile_until = None
        self._persist(
            lambda st: st.model_copy(
                update={"profile_until": None, "profile_until_changed_at": utcnow()}
            )
        )
        self._desire(Mode.PRODUCTION, "profile expiry")

    # ---------------------------------------------------------------- captures
    def _on_capture(self, args: dict[str, Any]) -> Reply:
        if self.capture is not None and self.capture.active:
            c = self.capture
            return Reply(
                ok=False,
                code="busy",
                message=f"capture {c.id} is {c.phase} (since {c.started_at:%H:%M:%S})",
                data={"capture": c.describe()},
            )
        if self.transition is not None or self.preempt is not None:
            return Reply(
                ok=False, code="busy", message=f"a switch is in progress: {self._status_line()}"
            )
        if self.state is not State.SERVING or self.serving_mode is not Mode.PROFILE:
            return Reply(
                ok=False,
                code="wrong_mode",
                message=f"vLLM is not serving in profile mode ({self._status_line()}): switch "
                "first with `kimi-mode profile`, or use `kimi-mode capture --switch`",
            )
        out = Path(args["out"]) if args.get("out") else None
        if out is not None:
            problem = _unusable_out(out, int(args.get("uid", 0)))
            if problem:
                return Reply(ok=False, code="bad_request", message=f"--out {out}: {problem}")
        spec = CaptureSpec(args.get("seconds"), args.get("then", "production"), out, args["by"])
        self.capture = Capture(
            self.config,
            spec,
            self.bus.publish,
            lambda c: self.commands.put(Command("capture_done", {"capture": c})),
            self.log,
        )
        self.capture.start()
        self.log("capture_started", **self.capture.describe())
        self._publish()
        return Reply(
            ok=True,
            code="accepted",
            message=f"capture {self.capture.id} starting"
            + (f" for {spec.seconds:g} s" if spec.seconds else " until stopped"),
            data={"capture": self.capture.describe()},
        )

    def _capture_done(self, c: Capture) -> None:
        history.append(
            self.config.state.dir,
            "capture",
            {
                **c.describe(),
                "finished_at": utcnow().isoformat(),
                "ok": c.ok,
                "message": c.message,
                "folder": str(c.folder) if c.folder else None,
            },
        )
        if self.capture is c:
            self.capture = None
        if c.spec.then == "production" and self.desired is Mode.PROFILE:
            self._desire(Mode.PRODUCTION, f"capture {c.id} (--then production)")
            self._set_expiry(Mode.PRODUCTION, None, "capture")
            self.preempt = (Mode.PRODUCTION, f"capture {c.id} (--then production)")
        self._publish()

    def _capture_blocks_switch(self) -> bool:
        """A capture in progress holds switches back until its traces are flushed (a cut-off
        trace is useless); recording is stopped so that the flush begins. --force overrides."""
        c = self.capture
        # Until the loop has handled the capture's end (capture_done clears self.capture): the
        # capture thread marks itself done a moment before, and a switch started in between
        # would begin before the capture is recorded as finished.
        if c is None or self.preempt_force:
            return False
        if c.phase in ("starting", "recording") and not c.stop.is_set():
            self.log("capture_stopped_for_switch", capture=c.id)
            c.stop.set()
        return True

    def _desire(self, mode: Mode, by: str) -> None:
        """Persist the desired mode: always before anything is torn down for it."""
        self._persist(lambda st: with_desired(st, mode, by))
        if mode is not self.desired:
            self.log("desired_mode_changed", previous=self.desired.value, desired=mode.value, by=by)
        self.desired = mode
        self._publish()

    # ---------------------------------------------------------------- boot
    def _load_state(self) -> None:
        st, warning = self.store.read()
        if warning:
            self._warn(warning)
            self.log("state_file_corrupt", level="error", message=warning)
            history.append(
                self.config.state.dir, "incident", {"at": utcnow().isoformat(), "what": warning}
            )
            self.store.write(st)
        self.desired = st.desired_mode
        self.profile_until = st.profile_until
        self._check_expiry()
        self.interrupted = st.transition
        if st.transition is not None:
            self.log("transition_interrupted", transition=st.transition.model_dump(mode="json"))

    def _wait_for_driver(self) -> bool:
        delay = 0.5
        while not self.stop_requested:
            try:
                n = self.gpu.device_count()
                self.indices = list(self.config.gpus.managed) or list(range(n))
                self.gpu.sample(self.indices)
                self._unwarn("waiting for the GPU driver")
                return True
            except GpuUnavailable as e:
                msg = f"waiting for the GPU driver: {e}"
                self._warn(msg)
                self._publish()
                self.notifier.status(msg)
            self._serve_until(self.clock.monotonic() + delay)
            delay = min(delay * 2, self.config.daemon.driver_retry_max_s)
        return False

    def _resolve_baseline(self) -> None:
        """Config, then the state file (same driver), else calibrated now (baseline.resolve);
        with processes on the GPUs and nothing stored, a provisional baseline until they are
        next seen idle (after a CLEAN teardown)."""
        fixed = self.config.gpus.baseline_mib
        try:
            self.baselines = baseline.resolve(self.gpu, self.indices, fixed, self.config.state.dir)
        except baseline.BaselineError as e:
            self.baselines = {i: fixed.get(str(i), PROVISIONAL_BASELINE_MIB) for i in self.indices}
            self.baseline_provisional = True
            self._warn(
                f"no baseline, and it cannot be measured now ({e}): using "
                f"{PROVISIONAL_BASELINE_MIB} MiB until the GPUs are next idle, then calibrating"
            )
            return
        if self.baseline_provisional:
            self.log("baseline_calibrated", devices=self.baselines)
        self.baseline_provisional = False
        self._unwarn("no baseline")

    # ---------------------------------------------------------------- observation
    def _observe(self) -> Observed | None:
        try:
            st = self.systemd.status(self.unit)
        except SystemdError as e:
            self._warn(f"cannot read {self.unit}: {e}")
            return None
        self._unwarn(f"cannot read {self.unit}")
        up = st.active_state in ("active", "activating", "reloading")
        mode = self._running_mode(st.main_pid) if up else None
        health = -1
        if up:
            health = self._probe_health(st.main_pid)
        now = self.clock.monotonic()
        steady = self.state is State.SERVING and st.main_pid == self.serving_pid
        if (
            steady
            and self._gpus_at is not None
            and now - self._gpus_at < (self.config.daemon.health_interval_s)
        ):
            clean = all(d["clean"] for d in self.devices)
        else:
            clean = self._sample_gpus()
        obs = Observed(
            active_state=st.active_state,
            sub_state=st.sub_state,
            main_pid=st.main_pid,
            running_mode=mode,
            health=health,
            gpus_clean=clean,
            result=st.result,
            exec_main_status=st.exec_main_status,
        )
        if obs.healthy or not up:
            self.unhealthy_since = None
        elif self.unhealthy_since is None:
            self.unhealthy_since = now
        self.observed = obs
        return obs

    def _probe_health(self, main_pid: int) -> int:
        """GET /health; while serving the same MainPID, at most every health_interval_s."""
        d, now = self.config.daemon, self.clock.monotonic()
        last, at = self._health
        fresh = now - at < d.health_interval_s and last != -1
        if self.state is State.SERVING and main_pid == self.serving_pid and fresh:
            return last
        status = http_request(self.config.vllm.health_url, timeout_s=d.health_timeout_s).status
        self._health = (status, now)
        return status

    def _running_mode(self, main_pid: int) -> Mode | None:
        """The mode MainPID was started in; read once per MainPID (its argv does not change)."""
        if self._mode_of_pid[0] != main_pid or self._mode_of_pid[1] is None:
            self._mode_of_pid = (main_pid, launcher.running_mode(self.config, main_pid))
        return self._mode_of_pid[1]

    def _title(self, pid: int) -> str:
        if pid not in self._titles:
            self._titles[pid] = _title(pid)
        return self._titles[pid]

    def _sample_gpus(self) -> bool:
        tol = self.config.gpus.tolerance_mib
        try:
            samples = self.gpu.sample(self.indices)
        except GpuUnavailable as e:
            self._warn(f"cannot read the GPUs: {e}")
            return False
        self._unwarn("cannot read the GPUs")
        self._gpus_at = self.clock.monotonic()
        self._listed = {s.index: [p.pid for p in s.processes] for s in samples}
        devices = []
        holders = {p.pid for s in samples for p in s.processes}
        self._titles = {pid: t for pid, t in self._titles.items() if pid in holders}
        for s in samples:
            base = self.baselines.get(s.index, PROVISIONAL_BASELINE_MIB)
            devices.append(
                {
                    "index": s.index,
                    "used_mib": s.used_mib,
                    "baseline_mib": base,
                    "tolerance_mib": tol,
                    "total_mib": s.total_mib,
                    "clean": s.used_mib <= base + tol and not s.processes,
                    "holders": [
                        {"pid": p.pid, "name": self._title(p.pid), "used_mib": p.used_mib}
                        for p in s.processes
                    ],
                }
            )
        self.devices = devices
        return all(d["clean"] for d in devices)

    # ---------------------------------------------------------------- acting
    def _memory(self) -> Memory:
        return Memory(
            state=self.state,
            serving_pid=self.serving_pid,
            start_deadline=self.start_deadline,
            next_attempt_at=self.next_attempt_at,
            unhealthy_since=self.unhealthy_since,
        )

    def _tick(self) -> None:
        if self.state is State.STARTING:
            self._follow_output()
        self._check_expiry()
        obs = self._observe()
        if obs is None:
            self._publish()
            return
        if self.state is State.STARTING and obs.unit_up and self._intruders():
            self._publish()
            return
        if self.preempt is not None and self._capture_blocks_switch():
            self._publish()
            return
        if self.preempt is not None:
            mode, by = self.preempt
            self.preempt = None
            if self.transition is not None:
                self._end_transition(False, "preempted", f"superseded by a switch to {mode.value}")
            self.preempt_force = False
            self._run_transition(mode, "switch", f"asked by {by}", by)
            return
        action = decide(
            self.desired,
            self._memory(),
            obs,
            self.clock.monotonic(),
            self.config.daemon.health_grace_s,
        )
        if action.do in (Do.SWITCH, Do.RETRY) and self._capture_blocks_switch():
            self._publish()
            return
        self._act(action, obs)
        self._publish()

    def _act(self, action: Action, obs: Observed) -> None:
        if action.do is Do.NOTHING:
            return
        self.log("reconcile", action=action.do.value, reason=action.reason, state=self.state.value)
        if action.do is Do.ADOPT:
            self._adopt(obs, action.reason)
        elif action.do is Do.RESUME_START:
            self._resume_start(obs)
        elif action.do is Do.READY:
            self._ready(obs)
        elif action.do is Do.START_FAILED:
            self._start_failed(action.reason)
        elif action.do is Do.DIED:
            self._died(action.reason)
        elif action.do in (Do.SWITCH, Do.RETRY):
            kind = "retry" if action.do is Do.RETRY else "switch"
            reason = action.reason
            if self.interrupted is not None:
                kind, reason = (
                    "switch",
                    (
                        f"redoing {self.interrupted.id} (to {self.interrupted.target.value}), "
                        f"interrupted at {self.interrupted.step}: {reason}"
                    ),
                )
                self.interrupted = None
            elif self.state is State.BOOTING:
                kind = "boot"
            self._run_transition(self.desired, kind, reason, "daemon")

    def _adopt(self, obs: Observed, reason: str) -> None:
        ref = processes.ref_of(obs.main_pid)
        since = utcnow()
        if ref is not None:
            with contextlib.suppress(OSError, ValueError):
                since = datetime.fromtimestamp(processes.start_time_epoch(ref), tz=since.tzinfo)
        self.serving_mode, self.serving_pid, self.mode_since = obs.running_mode, obs.main_pid, since
        if self.transition is not None or self.interrupted is not None:
            self.transition = self.transition or self.interrupted
            self._end_transition(True, "ready", f"{self.desired.value} was already running")
        self.interrupted = None
        self.log("adopted", mode=self.desired.value, main_pid=obs.main_pid, reason=reason)
        self._set_state(State.SERVING, reason)
        self.stuck_retries = 0

    def _resume_start(self, obs: Observed) -> None:
        tr = self.interrupted
        self.interrupted = None
        now = utcnow()
        if tr is None or tr.target is not self.desired:
            tr = TransitionRecord(
                id=_new_id(),
                target=self.desired,
                kind="boot",
                reason="found loading at boot",
                requested_by="daemon",
                started_at=now,
                step="starting",
                step_changed_at=now,
            )
        deadline_at = tr.start_deadline_at or now + timedelta(
            seconds=self.config.daemon.start_timeout_s
        )
        tr = tr.model_copy(update={"step": "starting", "start_deadline_at": deadline_at})
        self.transition = tr
        self._persist_transition()
        self.start_deadline = self.clock.monotonic() + (deadline_at - now).total_seconds()
        self.output.begin()
        self.progress = Progress()
        self.log("start_resumed", transition=tr.id, main_pid=obs.main_pid)
        self._set_state(State.STARTING, "a load was in progress when the daemon started")

    def _run_transition(self, target: Mode, kind: str, reason: str, by: str) -> None:
        now = utcnow()
        obs = self.observed
        previous = self.serving_mode or (obs.running_mode if obs and obs.unit_up else None)
        tr = TransitionRecord(
            id=_new_id(),
            target=target,
            previous=previous,
            kind=kind,  # type: ignore[arg-type]
            reason=reason,
            requested_by=by,
            started_at=now,
            step="teardown",
            step_changed_at=now,
        )
        self.transition = tr
        self._persist_transition()
        self.serving_mode, self.serving_pid, self.mode_since = None, 0, None
        self.log("transition_started", **tr.model_dump(mode="json"))
        self._event("transition_started", tr.model_dump(mode="json"))
        self._set_state(State.TEARING_DOWN, reason)
        report = self._teardown(reason)
        if report.outcome is Outcome.STUCK:
            self._stuck(report)
            return
        if self.stop_requested:
            self._end_transition(False, "stopped", "the daemon is stopping")
            return
        if self.preempt is not None:
            mode, by2 = self.preempt
            self.preempt, self.preempt_force = None, False
            self._end_transition(False, "preempted", f"superseded by a switch to {mode.value}")
            self._run_transition(mode, "switch", f"asked by {by2} (took over)", by2)
            return
        self._start()

    def _start(self) -> None:
        tr = self.transition
        assert tr is not None
        argv_file = launcher.write_argv_file(self.config, tr.target)
        self.output.begin()
        self.progress = Progress()
        deadline_at = utcnow() + timedelta(seconds=self.config.daemon.start_timeout_s)
        self.transition = tr = tr.model_copy(
            update={
                "step": "starting",
                "step_changed_at": utcnow(),
                "start_deadline_at": deadline_at,
            }
        )
        self._persist_transition()
        argv = self.config.launch_argv(tr.target)
        try:
            st = self.systemd.status(self.unit)
            if st.active_state == "failed":
                self.systemd.reset_failed(self.unit)
            self.systemd.start(self.unit)
        except SystemdError as e:
            self._set_state(State.STARTING)
            self._start_failed(f"systemd refused to start {self.unit}: {e}")
            return
        self.start_deadline = self.clock.monotonic() + self.config.daemon.start_timeout_s
        self.log("vllm_starting", mode=tr.target.value, argv=argv, argv_file=str(argv_file))
        self._event("starting", {"mode": tr.target.value, "argv": argv})
        self._set_state(State.STARTING, f"started {self.unit} in {tr.target.value}")

    def _follow_output(self) -> None:
        before = self.progress
        for line in self.output.read_new():
            self.progress = advance(self.progress, line)
        if self.progress != before:
            p = self.progress
            self._event("progress", {"phase": p.phase, "percent": p.percent, "text": p.describe()})
            if p.phase != before.phase:
                self.log("vllm_progress", phase=p.phase, percent=p.percent)

    def _ready(self, obs: Observed) -> None:
        tr = self.transition
        self._follow_output()
        self.serving_mode, self.serving_pid, self.mode_since = (
            tr.target if tr else self.desired,
            obs.main_pid,
            utcnow(),
        )
        self.progress = Progress("ready")
        took = (utcnow() - tr.started_at).total_seconds() if tr else 0.0
        self._event(
            "ready",
            {
                "mode": self.serving_mode.value,
                "main_pid": obs.main_pid,
                "duration_s": round(took, 3),
            },
        )
        self.log(
            "vllm_ready",
            mode=self.serving_mode.value,
            main_pid=obs.main_pid,
            duration_s=round(took, 3),
        )
        self.stuck_retries = 0
        self._end_transition(True, "ready", f"{self.serving_mode.value} is ready ({took:.1f} s)")
        self._set_state(State.SERVING, "GET /health answered 200")

    def _start_failed(self, reason: str) -> None:
        tr = self.transition
        assert tr is not None
        self._follow_output()
        tail = self.output.tail()
        self.log(
            "vllm_start_failed",
            level="error",
            mode=tr.target.value,
            reason=reason,
            output_tail=tail,
        )
        self._event(
            "start_failed", {"mode": tr.target.value, "reason": reason, "output_tail": tail}
        )
        self.transition = tr = tr.model_copy(update={"step": "teardown"})
        self._set_state(State.TEARING_DOWN, reason)
        report = self._teardown(f"start of {tr.target.value} failed: {reason}")
        back = policy.rollback_target(tr.target, tr.previous)
        detail = {"reason": reason, "output_tail": tail}
        if report.outcome is Outcome.STUCK:
            self._stuck(report, detail)
            return
        if self.stop_requested:
            self._end_transition(False, "stopped", "the daemon is stopping", detail)
            return
        if self.preempt is not None:
            mode, by = self.preempt
            self.preempt = None
            self._end_transition(
                False, "preempted", f"superseded by a switch to {mode.value}", detail
            )
            self._run_transition(mode, "switch", f"asked by {by} (took over)", by)
            return
        decided = policy.after_failed_start(
            self.config.daemon.rollback, tr.kind == "rollback", back
        )
        if decided is policy.AfterFailedStart.ROLLBACK and back is not None:
            why = f"{tr.target.value} did not become ready ({reason})"
            self._end_transition(
                False, "rolled_back", f"{why}; rolling back to {back.value}", detail
            )
            self._desire(back, "rollback")
            self._run_transition(back, "rollback", why, "rollback")
            return
        self._failure(f"{tr.target.value} did not become ready: {reason}", detail)

    def _main_exited(self, pid: int) -> None:
        """vLLM's MainPID exited (its pidfd said so). Told at once; then the unit is read until
        systemd has seen it too (at most main_exit_settle_s), so that the tick that follows
        observes the death instead of a unit that still names the dead MainPID."""
        self.log("vllm_main_exited", level="warning", main_pid=pid)
        self._event("vllm_main_exited", {"main_pid": pid})
        self._health = (-1, 0.0)
        deadline = self.clock.monotonic() + MAIN_EXIT_SETTLE_S
        while self.clock.monotonic() < deadline:
            try:
                st = self.systemd.status(self.unit)
            except SystemdError:
                return
            if st.main_pid != pid or st.active_state not in ("active", "reloading"):
                return
            self.clock.sleep(0.01)

    def _intruders(self) -> bool:
        """While vLLM loads: a live process outside its unit and its tree that NVML lists on a
        managed GPU is noticed (history, event, metric, status) and dealt with: a teardown (which
        kills it on NVML's evidence, with vLLM's partial load), then the load again after the
        failure backoff."""
        if all(pid in self._unit_pids for pids in self._listed.values() for pid in pids):
            return False
        try:
            self._unit_pids = set(self.systemd.cgroup_pids(self.unit))
        except SystemdError:
            return False
        main = self.observed.main_pid if self.observed else 0
        if main:  # vLLM's own tree is vLLM's, even where a child left the unit's cgroup
            self._unit_pids |= {main, *processes.descendants(main)}
        paths = {i: self.gpu.device_path(i) for i in self._listed}
        found = intrusion.foreign(self._listed, self._unit_pids, paths)
        if not found:
            return False
        tr = self.transition
        assert tr is not None
        who = "; ".join(f"PID {f.pid} ({f.name}) on GPU {f.gpu}" for f in found)
        reason = (
            f"a process outside {self.unit} took a managed GPU while {tr.target.value} was "
            f"loading: {who}"
        )
        record = {
            "at": utcnow().isoformat(),
            "what": reason,
            "incident": "gpu_intrusion",
            "processes": [{"pid": f.pid, "gpu": f.gpu, "name": f.name} for f in found],
        }
        self.last_intrusion = record
        history.append(self.config.state.dir, "incident", record)
        self.log("gpu_intrusion", level="warning", **record)
        self._event("gpu_intrusion", record)
        if self.metrics:
            for f in found:
                self.metrics.intrusions.labels(str(f.gpu)).inc()
        self.transition = tr.model_copy(update={"step": "teardown"})
        self._set_state(State.TEARING_DOWN, reason)
        report = self._teardown(reason)
        if report.outcome is Outcome.STUCK:
            self._stuck(report, {"intrusion": record})
        elif self.stop_requested:
            self._end_transition(False, "stopped", "the daemon is stopping", {"intrusion": record})
        else:
            self._failure(f"{reason}; torn down", {"intrusion": record}, outcome="intruded")
        return True

    def _died(self, reason: str) -> None:
        self.log(
            "vllm_died",
            level="error",
            reason=reason,
            mode=(self.serving_mode.value if self.serving_mode else None),
        )
        history.append(
            self.config.state.dir, "incident", {"at": utcnow().isoformat(), "what": reason}
        )
        self._event("vllm_died", {"reason": reason})
        self.serving_mode, self.serving_pid, self.mode_since = None, 0, None
        self._set_state(State.TEARING_DOWN, reason)
        report = self._teardown(f"vLLM died: {reason}")
        if report.outcome is Outcome.STUCK:
            self._stuck(report)
            return
        self._failure(reason, {})

    def _failure(self, reason: str, detail: dict[str, Any], outcome: str = "failed") -> None:
        d = self.config.daemon
        now = self.clock.monotonic()
        v = policy.after_failure(
            self.failures,
            now,
            d.failure_window_s,
            d.max_failures,
            d.restart_backoff_initial_s,
            d.restart_backoff_max_s,
        )
        self.failures = collections.deque(v.failures)
        n = len(v.failures)
        if v.failed:
            msg = (
                f"{reason}; {n} failures within {d.failure_window_s:g} s: not retrying. "
                f"Fix the cause, then `kimi-mode {self.desired.value}`"
            )
            self._end_transition(False, "failed", msg, detail)
            self.log("failed", level="error", message=msg)
            self._set_state(State.FAILED, msg)
            return
        self.next_attempt_at = now + v.backoff_s
        msg = (
            f"{reason}; starting {self.desired.value} again in {v.backoff_s:g} s (failure {n} "
            f"of {d.max_failures})"
        )
        self._end_transition(False, outcome, msg, detail)
        self._set_state(State.BACKOFF, msg)

    def _stuck(self, report: TeardownReport, detail: dict[str, Any] | None = None) -> None:
        d = self.config.daemon
        wait = policy.stuck_retry_s(self.stuck_retries, d.stuck_retry_s, d.restart_backoff_max_s)
        self.stuck_retries += 1
        self.next_attempt_at = self.clock.monotonic() + wait
        msg = (
            f"teardown STUCK: {report.diagnosis}. Next: {report.next_action}. "
            f"Retrying in {wait:g} s; vLLM is not started on occupied GPUs"
        )
        if self.transition is not None:
            self._end_transition(False, "stuck", msg, detail or {})
        self.log("stuck", level="error", message=msg)
        self._set_state(State.STUCK, msg)

    def _end_transition(
        self, ok: bool, outcome: str, message: str, detail: dict[str, Any] | None = None
    ) -> None:
        tr = self.transition
        if tr is None:
            return
        finished = utcnow()
        record = {
            "id": tr.id,
            "target": tr.target.value,
            "previous": tr.previous.value if tr.previous else None,
            "trigger": tr.kind,
            "reason": tr.reason,
            "requested_by": tr.requested_by,
            "started_at": tr.started_at.isoformat(),
            "finished_at": finished.isoformat(),
            "duration_s": round((finished - tr.started_at).total_seconds(), 3),
            "outcome": outcome,
            "message": message,
            **(detail or {}),
        }
        history.append(self.config.state.dir, "transition", record)
        if self.metrics:
            self.metrics.transitions.labels(outcome).inc()
        self.log("transition_finished", level="info" if ok else "warning", **record)
        self.bus.publish(
            End(ok=ok, outcome=outcome, message=message, data={"transition": tr.id, **record})
        )
        self.transition = None
        self._persist_transition()

    # ---------------------------------------------------------------- teardown
    def _teardown(self, reason: str) -> TeardownReport:
        if not self.indices:
            self._wait_for_driver()
        if not self.baselines:
            self._resolve_baseline()
        tid = self.transition.id if self.transition else None

        def on_event(kind: str, data: dict[str, Any]) -> None:
            self.log(kind, transition=tid, **data)
            if kind == "step_started" and self.transition is not None:
                self.transition = self.transition.model_copy(
                    update={"step": f"teardown:{data['step']}", "step_changed_at": utcnow()}
                )
                self._persist_transition()
            if kind == "gpus":
                self._devices_from_teardown(data["devices"])
            if kind == "kill" and data.get("signal") == "SIGKILL" and self.metrics:
                self.metrics.kills.labels(data.get("step", "")).inc()
            self._event(kind, data)
            self._publish()

        report = Teardown(
            self.config,
            self.systemd,
            self.gpu,
            _BusyClock(self),
            dict(self.baselines),
            on_event=on_event,
        ).run()
        self.last_teardown = report
        body = report.model_dump(mode="json") | {"transition": tid, "reason": reason}
        history.append(self.config.state.dir, "teardown", body)
        if self.metrics:
            self.metrics.teardown_seconds.labels(report.outcome.value).observe(report.duration_s)
        if report.outcome is Outcome.CLEAN and self.baseline_provisional:
            self._resolve_baseline()
        self._sample_gpus()
        self._publish()
        return report

    def _devices_from_teardown(self, devices: list[dict[str, Any]]) -> None:
        tol = self.config.gpus.tolerance_mib
        self.devices = [
            {
                "index": d["index"],
                "used_mib": d["used_mib"],
                "baseline_mib": d["baseline_mib"],
                "tolerance_mib": tol,
                "clean": d["used_mib"] <= d["baseline_mib"] + tol and not d["processes"],
                "holders": [{"pid": p, "name": self._title(p)} for p in d["processes"]],
            }
            for d in devices
        ]

    # ---------------------------------------------------------------- the loop
    def _next_tick_in(self) -> float:
        d = self.config.daemon
        return d.start_poll_s if self.state is State.STARTING else d.tick_s

    def boot(self) -> bool:
        """Up to READY: state read, driver answering, baseline known, the world observed."""
        self._load_state()
        self._publish()
        if not self._wait_for_driver():
            return False
        self._resolve_baseline()
        self._observe()
        self._publish()
        self.notifier.ready(self._status_line())
        self.log(
            "ready",
            desired=self.desired.value,
            state=self.state.value,
            unit=self.observed.describe_unit() if self.observed else "unknown",
        )
        return True

    def loop(self) -> None:
        """Tick until a stop is asked for; then tear down to clean (see `shutdown`)."""
        next_tick = self.clock.monotonic()
        while not self.stop_requested and not self.reexec_requested:
            self._serve_until(next_tick)
            if self.stop_requested or self.reexec_requested:
                break
            self._tick()
            self.wakeup.watch(self.serving_pid if self.state is State.SERVING else 0)
            next_tick = self.clock.monotonic() + self._next_tick_in()

    def shutdown(self) -> bool:
        """`systemctl stop`: teardown to CLEAN (a few attempts), then return True if clean."""
        t = self.config.teardown
        budget = (
            t.term_grace_s
            + t.cgroup_kill_timeout_s
            + t.strays_timeout_s
            + t.holders_timeout_s
            + t.release_timeout_s
            + 30
        )
        self.notifier.extend_timeout(budget)
        self._set_state(State.STOPPING, "stop requested")
        self.notifier.stopping("stopping: tearing vLLM down")
        self._end_transition(False, "stopped", "the daemon is stopping")
        report = None
        for _attempt in range(3):
            self.notifier.extend_timeout(budget)
            report = self._teardown("the supervisor is stopping")
            if report.outcome is Outcome.CLEAN:
                break
        clean = report is not None and report.outcome is Outcome.CLEAN
        self.log("stopped", clean=clean, desired=self.desired.value)
        return clean

    def request_from_signal(self, kind: str) -> None:
        self.commands.put(Command(kind))
        self.wakeup.ring()


def _unusable_out(out: Path, uid: int) -> str | None:
    """The daemon runs as root and moves trace files into --out: only into a directory that
    the asking user owns (root may use any), never through a symlink."""
    if not out.is_absolute():
        return "give an absolute path"
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return "no such directory: create it first"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return "not a directory (symlinks are not followed)"
    if uid != 0 and st.st_uid != uid:
        return f"owned by uid {st.st_uid}, not by you (uid {uid}): use a directory of your own"
    return None


def _title(pid: int) -> str:
    """What an operator recognises a process by: its (possibly retitled) command line."""
    return " ".join(processes.cmdline_of(pid))[:48] or processes.comm_of(pid)


def _teardown_summary(r: TeardownReport) -> dict[str, Any]:
    return {
        "outcome": r.outcome.value,
        "started_at": r.started_at.isoformat(),
        "duration_s": round(r.duration_s, 3),
        "kills": [
            {
                "pid": k.process.pid,
                "comm": k.process.comm,
                "cmdline": " ".join(k.process.cmdline)[:200],
                "step": k.step.value,
                "evidence": k.evidence.value,
                "result": k.result,
            }
            for k in r.kills
            if k.signal == "SIGKILL"
        ],
        "diagnosis": r.diagnosis,
        "next_action": r.next_action,
        "remaining": [
            {
                "pid": h.process.pid,
                "name": " ".join(h.process.cmdline)[:80] or h.process.comm,
                "role": h.role.value,
                "devices": h.devices,
                "why": h.why,
                "check": h.check,
            }
            for h in r.remaining
        ],
    }


def install_signal_handlers(daemon: Daemon) -> None:
    signal.signal(signal.SIGTERM, lambda *_: daemon.request_from_signal("stop"))
    signal.signal(signal.SIGINT, lambda *_: daemon.request_from_signal("stop"))
    signal.signal(signal.SIGHUP, lambda *_: daemon.request_from_signal("reexec"))
    signal.signal(signal.SIGUSR2, lambda *_: daemon.request_from_signal("wedge"))


def reexec() -> None:
    """Replace this process with a fresh copy of itself (upgrades): vLLM is left running and is
    adopted by the new process. The control socket's lock dies with the old image."""
    os.execv(sys.executable, list(sys.orig_argv))
