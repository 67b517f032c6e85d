"""The daemon's loop: one thread that owns vLLM's unit and the GPUs.

    wait for a message or a deadline -> handle it -> observe -> reconcile.decide -> act
                                     -> persist -> publish

What wakes it (loop/inbox.py): a request (connection threads and
signal handlers put typed messages in its inbox and ring its doorbell), the teardown job's
progress and end, the exit of the vLLM MainPID it serves (a pidfd), or a deadline: the next
/health poll while vLLM loads, a backoff or a STUCK retry falling due, timed profile mode's end,
the unit's periodic read (`tick_s`, for what nothing can wake it for), and the watchdog.

Only this thread changes the loop state (loop/loopstate.py). A teardown runs on a job
thread and reports back through the inbox; while it runs, requests are answered (status from
the published snapshot, switches joined, refused or accepted as the next intent) and nothing
else is decided. Nothing here calls itself: each message is handled to its end, then the loop
waits again.

The desired mode is persisted before anything is torn down; the transition in progress is
persisted with its step, so a daemon that dies mid-switch redoes it from the start of the
teardown (every step is idempotent), and a daemon that dies mid-load waits for that load.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from kimi_supervisor.config import Config
from kimi_supervisor.decide.liveness import health_failure
from kimi_supervisor.decide.reconcile import Observed, decide
from kimi_supervisor.loop import boot
from kimi_supervisor.loop.admission import Desk
from kimi_supervisor.loop.context import Context, EventBus, Log
from kimi_supervisor.loop.inbox import (
    BundleDone,
    CaptureDone,
    CaptureStart,
    CaptureStop,
    Inbox,
    JobDone,
    JobEvent,
    LivenessSeen,
    MainExited,
    Message,
    Reexec,
    Request,
    Stop,
    Switch,
    Wakeup,
    Warmed,
)
from kimi_supervisor.loop.lifecycle import Lifecycle
from kimi_supervisor.loop.liveness import engine_cpu
from kimi_supervisor.loop.observer import Observer
from kimi_supervisor.loop.publish import build, export, status_line
from kimi_supervisor.messages import Reply
from kimi_supervisor.model import Mode, State, utcnow
from kimi_supervisor.ports import processes
from kimi_supervisor.ports.bounded import IoWorker, Worker
from kimi_supervisor.ports.clock import Clock, SystemClock
from kimi_supervisor.ports.gpu import GpuPort, GpuUnavailable
from kimi_supervisor.ports.metrics import Metrics
from kimi_supervisor.ports.notify import Notifier
from kimi_supervisor.ports.output import OutputPort
from kimi_supervisor.ports.systemd import SystemdError, SystemdPort
from kimi_supervisor.status import Status
from kimi_supervisor.store.state import StateStore

# After vLLM's MainPID exits, how long to wait for systemd to reflect it before acting, and how
# often to look meanwhile (the loop's passes; it never sleeps on its thread).
MAIN_EXIT_SETTLE_S = 0.5
MAIN_EXIT_POLL_S = 0.01
# A pass that failed unexpectedly is retried after 1 s, doubling up to 5 minutes.
STEP_RETRY_S = 1.0
STEP_RETRY_MAX_S = 300.0
STEP_FAILED = "the loop's pass failed"
# While /health fails, the API server's CPU is read at each pass: this many readings at most.
MAX_API_READINGS = 64


# What status says while a re-exec waits for a call stuck in the kernel.
REEXEC_WAITS = "the re-exec waits"


class Daemon:
    def __init__(
        self,
        config: Config,
        systemd: SystemdPort,
        gpu: GpuPort,
        *,
        output: OutputPort,
        notifier: Notifier,
        log: Log,
        clock: Clock | None = None,
        metrics: Metrics | None = None,
        disk: IoWorker | None = None,
        reads: IoWorker | None = None,
        bundles: IoWorker | None = None,
    ) -> None:
        self.config = config
        self.bus = EventBus()
        self.wakeup = Wakeup()
        self.inbox = Inbox(self.wakeup.ring)
        clock = clock or SystemClock()
        # The observer's warnings are the context's (they show in status while they last).
        observer = Observer(
            config, systemd, gpu, clock, lambda *a: self.ctx.warn(*a), lambda p: self.ctx.unwarn(p)
        )
        self.ctx = ctx = Context(
            config,
            systemd,
            gpu,
            output,
            notifier,
            log,
            clock,
            metrics,
            StateStore(config.state.dir),
            self.bus,
            observer,
            disk_worker=disk,
            bundle_worker=bundles,
        )
        # The history's reads for clients (control/handlers.py), apart from the loop's own.
        self.reads: IoWorker = reads or Worker("history", config.state.timeout_s, copy=True)
        self.s = ctx.s
        self.desk = Desk(ctx, self.inbox.put)
        self.life = Lifecycle(ctx, self.inbox.put)
        self.started_at = utcnow()
        self.heartbeat = ctx.clock.monotonic()
        self._last_watchdog = 0.0
        self._last_line = ""
        self._status_lock = threading.Lock()
        self._status: Status | None = None
        self._next_step = 0.0  # the regular pass (monotonic)
        self._last_step = float("-inf")  # when the last pass began
        self.guard = StepGuard(ctx)  # a pass's unexpected error: shown, retried, never fatal
        self._exited: tuple[int, float] | None = None  # a MainPID's exit systemd has yet to see
        self._publish()  # a status asked for before boot has begun is complete, too

    # ---------------------------------------------------------------- asking the loop
    def ask(self, request: Message) -> None:
        """From any thread: hand a request to the loop, which answers through its `reply`."""
        self.inbox.put(request)

    # ---------------------------------------------------------------- status
    def snapshot(self) -> dict[str, Any]:
        """The last published status, with its ages as of now (any thread)."""
        with self._status_lock:
            st = self._status
        assert st is not None
        now = self.ctx.clock.monotonic()
        gpus_at, until = self.ctx.observer.gpus_at, self.s.profile_until
        capture = self.s.capture
        update = {
            "daemon": st.daemon.model_copy(
                update={"loop_heartbeat_age_s": round(now - self.heartbeat, 3)}
            ),
            "gpus_age_s": round(now - gpus_at, 1) if gpus_at is not None else None,
            "profile_left_s": (
                max(round((until - utcnow()).total_seconds()), 0) if until is not None else None
            ),
            "capture": capture.describe() if capture is not None else None,
        }
        return st.model_copy(update=update).model_dump(mode="json")

    def _publish(self) -> None:
        """The one place status is published (at the end of each turn, before a request's
        answer, and at boot), followed by the events queued since (Context.outbox)."""
        ctx, s = self.ctx, self.s
        shown = s.state is State.STARTING or (s.output_failed and s.state is not State.SERVING)
        tail = (ctx.output.tail() if shown else [], ctx.output.where)
        st = build(
            s,
            ctx.unit,
            ctx.observer.gpus,
            now=ctx.clock.monotonic(),
            started_at=self.started_at,
            output=tail,
        )
        with self._status_lock:
            self._status = st
        if st.status_line != self._last_line:
            self._last_line = st.status_line
            ctx.notifier.status(st.status_line)
        if ctx.metrics:
            export(ctx.metrics, s, st, uuid=self._uuid)
        ctx.send_events()

    def _uuid(self, index: int) -> str:
        """The GPU's UUID for the metrics' labels (the GPU port asks NVML once and keeps it);
        empty while the driver is not there: asked again on the next publish."""
        try:
            return self.ctx.gpu.uuid(index)
        except GpuUnavailable:
            return ""

    # ---------------------------------------------------------------- boot
    def boot(self) -> None:
        """Read the persisted state, then READY=1: the daemon has started, and whatever it
        waits for next (the driver, the bus) it waits for running, with the reason in status
        and in the unit's status text. `systemctl start`, an install, a provisioning run that
        enables it before the driver is there, never hang on it."""
        boot.load_state(self.ctx)
        self.life.bundles.find_newest()
        self.desk.check_expiry()
        self._publish()
        self.ctx.notifier.ready(status_line(self.s, self.ctx.clock.monotonic()))

    def _driver_up(self) -> bool:
        """BOOTING: once NVML answers (boot.driver_up), the first observation."""
        ctx, s = self.ctx, self.s
        if not boot.driver_up(ctx):
            return False
        s.observed = self._observe()
        unit = s.observed.describe_unit() if s.observed else "unknown"
        ctx.log("ready", desired=s.desired.value, state=s.state.value, unit=unit)
        return True

    # ---------------------------------------------------------------- the loop
    def loop(self) -> None:
        """Until a re-exec is asked for, or a stop has torn down (`stopped_clean` is set)."""
        while self.turn():
            self.wait()

    def turn(self) -> bool:
        """One message, followed by a pass if it made one due (a switch accepted is begun before
        the next request is admitted, which then joins it). A request is answered before the
        pass, once its effect is published (the status, then the events it queued): a slow
        pass (systemd or NVML slow to answer) never delays a reply. The pass's own effect is
        published at the turn's end. Whoever is answered or told an event reads a status at
        least as new. False once the loop is to end."""
        s, clock = self.s, self.ctx.clock
        msg = self.inbox.take()
        if msg is not None:
            reply = self._handle(msg)
            if isinstance(msg, Request):
                self._publish()
                msg.answer(reply)
        go_on = s.stopped_clean is None
        if go_on and s.reexec_requested and not s.stop_requested and not s.busy:
            if self._stuck_in_kernel():
                pass  # said in status; the re-exec waits for the call to return
            else:
                self.ctx.verify_state()  # the new image must read what this one knows
                go_on = False
        if go_on and not s.busy:
            if s.stop_requested and s.state is not State.STOPPING:
                self.life.begin_shutdown()
            elif s.state is not State.STOPPING and clock.monotonic() >= self._step_due():
                self._last_step = clock.monotonic()
                retry_in = self.guard.run(self._step)
                self._next_step = clock.monotonic() + (retry_in or self._interval())
        self._publish()
        return go_on

    def wait(self, max_s: float | None = None) -> None:
        """Sleep until a message rings, the served MainPID exits, or the next deadline (at most
        `max_s`: the in-process tests, whose clock is not the one select waits on)."""
        s = self.s
        # The vLLM that serves, also while a switch warms (it still serves then, and its exit
        # ends the warming: Lifecycle.main_exited).
        served = (s.state is State.SERVING and not s.busy) or s.state is State.WARMING
        watch = s.serving.pid if s.serving and served else 0
        self.wakeup.watch(watch)
        timeout = 0.0 if len(self.inbox) else self.timeout()
        exited = self.wakeup.wait(timeout if max_s is None else min(timeout, max_s))
        self._feed_watchdog()
        if exited:
            self.inbox.put(MainExited(exited))

    def _interval(self) -> float:
        d = self.config.daemon
        if self._exited is not None:
            return MAIN_EXIT_POLL_S
        return d.start_poll_s if self.s.state is State.STARTING else d.tick_s

    def _step_due(self) -> float:
        """When the next pass falls due (monotonic): the regular one, or earlier for a backoff
        or STUCK retry, the driver's next try, or timed profile mode's end. A deadline already
        passed at the last pass was handled there (or cannot be acted on yet: a retry held for a
        capture's flush), so it does not make the loop spin."""
        s, now = self.s, self.ctx.clock.monotonic()
        early = []
        if s.next_attempt_at is not None and s.state in (State.BACKOFF, State.STUCK):
            early.append(s.next_attempt_at)
        if not s.driver_ready:
            early.append(s.driver_retry_at)
        if s.state is State.SERVING and self.config.liveness.enabled:
            early.append(self.life.liveness.next_probe)  # not one tick_s late
        if s.profile_until is not None and s.desired is Mode.PROFILE:
            early.append(now + (s.profile_until - utcnow()).total_seconds())
        return min([self._next_step, *(t for t in early if t > self._last_step)])

    def timeout(self) -> float:
        """Until the step falls due, or half the watchdog interval (a teardown's job and any
        request ring the doorbell)."""
        now = self.ctx.clock.monotonic()
        interval = self.ctx.notifier.watchdog_interval_s
        due = now + self.config.daemon.tick_s if self.s.busy else self._step_due()
        if interval:
            due = min(due, now + interval / 2)
        return max(due - now, 0.0)

    def _feed_watchdog(self) -> None:
        now = self.ctx.clock.monotonic()
        self.heartbeat = now
        interval = self.ctx.notifier.watchdog_interval_s
        if interval and now - self._last_watchdog >= interval / 2:
            self.ctx.notifier.watchdog()
            self._last_watchdog = now

    def _handle(self, msg: Message) -> Reply:
        """One message, handled to its end; the reply its asker gets once the pass's status is
        published."""
        try:
            return self._dispatch(msg)
        except Exception as e:  # never let one bad message take the loop down
            self.ctx.log("command_failed", level="error", kind=type(msg).__name__, error=repr(e))
            return Reply(ok=False, code="internal", message=f"internal error: {e}")

    def _dispatch(self, msg: Message) -> Reply:
        s, ok = self.s, Reply(ok=True, code="accepted")
        match msg:
            case Switch():
                reply = self.desk.switch(msg)
                if reply.code == "accepted":
                    self._next_step = 0.0  # act on it now (or when the teardown ends)
                return reply
            case Stop() if why := self._stop_without_teardown():
                # `systemctl restart kimi-supervisor` (an upgrade reflex) must not cost a model
                # load: the next daemon adopts vLLM, as after a crash. At a system shutdown
                # systemd stops vLLM itself, gracefully, once this daemon has exited.
                self.ctx.log("exiting_without_teardown", message=why)
                s.stopped_clean = True
                return ok.model_copy(update={"message": why})
            case Stop():
                s.stop_requested = True
                s.stop_warming("the daemon is stopping")  # a stop never waits for it
                return ok.model_copy(update={"message": "stopping"})
            case Reexec():
                s.reexec_requested = True
                return ok.model_copy(update={"message": "re-executing"})
            case CaptureStart():
                return self.desk.capture_start(msg)
            case CaptureStop():
                return self.desk.capture_stop(msg)
            case CaptureDone(capture=c):
                self.desk.capture_done(c)
                self._next_step = 0.0
            case JobEvent() | JobDone() | Warmed():
                self.life.job_message(msg)
                self._next_step = 0.0
            case MainExited(pid=pid):
                self._main_exited(pid)
                self._next_step = 0.0
            case LivenessSeen(reading=reading):
                self.life.liveness_seen(reading)
            case BundleDone():
                self.life.bundles.done(msg)
        return ok

    def _stuck_in_kernel(self) -> bool:
        """A call to NVML or the state folder has had no answer past its deadline. The daemon's
        calls run in processes of their own, which hold no execve; on a thread (as the tests
        run them), execve would wait until that thread left the kernel, the host unsupervised
        and its control socket gone meanwhile (seen by an outside review with a frozen file
        system). Either way the re-exec waits, and status says so: the new image would start
        its own process against the same stuck folder or driver, and never reap the old one."""
        workers = [self.ctx.disk, getattr(self.ctx.gpu, "worker", None)]
        looks = [w.stuck() for w in workers if w is not None]
        stuck = [look for look in looks if look is not None]
        if stuck:
            what = stuck[0][0]
            self.ctx.warn(f"{REEXEC_WAITS}: {what} is stuck in the kernel, and a re-exec would "
                          "wait for it unsupervised", key=REEXEC_WAITS)  # fmt: skip
            return True
        self.ctx.unwarn(REEXEC_WAITS)
        return False

    def _stop_without_teardown(self) -> str:
        """Why this SIGTERM must not tear vLLM down ("" if it must): the stop half of a restart
        job for the daemon's own unit, or the system going down (a job for shutdown.target)."""
        try:
            jobs = self.ctx.systemd.jobs()
        except SystemdError:
            return ""
        unit = processes.unit_of(os.getpid())
        if unit and jobs.get(unit) == "restart":
            return "restarting: vLLM keeps running and is adopted by the next daemon"
        if jobs.get("shutdown.target") == "start":
            return "the system is shutting down: systemd stops vLLM after this daemon"
        return ""

    def _step(self) -> None:
        """Observe, decide, act: only while no teardown runs."""
        s, life = self.s, self.life
        self.ctx.flush()  # what a full disk kept from being written
        self.ctx.verify_state()
        if not s.driver_ready and (
            self.ctx.clock.monotonic() < s.driver_retry_at or not self._driver_up()
        ):
            return
        if self._exited is not None and not self._exit_seen():
            return
        if s.state is State.STARTING:
            life.follow_output()
        life.warm_left_returned()
        self.desk.check_expiry()
        obs = s.observed = self._observe()
        if obs is None:
            return
        if s.state is State.STARTING and obs.unit_up:
            found = self.ctx.observer.intruders(obs.main_pid)
            if found:
                life.intrusion(found)
                return
        capture = s.capture is not None and s.capture.phase.holds_switch
        grace = self.config.daemon.health_grace_s
        now = self.ctx.clock.monotonic()
        action = decide(
            s.desired,
            s.memory(),
            obs,
            now=now,
            health_grace_s=grace,
            intent=s.intent,
            capture=capture,
        )
        life.act(action, obs)
        life.judge_liveness(obs)

    def _observe(self) -> Observed | None:
        s = self.s
        serving = s.serving.pid if s.serving and s.state is State.SERVING else 0
        starting = s.state is State.STARTING
        obs = self.ctx.observer.observe(serving, s.indices, s.baselines, starting=starting)
        s.waiting_for = "" if obs is not None else f"waiting for systemd: {self.ctx.observer.error}"
        if obs is not None:
            self._watch_health(obs)
        return obs

    def _watch_health(self, obs: Observed) -> None:
        """Since when /health fails, and whether that is more than a slow answer: vLLM's
        processes' CPU is read at each pass meanwhile (decide/liveness.health_failure). A slow
        /health with busy processes is a doubt (status, the doubt metric), never a restart."""
        s, d = self.s, self.config.daemon
        if obs.healthy or not obs.unit_up:
            s.unhealthy_since, s.unhealthy_api, s.unhealthy_why = None, [], ""
            s.health_doubt_since = None
            self.ctx.unwarn("/health has given no answer")
            return
        now = self.ctx.clock.monotonic()
        if s.unhealthy_since is None:
            s.unhealthy_since = now
        if s.state not in (State.SERVING, State.BOOTING):
            return  # a load answers nothing until it is ready: start_timeout_s judges it
        cpu = engine_cpu(obs.main_pid)
        if cpu is not None:
            keep = cpu.at - 2 * d.health_grace_s
            s.unhealthy_api = [c for c in s.unhealthy_api[-MAX_API_READINGS:] if c.at >= keep]
            s.unhealthy_api.append(cpu)
        fraction = self.config.liveness.cpu_idle_fraction
        s.unhealthy_why = health_failure(
            obs.health,
            obs.health_slow,
            s.unhealthy_api,
            window_s=d.health_grace_s,
            idle_fraction=fraction,
        )
        failing = now - s.unhealthy_since
        if obs.health_slow and not s.unhealthy_why and failing >= d.health_grace_s:
            if s.health_doubt_since is None:
                s.health_doubt_since = utcnow() - timedelta(seconds=failing)
            seen = "are busy" if s.unhealthy_api else "cannot be read"
            self.ctx.warn(
                f"/health has given no answer for over {d.health_grace_s:g} s, but vLLM's "
                f"processes {seen}: not restarted (slow is not hung)"
            )

    def _main_exited(self, pid: int) -> None:
        """vLLM's MainPID exited (its pidfd said so). Told at once; then the passes that follow
        wait, MAIN_EXIT_POLL_S apart, until systemd has seen it too (at most
        MAIN_EXIT_SETTLE_S), so that the pass that decides observes the death instead of a unit
        that still names the dead MainPID. The loop goes on answering meanwhile."""
        ctx = self.ctx
        ctx.log("vllm_main_exited", level="warning", main_pid=pid)
        ctx.event("vllm_main_exited", {"main_pid": pid})
        self.life.main_exited()
        self._exited = (pid, ctx.clock.monotonic() + MAIN_EXIT_SETTLE_S)

    def _exit_seen(self) -> bool:
        """Whether systemd has seen the MainPID's exit (or no longer answers, or the settle time
        is over); until then a pass decides nothing."""
        assert self._exited is not None
        ctx, (pid, deadline) = self.ctx, self._exited
        try:
            st = ctx.systemd.status(ctx.unit)
            seen = st.main_pid != pid or not st.up
        except SystemdError:
            seen = True
        if seen or ctx.clock.monotonic() >= deadline:
            self._exited = None
            return True
        return False


# ------------------------------------------------------------------ the pass's guard
# The loop's passes, guarded: an unexpected error in one never ends the daemon.
#
# A pass reads ports (NVML, /proc, systemd, the disk); a port failing in a way it was not written
# for must not end the loop, or systemd restarts the daemon into the same error, gives up, and
# vLLM runs unsupervised ("GPU is lost" from NVML once gave five restarts in 15 s, then failed).
# The error is logged, counted, shown in status, and the pass is tried again after a doubling
# delay; the next pass that goes through clears it.


class StepGuard:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.failures = 0  # passes in a row that ended in an unexpected error

    def run(self, step: Callable[[], None]) -> float | None:
        """Run one pass; after an unexpected error, the delay before the next try (None after
        a pass that went through)."""
        try:
            step()
        except Exception as e:
            self.failures += 1
            delay = min(STEP_RETRY_S * 2.0 ** (self.failures - 1), STEP_RETRY_MAX_S)
            self.ctx.log(
                "step_failed", level="error", error=repr(e), failures=self.failures,
                retry_in_s=delay,
            )  # fmt: skip
            self.ctx.unwarn(STEP_FAILED)
            self.ctx.warn(
                f"{STEP_FAILED} ({type(e).__name__}: {e}); {self.failures} in a row, "
                f"retrying in {delay:g} s"
            )
            return delay
        if self.failures:
            self.ctx.log("step_recovered", failures=self.failures)
            self.ctx.unwarn(STEP_FAILED)
            self.failures = 0
        return None


# ------------------------------------------------------------------ signals
# The signals the daemon handles. They stay blocked from the start of `kimi-supervisor run` (so
# every thread it starts blocks them too, and they reach the main thread, whose select they wake)
# until the handlers are installed; and again across a re-exec, whose new image inherits the mask
# and the pending signals: between execv and the new handlers, SIGHUP's and SIGTERM's default
# actions would kill the daemon, and systemd counts a death by SIGHUP as a clean exit.
HANDLED = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def block_signals() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)


def install_signal_handlers(daemon: Daemon) -> None:
    signal.signal(signal.SIGTERM, lambda *_: daemon.ask(Stop()))
    signal.signal(signal.SIGINT, lambda *_: daemon.ask(Stop()))
    signal.signal(signal.SIGHUP, lambda *_: daemon.ask(Reexec()))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)  # pending ones are handled now


def reexec(notifier: Notifier) -> None:
    """Replace this process with a fresh copy of itself (upgrades): vLLM is left running and is
    adopted by the new process. The control socket's lock dies with the old image. systemd is
    told RELOADING=1; the new image's READY=1 ends the reload (`systemctl reload` waits)."""
    block_signals()
    notifier.reloading("re-executing: vLLM keeps running and is adopted")
    os.execv(sys.executable, list(sys.orig_argv))
